"""Broadcasting initial state: parameters, optimizer state, arbitrary objects."""
from __future__ import annotations

import collections.abc

import torch

from hvdlite.common.core import allgather_object, broadcast_object, rank

from .mpi_ops import broadcast_async_, synchronize
from .state_dicts import load_state_keeping_groups


def broadcast_parameters(params, root_rank: int = 0) -> None:
    """Overwrite every rank's tensors with ``root_rank``'s, in place.

    ``params``: a ``state_dict()``, ``model.named_parameters()``, a list of (name, tensor)
    pairs, or (as in Horovod) a list of tensors such as ``list(model.parameters())``, which are
    named by their position.  Names (or, for bare tensors, the order) must be the same on every
    rank.
    """
    if isinstance(params, collections.abc.Mapping):
        items = sorted(params.items())
    elif isinstance(params, collections.abc.Iterable):
        items = [x if isinstance(x, tuple) else (f"#{i}", x) if isinstance(x, torch.Tensor)
                 else x for i, x in enumerate(params)]
        if any(not (isinstance(x, tuple) and len(x) == 2) for x in items):
            raise ValueError("broadcast_parameters expects a dict, a list of (name, tensor) "
                             "pairs or a list of tensors, e.g. model.state_dict(), "
                             "model.named_parameters() or list(model.parameters()).")
    else:
        raise ValueError(f"invalid params of type {type(params).__name__}")
    items = [(name, p) for name, p in items if p is not None]
    for name, p in items:   # all checked before any is sent: an error leaves nothing in flight
        if not isinstance(p, torch.Tensor):
            raise ValueError(f"broadcast_parameters: {name!r} is a {type(p).__name__}, not a "
                             f"tensor; broadcast it with broadcast_object.")
    handles = []
    for name, p in items:
        with torch.no_grad():
            handles.append(broadcast_async_(p, root_rank, name=f"broadcast.param.{name}"))
    for handle in handles:
        synchronize(handle)


def _create_lazy_state(optimizer: torch.optim.Optimizer, model=None) -> None:
    """Horovod's way to create the state that optimizers create lazily: every parameter that
    requires a gradient gets a zero ``.grad`` (sparse for ``SparseAdam``, and for an ``SGD``'s
    ``nn.Embedding(sparse=True)`` parameters of ``model``), and the optimizer takes one step.
    As in Horovod, the zero gradients stay, and so does whatever that step did to the
    parameters (weight decay shrinks them once): a script sees the same values as under
    Horovod."""
    sparse = set()
    if model is not None:
        sparse = {p for m in model.modules()
                  if isinstance(m, torch.nn.Embedding) and m.sparse for p in m.parameters()}
    all_sparse = isinstance(optimizer, torch.optim.SparseAdam)
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                grad = torch.zeros_like(p)
                if all_sparse or (isinstance(optimizer, torch.optim.SGD) and p in sparse):
                    grad = grad.to_sparse()
                p.grad = grad
    if isinstance(optimizer, _distributed_cls()):
        super(_distributed_cls(), optimizer).step()   # the wrapped optimizer's own step
    else:
        optimizer.step()


def _distributed_cls():
    from .optimizer import DistributedOptimizerMixin
    return DistributedOptimizerMixin


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0,
                              model=None) -> None:
    """Make every rank's optimizer state (per-parameter tensors such as momentum buffers, step
    counters, and the hyper-parameters in ``param_groups``) equal to ``root_rank``'s.

    Works before the first step too, as in Horovod: a rank whose optimizer has no state yet
    gives every parameter that requires a gradient a zero ``.grad`` and takes one step, which
    creates the state; the zero gradients stay, and so does that step's effect on the
    parameters (with weight decay it shrinks them once, with this rank's hyper-parameters),
    so broadcast the parameters afterwards if ranks may differ there.  ``model`` (optional, as
    in Horovod) marks its ``nn.Embedding(sparse=True)`` parameters, whose zero gradient is
    then sparse for ``SGD`` (``SparseAdam`` always gets sparse ones).
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    if not optimizer.state:
        _create_lazy_state(optimizer, model)
    state = optimizer.state_dict()
    # Everything but the tensors travels as one pickled object from the root.
    skeleton = {
        "param_groups": state["param_groups"],
        "state": {pid: {k: (("tensor", tuple(v.shape), str(v.dtype), v.device.type)
                            if torch.is_tensor(v) else ("value", v)) for k, v in s.items()}
                  for pid, s in state["state"].items()},
    }
    skeleton = broadcast_object(skeleton if rank() == root_rank else None, root_rank,
                                name="optimizer_state")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    new_state = {}
    handles = []
    for pid, entries in sorted(skeleton["state"].items()):
        local = state["state"].get(pid, {})
        new_state[pid] = {}
        for key, (kind, *info) in sorted(entries.items()):
            if kind == "value":
                new_state[pid][key] = info[0]
                continue
            shape, dtype, device_type = info
            # State lives where the root keeps it: on the parameter's GPU, or on the CPU (e.g.
            # Adam's step counter), so every rank broadcasts from the same kind of device.
            device = (params[pid].device if device_type != "cpu" and pid < len(params)
                      else torch.device("cpu"))
            tensor = local.get(key)
            if (not torch.is_tensor(tensor) or tuple(tensor.shape) != shape
                    or str(tensor.dtype) != dtype or tensor.device.type != device.type):
                tensor = torch.empty(shape, dtype=getattr(torch, dtype.split(".")[-1]),
                                     device=device)
            new_state[pid][key] = tensor
            handles.append(broadcast_async_(tensor, root_rank,
                                            name=f"broadcast.optimizer.{pid}.{key}"))
    for handle in handles:
        synchronize(handle)
    load_state_keeping_groups(optimizer, {"state": new_state,
                                          "param_groups": skeleton["param_groups"]})


__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object",
           "allgather_object"]

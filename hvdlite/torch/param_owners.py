"""Which DistributedOptimizer owns each parameter: its gradient hook and its name on the wire.
(The owner is the optimizer's :class:`~hvdlite.torch.reducer.Reducer`, which holds both; the
hooks themselves are made here.)

Two situations would otherwise send one name twice, which fails (a name already in flight)
or, worse, depends on timing and so differs between ranks:

* a parameter wrapped again (a new optimizer for the next phase of training): the old
  optimizer's hook would keep firing for as long as that optimizer lives (until the garbage
  collector finds it, if it is in a reference cycle);
* two models named alike (a GAN's generator and discriminator, both ``nn.Sequential``) whose
  gradients are in flight together.

A new owner therefore takes over a parameter's hook, and names that another live optimizer
already uses for other parameters are told apart.  Everything here depends only on the order
in which optimizers are created and on which of them are still reachable, never on timing,
so every rank decides the same.
"""
from __future__ import annotations

import gc
import weakref
from typing import Callable

import torch

# id(parameter) -> (weak parameter, weak owning optimizer's reducer)
_owners: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def _forget(key: int, ref: weakref.ref) -> None:
    entry = _owners.get(key)
    if entry is not None and entry[0] is ref:
        del _owners[key]


def claim(optimizer, params) -> None:
    """Make ``optimizer`` the owner of ``params``; a previous owner drops its hooks on them."""
    for p in params:
        key = id(p)
        entry = _owners.get(key)
        if entry is not None and entry[0]() is p:
            previous = entry[1]()
            if previous is not None and previous is not optimizer:
                previous.release_hook(p)
        ref = weakref.ref(p, lambda r, key=key: _forget(key, r))
        _owners[key] = (ref, weakref.ref(optimizer))


def _names_of_others(optimizer) -> set[str]:
    names = set()
    for p_ref, owner_ref in list(_owners.values()):
        p, owner = p_ref(), owner_ref()
        if p is not None and owner is not None and owner is not optimizer:
            name = getattr(owner, "names", {}).get(p)
            if name is not None:
                names.add(name)
    return names


def names_taken(optimizer, names) -> set[str]:
    """Those of ``names`` that another live optimizer uses for its own parameters.

    Optimizers that are no longer reachable still hold their names until the cyclic garbage
    collector frees them (their hooks make a cycle), which happens at different times on
    different ranks; so a clash is confirmed after a collection.
    """
    clash = set(names) & _names_of_others(optimizer)
    if clash:
        gc.collect()
        clash = set(names) & _names_of_others(optimizer)
    return clash


def take_over(owner, names: dict, prefix: str | None, index: int) -> tuple[dict, str | None]:
    """Make ``owner`` (the ``index``-th DistributedOptimizer created in the process, with name
    ``prefix`` so far) the owner of ``names``' parameters (``param -> allreduce.<name>``).
    Returns their names on the wire and the owner's prefix: if another live optimizer uses
    some of these names for other parameters, the owner's names get the prefix
    ``allreduce.opt<index>.``, so their gradients never clash."""
    claim(owner, names)
    if prefix is None and names_taken(owner, names.values()):
        prefix = f"allreduce.opt{index}."
    if prefix is not None:
        names = {p: prefix + name[len("allreduce."):] for p, name in names.items()}
    return names, prefix


def gradient_hook(owner) -> Callable[[torch.Tensor], None]:
    """The gradient hook of ``owner``'s parameters: ``owner.on_grad_ready(p)``, with the owner
    held weakly.  A hook on a parameter that referred to the owner (which refers to the
    parameter) would make a cycle that torch's tensors hide from the garbage collector: a
    dropped model and its optimizer (state included) would never be freed."""
    ref = weakref.ref(owner)

    def on_grad_ready(p: torch.Tensor) -> None:
        current = ref()
        if current is not None:
            current.on_grad_ready(p)

    return on_grad_ready


def hook(params, on_grad_ready: Callable[[torch.Tensor], None], handles: dict) -> None:
    """Call ``on_grad_ready`` (see :func:`gradient_hook`) once each parameter's gradient is
    accumulated; ``handles`` receives each hook's handle.  Parameters that need no gradient
    now get none (their owner reduces them in ``synchronize()`` if they need one later)."""
    for p in params:
        if p.requires_grad:
            handles[p] = p.register_post_accumulate_grad_hook(on_grad_ready)


def unhook_when_collected(owner, handles: dict) -> None:
    """Remove the hooks in ``handles`` once ``owner`` is collected: no dead hooks left."""
    weakref.finalize(owner, _remove_hooks, handles)


def _remove_hooks(handles: dict) -> None:
    for handle in handles.values():
        handle.remove()

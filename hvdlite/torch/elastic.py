"""Horovod's elastic API for PyTorch: ``hvd.elastic.run``, ``TorchState``, ``ElasticSampler``.

Run the script with ``hvdlite run --min-np N --max-np M (-H ... | --host-discovery-script S)``;
see docs/elastic.md.  The semantics are Horovod's (``horovod/torch/elastic``): the state's
model, optimizer and sampler have handlers (``get_handler_registry``/``set_handler_registry``),
every other keyword argument is an attribute kept as a plain object; ``commit()`` saves a copy,
``restore()`` goes back to it, ``sync()`` broadcasts rank 0's.  What hvdlite adds is how the
last commit outlives the processes (:mod:`hvdlite.common.api.elastic`): tensors travel to the
driver as raw bytes, through the codec registered here.
"""
from __future__ import annotations

import collections
import copy
from typing import Any

import torch

from hvdlite.common.core import (Codec, ElasticSamplerBase, HorovodInternalError,
                                 HostsUpdatedInterrupt, ObjectState, State, broadcast_object,
                                 elastic_run_fn, rank, register_codec)

from .functions import broadcast_optimizer_state, broadcast_parameters


def run(func):
    """Decorator running ``func(state, ...)`` elastically (Horovod's ``hvd.elastic.run``).

    Before ``func`` runs the state is synchronized from rank 0; after a failure
    (``HorovodInternalError``) or a change of hosts (``HostsUpdatedInterrupt``) the driver
    starts a new world, whose workers resume ``func`` from the last commit (after a host
    change: from the state at the interrupt).  Call no collective operation before ``func``:
    the new world's workers synchronize inside it."""
    return elastic_run_fn(func)


class ElasticSampler(ElasticSamplerBase, torch.utils.data.Sampler):
    """Sampler that partitions a dataset over the ranks and, after a reset, deals out the
    samples of the epoch not yet processed over the new ranks (Horovod's
    ``hvd.elastic.ElasticSampler``; see :mod:`hvdlite.common.api.elastic_sampler`).

    Put it in the ``TorchState``, call ``record_batch(batch_idx, batch_size)`` after every
    batch and ``set_epoch(epoch)`` at the end of every epoch.

    Args:
        dataset: the dataset (its size must not change).
        shuffle: shuffle the indices, differently each epoch (default True).
        seed: the shuffle's seed, the same on every rank (default 0).
    """

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0) -> None:
        ElasticSamplerBase.__init__(self, dataset, shuffle=shuffle, seed=seed)


# --- tensors between worlds ------------------------------------------------------------------
def _dense(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.layout == torch.strided and not t.is_quantized


def _export(t: torch.Tensor) -> memoryview:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.resolve_conj().resolve_neg().contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _rebuild(meta, buffer: bytearray) -> torch.Tensor:
    dtype, shape = meta
    raw = torch.frombuffer(buffer, dtype=torch.uint8) if len(buffer) else torch.empty(
        0, dtype=torch.uint8)
    return raw.view(getattr(torch, dtype)).reshape(shape)


register_codec(Codec("torch", torch.Tensor, _dense,
                     lambda t: (str(t.dtype).replace("torch.", ""), tuple(t.shape)),
                     _export, _rebuild))


_IMMUTABLE = frozenset((int, float, complex, str, bytes, bool, type(None), torch.dtype,
                        torch.device))
_TENSORS = frozenset((torch.Tensor, torch.nn.Parameter))
_DICTS = frozenset((dict, collections.OrderedDict))


def _snapshot(tree: Any) -> Any:
    """A private copy of a state dict: tensors cloned, containers rebuilt, other values deep
    copied (as ``copy.deepcopy`` would, but without its per-object overhead: a commit copies
    the whole state every time)."""
    with torch.no_grad():
        return _copy(tree)


def _copy(tree: Any) -> Any:
    kind = type(tree)
    if kind in _IMMUTABLE:
        return tree
    if kind in _TENSORS or isinstance(tree, torch.Tensor):
        return tree.clone()
    if kind in _DICTS:
        out = kind()
        for key, value in tree.items():
            inner = type(value)
            out[key] = value if inner in _IMMUTABLE else (
                value.clone() if inner in _TENSORS else _copy(value))
        metadata = getattr(tree, "_metadata", None)   # a module's state_dict versions (shared:
        if metadata is not None:                     # load_state_dict only reads them)
            out._metadata = metadata
        return out
    if isinstance(tree, dict):
        return {key: _copy(value) for key, value in tree.items()}
    if kind is list:
        return [value if type(value) in _IMMUTABLE else _copy(value) for value in tree]
    if kind is tuple:
        return tuple(_copy(value) for value in tree)
    return copy.deepcopy(tree)


# --- the state -------------------------------------------------------------------------------
class StateHandler:
    """Saves, restores and synchronizes one kind of value of a ``TorchState``."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def save(self) -> None:
        raise NotImplementedError()

    def restore(self) -> None:
        raise NotImplementedError()

    def sync(self) -> None:
        raise NotImplementedError()

    def set_value(self, value: Any) -> None:
        self.value = value
        self.save()

    def committed(self) -> Any:
        """The saved value, picklable (hvdlite: kept by the elastic driver between worlds)."""
        raise NotImplementedError()

    def load_committed(self, committed: Any) -> None:
        """Make ``committed`` the saved value and restore it."""
        raise NotImplementedError()


class ModelStateHandler(StateHandler):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self._saved_model_state = _snapshot(self.value.state_dict())

    def save(self) -> None:
        self._saved_model_state = _snapshot(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self._saved_model_state)

    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)

    def committed(self) -> Any:
        return self._saved_model_state

    def load_committed(self, committed: Any) -> None:
        self._saved_model_state = committed
        self.restore()


class OptimizerStateHandler(StateHandler):
    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(optimizer)
        self._saved_optimizer_state = _snapshot(self.value.state_dict())

    def save(self) -> None:
        self._saved_optimizer_state = _snapshot(self.value.state_dict())

    def restore(self) -> None:
        # A copy: torch's load_state_dict keeps the tensors it is given as the optimizer's
        # state, and the saved copy must stay as saved for the next restore().
        self.value.load_state_dict(_snapshot(self._saved_optimizer_state))

    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)

    def committed(self) -> Any:
        return self._saved_optimizer_state

    def load_committed(self, committed: Any) -> None:
        self._saved_optimizer_state = committed
        self.restore()


class SamplerStateHandler(StateHandler):
    def __init__(self, sampler: ElasticSampler) -> None:
        super().__init__(sampler)
        self._saved_sampler_state = copy.deepcopy(self.value.state_dict())

    def save(self) -> None:
        self._saved_sampler_state = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self._saved_sampler_state)

    def sync(self) -> None:
        self.value.load_state_dict(broadcast_object(self.value.state_dict()))

    def committed(self) -> Any:
        return dict(self._saved_sampler_state)

    def load_committed(self, committed: Any) -> None:
        self._saved_sampler_state = dict(committed)
        self.restore()


_handler_registry: list[tuple[type, type]] = [
    (torch.nn.Module, ModelStateHandler),
    (torch.optim.Optimizer, OptimizerStateHandler),
    (ElasticSampler, SamplerStateHandler),
]


def get_handler_registry() -> list[tuple[type, type]]:
    """The (value type, handler class) pairs ``TorchState`` consults, first match wins."""
    return _handler_registry


def set_handler_registry(registry: list[tuple[type, type]]) -> None:
    global _handler_registry
    _handler_registry = registry


def _get_handlers(kwargs: dict) -> tuple[dict, dict]:
    handlers, remainder = {}, {}
    for key, value in kwargs.items():
        for handler_type, handler_cls in _handler_registry:
            if isinstance(value, handler_type):
                handlers[key] = handler_cls(value)
                break
        else:
            remainder[key] = value
    return handlers, remainder


class TorchState(ObjectState):
    """State of a PyTorch training process (Horovod's ``hvd.elastic.TorchState``).

    Args:
        model: a ``torch.nn.Module`` (optional).
        optimizer: a ``torch.optim.Optimizer``, e.g. the ``DistributedOptimizer`` (optional).
        kwargs: more attributes; values with a registered handler (modules, optimizers,
            ``ElasticSampler``) are handled by it, others are kept as plain objects (epoch,
            batch, ...).
    """

    def __init__(self, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, **kwargs: Any) -> None:
        kwargs.update(dict(model=model, optimizer=optimizer))
        self._handlers, kwargs = _get_handlers(kwargs)
        for name, handler in self._handlers.items():
            setattr(self, name, handler.value)
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **kwargs)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        for handler in self._handlers.values():
            handler.sync()
        super().sync()

    def __setattr__(self, name: str, value: Any) -> None:
        if hasattr(self, name) and name in self._handlers:
            self._handlers[name].set_value(value)
        super().__setattr__(name, value)

    def committed_state(self) -> Any:
        committed = super().committed_state()
        committed["handlers"] = {name: h.committed() for name, h in self._handlers.items()}
        return committed

    def load_committed_state(self, committed: Any) -> None:
        saved = committed["handlers"]
        if set(saved) != set(self._handlers):
            raise ValueError(f"TorchState: the committed state has {sorted(saved)} but this "
                             f"state has {sorted(self._handlers)}; every world must build the "
                             f"state with the same arguments.")
        for name, handler in self._handlers.items():
            handler.load_committed(saved[name])
        super().load_committed_state(committed)


__all__ = ["run", "State", "ObjectState", "TorchState", "ElasticSampler", "StateHandler",
           "ModelStateHandler", "OptimizerStateHandler", "SamplerStateHandler",
           "get_handler_registry", "set_handler_registry", "HorovodInternalError",
           "HostsUpdatedInterrupt"]

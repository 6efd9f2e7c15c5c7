"""Horovod's elastic API (``hvd.elastic``) is not supported: a clear error instead.

Horovod's elastic mode adds and removes workers while a job runs (``horovodrun --min-np``, host
discovery scripts, ``hvd.elastic.run`` with ``State`` objects that commit and restore).  hvdlite
runs a fixed set of MPI processes.  Each adapter's ``elastic`` module resolves every public name
through :func:`unsupported`, so ``hvd.elastic.run``, ``hvd.elastic.TorchState`` or
``from hvdlite.torch.elastic import ElasticSampler`` fail at once, naming the alternative,
rather than with an AttributeError deep in a script.
"""
from __future__ import annotations

MESSAGE = ("hvdlite does not support Horovod's elastic training (hvd.elastic.{name}): the "
           "number of ranks is fixed when the job starts. Launch a fixed number of processes "
           "with `hvdlite run -np N` and, to survive failures, checkpoint from rank 0 and restart "
           "the job from the checkpoint (see the README's 'Elastic training' section).")


def unsupported(name: str):
    """Module ``__getattr__`` for the adapters' ``elastic`` modules."""
    if name.startswith("__") and name.endswith("__"):
        raise AttributeError(name)   # introspection (inspect, pickle, pytest) must keep working
    raise NotImplementedError(MESSAGE.format(name=name))

"""hvdlite: Horovod-style data-parallel training in pure Python.

``import hvdlite as hvd`` gives the framework-neutral API on numpy arrays; ``hvdlite.torch`` and
``hvdlite.tensorflow`` are the framework adapters with Horovod's names.
"""
from .version import __version__
from hvdlite.common.core import *  # noqa: F401,F403 - lifecycle, topology, errors, reduce ops
from hvdlite.common.core import (GroupHandle, Handle, allgather, allgather_async, allreduce,
                                 allreduce_, allreduce_async, allreduce_async_, alltoall,
                                 alltoall_async, barrier, broadcast, broadcast_, broadcast_async,
                                 broadcast_async_, grouped_allgather, grouped_allgather_async,
                                 grouped_allreduce, grouped_allreduce_, grouped_allreduce_async,
                                 grouped_allreduce_async_, grouped_reducescatter,
                                 grouped_reducescatter_async, join, poll, reducescatter,
                                 reducescatter_async, synchronize)


def __getattr__(name: str):
    # hvdlite.run (Horovod's horovod.run) loads the launcher only when used: ~50 ms of imports
    # that a training script never needs.
    if name == "run":
        from .runner.function_runner import run
        return run
    raise AttributeError(f"module 'hvdlite' has no attribute {name!r}")

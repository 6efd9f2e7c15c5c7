"""The ``hvdlite run`` launcher (hvdlite's ``horovodrun``).

``hvdlite run -np 4 python train.py`` (or ``python -m hvdlite.runner run ...``) starts the job
with the installed MPI launcher (MPICH, Intel MPI or Open MPI); see :mod:`.launch`.
``hvdlite.run(func, num_proc=4)`` does the same from Python and returns ``func``'s return value
on every rank (Horovod's ``horovod.run``); see :mod:`.function_runner`.
"""
from .function_runner import run
from .launch import main

__all__ = ["main", "run"]

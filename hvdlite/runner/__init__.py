"""The ``hvdlite run`` launcher (hvdlite's ``horovodrun``).

``hvdlite run -np 4 python train.py`` (or ``python -m hvdlite.runner run ...``) starts the job
with the installed MPI launcher (MPICH, Intel MPI or Open MPI); see :mod:`.launch`.
"""
from .launch import main

__all__ = ["main"]

"""Build and feature queries (Horovod's ``*_built()`` / ``*_enabled()``), truthful about this
installation: what hvdlite can use here, whether or not a job is running."""
from __future__ import annotations

import importlib.util

from hvdlite.common.runtime.state import is_initialized


def mpi_built() -> bool:
    """True if mpi4py (the MPI controller and data path) can be imported."""
    return importlib.util.find_spec("mpi4py") is not None


def mpi_enabled() -> bool:
    """True if MPI is used by the running job (always, once initialized)."""
    return is_initialized()


def gloo_built() -> bool:
    return False


def gloo_enabled() -> bool:
    return False


def nccl_built() -> int:
    """NCCL's version code (e.g. 22703 for 2.27.3, Horovod style) when the NCCL binding (CuPy's)
    loads, else 0.  Needs no GPU: it says whether GPU tensors can go through NCCL."""
    from hvdlite.common.gpu.cuda import nccl_version
    return nccl_version()


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    """True when CuPy (hvdlite's CUDA runtime binding) imports, so CUDA tensors are accepted."""
    from hvdlite.common.gpu.cuda import cupy_importable
    return cupy_importable()


def rocm_built() -> bool:
    return False


def sycl_built() -> bool:
    """False: hvdlite has no SYCL (Intel GPU) data path."""
    return False

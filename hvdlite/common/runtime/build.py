"""Build and feature queries (Horovod's ``*_built()`` / ``*_enabled()``), truthful about this
installation: what hvdlite can use here, whether or not a job is running."""
from __future__ import annotations

import importlib.util
import subprocess
import sys

from hvdlite.common.runtime.state import is_initialized

_LIBRARY_VERSION_SNIPPET = ("import mpi4py; mpi4py.rc.initialize = False; "
                            "from mpi4py import MPI; print(MPI.Get_library_version())")


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


def mpi_library_version() -> str | None:
    """First line of ``MPI.Get_library_version()`` (the MPI library mpi4py uses), or None when
    mpi4py is unusable.

    Read in a child process with ``mpi4py.rc.initialize = False`` unless mpi4py's MPI module is
    already loaded here, so the check never initializes MPI in the caller.
    """
    if "mpi4py.MPI" in sys.modules:
        text = sys.modules["mpi4py.MPI"].Get_library_version()
    else:
        try:
            proc = subprocess.run([sys.executable, "-c", _LIBRARY_VERSION_SNIPPET],
                                  capture_output=True, text=True, timeout=60, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return None
        if proc.returncode != 0:
            return None
        text = proc.stdout
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return " ".join(lines[0].split()) if lines else None

"""``hvdlite --check-build``: what this installation can do, in ``horovodrun --check-build`` form.

Every mark comes from a real query: framework packages are looked up with
``importlib.util.find_spec`` (nothing heavy is imported), controllers and tensor operations come
from ``hvdlite.mpi_built()``/``nccl_built()``/``gloo_built()``/``ddl_built()``/``ccl_built()``,
and the MPI library version is read from mpi4py without initializing MPI.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from typing import Sequence

from . import mpi_flavor

# (label, framework module, hvdlite adapter module)
FRAMEWORKS = (("TensorFlow", "tensorflow", "hvdlite.tensorflow"),
              ("PyTorch", "torch", "hvdlite.torch"))

def module_available(name: str) -> bool:
    """True if ``name`` can be imported, without importing it."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def framework_available(framework: str, adapter: str) -> bool:
    """True if the framework is installed and hvdlite ships its adapter."""
    return module_available(framework) and module_available(adapter)


def nccl_version_string(code: int) -> str:
    """Format an NCCL version code (``major*10000 + minor*100 + patch``, or
    ``major*1000 + minor*100 + patch`` before NCCL 2.9) as ``2.18.3``."""
    if code >= 10000:
        major, rest = divmod(code, 10000)
    else:
        major, rest = divmod(code, 1000)
    minor, patch = divmod(rest, 100)
    return f"{major}.{minor}.{patch}"


def mpi_library_version() -> str | None:
    """First line of the MPI library's version text, read without initializing MPI here (see
    ``hvdlite.common.runtime.build.mpi_library_version``), or None."""
    from hvdlite.common import core
    return core.mpi_library_version()


def launcher_description(launcher: str | None = None
                         ) -> tuple[str, mpi_flavor.MpiFlavor | None]:
    """A line naming the MPI launcher ``hvdlite run`` would use, and its flavour."""
    launcher = launcher or mpi_flavor.find_launcher()
    if launcher is None:
        return "not found (pip install mpich, or install your system's MPI)", None
    try:
        flavor = mpi_flavor.detect_flavor(mpi_flavor.launcher_version_text(launcher))
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{launcher} (cannot run --version: {exc})", None
    if flavor is None:
        return f"{launcher} (unrecognised MPI)", None
    return f"{launcher} ({flavor.description})", flavor


def _mark(flag: bool) -> str:
    return "[X]" if flag else "[ ]"


def _section(title: str, rows: Sequence[tuple[str, bool]]) -> list[str]:
    return [f"{title}:"] + [f"    {_mark(flag)} {label}" for label, flag in rows] + [""]


def _features() -> dict[str, object]:
    from hvdlite.common import core
    from hvdlite.version import __version__
    return {"version": __version__, "mpi": bool(core.mpi_built()),
            "nccl": int(core.nccl_built() or 0), "gloo": bool(core.gloo_built()),
            "ddl": bool(core.ddl_built()), "ccl": bool(core.ccl_built()),
            "cuda": _cuda_line(), "cma": cma_line(),
            "launch": core.launch_env.forecast(core.launch_env.detect(os.environ), os.environ,
                                               module_available("torch"))}


def cma_line(yama_scope_file: str | None = None) -> str:
    """What this machine says about direct copies between ranks (cross-memory attach).  Only a
    job can tell for sure: it tries them once (see hvdlite/common/intranode/direct_copies.py)."""
    from hvdlite.common.core import cma
    if cma.load() is None:
        return ("not available (Linux's process_vm_readv is missing): large allreduces use the "
                "shared-memory window")
    scope = cma.yama_scope(yama_scope_file)   # None: no Yama, only the same-user rule applies
    if scope == 1:
        return ("process_vm_readv found; Yama's ptrace_scope is 1, so each rank lets in only "
                "the job's launcher process and its descendants (prctl PR_SET_PTRACER; a job "
                "tries it once; HVDLITE_DIRECT_COPIES=0 turns it off)")
    if scope is not None and scope >= 2:
        return (f"process_vm_readv found, but Yama's ptrace_scope is {scope}: ranks may read "
                f"each other's memory only with CAP_SYS_PTRACE, else large allreduces use the "
                f"shared-memory window")
    return "process_vm_readv found (a job tries it once; HVDLITE_DIRECT_COPIES=0 turns it off)"


def _cuda_line() -> str:
    """What the GPU data path has here: CuPy's version and the CUDA devices it sees."""
    from hvdlite.common.core import cuda
    if not cuda.cupy_importable():
        return "not available (pip install 'hvdlite[nccl]' for CUDA tensors)"
    import cupy
    count = cuda.cuda_device_count()
    return f"CuPy {cupy.__version__}, {count} device{'s' if count != 1 else ''} visible"


def format_report(features: dict[str, object], frameworks: Sequence[tuple[str, bool]],
                  library: str | None, launcher: str,
                  mismatch: str | None = None) -> str:
    """Render the check-build text from already-gathered facts (pure; used by the tests)."""
    nccl = int(features["nccl"])  # type: ignore[arg-type]
    nccl_label = f"NCCL ({nccl_version_string(nccl)})" if nccl else "NCCL"
    lines = [f"hvdlite v{features['version']}:", ""]
    lines += _section("Available Frameworks", frameworks)
    lines += _section("Available Controllers",
                      [("MPI", bool(features["mpi"])), ("Gloo", bool(features["gloo"]))])
    lines += _section("Available Tensor Operations",
                      [(nccl_label, bool(nccl)), ("DDL", bool(features["ddl"])),
                       ("CCL", bool(features["ccl"])), ("MPI", bool(features["mpi"])),
                       ("Gloo", bool(features["gloo"]))])
    lines.append(f"MPI library: {library or 'not available (pip install mpi4py)'}")
    lines.append(f"MPI launcher: {launcher}")
    if features.get("launch"):
        lines.append(f"This environment: {features['launch']}")
    if features.get("cuda"):
        lines.append(f"CUDA: {features['cuda']}")
    if features.get("cma"):
        lines.append(f"Direct copies between ranks: {features['cma']}")
    if mismatch:
        lines.append(f"WARNING: {mismatch}")
    return "\n".join(lines) + "\n"


def _mismatch(library: str | None, launcher_flavor: mpi_flavor.MpiFlavor | None) -> str | None:
    if not library or launcher_flavor is None:
        return None
    library_flavor = mpi_flavor.detect_flavor(library)
    if library_flavor is None:
        return None
    # MPICH and Intel MPI share the Hydra launcher protocol (and ABI); Open MPI shares neither.
    library_ompi = library_flavor.kind == mpi_flavor.OPEN_MPI
    if library_ompi == (launcher_flavor.kind == mpi_flavor.OPEN_MPI):
        return None
    return (f"mpi4py is built against {mpi_flavor.FLAVOR_NAMES[library_flavor.kind]} but the "
            f"launcher is {mpi_flavor.FLAVOR_NAMES[launcher_flavor.kind]}; jobs will not start "
            f"as one world. Put the matching mpiexec first (or use --mpiexec).")


def check_build_report(launcher: str | None = None) -> str:
    """Gather every fact and return the full check-build text (``launcher`` overrides the
    launcher search, as ``--mpiexec`` does)."""
    features = _features()
    frameworks = [(label, framework_available(module, adapter))
                  for label, module, adapter in FRAMEWORKS]
    library = mpi_library_version() if features["mpi"] else None
    launcher_line, flavor = launcher_description(launcher)
    return format_report(features, frameworks, library, launcher_line, _mismatch(library, flavor))


def main(launcher: str | None = None) -> int:
    """Print the check-build report; always succeeds."""
    sys.stdout.write(check_build_report(launcher))
    sys.stdout.flush()
    return 0

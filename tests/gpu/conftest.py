"""Gatekeeping for tests/gpu: every test here needs a CUDA GPU that both PyTorch and hvdlite's GPU
runtime (CuPy) can use, and the tests marked ``nccl`` also need NCCL.

On a machine without them every test in this folder is skipped (not failed) with the reason, so
``python -m pytest tests/gpu`` is clean on CPU-only CI and meaningful on a GPU machine (run it
there with ``bash scripts/gpu_check.sh``).  The probe runs once, in the pytest process, and only
looks: it creates no CUDA context.
"""
from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@dataclasses.dataclass(frozen=True)
class GpuProbe:
    skip_all: str | None      # why no test here can run, or None
    skip_nccl: str | None     # why the NCCL tests cannot run, or None
    devices: int              # CUDA devices usable by both torch and hvdlite


@functools.lru_cache(maxsize=None)
def gpu_probe() -> GpuProbe:
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - any import failure means: no GPU tests
        return GpuProbe(f"GPU tests need PyTorch, which cannot be imported "
                        f"({type(exc).__name__}: {exc})", None, 0)
    if not torch.cuda.is_available():
        return GpuProbe("GPU tests need a CUDA GPU: torch.cuda.is_available() is False (no GPU "
                        "or driver here, or a CPU-only PyTorch build)", None, 0)
    from hvdlite.common.gpu import cuda
    devices = cuda.cuda_device_count()
    if devices == 0:
        why = cuda._import_cupy()[1]
        detail = (f"CuPy cannot be imported: {why}" if why
                  else "CuPy imports but sees no CUDA device")
        return GpuProbe(f"GPU tests need hvdlite's GPU runtime: "
                        f"hvdlite.common.gpu.cuda.cuda_device_count() is 0 ({detail}); "
                        f"{cuda.INSTALL_HINT}", None, 0)
    skip_nccl = None
    if cuda.nccl_version() == 0:
        skip_nccl = (f"NCCL tests need NCCL: hvdlite.nccl_built() is 0 "
                     f"({cuda._import_nccl()[2]}); {cuda.INSTALL_HINT}")
    return GpuProbe(None, skip_nccl, min(devices, torch.cuda.device_count()))


def pytest_configure(config):
    config.addinivalue_line("markers", "nccl: needs NCCL (hvdlite.nccl_built() > 0) as well as a "
                                       "CUDA GPU (tests/gpu only)")


def _in_this_folder(item) -> bool:
    path = Path(str(getattr(item, "path", None) or item.fspath)).resolve()
    return HERE == path.parent or HERE in path.parents


def pytest_collection_modifyitems(config, items):
    mine = [item for item in items if _in_this_folder(item)]
    if not mine:
        return
    probe = gpu_probe()
    for item in mine:
        if probe.skip_all:
            item.add_marker(pytest.mark.skip(reason=probe.skip_all))
        elif probe.skip_nccl and item.get_closest_marker("nccl"):
            item.add_marker(pytest.mark.skip(reason=probe.skip_nccl))

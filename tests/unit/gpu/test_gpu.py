"""The GPU data path's pure logic, no MPI and no GPU: the HVDLITE_GPU_OPERATIONS knob, NCCL's dtype
check, the lazy CuPy/NCCL probes and their error messages, nccl_built()/cuda_built(), the
one-GPU-per-process claim, submission checks (submission.make_entry with a stand-in engine), the
host-staged backend's copies around a stand-in MPI backend, and the GPU completion thread.
Multi-rank behaviour under real MPI is in tests/core/test_gpu_staged.py.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import types
from pathlib import Path

import numpy as np
import pytest

from hvdlite.common.gpu import cuda
from hvdlite.common.data_paths.nccl import NCCL_TYPES, nccl_reduce_check
from hvdlite.common.data_paths.staged import StagedPath
from hvdlite.common.config import Config
from hvdlite.common.errors import GpuUnavailableError, HvdliteError
from hvdlite.common.gpu.completion import GpuCompletions
from hvdlite.common.engine.handle import Entry, Handle
from hvdlite.common.engine.messages import (ALLGATHER, ALLREDUCE, ALLTOALL, BROADCAST,
                                            REDUCESCATTER, Request, Response)
from hvdlite.common.reduce_ops import ReduceOp
from tests.workers import gpu_loopback

REPO = Path(__file__).resolve().parents[3]
ALL_DTYPES = ["bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64",
              "float16", "bfloat16", "float32", "float64"]


@pytest.fixture(autouse=True)
def clean_gpu_state():
    """Every test starts and ends with the real runtime and no GPU claimed."""
    cuda.set_runtime_for_tests(None)
    cuda.reset_process_device()
    yield
    cuda.set_runtime_for_tests(None)
    cuda.reset_process_device()


# --- HVDLITE_GPU_OPERATIONS -----------------------------------------------------------------------
@pytest.mark.parametrize("env,want", [
    ({}, "nccl"),
    ({"HVDLITE_GPU_OPERATIONS": "nccl"}, "nccl"),
    ({"HVDLITE_GPU_OPERATIONS": "mpi"}, "mpi"),
    ({"HVDLITE_GPU_OPERATIONS": "MPI"}, "mpi"),
    ({"HVDLITE_GPU_OPERATIONS": "Nccl"}, "nccl"),
    ({"HVDLITE_GPU_OPERATIONS": " mpi "}, "mpi"),
    ({"HVDLITE_GPU_OPERATIONS": ""}, "nccl"),          # empty = unset
    ({"HOROVOD_GPU_OPERATIONS": "mpi"}, "mpi"),        # Horovod's spelling
    ({"HOROVOD_GPU_OPERATIONS": "NCCL"}, "nccl"),
    ({"HVDLITE_GPU_OPERATIONS": "nccl", "HOROVOD_GPU_OPERATIONS": "mpi"}, "nccl"),   # ours wins
    ({"HVDLITE_GPU_OPERATIONS": "mpi", "HOROVOD_GPU_OPERATIONS": "nccl"}, "mpi"),
    ({"HVDLITE_GPU_OPERATIONS": "", "HOROVOD_GPU_OPERATIONS": "mpi"}, "mpi"),
])
def test_gpu_operations_knob(env, want):
    assert Config.from_env(env).gpu_operations == want


def test_gpu_operations_default_matches_dataclass():
    assert Config().gpu_operations == "nccl" == Config.from_env({}).gpu_operations


@pytest.mark.parametrize("env,variable", [
    ({"HVDLITE_GPU_OPERATIONS": "gloo"}, "HVDLITE_GPU_OPERATIONS"),
    ({"HOROVOD_GPU_OPERATIONS": "gloo"}, "HOROVOD_GPU_OPERATIONS"),   # the one the user set
    ({"HVDLITE_GPU_OPERATIONS": "gloo", "HOROVOD_GPU_OPERATIONS": "mpi"},   # ours wins, bad
     "HVDLITE_GPU_OPERATIONS"),
])
def test_gpu_operations_invalid_value(env, variable):
    with pytest.raises(ValueError) as err:
        Config.from_env(env)
    msg = str(err.value)
    for part in (f"{variable}='gloo'", "nccl", "mpi", "host memory"):
        assert part in msg, msg


def test_gpu_operations_invalid_value_keeps_the_spelling_given():
    with pytest.raises(ValueError, match="'Ddl'"):
        Config.from_env({"HVDLITE_GPU_OPERATIONS": "Ddl"})


# --- nccl_reduce_check ----------------------------------------------------------------------------
REDUCING = [ReduceOp.Sum, ReduceOp.Average, ReduceOp.Min, ReduceOp.Max, ReduceOp.Product]


@pytest.mark.parametrize("dtype", ["int16", "uint16"])
@pytest.mark.parametrize("op", REDUCING)
def test_nccl_reduce_check_rejects_16_bit_integers(dtype, op):
    with pytest.raises(GpuUnavailableError) as err:
        nccl_reduce_check(dtype, op, "allreduce of 'grad'")
    msg = str(err.value)
    for part in ("allreduce of 'grad'", f"NCCL has no {dtype} reduction", "Cast",
                 "int32", "HVDLITE_GPU_OPERATIONS=mpi"):
        assert part in msg, msg


@pytest.mark.parametrize("dtype", [d for d in ALL_DTYPES if d not in ("int16", "uint16")])
@pytest.mark.parametrize("op", REDUCING)
def test_nccl_reduce_check_accepts_what_nccl_reduces(dtype, op):
    nccl_reduce_check(dtype, op, "allreduce of 'grad'")


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_nccl_reduce_check_never_raises_for_adasum(dtype):
    nccl_reduce_check(dtype, ReduceOp.Adasum, "allreduce of 'grad'")   # host-staged


def test_nccl_types_cover_every_other_dtype():
    assert set(NCCL_TYPES) == set(ALL_DTYPES) - {"int16", "uint16"}


# --- CuPy / NCCL probes and messages --------------------------------------------------------------
WHY_CUPY = "ModuleNotFoundError: No module named 'cupy'"


def _no_cupy(monkeypatch):
    """CuPy absent: both probes report it (NCCL's derives from CuPy's, uncached)."""
    monkeypatch.setattr(cuda, "_import_cupy", lambda: (None, WHY_CUPY))
    monkeypatch.setattr(cuda, "_import_nccl", cuda._import_nccl.__wrapped__)


def _fake_cupy(monkeypatch, nccl_available=True, version=22703, version_error=None,
               device_count=2):
    """Fake ``cupy``/``cupy.cuda``/``cupy.cuda.nccl`` modules, seen by uncached probes."""
    cupy = types.ModuleType("cupy")
    cupy_cuda = types.ModuleType("cupy.cuda")
    nccl = types.ModuleType("cupy.cuda.nccl")
    nccl.available = nccl_available

    def get_version():
        if version_error is not None:
            raise version_error
        return version
    nccl.get_version = get_version

    def get_device_count():
        if isinstance(device_count, Exception):
            raise device_count
        return device_count
    cupy_cuda.runtime = types.SimpleNamespace(getDeviceCount=get_device_count)
    cupy_cuda.nccl = nccl
    cupy.cuda = cupy_cuda
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cupy_cuda)
    monkeypatch.setitem(sys.modules, "cupy.cuda.nccl", nccl)
    monkeypatch.setattr(cuda, "_import_cupy", cuda._import_cupy.__wrapped__)
    monkeypatch.setattr(cuda, "_import_nccl", cuda._import_nccl.__wrapped__)
    return cupy


def test_require_without_cupy(monkeypatch):
    _no_cupy(monkeypatch)
    with pytest.raises(GpuUnavailableError) as err:
        cuda.GpuRuntime().require("allreduce of 'grad'")
    msg = str(err.value)
    for part in ("allreduce of 'grad'", "GPU", "CuPy", WHY_CUPY, cuda.INSTALL_HINT,
                 "move the tensor to the CPU"):
        assert part in msg, msg


def test_require_returns_and_keeps_cupy(monkeypatch):
    fake = _fake_cupy(monkeypatch)
    rt = cuda.GpuRuntime()
    assert rt.require("x") is fake
    monkeypatch.setattr(cuda, "_import_cupy", lambda: (None, "gone"))
    assert rt.require("x") is fake   # looked up once per runtime


def test_require_nccl_without_cupy(monkeypatch):
    _no_cupy(monkeypatch)
    with pytest.raises(GpuUnavailableError) as err:
        cuda.GpuRuntime().require_nccl("allgather of 'w'")
    msg = str(err.value)
    for part in ("allgather of 'w'", "HVDLITE_GPU_OPERATIONS=nccl", "CuPy cannot be imported",
                 WHY_CUPY, cuda.INSTALL_HINT, "HVDLITE_GPU_OPERATIONS=mpi", "host memory"):
        assert part in msg, msg


@pytest.mark.parametrize("why", ["this CuPy was built without NCCL",
                                 "NCCL cannot be loaded (OSError: libnccl.so.2: not found)"])
def test_require_nccl_reports_why(monkeypatch, why):
    monkeypatch.setattr(cuda, "_import_nccl", lambda: (None, 0, why))
    with pytest.raises(GpuUnavailableError) as err:
        cuda.GpuRuntime().require_nccl("allreduce of 'g'")
    msg = str(err.value)
    for part in ("allreduce of 'g'", why, cuda.INSTALL_HINT, "HVDLITE_GPU_OPERATIONS=mpi"):
        assert part in msg, msg


def test_require_nccl_returns_the_binding(monkeypatch):
    _fake_cupy(monkeypatch)
    assert cuda.GpuRuntime().require_nccl("x") is sys.modules["cupy.cuda.nccl"]


def test_import_cupy_probe_reports_the_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)   # makes `import cupy` raise ImportError
    module, why = cuda._import_cupy.__wrapped__()
    assert module is None and "Error: " in why and "cupy" in why, why


def test_probes_are_cached():
    assert hasattr(cuda._import_cupy, "cache_info") and hasattr(cuda._import_nccl, "cache_info")


def test_nccl_probe_built_without_nccl(monkeypatch):
    _fake_cupy(monkeypatch, nccl_available=False)
    assert cuda._import_nccl() == (None, 0, "this CuPy was built without NCCL")


def test_nccl_probe_library_fails_to_load(monkeypatch):
    _fake_cupy(monkeypatch, version_error=OSError("libnccl.so.2: cannot open"))
    module, version, why = cuda._import_nccl()
    assert module is None and version == 0
    assert "NCCL cannot be loaded" in why and "libnccl.so.2" in why


def test_built_queries_without_cupy(monkeypatch):
    import hvdlite as hvd
    _no_cupy(monkeypatch)
    assert hvd.nccl_built() == 0 and type(hvd.nccl_built()) is int
    assert hvd.cuda_built() is False
    assert cuda.nccl_version() == 0 and cuda.cupy_importable() is False
    assert cuda.cuda_device_count() == 0


def test_built_queries_with_cupy_and_nccl(monkeypatch):
    import hvdlite as hvd
    _fake_cupy(monkeypatch, version=22703)
    assert hvd.nccl_built() == 22703
    assert hvd.cuda_built() is True
    assert cuda.cuda_device_count() == 2


def test_built_queries_with_cupy_without_nccl(monkeypatch):
    import hvdlite as hvd
    _fake_cupy(monkeypatch, nccl_available=False)
    assert hvd.nccl_built() == 0
    assert hvd.cuda_built() is True


def test_device_count_without_a_driver(monkeypatch):
    _fake_cupy(monkeypatch, device_count=RuntimeError("cudaErrorInsufficientDriver"))
    assert cuda.cuda_device_count() == 0


def test_built_queries_on_this_machine_agree_with_the_probe():
    import importlib.util
    import hvdlite as hvd
    if importlib.util.find_spec("cupy") is None:
        assert hvd.cuda_built() is False and hvd.nccl_built() == 0


# --- runtime replacement and the process's GPU ----------------------------------------------------
def test_set_runtime_for_tests():
    real = cuda.runtime()
    assert type(real) is cuda.GpuRuntime and cuda.runtime() is real
    loop = gpu_loopback.install()
    assert cuda.runtime() is loop
    cuda.set_runtime_for_tests(None)
    again = cuda.runtime()
    assert type(again) is cuda.GpuRuntime and again is not loop


def test_claim_device_one_gpu_per_process():
    cuda.claim_device(0, "allreduce of 'a'")
    cuda.claim_device(0, "allreduce of 'b'")   # the same GPU again: fine
    with pytest.raises(GpuUnavailableError) as err:
        cuda.claim_device(1, "allreduce of 'c'")
    msg = str(err.value)
    for part in ("allreduce of 'c'", "cuda:1", "cuda:0", "one GPU per process",
                 "set_device"):
        assert part in msg, msg
    assert cuda.process_device(5) == 0   # the failed claim changed nothing


def test_reset_process_device_allows_another_gpu():
    cuda.claim_device(2, "x")
    assert cuda.process_device(0) == 2
    cuda.reset_process_device()
    cuda.claim_device(1, "y")
    assert cuda.process_device(0) == 1


def test_process_device_before_any_claim_asks_the_runtime(monkeypatch):
    loop = gpu_loopback.install()
    loop.device_id = 3
    assert cuda.process_device(0) == 3
    cuda.set_runtime_for_tests(None)
    _no_cupy(monkeypatch)
    with pytest.raises(GpuUnavailableError, match="on rank 7"):
        cuda.process_device(7)


def test_shutdown_forgets_the_gpu(monkeypatch):
    """lifecycle.shutdown() resets the claim (a later init may use another GPU)."""
    from hvdlite.common.runtime import lifecycle, state
    cuda.claim_device(1, "x")
    monkeypatch.setattr(state, "current", None)
    lifecycle.shutdown()   # not initialised: nothing to do
    assert cuda.process_device(0) == 1
    stopped = []
    engine = types.SimpleNamespace(shutdown=lambda: stopped.append(True),
                                   comm=types.SimpleNamespace(Free=lambda: None))
    monkeypatch.setattr(state, "current", types.SimpleNamespace(
        sets={}, engine=engine, world=types.SimpleNamespace(Free=lambda: None), watchdog=None))
    lifecycle.shutdown()
    assert stopped == [True]
    cuda.claim_device(0, "y")   # no error: the claim was forgotten
    assert cuda.process_device(0) == 0


# --- importing never imports CuPy -----------------------------------------------------------------
def test_importing_hvdlite_does_not_import_cupy(tmp_path):
    """A fake ``cupy`` on the path records being imported: importing hvdlite (core, GPU
    backends, the torch adapter) and running a CPU job must not import it; asking whether CUDA
    is built does (the positive control that the probe works)."""
    fake = tmp_path / "cupy"
    fake.mkdir()
    marker = tmp_path / "imported"
    (fake / "__init__.py").write_text(
        f"open({str(marker)!r}, 'w').close()\nraise ImportError('fake cupy for the test')\n")
    code = (
        "import os, sys\n"
        "import numpy as np\n"
        "import hvdlite as hvd\n"
        "import hvdlite.common.gpu.cuda, hvdlite.common.data_paths.nccl\n"
        "import hvdlite.common.data_paths.staged, hvdlite.common.gpu.completion\n"
        "import hvdlite.common.engine.engine, hvdlite.common.api.ops\n"
        "import importlib.util\n"
        "if importlib.util.find_spec('torch') is not None:\n"
        "    import hvdlite.torch\n"
        "hvd.init()\n"
        "assert hvd.allreduce(np.ones(3), name='x').tolist() == [1.0, 1.0, 1.0]\n"
        "hvd.shutdown()\n"
        f"assert not os.path.exists({str(marker)!r}), 'cupy was imported'\n"
        "assert 'cupy' not in sys.modules\n"
        "assert hvd.cuda_built() is False and hvd.nccl_built() == 0\n"
        f"assert os.path.exists({str(marker)!r}), 'the probe never imported the fake cupy'\n"
        "print('ok')\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(REPO), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    for key in [k for k in env if k.startswith(("HVDLITE_", "HOROVOD_"))]:
        del env[key]
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), (
        f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


# --- submission checks (submission.make_entry) ----------------------------------------------
def _engine(mode: str):
    return types.SimpleNamespace(config=Config(gpu_operations=mode),
                                 new_handle=lambda name: Handle(name, lambda: True))


def _entry(mode, kind, array, **kw):
    from hvdlite.common.api.submission import make_entry
    kw.setdefault("name", "t")
    return make_entry(_engine(mode), [0, 1], kind, array, **kw)


class _NcclPresent(gpu_loopback.LoopbackRuntime):
    def require_nccl(self, what):
        return object()


def test_mpi_mode_accepts_device_tensors():
    loop = gpu_loopback.install()
    loop.device_id = 2
    x = np.arange(4, dtype=np.float32)
    entry = _entry("mpi", ALLREDUCE, x, reduce_op=ReduceOp.Sum, device=0)
    assert entry.request.device == 2       # the runtime's device, not the argument's flag
    assert entry.array is x
    assert entry.output is not x and entry.output.shape == x.shape   # allocated "on the device"
    assert cuda.process_device(0) == 2


def test_mpi_mode_skips_nccl_checks():
    gpu_loopback.install(nccl=False)
    for dtype in ("int16", "uint16"):
        _entry("mpi", ALLREDUCE, np.zeros(3, dtype), reduce_op=ReduceOp.Sum, name=dtype,
               device=0)


def test_bfloat16_device_view_stays_16_bit():
    gpu_loopback.install()
    x = np.zeros(3, np.int16)
    entry = _entry("mpi", ALLREDUCE, x, dtype="bfloat16", device=0)
    assert entry.request.dtype == "bfloat16"
    assert entry.array is x and entry.output.dtype == np.int16
    gathered = _entry("mpi", ALLGATHER, x, dtype="bfloat16", name="g", device=0)
    assert gathered.allocate((5,), np.dtype("float64")).dtype == np.int16


@pytest.mark.parametrize("kind", [ALLREDUCE, ALLGATHER, BROADCAST, ALLTOALL, REDUCESCATTER])
def test_nccl_mode_without_nccl_fails_at_submission(kind):
    gpu_loopback.install(nccl=False)
    kw = {"root_rank": 0} if kind == BROADCAST else {}
    with pytest.raises(GpuUnavailableError) as err:
        _entry("nccl", kind, np.zeros((2, 2), np.float32), name="w", device=0, **kw)
    msg = str(err.value)
    assert f"{kind} of 'w'" in msg and "HVDLITE_GPU_OPERATIONS=mpi" in msg, msg


def test_nccl_mode_dtype_check_only_for_allreduce():
    cuda.set_runtime_for_tests(_NcclPresent())
    with pytest.raises(GpuUnavailableError, match="NCCL has no int16 reduction"):
        _entry("nccl", ALLREDUCE, np.zeros(3, np.int16), reduce_op=ReduceOp.Sum, device=0)
    _entry("nccl", ALLREDUCE, np.zeros(3, np.int32), reduce_op=ReduceOp.Sum, device=0)
    _entry("nccl", ALLGATHER, np.zeros(3, np.int16), name="ag", device=0)   # bytes: fine
    _entry("nccl", ALLREDUCE, np.zeros(2, np.float32), reduce_op=ReduceOp.Adasum, name="ad",
           device=0)


def test_real_runtime_without_cupy_fails_at_submission(monkeypatch):
    _no_cupy(monkeypatch)
    for mode in ("nccl", "mpi"):
        with pytest.raises(GpuUnavailableError) as err:
            _entry(mode, ALLREDUCE, np.zeros(3, np.float32), device=0)
        assert "CuPy" in str(err.value) and "allreduce of 't'" in str(err.value)
    assert cuda._process_device is None   # nothing claimed by a failed submission


def test_second_gpu_fails_at_submission():
    loop = gpu_loopback.install()
    _entry("mpi", ALLREDUCE, np.zeros(3, np.float32), name="a", device=0)
    loop.device_id = 1
    with pytest.raises(GpuUnavailableError) as err:
        _entry("mpi", ALLREDUCE, np.zeros(3, np.float32), name="b", device=0)
    assert "cuda:1" in str(err.value) and "cuda:0" in str(err.value)


def test_non_contiguous_device_input_is_refused():
    gpu_loopback.install()
    with pytest.raises(ValueError, match="not contiguous"):
        _entry("mpi", ALLREDUCE, np.zeros(6, np.float32)[::2], device=0)


def test_cpu_tensors_never_touch_the_gpu_runtime():
    class Exploding(gpu_loopback.LoopbackRuntime):
        def require(self, what):
            raise AssertionError("CPU tensor reached the GPU runtime")
    cuda.set_runtime_for_tests(Exploding())
    entry = _entry("nccl", ALLREDUCE, np.zeros(3, np.float32))
    assert entry.request.device == -1


# --- the host-staged backend around a stand-in MPI backend ----------------------------------------
class _FakeMPI:
    """Checks that staging finished before MPI reads host memory; 'reduces' by doubling."""

    def __init__(self, rt):
        self.rt = rt
        self.batches = []

    def enabled(self, batch):
        return True

    def execute(self, batch):
        assert self.rt.synchronize_calls == 1, "MPI ran before the host copies were waited for"
        self.batches.append(batch)
        for response, entry in batch:
            assert isinstance(entry.array, np.ndarray)
            if response.kind == ALLREDUCE:
                factor = 1 if entry.stand_in else 2
                if entry.output is entry.array:
                    entry.array *= factor
                else:
                    np.multiply(entry.array, factor, out=entry.output)
            elif response.kind == ALLGATHER:
                entry.output = entry.allocate((2,) + entry.array.shape[1:], entry.array.dtype)
                entry.output[...] = entry.array[:1] if entry.array.shape[0] else 0
            elif response.kind == ALLTOALL:
                entry.output = (entry.array[::-1].copy(), np.array([1, 2], np.int32))


def _agree_alone(error):
    """The engine's agreement with a single rank: a local failure is everyone's failure."""
    if error is not None:
        raise error


def _staged(rt):
    path = StagedPath.__new__(StagedPath)
    path._runtime = rt
    path._host_paths = [_FakeMPI(rt)]
    path._agree = _agree_alone
    return path


def _item(kind, array, output, dtype=None, allocate=None, stand_in=False):
    dtype = dtype or array.dtype.name
    request = Request("t", kind, dtype, array.shape)
    response = Response("t", kind, dtype, array.shape, int(ReduceOp.Sum), -1, 0)
    entry = Entry(request, array, output, allocate or (lambda s, d: np.empty(s, array.dtype)),
                  Handle("t", lambda: True))
    entry.stand_in = stand_in
    return response, entry


def test_staged_out_of_place_and_in_place():
    rt = gpu_loopback.LoopbackRuntime()
    x = np.arange(4, dtype=np.float32)
    out = np.zeros(4, np.float32)
    y = np.arange(3, dtype=np.float32)
    backend = _staged(rt)
    event, keep, _ = backend.execute_on([_item(ALLREDUCE, x, out), _item(ALLREDUCE, y, y)], 0)
    assert rt.event_done(event) and rt.records == 1
    np.testing.assert_array_equal(out, 2 * np.arange(4))
    np.testing.assert_array_equal(x, np.arange(4))     # the input is untouched
    np.testing.assert_array_equal(y, 2 * np.arange(3))   # in place: written back
    assert rt.to_host_calls == 2 and rt.to_device_calls == 2 and rt.synchronize_calls == 1
    staged = [e for _, e in keep]
    assert staged[0].array is not x and staged[1].output is staged[1].array   # host copies


def test_staged_bfloat16_travels_as_int16_on_the_device():
    import ml_dtypes
    rt = gpu_loopback.LoopbackRuntime()
    values = np.array([1.5, -2.0, 0.25], dtype=ml_dtypes.bfloat16)
    x = values.view(np.int16).copy()
    _staged(rt).execute_on([_item(ALLREDUCE, x, x, dtype="bfloat16")], 0)
    assert x.dtype == np.int16
    np.testing.assert_array_equal(x.view(ml_dtypes.bfloat16), values * 2)


def test_staged_stand_in_stays_on_the_host():
    rt = gpu_loopback.LoopbackRuntime()
    identity = np.zeros(3, np.float32)
    _staged(rt).execute_on([_item(ALLREDUCE, identity, identity, stand_in=True)], 0)
    assert rt.to_host_calls == 0 and rt.to_device_calls == 0


def test_staged_allocates_device_outputs_after_mpi():
    rt = gpu_loopback.LoopbackRuntime()
    allocated = []

    def allocate(shape, dtype):
        allocated.append((shape, dtype))
        return np.full(shape, -1, np.int32)
    x = np.array([[7, 8]], np.int32)
    _, entry = item = _item(ALLGATHER, x, None, allocate=allocate)
    _staged(rt).execute_on([item], 0)
    assert allocated == [((2, 2), np.dtype(np.int32))]
    np.testing.assert_array_equal(entry.output, [[7, 8], [7, 8]])
    assert rt.to_device_calls == 1


def test_staged_alltoall_keeps_received_splits():
    rt = gpu_loopback.LoopbackRuntime()
    x = np.arange(6, dtype=np.float64).reshape(3, 2)
    _, entry = item = _item(ALLTOALL, x, None)
    _staged(rt).execute_on([item], 0)
    rows, splits = entry.output
    np.testing.assert_array_equal(rows, x[::-1])
    assert splits.tolist() == [1, 2]


# --- the GPU completion thread --------------------------------------------------------------------
class _Events:
    """event_wait: events are ints; a negative one fails like a CUDA error."""

    def __init__(self):
        self.waited = []
        self.gate = threading.Event()

    def event_wait(self, event):
        if event == 0:
            assert self.gate.wait(10)
        self.waited.append(event)
        if event < 0:
            raise RuntimeError("cudaErrorIllegalAddress")


def _entries(*names):
    return [Entry(Request(n, ALLREDUCE, "float32", (1,)), None, None, None,
                  Handle(n, lambda: True)) for n in names]


def test_completions_in_order_after_their_event():
    rt = _Events()
    done, failed = [], []
    c = GpuCompletions(rt, lambda es: done.append([e.name for e in es]),
                       lambda e, err: failed.append((e.name, err)))
    first, second = _entries("a", "b"), _entries("c")
    c.put(0, first, keep_alive=object())
    c.put(1, second, keep_alive=None)
    assert done == []   # the first event has not fired: nothing completes, not even later ones
    rt.gate.set()
    c.close()
    assert done == [["a", "b"], ["c"]] and failed == [] and rt.waited == [0, 1]


def test_completions_device_error_fails_those_entries_and_keeps_serving():
    rt = _Events()
    rt.gate.set()
    done, failed = [], []
    c = GpuCompletions(rt, lambda es: done.append([e.name for e in es]),
                       lambda e, err: failed.append((e.name, err)))
    c.put(-1, _entries("x", "y"), None)
    c.put(2, _entries("z"), None)
    c.close()
    assert done == [["z"]]
    assert [name for name, _ in failed] == ["x", "y"]
    for _, err in failed:
        assert isinstance(err, HvdliteError)
        msg = str(err)
        assert "'x'" in msg and "'y'" in msg and "cudaErrorIllegalAddress" in msg, msg


def test_completions_close_from_its_own_thread_does_not_deadlock():
    rt = _Events()
    rt.gate.set()
    holder = {}
    c = GpuCompletions(rt, lambda es: holder["c"].close(), lambda e, err: None)
    holder["c"] = c
    c.put(1, _entries("a"), None)
    c._thread.join(10)
    c.close()
    assert not c._thread.is_alive()


def test_completions_already_completed_entries_are_only_held(caplog):
    """Asynchronous completion: the entries were completed by the engine; the thread only holds
    them until their event fires, and a device error is logged (naming them), not raised."""
    rt = _Events()
    rt.gate.set()
    done, failed = [], []
    c = GpuCompletions(rt, lambda es: done.append([e.name for e in es]),
                       lambda e, err: failed.append((e.name, err)))
    with caplog.at_level("ERROR", logger="hvdlite"):
        c.put(3, _entries("p"), None, completed=True)
        c.put(-4, _entries("q"), None, completed=True)
        c.close()
    assert done == [] and failed == [] and rt.waited == [3, -4]
    assert "['q']" in caplog.text and "cudaErrorIllegalAddress" in caplog.text, caplog.text
    assert "HVDLITE_ENABLE_ASYNC_COMPLETION=0" in caplog.text


# --- asynchronous completion: the knob, and handing results to the framework ---------------------
@pytest.mark.parametrize("env,want", [
    ({}, True), ({"HVDLITE_ENABLE_ASYNC_COMPLETION": "0"}, False),
    ({"HVDLITE_ENABLE_ASYNC_COMPLETION": "off"}, False),
    ({"HVDLITE_ENABLE_ASYNC_COMPLETION": "1"}, True),
    ({"HOROVOD_ENABLE_ASYNC_COMPLETION": "0"}, False),   # Horovod's spelling
    ({"HVDLITE_ENABLE_ASYNC_COMPLETION": "1", "HOROVOD_ENABLE_ASYNC_COMPLETION": "0"}, True),
])
def test_async_completion_knob(env, want):
    assert Config.from_env(env).gpu_async_completion is want


def test_async_completion_knob_refuses_other_values():
    with pytest.raises(ValueError, match="HVDLITE_ENABLE_ASYNC_COMPLETION='later'"):
        Config.from_env({"HVDLITE_ENABLE_ASYNC_COMPLETION": "later"})


class _WaitRecorder(cuda.GpuRuntime):
    def __init__(self):
        super().__init__()
        self.calls = []

    def event_wait(self, event):
        self.calls.append(("host", event))

    def stream_wait(self, event, stream_ptr):
        self.calls.append(("stream", event, stream_ptr))


def test_wait_for_device_work_on_the_framework_stream():
    rt = _WaitRecorder()
    cuda.set_runtime_for_tests(rt)
    cuda.set_consumer_stream(lambda device: 0xabc0 + device)
    try:
        cuda.wait_for_device_work("ev", 3)
    finally:
        cuda.set_consumer_stream(None)
    assert rt.calls == [("stream", "ev", 0xabc3)]


def test_wait_for_device_work_without_a_framework_waits_on_the_host():
    rt = _WaitRecorder()
    cuda.set_runtime_for_tests(rt)
    cuda.wait_for_device_work("ev", 0)
    assert rt.calls == [("host", "ev")]


def test_handle_hands_over_once_before_post_processing():
    order = []
    h = Handle("x", lambda: True)
    h._device_ready = lambda: order.append("ready")
    h.then(lambda res: order.append("post") or res + 1)
    h._complete(1)
    assert h.wait() == 2 and h.wait() == 2
    assert order == ["ready", "post"]


def test_handle_with_an_error_skips_the_handover():
    h = Handle("x", lambda: True)
    h._device_ready = lambda: pytest.fail("handed over a failed result")
    h._complete(None, HvdliteError("boom"))
    with pytest.raises(HvdliteError, match="boom"):
        h.wait()


# --- NCCL's unique id and the communicator's bootstrap (MPI.COMM_SELF, fake binding) -------------
from hvdlite.common.data_paths.nccl import (  # noqa: E402 - grouped with the tests that use them
    NCCLPath, unique_id_for_binding, unique_id_to_array)

UID_BYTES = bytes((i * 37 + 11) % 256 for i in range(128))   # covers bytes >= 128
UID_TUPLE = tuple(np.frombuffer(UID_BYTES, dtype=np.int8).tolist())   # older CuPy: signed ints


@pytest.mark.parametrize("uid", [UID_BYTES, UID_TUPLE], ids=["cupy14-bytes", "cupy13-tuple"])
def test_unique_id_array_holds_the_id_bytes(uid):
    arr = unique_id_to_array(uid)
    assert arr.dtype == np.int8 and arr.tobytes() == UID_BYTES


@pytest.mark.parametrize("version,want", [("14.2.0", UID_BYTES), ("15.0.0rc1", UID_BYTES),
                                          ("13.6.0", UID_TUPLE), ("12.3.0", UID_TUPLE)])
def test_unique_id_for_binding_matches_the_cupy_version(version, want):
    got = unique_id_for_binding(unique_id_to_array(UID_BYTES), version)
    assert type(got) is type(want) and got == want


def test_unique_id_of_the_wrong_size_is_refused():
    with pytest.raises(HvdliteError, match="127 bytes, expected 128"):
        unique_id_to_array(UID_BYTES[:127])


class _FakeBinding:
    """cupy.cuda.nccl as seen by NCCLPath._communicator: records what it was given."""

    def __init__(self, uid=UID_BYTES, uid_error=None):
        self.uid, self.uid_error, self.created = uid, uid_error, []
        binding = self

        class NcclCommunicator:
            def __init__(self, ndev, comm_id, rank):
                binding.created.append((ndev, comm_id, rank))
        self.NcclCommunicator = NcclCommunicator

    def get_unique_id(self):
        if self.uid_error is not None:
            raise self.uid_error
        return self.uid


class _BootstrapRuntime:
    def __init__(self, binding, cupy_version):
        self.binding = binding
        self.cupy = types.SimpleNamespace(
            __version__=cupy_version,
            cuda=types.SimpleNamespace(Device=lambda i: _NullContext()))

    def require_nccl(self, what):
        return self.binding

    def require(self, what):
        return self.cupy


class _NullContext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _backend(binding, cupy_version="14.2.0"):
    from mpi4py import MPI

    from hvdlite.common.config import Config
    from hvdlite.common.engine.data_path import PathContext
    context = PathContext(comm=MPI.COMM_SELF, global_ranks=[0], config=Config(), rank=0,
                          max_sleep=1e-3, on_slow=lambda waited: None, agree=lambda error: None)
    return NCCLPath(context, _BootstrapRuntime(binding, cupy_version))


@pytest.mark.parametrize("cupy_version,uid,want", [("14.2.0", UID_BYTES, UID_BYTES),
                                                   ("13.6.0", UID_TUPLE, UID_TUPLE)])
def test_communicator_gets_the_id_in_its_binding_form(cupy_version, uid, want):
    binding = _FakeBinding(uid=uid)
    backend = _backend(binding, cupy_version)
    comm = backend._communicator(0)
    assert binding.created == [(1, want, 0)]
    assert backend._communicator(0) is comm and len(binding.created) == 1   # created once


def test_communicator_reports_a_failed_unique_id():
    binding = _FakeBinding(uid_error=RuntimeError("NCCL_ERROR_SYSTEM_ERROR"))
    with pytest.raises(HvdliteError, match="unique id on rank 0: NCCL_ERROR_SYSTEM_ERROR"):
        _backend(binding)._communicator(0)
    assert binding.created == []


# --- device primitives over a fake CuPy: fusion copies and producer ordering ---------------------
class _FakeRuntimeCalls:
    """Just enough of ``cupy`` for GpuRuntime's pointer-level primitives; records the calls."""

    def __init__(self):
        self.calls = []
        self.events_made = 0
        fake = self

        class Event:
            def __init__(self, block=False, disable_timing=False):
                fake.events_made += 1
                self.ptr = 4241 + fake.events_made

        class Device:
            def __init__(self, device_id=None):
                pass

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

        runtime = types.SimpleNamespace(
            memcpyAsync=lambda *a: fake.calls.append(("memcpy",) + a),
            eventRecord=lambda *a: fake.calls.append(("record",) + a),
            streamWaitEvent=lambda *a: fake.calls.append(("wait",) + a))
        self.cuda = types.SimpleNamespace(
            Event=Event, Device=Device, runtime=runtime,
            get_current_stream=lambda: types.SimpleNamespace(ptr=77))


def _fake_array(ptr, nbytes, contiguous=True):
    return types.SimpleNamespace(data=types.SimpleNamespace(ptr=ptr), nbytes=nbytes,
                                 flags=types.SimpleNamespace(c_contiguous=contiguous))


def _runtime_over_fake():
    rt = cuda.GpuRuntime()
    rt._cp = _FakeRuntimeCalls()
    rt._streams[0] = types.SimpleNamespace(ptr=55)
    return rt


def test_fusion_copies_pack_and_unpack_at_byte_offsets():
    rt = _runtime_over_fake()
    parts = [_fake_array(1000, 8), _fake_array(2000, 0), _fake_array(3000, 12)]
    rt.concatenate_into(parts, _fake_array(9000, 20))
    rt.split_into(_fake_array(9000, 20), parts)
    d2d = 3
    assert rt._cp.calls == [("memcpy", 9000, 1000, 8, d2d, 77), ("memcpy", 9008, 3000, 12, d2d, 77),
                            ("memcpy", 1000, 9000, 8, d2d, 77), ("memcpy", 3000, 9008, 12, d2d, 77)]


def test_fusion_copies_refuse_non_contiguous_arrays():
    rt = _runtime_over_fake()
    with pytest.raises(HvdliteError, match="contiguous"):
        rt.split_into(_fake_array(9000, 8), [_fake_array(1000, 8, contiguous=False)])
    assert rt._cp.calls == []


def test_wait_for_producer_orders_our_stream_after_theirs():
    rt = _runtime_over_fake()
    rt.wait_for_producer(0, 0)    # torch's legacy default stream
    assert rt._cp.calls == [("record", 4242, 0), ("wait", 55, 4242, 0)]
    rt._cp.calls.clear()
    rt.wait_for_producer(55, 0)   # produced on hvdlite's own stream: already in order
    assert rt._cp.calls == []


def test_wait_for_producer_reuses_one_event_per_thread():
    """Re-recording an event is safe (a stream wait applies to the record before it), so each
    thread records the same event every time; another thread gets its own."""
    rt = _runtime_over_fake()
    for producer in (0, 7, 0):
        rt.wait_for_producer(producer, 0)
    assert rt._cp.events_made == 1
    assert rt._cp.calls == [("record", 4242, 0), ("wait", 55, 4242, 0),
                            ("record", 4242, 7), ("wait", 55, 4242, 0),
                            ("record", 4242, 0), ("wait", 55, 4242, 0)]
    rt._cp.calls.clear()
    other = threading.Thread(target=rt.wait_for_producer, args=(0, 0))
    other.start()
    other.join()
    assert rt._cp.events_made == 2
    assert rt._cp.calls == [("record", 4243, 0), ("wait", 55, 4243, 0)]


def test_wait_for_producer_without_cupy_names_the_tensor(monkeypatch):
    _no_cupy(monkeypatch)
    with pytest.raises(GpuUnavailableError, match="^tensor on cuda:0: the tensor is on a GPU"):
        cuda.GpuRuntime().wait_for_producer(0, 0, "tensor on cuda:0")

"""GPU tensors where the GPU data path they need is missing, under a real MPI launch.

Run under ``mpiexec`` at 2 ranks (tests/core/test_gpu_staged.py) with HVDLITE_GPU_OPERATIONS unset,
so GPU tensors go to NCCL (the default).  The loopback runtime (gpu_loopback.py) stands in for CUDA
without NCCL.  Every failure must happen at submission, on every rank, before anything is in
flight (so nothing waits on a peer and the same name can be used again at once), with a message
that says what to do; CPU operations keep working afterwards.  Also: with the real runtime
(CuPy is not installed here), a GPU tensor fails at submission with an error about CuPy; and
dtypes NCCL cannot reduce fail at submission when NCCL is present.

Importable without MPI: ``cases()`` lists what the job reports.
"""
from __future__ import annotations

import importlib.util
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # sibling helper modules

import numpy as np  # noqa: E402

import hvdlite as hvd  # noqa: E402
from tests.workers import gpu_loopback  # noqa: E402
from tests.workers.core_refs import attempt, check_exact  # noqa: E402
from hvdlite.common.runtime import state
from hvdlite.common.gpu import cuda
from hvdlite.common.api import grouped
from hvdlite.common.api import ops
from hvdlite.common.errors import GpuUnavailableError  # noqa: E402
from hvdlite.common.engine.messages import (ALLGATHER, ALLREDUCE, ALLTOALL, BROADCAST,  # noqa: E402
                                     REDUCESCATTER)
from hvdlite.common.reduce_ops import ReduceOp  # noqa: E402

RANK = SIZE = -1
RT: "ErrorsLoopback" = None
KINDS = (ALLREDUCE, ALLGATHER, BROADCAST, ALLTOALL, REDUCESCATTER)
CUPY_INSTALLED = importlib.util.find_spec("cupy") is not None


class ErrorsLoopback(gpu_loopback.LoopbackRuntime):
    """The loopback without NCCL; with ``nccl_present`` set, submission's NCCL check passes but
    the NCCL backend fails at once if anything reaches it (so a check that lets a tensor through
    shows up as an error, not as a hang)."""

    nccl_present = False

    def require_nccl(self, what):
        if not self.nccl_present:
            return super().require_nccl(what)
        if what.startswith(tuple(KINDS)):   # the submission checks: "<kind> of 'name'"
            return object()
        raise RuntimeError(f"test stand-in: nothing should reach the NCCL backend ({what})")


def cases() -> list[str]:
    names = ["config.default_is_nccl"]
    names += [f"nccl_missing.{kind}" for kind in KINDS]
    names += ["nccl_missing.grouped_allreduce", "nccl_missing.bfloat16_view",
              "nccl_dtype.int16_allreduce", "nccl_dtype.uint16_allreduce"]
    if not CUPY_INSTALLED:
        names.append("real_runtime.cupy_missing")
    names.append("nccl_missing.still_after_everything")
    return names


def kind_args(kind: str) -> dict:
    if kind in (ALLREDUCE, REDUCESCATTER):
        return {"reduce_op": ReduceOp.Sum}
    if kind == BROADCAST:
        return {"root_rank": 0}
    return {}


def cpu_expected(kind: str, xs: list[np.ndarray]):
    if kind == ALLREDUCE:
        return sum(xs)
    if kind == ALLGATHER:
        return np.concatenate(xs)
    if kind == BROADCAST:
        return xs[0]
    if kind == ALLTOALL:   # even split: two rows from every rank
        return np.concatenate([x[2 * RANK:2 * RANK + 2] for x in xs])
    total = sum(xs)        # reducescatter: 2 * size rows, two per rank
    return total[2 * RANK:2 * RANK + 2]


def counters():
    return RT.to_host_calls, RT.to_device_calls, RT.synchronize_calls


def fails_at_submission(label: str, submit, fragments: list[str]) -> None:
    """``submit()`` must raise GpuUnavailableError naming every fragment, with no device work."""
    before = counters()
    got = attempt(submit)
    if not isinstance(got, GpuUnavailableError):
        if hasattr(got, "wait"):
            attempt(lambda: got.wait(30))   # it went in flight (on every rank): let it end
        raise AssertionError(f"{label}: expected GpuUnavailableError at submission, got {got!r}")
    msg = str(got)
    for part in fragments:
        assert part in msg, f"{label}: {part!r} missing from: {msg}"
    assert counters() == before, f"{label}: device work happened: {before} -> {counters()}"


def cpu_works(label: str, kind: str, name: str) -> None:
    """The same name, on the CPU, right away: nothing of the failed submission is in flight."""
    xs = [np.arange(4 * SIZE, dtype=np.float32).reshape(2 * SIZE, 2) + 100 * k
          for k in range(SIZE)]
    got = attempt(lambda: ops.submit(kind, xs[RANK].copy(), name=name, **kind_args(kind)).wait())
    if kind == ALLTOALL and isinstance(got, tuple):
        got = got[0]
    check_exact(f"{label}: CPU {kind} under the same name afterwards", got, cpu_expected(kind, xs))


NCCL_FRAGMENTS = ["HVDLITE_GPU_OPERATIONS=mpi", cuda.INSTALL_HINT, "NCCL"]


def nccl_missing(kind: str) -> None:
    name = f"nm.{kind}"
    x = np.arange(4 * SIZE, dtype=np.float32).reshape(2 * SIZE, 2)
    fails_at_submission(kind, lambda: ops.submit(kind, x, name=name, device=0,
                                                 **kind_args(kind)),
                        NCCL_FRAGMENTS + [f"{kind} of {name!r}"])
    cpu_works(kind, kind, name)


def nccl_missing_grouped() -> None:
    xs = [np.ones(3, np.float32), np.ones((2, 2), np.int32)]
    fails_at_submission("grouped", lambda: grouped.submit_group(
        ALLREDUCE, xs, name="nm.grp", device=0, reduce_op=ReduceOp.Sum), NCCL_FRAGMENTS)
    # all or nothing: no member is in flight, so the same group runs on the CPU at once
    got = attempt(lambda: grouped.grouped_allreduce(xs, op=hvd.Sum, name="nm.grp"))
    if isinstance(got, BaseException):
        raise AssertionError(f"CPU group under the same name afterwards raised {got!r}")
    check_exact("member 0", got[0], xs[0] * SIZE)
    check_exact("member 1", got[1], xs[1] * SIZE)


def nccl_missing_bfloat16_view() -> None:
    """The torch bridge's bfloat16 (int16 view + dtype override) fails the same way."""
    x = np.zeros(4, np.int16)
    fails_at_submission("bfloat16", lambda: ops.submit(ALLREDUCE, x, name="nm.bf16", device=0,
                                                       dtype="bfloat16", reduce_op=ReduceOp.Sum),
                        NCCL_FRAGMENTS)
    cpu_works("bfloat16", ALLREDUCE, "nm.bf16")


def nccl_dtype(dtype: str) -> None:
    """NCCL present (stand-in), but it has no reduction for this dtype: fails at submission
    with advice; allgather of the same dtype would be fine (it moves bytes)."""
    RT.nccl_present = True
    try:
        x = np.arange(6, dtype=dtype)
        fails_at_submission(dtype, lambda: ops.submit(ALLREDUCE, x, name=f"nd.{dtype}",
                                                      device=0, reduce_op=ReduceOp.Sum),
                            [f"NCCL has no {dtype} reduction", "HVDLITE_GPU_OPERATIONS=mpi",
                             f"'nd.{dtype}'"])
    finally:
        RT.nccl_present = False
    cpu_works(dtype, ALLREDUCE, f"nd.{dtype}")


def real_runtime_cupy_missing() -> None:
    """No loopback: the real runtime, and CuPy is not installed."""
    cuda.set_runtime_for_tests(None)
    try:
        assert type(cuda.runtime()) is cuda.GpuRuntime, cuda.runtime()
        x = np.ones((2 * SIZE, 2), np.float32)
        got = attempt(lambda: ops.submit(ALLREDUCE, x, name="rr", device=0,
                                         reduce_op=ReduceOp.Sum))
        got_ag = attempt(lambda: ops.submit(ALLGATHER, x, name="rr.ag", device=0))
    finally:
        cuda.set_runtime_for_tests(RT)
    for label, res, name in (("allreduce", got, "rr"), ("allgather", got_ag, "rr.ag")):
        if not isinstance(res, GpuUnavailableError):
            if hasattr(res, "wait"):
                attempt(lambda: res.wait(30))
            raise AssertionError(f"{label}: expected GpuUnavailableError, got {res!r}")
        msg = str(res)
        for part in ("CuPy", "cupy", cuda.INSTALL_HINT, f"{label} of {name!r}", "CPU"):
            assert part in msg, f"{label}: {part!r} missing from: {msg}"
    cpu_works("real runtime", ALLREDUCE, "rr")
    cpu_works("real runtime", ALLGATHER, "rr.ag")


def config_default_is_nccl() -> None:
    assert state.engine().config.gpu_operations == "nccl", state.engine().config
    assert cuda.runtime() is RT


def still_after_everything() -> None:
    """After all the failures the engine is healthy and GPU tensors still fail cleanly."""
    nccl_missing(ALLREDUCE)   # the same name as an earlier case: reusable again


HANDLERS = {"config.default_is_nccl": config_default_is_nccl,
            "nccl_missing.grouped_allreduce": nccl_missing_grouped,
            "nccl_missing.bfloat16_view": nccl_missing_bfloat16_view,
            "nccl_dtype.int16_allreduce": lambda: nccl_dtype("int16"),
            "nccl_dtype.uint16_allreduce": lambda: nccl_dtype("uint16"),
            "real_runtime.cupy_missing": real_runtime_cupy_missing,
            "nccl_missing.still_after_everything": still_after_everything}
for _kind in KINDS:
    HANDLERS[f"nccl_missing.{_kind}"] = lambda kind=_kind: nccl_missing(kind)


def main() -> None:
    global RANK, SIZE, RT
    from tests.workers._report import Reporter
    RT = ErrorsLoopback(nccl=False)
    cuda.set_runtime_for_tests(RT)
    hvd.init()
    RANK, SIZE = hvd.rank(), hvd.size()
    r = Reporter(RANK)
    for name in cases():
        r.case(name, HANDLERS[name])
        r.write()
    hvd.shutdown()


if __name__ == "__main__":
    main()

"""The Adasum kernel (hvdlite.common.data_paths.adasum) against a numpy tree reference, on every rank.

Uses mpi4py's COMM_WORLD directly (the kernel does not need the engine, so no hvd.init()).  Each
rank regenerates every rank's input from the case name, computes the reference tree locally, runs
the kernel and compares; within a case the kernel and the cross-rank gather of result bytes are
always issued, and checked afterwards, so one rank's failed check never leaves the others waiting.

Importable without MPI: the reference (``adasum_pair``, ``adasum_tree``) and the case lists are
also used by tests/core/test_adasum_kernel.py.
"""
from __future__ import annotations

import hashlib
import zlib

import numpy as np

from hvdlite.common.data_paths.adasum import adasum_allreduce_

NP_POW2 = (2, 4, 8)  # rank counts on which the kernel runs
NP_BAD = (3,)      # rank counts on which every rank must get the clear ValueError

# case -> (dtype, segments, kind); kind picks the inputs (see make_inputs)
FLOAT_CASES = {
    "single.float64": ("float64", [1000], "normal"),
    "single.float32": ("float32", [1000], "normal"),
    "single.float16": ("float16", [1000], "normal"),
    "single.bfloat16": ("bfloat16", [1000], "normal"),
    "segments.float64": ("float64", [7, 1, 300, 2], "normal"),
    "segments.float32": ("float32", [7, 1, 300, 2], "normal"),
    "segments.float16": ("float16", [7, 1, 300, 2], "normal"),
    "segments.bfloat16": ("bfloat16", [7, 1, 300, 2], "normal"),
    "segments_with_empty.float64": ("float64", [0, 5, 0, 0, 12, 0], "normal"),
    "many_segments.float64": ("float64", "many", "normal"),
    "odd_total.float64": ("float64", [13], "normal"),
    "odd_total_segments.float32": ("float32", [5, 8, 0, 20], "normal"),
    "fewer_elements_than_ranks.float64": ("float64", [1, 2], "normal"),
    "one_element.float32": ("float32", [1], "normal"),
    "zero_segment_on_one_rank.float64": ("float64", [50, 40, 30], "zero_segment"),
    "zero_segment_on_one_rank.float16": ("float16", [50, 40, 30], "zero_segment"),
    "identical_inputs_give_the_input.float64": ("float64", [33, 64], "identical"),
    "orthogonal_inputs_give_the_sum.float64": ("float64", [40, 23], "orthogonal"),
    "large.float32": ("float32", [100_000, 3, 162_147], "normal"),
    "empty_buffer.float32": ("float32", [], "normal"),
}
OTHER_CASES = ["int32_raises_typeerror", "bad_segments_raise_valueerror", "comm_self_is_noop",
               "repeat_is_bitwise_deterministic", "split_communicator"]
BAD_SIZE_CASES = ["non_power_of_two_raises_valueerror"]

TOL = {"float64": 1e-12, "float32": 1e-5, "float16": 4e-3, "bfloat16": 3e-2}


def cases_for(size: int) -> list[str]:
    return list(FLOAT_CASES) + OTHER_CASES if size & (size - 1) == 0 else list(BAD_SIZE_CASES)


def np_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


# --- numpy reference ---------------------------------------------------------------------------
def adasum_pair(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """adasum(a, b) in float64; a coefficient with a zero denominator is 1."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    dot, aa, bb = float(a @ b), float(a @ a), float(b @ b)
    ca = 1.0 if aa == 0 else 1.0 - dot / (2 * aa)
    cb = 1.0 if bb == 0 else 1.0 - dot / (2 * bb)
    return ca * a + cb * b


def adasum_tree(vectors: list[np.ndarray]) -> np.ndarray:
    """Pairs at distance 1, then 2, 4, ...; each node rounded to the inputs' dtype."""
    dtype = vectors[0].dtype
    level = list(vectors)
    assert len(level) & (len(level) - 1) == 0, "power-of-two count"
    while len(level) > 1:
        level = [adasum_pair(level[i], level[i + 1]).astype(dtype)
                 for i in range(0, len(level), 2)]
    return level[0]


def adasum_reference(inputs: list[np.ndarray], segments: list[int]) -> np.ndarray:
    """Each segment reduced as its own tensor."""
    offsets = np.concatenate(([0], np.cumsum(segments, dtype=np.int64)))
    parts = [adasum_tree([x[offsets[i]:offsets[i + 1]] for x in inputs])
             for i in range(len(segments))]
    return np.concatenate(parts) if parts else inputs[0][:0].copy()


# --- inputs ------------------------------------------------------------------------------------
def rng_for(case: str, rank: int) -> np.random.Generator:
    return np.random.default_rng([zlib.crc32(case.encode()), rank])


def segments_of(case: str) -> list[int]:
    segments = FLOAT_CASES[case][1]
    if segments == "many":
        return [int(s) for s in rng_for(case, 999).integers(0, 40, size=150)]
    return list(segments)


def make_inputs(case: str, size: int) -> list[np.ndarray]:
    """Every rank's input for ``case`` (the same on every rank that calls this)."""
    dtype, _, kind = FLOAT_CASES[case]
    segments = segments_of(case)
    n = sum(segments)
    common = rng_for(case, 1000).standard_normal(n)   # shared by all ranks
    offsets = np.concatenate(([0], np.cumsum(segments, dtype=np.int64)))
    inputs = []
    for k in range(size):
        rng = rng_for(case, k)
        if kind == "identical":
            x = common.copy()
        elif kind == "orthogonal":
            x = np.where(np.arange(n) % size == k, common, 0.0)
        else:
            # correlated with the other ranks (so the Adasum coefficients are far from 1), and with
            # a per-rank, per-segment scale (so a kernel that mixed segments' norms would show)
            x = 0.8 * common + 0.6 * rng.standard_normal(n)
            for i in range(len(segments)):
                x[offsets[i]:offsets[i + 1]] *= (1.0 + k) ** (i % 3 - 1)
            if kind == "zero_segment":
                if k == 1:
                    x[offsets[1]:offsets[2]] = 0.0
                x[offsets[2]:offsets[3]] = 0.0
        inputs.append(x.astype(np_dtype(dtype)))
    return inputs


def check_close(got: np.ndarray, want: np.ndarray, dtype: str) -> None:
    assert got.dtype == np_dtype(dtype), f"dtype {got.dtype}, want {dtype}"
    assert got.shape == want.shape, f"shape {got.shape}, want {want.shape}"
    g, w = got.astype(np.float64), want.astype(np.float64)
    tol = TOL[dtype]
    scale = float(np.abs(w).max()) if w.size else 0.0
    bad = np.abs(g - w) > tol * (np.abs(w) + scale)
    assert not bad.any(), (f"{int(bad.sum())} of {w.size} elements off, e.g. at "
                           f"{np.argmax(bad)}: got {g[bad][:5]} want {w[bad][:5]}")


def digest(x: np.ndarray) -> str:
    return hashlib.sha256(x.tobytes()).hexdigest()


def attempt(fn):
    try:
        fn()
        return None
    except Exception as exc:  # noqa: BLE001 - re-raised by the caller after the collectives
        return exc


# --- cases (run under MPI) ---------------------------------------------------------------------
def run_float_case(comm, case: str, runs: int = 1) -> list[np.ndarray]:
    dtype, _, kind = FLOAT_CASES[case]
    segments = segments_of(case)
    inputs = make_inputs(case, comm.Get_size())
    results = []
    for _ in range(runs):
        buf = inputs[comm.Get_rank()].copy()
        err = attempt(lambda buf=buf: adasum_allreduce_(comm, buf, segments))
        everyone = comm.allgather(None if err else digest(buf))   # always issued
        if err is not None:
            raise err
        check_close(buf, adasum_reference(inputs, segments), dtype)
        if kind == "identical":
            check_close(buf, inputs[0], dtype)
        elif kind == "orthogonal":
            check_close(buf, np.sum(inputs, axis=0), dtype)
        elif kind == "zero_segment":
            assert not buf[sum(segments[:2]):].any(), "segment zero everywhere must stay zero"
        assert len(set(everyone)) == 1, f"results differ across ranks (bitwise): {everyone}"
        results.append(buf)
    return results


def int32_raises_typeerror(comm) -> None:
    buf = np.arange(10, dtype=np.int32)
    try:
        adasum_allreduce_(comm, buf, [4, 6])
    except TypeError as exc:
        assert "floating-point" in str(exc) and "int32" in str(exc), str(exc)
    else:
        raise AssertionError("int32 buffer did not raise TypeError")
    assert np.array_equal(buf, np.arange(10)), "buffer changed"


def bad_segments_raise_valueerror(comm) -> None:
    for segments in ([4, 5], [11, -1], [3]):
        try:
            adasum_allreduce_(comm, np.zeros(10), segments)
        except ValueError as exc:
            assert "segments" in str(exc), str(exc)
        else:
            raise AssertionError(f"segments {segments} for 10 elements did not raise")


def comm_self_is_noop(comm) -> None:
    from mpi4py import MPI
    x = rng_for("self", comm.Get_rank()).standard_normal(17).astype(np.float32)
    buf = x.copy()
    adasum_allreduce_(MPI.COMM_SELF, buf, [10, 7])
    assert np.array_equal(buf, x), "size-1 communicator changed the buffer"


def repeat_is_bitwise_deterministic(comm) -> None:
    first, second = run_float_case(comm, "segments.float32", runs=2)
    assert first.tobytes() == second.tobytes(), "same inputs gave different bits"


def split_communicator(comm) -> None:
    """The kernel works on a communicator other than COMM_WORLD (ranks renumbered)."""
    sub = comm.Split(comm.Get_rank() % 2, comm.Get_rank())
    try:
        err = attempt(lambda: run_float_case(sub, "segments.float64"))
    finally:
        sub.Free()
    if err is not None:
        raise err


def non_power_of_two_raises_valueerror(comm) -> None:
    buf = np.ones(8)
    try:
        adasum_allreduce_(comm, buf, [8])
    except ValueError as exc:
        msg = str(exc)
        assert str(comm.Get_size()) in msg and "power-of-two" in msg and "op=Average" in msg, msg
    else:
        raise AssertionError(f"size {comm.Get_size()} did not raise ValueError")
    assert np.array_equal(buf, np.ones(8)), "buffer changed"


def main() -> None:
    from tests.workers._report import Reporter
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    r = Reporter(comm.Get_rank())
    for case in cases_for(comm.Get_size()):
        if case in FLOAT_CASES:
            r.case(case, run_float_case, comm, case)
        else:
            r.case(case, globals()[case], comm)
    r.write()


if __name__ == "__main__":
    main()

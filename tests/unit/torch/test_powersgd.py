"""PowerSGD without MPI: the shared policy (hvdlite/common/api/powersgd.py, reached as
``core.powersgd_policy``) and the torch arithmetic (hvdlite/torch/powersgd.py) against the
numpy reference of tests/torch/workers/powersgd_reference.py, for a world of one or more ranks
simulated in one process."""
import numpy as np
import pytest
import torch

from hvdlite.common.core import ReduceOp, powersgd_policy as policy
from hvdlite.torch.compression import Compression, PowerSGDCompressor
from hvdlite.torch.powersgd import PowerSGDState, initial_q, orthogonalize_
from tests.torch.workers.powersgd_reference import Reference, gram_schmidt
from tests.torch.workers.powersgd_reference import initial_q as reference_q


def test_compression_rate_rule():
    config = policy.PowerSGDConfig(rank=1, min_compression_rate=2)
    assert policy.matrix_shape((5,)) is None
    assert policy.matrix_shape((4, 3, 2, 2)) == (4, 12)
    assert policy.compression_rate(10, 10, 1) == 5.0
    assert policy.compression_rate(2, 100, 4) == 200 / (2 * 102)   # rank clamped to 2
    assert policy.compresses((10, 10), config)
    assert not policy.compresses((3,), config)               # vectors travel whole
    assert not policy.compresses((2, 2), config)             # 4 / 4 = 1 < 2
    assert not policy.compresses((0, 5), config)
    assert policy.split([(10, 10), (10,), (2, 2), (8, 3, 3)], config) == ([0, 3], [1, 2])


@pytest.mark.parametrize("kwargs, words", [
    ({"rank": 0}, "rank"), ({"rank": 1.5}, "rank"), ({"start_iter": -1}, "start_iter"),
    ({"min_compression_rate": float("nan")}, "min_compression_rate"),
    ({"epsilon": -1.0}, "epsilon"), ({"wire_dtype": "int8"}, "dtype")])
def test_config_refuses_bad_values(kwargs, words):
    with pytest.raises(ValueError, match=words):
        policy.PowerSGDConfig(**kwargs)


def test_ops_and_dtypes():
    policy.check_op(ReduceOp.Average)
    policy.check_op(ReduceOp.Sum)
    for op in (ReduceOp.Adasum, ReduceOp.Max):
        with pytest.raises(ValueError, match="Average and op=Sum only"):
            policy.check_op(op)
    assert Compression.powersgd(dtype=torch.float16).wire_dtype is torch.float16
    assert Compression.powersgd(dtype="bf16").wire_dtype is torch.bfloat16
    assert Compression.powersgd().wire_dtype is None
    with pytest.raises(ValueError, match="dtype"):
        Compression.powersgd(dtype=torch.int8)
    with pytest.raises(TypeError, match="DistributedOptimizer"):
        Compression.powersgd().compress(torch.ones(2))
    assert isinstance(Compression.powersgd(rank=3), PowerSGDCompressor)


def test_step_counter_and_seeds():
    counter = policy.StepCounter(2)
    assert not counter.compressing
    counter.advance()
    counter.advance()
    assert counter.compressing
    counter.reset()
    assert counter.steps == 0
    config = policy.PowerSGDConfig()
    assert policy.factor_seed(config, "a") == policy.factor_seed(config, "a")
    assert policy.factor_seed(config, "a") != policy.factor_seed(config, "b")
    assert policy.factor_seed(config, "a", 1) != policy.factor_seed(config, "a", 2)


def test_orthogonalize_matches_numpy_and_keeps_zero_columns():
    a = np.random.default_rng(0).standard_normal((9, 3))
    got = orthogonalize_(torch.from_numpy(a.copy())).numpy()
    np.testing.assert_allclose(got, gram_schmidt(a), atol=1e-14)
    np.testing.assert_allclose(got.T @ got, np.eye(3), atol=1e-12)
    zero = torch.zeros(4, 2, dtype=torch.float64)
    assert torch.equal(orthogonalize_(zero), torch.zeros(4, 2, dtype=torch.float64))
    eps = orthogonalize_(torch.from_numpy(a.copy()), 1e-3).numpy()
    np.testing.assert_allclose(eps, gram_schmidt(a, 1e-3), atol=1e-14)


def test_initial_q_matches_reference():
    config = policy.PowerSGDConfig(rank=2)
    q = initial_q(7, 2, policy.factor_seed(config, "w"), torch.float64, torch.device("cpu"))
    np.testing.assert_allclose(q.numpy(), reference_q(config, "w", 7, 2), atol=1e-14)


def laid_out(array: np.ndarray, contiguous: bool) -> torch.Tensor:
    """``array`` as a tensor: contiguous, or the same values in a transposed (non-contiguous,
    as channels-last) layout."""
    if contiguous:
        return torch.from_numpy(array.copy())
    return torch.from_numpy(np.ascontiguousarray(array.transpose(2, 1, 0))).permute(2, 1, 0)


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("warm_start, error_feedback", [(True, True), (False, False)])
@pytest.mark.parametrize("contiguous", [True, False])
def test_state_math_matches_reference(world, warm_start, error_feedback, contiguous):
    """PowerSGDState on every simulated rank, with the allreduces done by summing here; the
    arithmetic works in the gradient's memory where it is contiguous, on a copy where not."""
    config = Compression.powersgd(rank=2, start_iter=0, warm_start=warm_start,
                                  error_feedback=error_feedback).config
    ref = Reference(config, world)
    states = [PowerSGDState(config) for _ in range(world)]
    rng = np.random.default_rng(1)
    for _ in range(3):
        grads = [{"w": rng.standard_normal((8, 3, 4))} for _ in range(world)]
        want = ref.step(grads)["w"]   # (8 x 12 at rank 2: compressed, 2.4 times)
        started = [s.start("w", laid_out(g["w"], contiguous)) for s, g in zip(states, grads)]
        p = orthogonalize_(sum(m @ q for m, q in started))
        q_locals = [m.T @ p for m, _ in started]
        for s, (m, _), q_local in zip(states, started, q_locals):
            s.finish_local("w", m, p, q_local)
        q = sum(q_locals) / world
        out = laid_out(np.zeros((8, 3, 4)), contiguous)
        assert out.is_contiguous() == contiguous
        for s in states:
            s.finish("w", p, q, out)
            s.counter.advance()
        np.testing.assert_allclose(out.numpy(), want, rtol=0, atol=1e-12)

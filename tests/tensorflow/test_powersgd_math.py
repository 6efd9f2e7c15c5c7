"""TensorFlow PowerSGD's host arithmetic on one process (hvdlite/tensorflow/powersgd.py): the
Gram-Schmidt, the seeded initial Q, the state's error feedback and warm start, the dtype
argument, and, with fake collectives, the phases' order and the reset on a new engine (an
elastic reset), which the multi-rank tests do not reach."""
import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from hvdlite.tensorflow import powersgd as ps  # noqa: E402


def test_orthogonalize_is_gram_schmidt():
    """Gram-Schmidt's Q is the QR decomposition's with a positive diagonal in R."""
    m = np.random.default_rng(0).standard_normal((7, 3))
    q, r = np.linalg.qr(m)
    np.testing.assert_allclose(ps.orthogonalize(m.copy()), q * np.sign(np.diag(r)), atol=1e-13)


def test_zero_column_stays_zero():
    out = ps.orthogonalize(np.zeros((4, 2)))
    assert not np.isnan(out).any() and not out.any()


def test_initial_q_depends_on_seed_only():
    a, b = ps.initial_q(9, 2, 5, np.float64), ps.initial_q(9, 2, 5, np.float64)
    assert a.tobytes() == b.tobytes() and a.shape == (9, 2)
    np.testing.assert_allclose(a.T @ a, np.eye(2), atol=1e-6)   # (float32 draws, orthonormal)
    assert ps.initial_q(9, 2, 6, np.float64).tobytes() != a.tobytes()


def test_state_error_feedback_and_warm_start():
    config = ps.PowerSGDConfig(rank=1, start_iter=0)
    state = ps.PowerSGDState(config)
    grad = np.arange(12, dtype=np.float32).reshape(3, 2, 2)
    matrix, q = state.start("g", grad)
    assert matrix.shape == (3, 4) and q.shape == (4, 1) and matrix.dtype == np.float32
    state.error["g"] = np.ones((3, 4), np.float32)
    state.q["g"] = np.full((4, 1), 0.5, np.float32)
    matrix2, q2 = state.start("g", grad)
    np.testing.assert_array_equal(matrix2, grad.reshape(3, 4) + 1)
    assert q2 is state.q["g"]
    assert not np.shares_memory(matrix, grad)   # (the input is TensorFlow's buffer: not written)
    state.reset()
    assert not state.q and not state.error and state.counter.steps == 0


def test_16_bit_gradients_computed_in_float32():
    assert ps.work_dtype(np.dtype(np.float16)) == np.float32
    assert ps.work_dtype(ps.BFLOAT16) == np.float32
    assert ps.work_dtype(np.dtype(np.float64)) == np.float64


def test_dtype_argument():
    assert ps.powersgd(dtype=tf.bfloat16).config.wire_dtype == "bfloat16"
    assert ps.powersgd(dtype="float16").config.wire_dtype == "float16"
    assert ps.powersgd().config == ps.PowerSGDConfig()   # (torch's defaults)
    with pytest.raises(ValueError, match="dtype"):
        ps.powersgd(dtype=tf.float64)
    with pytest.raises(ValueError, match="rank"):
        ps.powersgd(rank=0)


def test_refused_ops_and_per_tensor_use():
    import hvdlite.tensorflow as hvd
    with pytest.raises(ValueError, match="Average and op=Sum only"):
        ps.PowerSGDReduction("x", ps.PowerSGDConfig(), hvd.Adasum, 1.0, 1.0, None)
    with pytest.raises(TypeError):
        hvd.Compression.powersgd().compress(tf.ones(2))


class FakeEngine:
    size = 2   # (one rank alone would submit nothing: its reductions are the identity)


class FakeCollectives:
    """core.submit_group and the engine lookup: a group's results are its inputs; every
    group's name and op is recorded."""

    def __init__(self, monkeypatch):
        self.engine, self.calls = FakeEngine(), []
        monkeypatch.setattr(ps, "process_set_engine", lambda ps_, what: (self.engine, None))
        monkeypatch.setattr(ps.core, "submit_group", self.submit_group)

    def submit_group(self, kind, arrays, name=None, dtypes=None, process_set=None, **kwargs):
        self.calls.append((name.rsplit(".", 1)[-1], kwargs["reduce_op"],
                           [a.dtype.name for a in arrays]))
        return type("Handle", (), {"wait": lambda _self: [a.copy() for a in arrays]})()


def test_plain_then_compressed_and_a_new_engine_starts_over(monkeypatch):
    """start_iter plain steps, then uncompressed + P + Q; a new engine (an elastic reset)
    starts over with plain steps and no Q or error; one rank alone gets its gradient back
    where the rank is full (error feedback then makes up the rest)."""
    import hvdlite.tensorflow as hvd
    fake = FakeCollectives(monkeypatch)
    config = ps.PowerSGDConfig(rank=1, start_iter=1)
    reduce = ps.PowerSGDReduction("g", config, hvd.Average, 1.0, 1.0, None)
    grads = [np.random.default_rng(1).standard_normal((6, 5)), np.ones(5)]
    out = reduce.reduce(["g.0", "g.1"], grads)
    assert [c[0] for c in fake.calls] == ["plain"]
    np.testing.assert_array_equal(out[0], grads[0])
    out = reduce.reduce(["g.0", "g.1"], grads)
    assert [c[0] for c in fake.calls[1:]] == ["uncompressed", "P", "Q"]
    assert fake.calls[2][1] == hvd.Sum and fake.calls[3][1] == hvd.Average
    np.testing.assert_array_equal(out[1], grads[1])
    np.testing.assert_allclose(out[0] + reduce.state.error["g.0"], grads[0], atol=1e-12)
    assert set(reduce.state.q) == {"g.0"}
    fake.engine = FakeEngine()   # hvd.elastic's reset makes a new engine
    reduce.reduce(["g.0", "g.1"], grads)
    assert fake.calls[-1][0] == "plain" and not reduce.state.q and not reduce.state.error


def test_wire_dtype_casts_the_factors(monkeypatch):
    import hvdlite.tensorflow as hvd
    fake = FakeCollectives(monkeypatch)
    config = ps.powersgd(rank=1, start_iter=0, dtype="bfloat16").config
    reduce = ps.PowerSGDReduction("g", config, hvd.Sum, 1.0, 1.0, None)
    out = reduce.reduce(["g.0"], [np.ones((6, 5), np.float32)])
    assert [c[2] for c in fake.calls] == [["bfloat16"], ["bfloat16"]]
    assert out[0].dtype == np.float32

"""TensorFlow PowerSGD's host arithmetic on one process (hvdlite/tensorflow/powersgd.py): the
Gram-Schmidt, the seeded initial Q, the state's error feedback and
warm start, the dtype argument, and what the multi-rank tests cannot see cheaply."""
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

"""hvdlite.jax's pure logic in one process, without MPI: the run-time names of traced
collectives, mapping a JAX runtime error back to hvdlite's, compression casts and the
optimizer's argument checks."""
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("optax")

import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import hvdlite.jax as hvd  # noqa: E402
from hvdlite.jax import bridge  # noqa: E402


class _Set:
    def __init__(self, set_id):
        self.process_set_id = set_id


def test_jit_names_follow_execution_order_per_process_set():
    bridge.reset_jit_names()
    names = [bridge.jit_name("allreduce", None), bridge.jit_name("broadcast", None),
             bridge.jit_name("allreduce", _Set(3)), bridge.jit_name("allgather", None),
             bridge.jit_name("allreduce", _Set(3))]
    assert names == ["allreduce.jax.0", "broadcast.jax.1", "allreduce.jax.set3.0",
                     "allgather.jax.2", "allreduce.jax.set3.1"]
    bridge.reset_jit_names()
    assert bridge.jit_name("allreduce", None) == "allreduce.jax.0"


def test_original_error_maps_a_runtime_error_back():
    mismatch = hvd.TensorMismatchError("shapes [3] and [4] differ for 'allreduce.jax.7'")
    bridge.remember(mismatch)
    quoted = RuntimeError(f"INTERNAL: CpuCallback error ... \nTensorMismatchError: {mismatch}")
    assert hvd.original_error(quoted) is mismatch
    assert hvd.original_error(RuntimeError("something else")) is None
    assert hvd.original_error(mismatch) is mismatch


def test_a_callback_error_reaches_the_caller_as_jax_runtime_error_with_the_original():
    def fail(_label, array):
        raise hvd.TensorMismatchError("planted mismatch")

    fn = jax.jit(lambda x: bridge.run("allreduce", "planted", None, fail, [x],
                                      lambda: [jax.ShapeDtypeStruct(x.shape, x.dtype)])[0])
    with pytest.raises(jax.errors.JaxRuntimeError) as info:
        fn(jnp.ones(2)).block_until_ready()
    assert "TensorMismatchError: planted mismatch" in str(info.value)
    assert isinstance(hvd.original_error(info.value), hvd.TensorMismatchError)


def test_a_result_of_another_shape_than_promised_raises():
    fn = jax.jit(lambda x: bridge.run("allgather", "planted", None,
                                      lambda _label, a: [jnp.ones(5)], [x],
                                      lambda: [jax.ShapeDtypeStruct((2,), x.dtype)])[0])
    with pytest.raises(jax.errors.JaxRuntimeError, match="was promised"):
        fn(jnp.ones(2)).block_until_ready()


def test_compression_casts_floats_only_and_refuses_powersgd():
    x = jnp.ones(3, jnp.float32)
    for compressor, dtype in ((hvd.Compression.fp16, jnp.float16),
                              (hvd.Compression.bf16, jnp.bfloat16)):
        sent, ctx = compressor.compress(x)
        assert sent.dtype == dtype and compressor.decompress(sent, ctx).dtype == jnp.float32
        ints = jnp.ones(3, jnp.int32)
        assert compressor.compress(ints)[0] is ints
    with pytest.raises(NotImplementedError, match="Compression.fp16"):
        hvd.Compression.powersgd(rank=1)


def test_optimizer_checks_its_arguments():
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        hvd.DistributedOptimizer(optax.sgd(0.1), backward_passes_per_step=0)
    with pytest.raises(ValueError, match="gradient_predivide_factor"):
        hvd.DistributedOptimizer(optax.sgd(0.1), op=hvd.Sum, gradient_predivide_factor=2.0)
    opt = hvd.DistributedOptimizer(optax.sgd(0.1), backward_passes_per_step=2)
    state = opt.init({"w": jnp.zeros(2)})
    assert isinstance(state, hvd.DistributedState) and int(state.count) == 0
    assert state.accumulated["w"].shape == (2,)

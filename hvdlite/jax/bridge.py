"""How a collective on JAX arrays runs: eagerly on numpy views, or inside a traced function
(``jax.jit``, ``jax.grad``, ``lax.cond``, ...) as one ordered ``io_callback`` into the engine.

Eagerly (concrete CPU arrays) the inputs are handed to the core as zero-copy numpy views
(``np.asarray``) and the core's results become jax.Arrays without a copy on the CPU
(:func:`to_jax`).

Traced, every collective becomes one ordered callback: an ordered
``jax.experimental.io_callback``, lowered without io_callback's second copy of the inputs
(:func:`ordered_callback`).
*Ordered* is what keeps the ranks paired: a collective blocks its XLA thread until every rank
has submitted it, so every rank must run its collectives in the same order, and JAX threads one
runtime token through all ordered effects of a process (within a program and across calls), so
they run one at a time in program order, the same on every rank that runs the same program.
(``pure_callback`` may be reordered, duplicated or dropped by XLA: a dropped or reordered
collective hangs the other ranks.)

Names.  An unnamed collective inside a traced function takes its name when it *runs*, from this
module's counter: ``<kind>.jax.<k>`` (``<kind>.jax.set<id>.<k>`` on another process set).  The
counter advances in execution order, which ordered effects make the same on every rank, so
names pair up whatever was traced or retraced where and whatever JAX cached; and it is apart
from the core's counter of eager unnamed operations (those run on the Python thread, the
callbacks on an XLA thread, concurrently).  A user's ``name=`` is used as it is (its calls are
one at a time, so one name can serve every step).

The callback receives the operands as the read-only numpy arrays XLA's host callback makes of
them and hands them to the core as they are; XLA copies the returned arrays into its buffers.

Errors.  An exception raised in the callback reaches the caller as ``jax.errors.JaxRuntimeError``
whose message holds the original error's class and message (``TensorMismatchError: ...``); JAX
keeps no reference to the exception itself, so this module remembers the last few
(:func:`original_error` maps the runtime error back to hvdlite's).
"""
from __future__ import annotations

import collections
import itertools
import threading
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from hvdlite.common.core import ProcessSet, global_process_set, process_set_engine


def is_traced(*values) -> bool:
    """Whether any of ``values`` is a JAX tracer (inside jit, grad, vmap, ...)."""
    return any(isinstance(v, jax.core.Tracer) for v in values)


def host_view(x) -> np.ndarray:
    """A numpy view of a concrete array (zero-copy for CPU jax arrays; read-only)."""
    return np.asarray(x)


def set_id_of(process_set: ProcessSet | None) -> int:
    return 0 if process_set is None or process_set.process_set_id is None else (
        process_set.process_set_id)


def check_member(process_set: ProcessSet | None, what: str) -> None:
    """Raise at trace time (``ValueError``/``TypeError``, as the core would when the callback
    runs) for a process set this rank cannot use."""
    process_set_engine(None if process_set is global_process_set else process_set, what)


# --- names of collectives run by callbacks ---------------------------------------------------
_lock = threading.Lock()
_counters: dict[int, itertools.count] = {}


def jit_name(kind: str, process_set: ProcessSet | None) -> str:
    """The next run-time name of an unnamed traced collective (see the module docstring)."""
    set_id = set_id_of(process_set)
    with _lock:
        counter = _counters.setdefault(set_id, itertools.count())
        n = next(counter)
    return f"{kind}.jax.{n}" if set_id == 0 else f"{kind}.jax.set{set_id}.{n}"


def reset_jit_names() -> None:
    """Restart the counters (every rank together, e.g. after ``shutdown()`` and ``init()``)."""
    with _lock:
        _counters.clear()


# --- errors raised inside callbacks -----------------------------------------------------------
_raised: collections.deque = collections.deque(maxlen=32)


def remember(exc: BaseException) -> None:
    _raised.append(exc)


def original_error(error: BaseException) -> BaseException | None:
    """The exception raised inside an hvdlite callback that ``error`` (a
    ``jax.errors.JaxRuntimeError``, or anything whose message quotes it) reports, or None."""
    if error in _raised:
        return error
    text = str(error)
    for exc in reversed(_raised):
        if f"{type(exc).__name__}: {exc}" in text:
            return exc
    return None


# --- the ordered callback ----------------------------------------------------------------------
# ``jax.experimental.io_callback`` costs two copies of every input: XLA's host callback hands
# Python numpy copies of the operands, and io_callback's implementation then ``device_put``s them
# onto the CPU device again (they are only 16-byte aligned, so that is a copy too) before calling
# the function.  The collective reads its inputs only, so this module binds a primitive of its own
# that lowers exactly as an ordered io_callback does (the same ``emit_python_callback``, the same
# ordered-IO effect and runtime token, hence the same pairing and ordering with other ordered
# callbacks, inside lax.cond/scan as well) but gives the numpy operands to the callback directly:
# the grouped allreduce of 21 MB (8 float32 leaves) inside jit took 11.3 -> 7.5 ms at 1 rank
# (the engine alone: 1.8 ms) and 32.5 -> 26.7 ms at 2 ranks (engine: 12.8 ms), alternating in
# one run on the loaded 2-core machine.  Outside JAX's checked internals it falls back to
# io_callback.
def _ordered_callback_primitive():
    try:
        from jax._src import callback as jcb
        from jax._src import core as jcore
        from jax._src import dispatch
        from jax._src.interpreters import mlir
        effect = jcb._OrderedIOEffect
        emit, op_sharding = jcb.emit_python_callback, jcb._callback_op_sharding
    except (ImportError, AttributeError):   # pragma: no cover - other JAX versions
        return None

    prim = jcore.Primitive("hvdlite_ordered_callback")
    prim.multiple_results = True
    dispatch.prim_requires_devices_during_lowering.add(prim)
    prim.def_impl(lambda *args, **params: dispatch.apply_primitive(prim, *args, **params))

    @prim.def_effectful_abstract_eval
    def _abstract_eval(*avals, callback, result_avals):
        return result_avals, {effect}

    def _refuse(what):   # the errors an ordered io_callback raises
        def rule(*args, **params):
            raise ValueError(what)
        return rule

    from jax._src.interpreters import ad, batching
    ad.primitive_jvps[prim] = _refuse("IO callbacks do not support JVP.")
    ad.primitive_transposes[prim] = _refuse("IO callbacks do not support transpose.")
    batching.primitive_batchers[prim] = _refuse("Cannot `vmap` ordered IO callback.")

    def _lowering(ctx, *args, callback, result_avals):
        def _callback(*flat_args):   # numpy operands, as XLA's host callback hands them
            return tuple(callback(*flat_args))
        token = ctx.tokens_in.get(effect)
        result, token, _ = emit(
            ctx, _callback, token, list(args), ctx.avals_in, ctx.avals_out,
            has_side_effect=True, returns_token=True,
            sharding=op_sharding(ctx.module_context.axis_context, None, ctx.avals_out))
        ctx.set_tokens_out(ctx.tokens_in.update_tokens(mlir.TokenSet({effect: token})))
        return result

    mlir.register_lowering(prim, _lowering, cacheable=False)
    return prim


_ordered_callback_p = _ordered_callback_primitive()


def ordered_callback(callback: Callable, specs: Sequence[jax.ShapeDtypeStruct], *args) -> list:
    """``io_callback(callback, specs, *args, ordered=True)`` (flat arguments and results),
    without io_callback's extra copy of the arguments (see above)."""
    if _ordered_callback_p is None:   # pragma: no cover
        return list(io_callback(callback, list(specs), *args, ordered=True))
    avals = tuple(jax.core.ShapedArray(tuple(s.shape), s.dtype) for s in specs)
    return list(_ordered_callback_p.bind(*args, callback=callback, result_avals=avals))


def to_jax(out):
    """A result of the core as a JAX array on the default device.  The core's results are new
    arrays that nothing else holds (large ones 64-byte aligned, from its result pool), so on
    the CPU the jax.Array adopts the memory instead of copying it (``jnp.asarray`` copied it:
    that copy was most of the eager path's cost over the engine's: 21 MB in 8 leaves 4.9 ->
    2.8 ms at 1 rank, 23.1 -> 17.2 ms at 2 ranks, against 1.8 and 12.8 in the engine); the
    array stays alive, and its pool block leased, as long as the jax.Array uses it."""
    if isinstance(out, np.ndarray):
        return jax.device_put(out, may_alias=True)
    return jnp.asarray(out)


# --- running one collective ------------------------------------------------------------------
Compute = Callable[..., Sequence[np.ndarray]]


def run(kind: str, name: str | None, process_set: ProcessSet | None, compute: Compute,
        inputs: Sequence, out_specs: Callable[[], Sequence[jax.ShapeDtypeStruct]] | None
        ) -> list:
    """Run ``compute(name, *numpy inputs) -> list of numpy outputs`` on ``inputs``: at once on
    concrete arrays (``out_specs`` unused), or as one ordered callback when any input is
    traced (``out_specs()`` gives the static shapes and dtypes of the outputs; the callback
    checks them, so a rank whose result would differ raises instead of returning garbage)."""
    if not is_traced(*inputs):
        return [to_jax(o) for o in compute(name, *[host_view(x) for x in inputs])]
    specs = list(out_specs())

    def callback(*arrays):
        try:
            label = name if name is not None else jit_name(kind, process_set)
            # numpy arrays from XLA's host callback (read-only); np.asarray keeps them as they
            # are (with io_callback's fallback it makes numpy views of its CPU jax.Arrays: the
            # core given the jax.Arrays themselves took 10 ms for the same grouped allreduce
            # inside a training step).
            outs = compute(label, *[host_view(a) for a in arrays])
            checked = []
            for out, spec in zip(outs, specs):
                out = np.asarray(out)
                if out.shape != tuple(spec.shape) or out.dtype != spec.dtype:
                    raise ValueError(f"hvdlite: {kind} {label!r} produced {out.dtype}"
                                     f"{list(out.shape)} inside a traced function, where "
                                     f"{spec.dtype}{list(spec.shape)} was promised.")
                checked.append(out)
            return checked
        except BaseException as exc:
            remember(exc)
            raise

    return ordered_callback(callback, specs, *inputs)

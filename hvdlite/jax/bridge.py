"""How a collective on JAX arrays runs: eagerly on numpy views, or inside a traced function
(``jax.jit``, ``jax.grad``, ``lax.cond``, ...) as one ordered ``io_callback`` into the engine.

Eagerly (concrete CPU arrays) the inputs are handed to the core as zero-copy numpy views
(``np.asarray``) and the results come back with ``jnp.asarray``.

Traced, every collective becomes one ``jax.experimental.io_callback(..., ordered=True)``.
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

The callback receives CPU jax arrays (JAX puts XLA's host buffers on its CPU device
first) and hands the core numpy views of them, as the eager path does.

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


# --- running one collective ------------------------------------------------------------------
Compute = Callable[..., Sequence[np.ndarray]]


def run(kind: str, name: str | None, process_set: ProcessSet | None, compute: Compute,
        inputs: Sequence, out_specs: Callable[[], Sequence[jax.ShapeDtypeStruct]] | None
        ) -> list:
    """Run ``compute(name, *numpy inputs) -> list of numpy outputs`` on ``inputs``: at once on
    concrete arrays (``out_specs`` unused), or as one ordered io_callback when any input is
    traced (``out_specs()`` gives the static shapes and dtypes of the outputs; the callback
    checks them, so a rank whose result would differ raises instead of returning garbage)."""
    if not is_traced(*inputs):
        return [jnp.asarray(o) for o in compute(name, *[host_view(x) for x in inputs])]
    specs = list(out_specs())

    def callback(*arrays):
        try:
            label = name if name is not None else jit_name(kind, process_set)
            # JAX hands the callback CPU jax.Arrays (put there from XLA's host buffers): numpy
            # views of them first (11 us for six arrays), as the core given the jax.Arrays
            # themselves took 10 ms for the same grouped allreduce inside a training step.
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

    return list(io_callback(callback, specs, *inputs, ordered=True))

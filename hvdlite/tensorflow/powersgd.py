"""PowerSGD gradient compression for TensorFlow's DistributedGradientTape and the Keras (and
TF1) DistributedOptimizer: ``compression=hvd.Compression.powersgd(...)`` (docs/compression.md).

The policy (settings, compression-rate rule, step count, seeds) is the framework-neutral one of
hvdlite/common/api/powersgd.py, shared with torch.  A step's whole reduction is one graph node
(eagerly: one call): its Python function receives the gradients as host numpy arrays and runs
PowerSGD's phases there, with the core's grouped allreduces in between:

1. before ``start_iter`` steps: one grouped allreduce of every gradient;
2. then: the uncompressed gradients (vectors, small matrices) in one flat allreduce per dtype,
   all P = M Q in one grouped allreduce (Sum), Gram-Schmidt on each P, all Q = M^T P in a second
   grouped allreduce (the op, Average or Sum, with its predivide factors); the gradient is P Q^T.

Every rank runs the same node with the same collectives in the same order, so they stay paired,
and the same numpy operations on the same reduced factors, so the gradients are bitwise
identical across ranks.  The arithmetic runs in numpy on the host, in the gradients' dtype
(float32 for float16 and bfloat16 gradients): a GPU gradient is copied to the host and back, as
every hvdlite TensorFlow collective does.
"""
from __future__ import annotations

import weakref

import numpy as np
import tensorflow as tf

from hvdlite.common import core
from hvdlite.common.core import ALLREDUCE, ReduceOp, process_set_engine
from hvdlite.common.core import powersgd_policy as policy

from .graph import graph_node, node_label, set_static_shapes
from .membership import id_of

PowerSGDConfig = policy.PowerSGDConfig

_DTYPES = {None: None, tf.float16: "float16", tf.bfloat16: "bfloat16", "float16": "float16",
           "bfloat16": "bfloat16", "fp16": "float16", "bf16": "bfloat16"}
BFLOAT16 = np.dtype(tf.bfloat16.as_numpy_dtype)
_WIRE = {"float16": np.dtype(np.float16), "bfloat16": BFLOAT16}


class PowerSGDCompressor:
    """What ``Compression.powersgd(...)`` returns: PowerSGD's settings, for
    ``DistributedGradientTape`` and ``DistributedOptimizer`` only (two allreduce phases per
    step, so no per-tensor compress/decompress pair like fp16).  It keeps no state itself."""

    def __init__(self, config: PowerSGDConfig) -> None:
        self.config = config

    def compress(self, tensor):
        raise TypeError("Compression.powersgd(...) compresses the gradients of a "
                        "DistributedGradientTape or DistributedOptimizer only (it needs two "
                        "allreduces per step); pass it there, not to a collective.")

    def decompress(self, tensor, ctx):
        self.compress(tensor)

    def __repr__(self) -> str:
        return f"Compression.powersgd({self.config})"


def powersgd(rank: int = 1, start_iter: int = 10, min_compression_rate: float = 2.0,
             warm_start: bool = True, error_feedback: bool = True, dtype=None,
             epsilon: float = 0.0, seed: int = 0) -> PowerSGDCompressor:
    """PowerSGD low-rank gradient compression (see docs/compression.md); the arguments are
    torch's ``Compression.powersgd``'s.

    Args:
      rank: rank of the factors; higher is closer to the exact gradient, and costs more.
      start_iter: optimizer steps (reductions) that use a plain allreduce first.
      min_compression_rate: gradients that compression would shrink less than this many times
        (vectors, small matrices) travel uncompressed, all in one allreduce.
      warm_start: start each step's power iteration from the last step's Q.
      error_feedback: add what compression lost to the next step's gradient.
      dtype: ``tf.float16`` or ``tf.bfloat16`` (or their names) to send the factors and the
        uncompressed gradients in that precision; the arithmetic keeps the gradients' dtype.
      epsilon: added to column norms when orthogonalizing (0: exact Gram-Schmidt).
      seed: seed of the random initial Q, the same on every rank.
    """
    try:
        wire = _DTYPES[dtype]
    except (KeyError, TypeError):
        raise ValueError(f"powersgd: dtype must be None, tf.float16 or tf.bfloat16, got "
                         f"{dtype!r}.") from None
    return PowerSGDCompressor(PowerSGDConfig(rank, start_iter, min_compression_rate,
                                             warm_start, error_feedback, epsilon, seed, wire))


def orthogonalize(matrix: np.ndarray, epsilon: float = 0.0) -> np.ndarray:
    """Gram-Schmidt on the columns of the 2-D ``matrix``, in place (torch DDP's, as
    hvdlite/torch/powersgd.py): with ``epsilon`` 0 a zero column stays zero instead of NaN."""
    columns = matrix.shape[1]
    for i in range(columns):
        col = matrix[:, i:i + 1]
        norm = np.linalg.norm(col)
        if epsilon == 0:
            col /= norm if norm > 0 else matrix.dtype.type(1)
        else:
            col /= norm + epsilon
        if i + 1 < columns:
            rest = matrix[:, i + 1:]
            rest -= (col * rest).sum(axis=0, keepdims=True) * col
    return matrix


def initial_q(m: int, r: int, seed: int, dtype) -> np.ndarray:
    """A random m x r Q, orthogonalized: float32 normal draws of numpy's PCG64 from ``seed``
    (the same on every rank and device), in ``dtype``."""
    draw = np.random.default_rng(seed).standard_normal((m, r), dtype=np.float32)
    return orthogonalize(draw.astype(dtype))


def work_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype PowerSGD computes a gradient of ``dtype`` in (numpy has no fast 16-bit
    matrix products)."""
    return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


def is_float(dtype: np.dtype) -> bool:
    return dtype.kind == "f" or dtype == BFLOAT16


class PowerSGDState(policy.FactorState):
    """One reduction's PowerSGD state (see FactorState), with its arithmetic on numpy arrays."""

    def start(self, name: str, grad: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The matrix M to compress for ``grad`` (error feedback added) and the starting Q."""
        n, m = policy.matrix_shape(grad.shape)
        dtype = work_dtype(grad.dtype)
        matrix = grad.reshape(n, m).astype(dtype)   # (a copy: the input is TF's buffer)
        error = self.error.get(name)
        if error is not None and error.shape == matrix.shape and error.dtype == dtype:
            matrix += error
        q = self.q.get(name) if self.config.warm_start else None
        r = policy.factor_rank(n, m, self.config.rank)
        if q is None or q.shape != (m, r) or q.dtype != dtype:
            step = 0 if self.config.warm_start else self.counter.steps
            q = initial_q(m, r, policy.factor_seed(self.config, name, step), dtype)
        return matrix, q


# A DistributedGradientTape is usually made anew every step, so its state outlives it, here,
# per (reduction name, process set, settings); an optimizer keeps its own.
_TAPE_STATES: dict = {}


def tape_state(name: str, process_set, config: PowerSGDConfig) -> PowerSGDState:
    """The PowerSGD state shared by the DistributedGradientTapes of ``name`` on
    ``process_set`` with ``config``."""
    key = (name, id_of(process_set), config)
    state = _TAPE_STATES.get(key)
    if state is None:
        state = _TAPE_STATES[key] = PowerSGDState(config)
    return state


# Every live state and the process set it reduces over, for _after_join.
_LIVE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _after_join(process_set) -> None:
    """hvd.join() on ``process_set`` returned on every rank of it: the states over that set
    start over alike (see FactorState.after_join)."""
    joined = process_set_engine(process_set, "join")[0]
    for state, state_set in list(_LIVE.items()):
        try:
            engine = process_set_engine(state_set, "join")[0]
        except ValueError:   # its process set was removed since: it cannot reduce anyway
            continue
        if engine is joined:
            state.after_join()


core.on_join(_after_join)


class Reduced:
    """The handle of a reduction that was complete when it started (a set of one rank)."""

    def __init__(self, arrays: list) -> None:
        self.arrays = arrays

    def wait(self) -> list:
        return self.arrays


class PowerSGDReduction:
    """``reduction(grads) -> reduced grads`` (dense or None entries; None stays None): PowerSGD
    over ``process_set`` (module docstring); ``op`` Average or Sum, else ValueError."""

    def __init__(self, name: str, config: PowerSGDConfig, op: ReduceOp, prescale: float,
                 postscale: float, process_set, state: PowerSGDState | None = None,
                 what: str = "DistributedOptimizer(compression=powersgd)") -> None:
        policy.check_op(op, what)
        self.name, self.config, self.op = name, config, op
        self.prescale, self.postscale = prescale, postscale
        self.process_set = process_set
        self.state = state if state is not None else PowerSGDState(config)
        _LIVE[self.state] = process_set
        self.wire = _WIRE.get(config.wire_dtype)
        self._alone = False   # this step's process set has one rank (set by reduce)

    def __call__(self, grads: list) -> list:
        present = [i for i, g in enumerate(grads) if g is not None]
        tensors = [tf.convert_to_tensor(grads[i]) for i in present]   # (sparse made dense)
        out = list(grads)
        if not tensors:
            return out
        names = [f"{self.name}.{i}" for i in present]   # (positions: alike on every rank)
        reduced = graph_node(node_label("powersgd", self.name),
                             lambda *arrays: self.reduce(names, arrays), tensors,
                             [t.dtype for t in tensors])
        set_static_shapes(reduced, [t.shape for t in tensors])
        for i, r in zip(present, reduced):
            out[i] = r
        return out

    # --- on host arrays, the same on every rank ------------------------------------------------
    def reduce(self, names: list, arrays) -> list:
        """One step's reduction of ``arrays`` (numpy), named ``names``."""
        state = self.state
        engine = process_set_engine(self.process_set, "PowerSGD")[0]
        state.follow(engine)
        self._alone = engine.size == 1
        if state.counter.needs_agreement:   # after a join: the ranks' counts may differ
            count = [state.counter.steps] if self._alone else core.allreduce(
                np.array([state.counter.steps], dtype=np.int64),
                name=f"{self.name}.powersgd.steps", op=ReduceOp.Max, process_set=self.process_set)
            state.counter.agree(int(count[0]))
        arrays = [np.asarray(a) for a in arrays]
        if state.counter.compressing:
            out = self._compressed(names, arrays)
        else:
            out = self._plain(arrays)
        state.counter.advance()
        return out

    def _submit(self, arrays: list, what: str, op: ReduceOp, scaled: bool):
        """Start one grouped allreduce of ``arrays`` cast to the wire dtype.  Alone in its
        process set the reduction is the identity: only the scaling is applied, with no engine
        round trip for nothing."""
        if self.wire is not None:
            arrays = [a.astype(self.wire) if is_float(a.dtype) else a for a in arrays]
        arrays = [np.ascontiguousarray(a).reshape(a.shape) for a in arrays]
        pre, post = (self.prescale, self.postscale) if scaled else (1.0, 1.0)
        if self._alone:
            for factor in (pre, post):
                if factor != 1.0:
                    arrays = [a * np.asarray(factor, dtype=a.dtype) for a in arrays]
            return Reduced(arrays)
        dtypes = ["bfloat16" if a.dtype == BFLOAT16 else None for a in arrays]
        return core.submit_group(ALLREDUCE, arrays, name=f"{self.name}.powersgd.{what}",
                                 dtypes=dtypes if any(dtypes) else None,
                                 process_set=self.process_set, reduce_op=op,
                                 prescale_factor=pre, postscale_factor=post)

    def _plain(self, arrays: list) -> list:
        """Before ``start_iter``: every gradient allreduced as it is (one group)."""
        results = self._submit(arrays, "plain", self.op, True).wait()
        return [np.asarray(r).astype(a.dtype).reshape(a.shape)
                for a, r in zip(arrays, results)]

    def _compressed(self, names: list, arrays: list) -> list:
        out: list = [None] * len(arrays)
        compressed, whole = policy.split([a.shape for a in arrays], self.config)
        whole += [i for i in compressed if not is_float(arrays[i].dtype)]
        compressed = [i for i in compressed if is_float(arrays[i].dtype)]
        groups = policy.groups_by_dtype(sorted(whole), [a.dtype for a in arrays])
        bucket = None
        if groups:   # vectors and small matrices: one flat group, in flight meanwhile
            flats = [np.concatenate([arrays[i].reshape(-1) for i in group]) for group in groups]
            bucket = self._submit(flats, "uncompressed", self.op, True)
        try:
            reduced = self._power_step([names[i] for i in compressed],
                                       [arrays[i] for i in compressed])
            for i, r in zip(compressed, reduced):
                out[i] = r
        finally:
            if bucket is not None:
                flats = bucket.wait()
                for group, flat in zip(groups, flats):
                    offset = 0
                    for i in group:
                        n = arrays[i].size
                        out[i] = (np.asarray(flat[offset:offset + n]).astype(arrays[i].dtype)
                                  .reshape(arrays[i].shape))
                        offset += n
        return out

    def _power_step(self, names: list, grads: list) -> list:
        """P = M Q, allreduce P, orthogonalize, Q = M^T P, allreduce Q, grad = P Q^T."""
        if not grads:
            return []
        state, config = self.state, self.config
        started = [state.start(name, g) for name, g in zip(names, grads)]
        ps = self._submit([matrix @ q for matrix, q in started], "P", ReduceOp.Sum,
                          False).wait()
        factors = []
        for (matrix, _), p_wire, name in zip(started, ps, names):
            p = orthogonalize(np.array(p_wire, dtype=matrix.dtype), config.epsilon)
            q_local = matrix.T @ p
            if config.error_feedback:   # what this rank's compression lost: M - P Q_local^T
                state.error[name] = matrix - p @ q_local.T
            factors.append((p, q_local))
        qs = self._submit([q for _, q in factors], "Q", self.op, True).wait()
        out = []
        for (p, _), q_wire, name, grad in zip(factors, qs, names, grads):
            q = np.array(q_wire, dtype=p.dtype)
            if config.warm_start:
                state.q[name] = q
            out.append((p @ q.T).reshape(grad.shape).astype(grad.dtype))
        return out


__all__ = ["PowerSGDCompressor", "PowerSGDReduction", "PowerSGDState", "initial_q",
           "orthogonalize", "powersgd", "tape_state"]

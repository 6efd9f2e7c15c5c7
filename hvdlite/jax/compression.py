"""Gradient compression for the wire on JAX arrays: ``Compression.none``, ``Compression.fp16``,
``Compression.bf16`` (the core's casting compressors with JAX's dtypes and cast).  PowerSGD is
the torch and TensorFlow adapters' only: asking for it here raises a ``NotImplementedError``
that says what to use."""
from __future__ import annotations

import jax.numpy as jnp

from hvdlite.common.core import (BF16_DOC, FP16_DOC, Compressor, NoneCompressor,
                                 casting_compressor)


def _is_floating(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


def _cast(array, dtype):
    return array.astype(dtype)


FP16Compressor = casting_compressor("FP16Compressor", FP16_DOC, jnp.dtype(jnp.float16),
                                    _is_floating, _cast)
BF16Compressor = casting_compressor("BF16Compressor", BF16_DOC, jnp.dtype(jnp.bfloat16),
                                    _is_floating, _cast)


def _powersgd(*args, **kwargs):
    raise NotImplementedError(
        "hvdlite.jax: Compression.powersgd is not available for JAX (it is implemented in the "
        "torch and TensorFlow adapters only); use Compression.fp16 or Compression.bf16 to "
        "halve the bytes on the wire.")


class Compression:
    """Compression algorithms to pass as ``compression=``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
    powersgd = staticmethod(_powersgd)


__all__ = ["BF16Compressor", "Compression", "Compressor", "FP16Compressor", "NoneCompressor"]

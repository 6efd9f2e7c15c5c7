"""Gradient compression for the wire: Horovod's ``Compression.none`` / ``Compression.fp16``, plus
``Compression.bf16`` (float32's range, so no overflow on large gradients) and
``Compression.powersgd(...)`` (low-rank gradients for DistributedGradientTape and
DistributedOptimizer, see powersgd.py)."""
from __future__ import annotations

import tensorflow as tf

from hvdlite.common.core import (BF16_DOC, FP16_DOC, Compressor, NoneCompressor,
                                 casting_compressor)

from .powersgd import PowerSGDCompressor, powersgd


def _is_floating(dtype: tf.dtypes.DType) -> bool:
    return dtype.is_floating


FP16Compressor = casting_compressor("FP16Compressor", FP16_DOC, tf.float16, _is_floating, tf.cast)
BF16Compressor = casting_compressor("BF16Compressor", BF16_DOC, tf.bfloat16, _is_floating,
                                    tf.cast)


class Compression:
    """Compression algorithms to pass as ``compression=``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
    powersgd = staticmethod(powersgd)


__all__ = ["BF16Compressor", "Compression", "Compressor", "FP16Compressor", "NoneCompressor",
           "PowerSGDCompressor"]

"""Gradient compression for the wire: Horovod's ``Compression.none`` / ``Compression.fp16``, plus
``Compression.bf16`` (same range as float32, so no overflow on large gradients) and
``Compression.powersgd(...)`` (low-rank gradients for DistributedOptimizer, see powersgd.py)."""
from __future__ import annotations

import torch

from hvdlite.common.core import (BF16_DOC, FP16_DOC, Compressor, NoneCompressor,
                                 casting_compressor)

from .powersgd import PowerSGDCompressor, powersgd


def _is_floating(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point


def _cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor.to(dtype)


FP16Compressor = casting_compressor("FP16Compressor", FP16_DOC, torch.float16, _is_floating, _cast)
BF16Compressor = casting_compressor("BF16Compressor", BF16_DOC, torch.bfloat16, _is_floating,
                                    _cast)


class Compression:
    """Compression algorithms to pass as ``compression=``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
    powersgd = staticmethod(powersgd)


__all__ = ["BF16Compressor", "Compression", "Compressor", "FP16Compressor", "NoneCompressor",
           "PowerSGDCompressor"]

"""Gradient compression for the wire: Horovod's ``Compression.none`` / ``Compression.fp16``, plus
``Compression.bf16`` (same range as float32, so no overflow on large gradients)."""
from __future__ import annotations

import torch


class Compressor:
    """Interface: ``compress`` returns (tensor to send, context); ``decompress`` undoes it."""

    @staticmethod
    def compress(tensor: torch.Tensor):
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx):
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Send tensors as they are."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


def _casting(target: torch.dtype, name: str, doc: str):
    def compress(tensor):
        if tensor.dtype.is_floating_point and tensor.dtype != target:
            return tensor.to(target), tensor.dtype
        return tensor, None

    def decompress(tensor, ctx):
        return tensor if ctx is None else tensor.to(ctx)

    return type(name, (Compressor,), {"__doc__": doc, "compress": staticmethod(compress),
                                      "decompress": staticmethod(decompress)})


FP16Compressor = _casting(torch.float16, "FP16Compressor",
                          "Send floating-point tensors as float16 (halves the bytes).")
BF16Compressor = _casting(torch.bfloat16, "BF16Compressor",
                          "Send floating-point tensors as bfloat16 (halves the bytes, keeps "
                          "float32's range).")


class Compression:
    """Compression algorithms to pass as ``compression=``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor

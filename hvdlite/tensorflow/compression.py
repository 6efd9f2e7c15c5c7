"""Gradient compression for the wire: Horovod's ``Compression.none`` / ``Compression.fp16``, plus
``Compression.bf16`` (float32's range, so no overflow on large gradients)."""
from __future__ import annotations

import tensorflow as tf


class Compressor:
    """Interface: ``compress`` returns (tensor to send, context); ``decompress`` undoes it."""

    @staticmethod
    def compress(tensor):
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Send tensors as they are."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


def _casting(target, name: str, doc: str):
    def compress(tensor):
        dtype = tensor.dtype
        if dtype.is_floating and dtype != target:
            return tf.cast(tensor, target), dtype
        return tensor, None

    def decompress(tensor, ctx):
        return tensor if ctx is None else tf.cast(tensor, ctx)

    return type(name, (Compressor,), {"__doc__": doc, "compress": staticmethod(compress),
                                      "decompress": staticmethod(decompress)})


FP16Compressor = _casting(tf.float16, "FP16Compressor",
                          "Send floating-point tensors as float16 (halves the bytes).")
BF16Compressor = _casting(tf.bfloat16, "BF16Compressor",
                          "Send floating-point tensors as bfloat16 (halves the bytes, keeps "
                          "float32's range).")


class Compression:
    """Compression algorithms to pass as ``compression=``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor

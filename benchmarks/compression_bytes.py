"""The bytes one training step's allreduces carry under each compression the compression
benchmark runs (``none``, ``fp16``, ``powersgd<rank>``), from the parameters' shapes; shared by
its torch and Keras ranks (no framework imported here)."""
from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hvdlite.common.api import powersgd as policy  # noqa: E402


def step_bytes(shapes: list[tuple[int, ...]], name: str) -> dict:
    """The bytes one step's allreduces carry for compression ``name`` (float32 gradients), with
    PowerSGD's compression-rate rule (hvdlite/common/api/powersgd.py): every compressed n x m
    gradient sends P (n x r) and Q (m x r), the others travel whole."""
    whole = sum(4 * math.prod(s) for s in shapes)
    if name == "none":
        return {"total": whole, "uncompressed": whole, "P": 0, "Q": 0}
    if name == "fp16":
        return {"total": whole // 2, "uncompressed": whole // 2, "P": 0, "Q": 0}
    config = policy.PowerSGDConfig(rank=int(name[len("powersgd"):]))
    compressed, rest = policy.split(shapes, config)
    p_bytes = q_bytes = 0
    for i in compressed:
        n, m = policy.matrix_shape(shapes[i])
        r = policy.factor_rank(n, m, config.rank)
        p_bytes += 4 * n * r
        q_bytes += 4 * m * r
    rest_bytes = sum(4 * math.prod(shapes[i]) for i in rest)
    return {"total": p_bytes + q_bytes + rest_bytes, "uncompressed": rest_bytes,
            "P": p_bytes, "Q": q_bytes}


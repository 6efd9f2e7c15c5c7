"""Agreeing across ranks on the layout of gradients that some ranks lack or hold in another
layout: the step both adapters take before reducing such a gradient.

Every rank must submit the same reduction for a gradient, but a rank whose loss did not reach a
parameter has no gradient for it, and an embedding's gradient may be sparse on one rank and
dense, or missing, on another.  A rank that guessed which reduction the others start (a dense
allreduce, or the allgathers of a sparse one) and guessed wrong would leave every rank waiting
for good.  So the ranks vote: each sends, per gradient, a small integer naming what it holds,
and one allreduce takes the maximum at every position.  Each adapter numbers its layouts so
that the one every rank can follow is the highest:

* PyTorch (``hvdlite/torch/grad_layouts.py``): -1 no gradient, 0 dense, k > 0 sparse with k
  sparse dimensions.  Ranks with a gradient go on with their own; only ranks without one
  follow the vote (a sparse reduction wherever some rank's gradient is sparse).
* TensorFlow (``hvdlite/tensorflow/grad_layouts.py``): 0 none, 1 and 2 ``tf.IndexedSlices``
  with int32 and int64 indices, 3 dense.  Every rank converts its gradient to the agreed
  layout (dense wherever some rank's is dense).

A rank that has joined (``hvd.join()``) takes part with zeros, so a joined rank votes 0.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from hvdlite.common.api.ops import allreduce_async, synchronize
from hvdlite.common.engine.handle import Handle
from hvdlite.common.reduce_ops import ReduceOp
from hvdlite.common.runtime.process_sets import ProcessSet


def vote_layouts_async(votes: Sequence[int], name: str,
                       process_set: ProcessSet | None) -> Handle:
    """Start the vote: one allreduce (Max) of ``votes`` as int32 under ``name`` over
    ``process_set``; the handle yields the agreed layout of each position (a numpy array)."""
    return allreduce_async(np.asarray(votes, dtype=np.int32), name=name, op=ReduceOp.Max,
                           process_set=process_set)


def vote_layouts(votes: Sequence[int], name: str, process_set: ProcessSet | None) -> list[int]:
    """:func:`vote_layouts_async`, waited for: the agreed layout of each position."""
    return [int(v) for v in synchronize(vote_layouts_async(votes, name, process_set))]

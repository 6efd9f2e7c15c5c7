"""Single large allreduces of ranks that share one node, by direct copies between their memory
(see :mod:`hvdlite.common.intranode.direct`; ``HVDLITE_DIRECT_COPIES``)."""
from __future__ import annotations

from hvdlite.common.data_paths.helpers import phase, postscale_factor
from hvdlite.common.dtypes import dtype_info, numpy_reduce_ufunc
from hvdlite.common.engine.data_path import Batch, DataPath, PathContext
from hvdlite.common.engine.messages import ALLREDUCE
from hvdlite.common.intranode.direct import MIN_BYTES, DirectAllreduce
from hvdlite.common.reduce_ops import ReduceOp


class DirectCopyPath(DataPath):
    """``direct`` is the copier (None when ``HVDLITE_DIRECT_COPIES=0`` or at one rank)."""

    name = "direct_copies"

    def __init__(self, context: PathContext) -> None:
        super().__init__(context)
        cma = context.config.direct_copies
        self.direct = (DirectAllreduce(context.comm, context.max_sleep, context.on_slow,
                                       required=cma == "on", global_ranks=context.global_ranks)
                       if cma != "off" and self.size > 1 else None)

    def enabled(self, batch: Batch) -> bool:
        response, entry = batch[0]
        if response.kind != ALLREDUCE or len(batch) != 1 or entry.array.nbytes < MIN_BYTES:
            return False   # (the size test is usable()'s, sooner)
        return (self.direct is not None
                and response.device < 0 and response.reduce_op != ReduceOp.Adasum
                and self.direct.usable(entry.array.nbytes))   # collective: every rank

    def execute(self, batch: Batch) -> None:
        response, entry = batch[0]
        info = dtype_info(response.dtype)
        phase(batch, "CMA_ALLREDUCE")
        self.direct.allreduce_one(entry.array.reshape(-1), entry.output.reshape(-1),
                                  numpy_reduce_ufunc(info, ReduceOp(response.reduce_op)),
                                  1.0 if entry.stand_in else response.prescale,
                                  postscale_factor(response, self.size), name=response.name)

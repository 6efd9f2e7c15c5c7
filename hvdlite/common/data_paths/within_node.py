"""The data paths of ranks that share one node: single large allreduces by direct copies
between their memory (:class:`DirectCopyPath`, see :mod:`hvdlite.common.intranode.direct_copies`;
``HVDLITE_DIRECT_COPIES``), and allreduces through a shared-memory window
(:class:`SharedWindowPath`, see :mod:`hvdlite.common.intranode.shared_window`): fused batches,
and single tensors too small for direct copies."""
from __future__ import annotations

from hvdlite.common.data_paths.helpers import copy_out_pieces, flat, pack, phase, postscale_factor
from hvdlite.common.dtypes import dtype_info, numpy_reduce_ufunc
from hvdlite.common.engine.data_path import Batch, DataPath, PathContext
from hvdlite.common.engine.messages import ALLREDUCE
from hvdlite.common.intranode.direct_copies import MIN_BYTES, DirectCopies
from hvdlite.common.intranode.shared_window import MIN_SINGLE_BYTES, SharedWindow
from hvdlite.common.reduce_ops import ReduceOp


class DirectCopyPath(DataPath):
    """``direct`` is the copier (None when ``HVDLITE_DIRECT_COPIES=0`` or at one rank)."""

    name = "direct_copies"

    def __init__(self, context: PathContext) -> None:
        super().__init__(context)
        cma = context.config.direct_copies
        self.direct = (DirectCopies(context.comm, context.max_sleep, context.on_slow,
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
        phase(batch, "DIRECT_COPIES_ALLREDUCE")
        self.direct.allreduce_one(entry.array.reshape(-1), entry.output.reshape(-1),
                                  numpy_reduce_ufunc(info, ReduceOp(response.reduce_op)),
                                  1.0 if entry.stand_in else response.prescale,
                                  postscale_factor(response, self.size), name=response.name)


class SharedWindowPath(DataPath):
    """``window`` is the node's shared fusion window (``HVDLITE_SHM_WINDOW_MB``; 0: off)."""

    name = "shared_window"

    def __init__(self, context: PathContext) -> None:
        super().__init__(context)
        cfg = context.config
        self.window = (SharedWindow(context.comm, cfg.shm_window_bytes, context.max_sleep,
                                    context.on_slow) if cfg.shm_window_bytes > 0 else None)

    def enabled(self, batch: Batch) -> bool:
        response, entry = batch[0]
        if response.kind != ALLREDUCE or (len(batch) == 1
                                          and entry.array.nbytes < MIN_SINGLE_BYTES):
            return False   # (a lone small tensor: usable()'s answer, without its arithmetic)
        if (self.window is None or response.device >= 0
                or response.reduce_op == ReduceOp.Adasum or self.size < 2):
            return False
        itemsize = dtype_info(response.dtype).itemsize
        nbytes = sum(entry.array.size for _, entry in batch) * itemsize
        return self.window.usable(nbytes, single=len(batch) == 1)   # collective: every rank

    def execute(self, batch: Batch) -> None:
        response, entry = batch[0]
        info = dtype_info(response.dtype)
        ufunc = numpy_reduce_ufunc(info, ReduceOp(response.reduce_op))
        window = self.window
        if len(batch) == 1:
            phase(batch, "SHARED_WINDOW_ALLREDUCE")
            window.allreduce_one(entry.array.reshape(-1), entry.output.reshape(-1), ufunc,
                                 1.0 if entry.stand_in else response.prescale,
                                 postscale_factor(response, self.size))
            return
        sizes = [e.array.size for _, e in batch]
        count = sum(sizes)
        pack(batch, window.pack_buffer(count, info.np_dtype), sizes, response.prescale)
        phase(batch, "SHARED_WINDOW_ALLREDUCE")
        if window.size == 2:
            in_place = None
            if response.prescale == 1.0:   # then every input is exactly what was packed
                in_place = [e.output is e.array for _, e in batch]
            window.reduce_pair_into(count, info.np_dtype, ufunc,
                                    [flat(e.output) for _, e in batch], sizes,
                                    postscale_factor(response, self.size), in_place)
            return
        pieces = window.reduce(count, info.np_dtype, ufunc)
        phase(batch, "MEMCPY_OUT_FUSION_BUFFER")   # the postscale rides along with the copy
        copy_out_pieces([flat(e.output) for _, e in batch], sizes, pieces,
                        postscale_factor(response, self.size))

    def close(self, collective: bool, abort: bool = False) -> None:
        if self.window is not None:
            self.window.close(collective)

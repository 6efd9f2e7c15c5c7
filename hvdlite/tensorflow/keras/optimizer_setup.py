"""What every Keras ``DistributedOptimizer`` keeps, whichever Keras it wraps (Keras 3's mixin in
:mod:`hvdlite.tensorflow.keras`, Keras 2's in :mod:`.keras2`)."""
from __future__ import annotations

from hvdlite.common.core import global_process_set

from ..gradient_tape import LocalVariables


class DistributedSetup:
    """The settings of a DistributedOptimizer and its local variables."""

    def _hvd_setup(self, name: str, allreduce_grads, backward_passes_per_step: int,
                   average_aggregated_gradients: bool, process_set=global_process_set) -> None:
        self._hvd_name = name
        self._hvd_process_set = process_set
        self._hvd_allreduce_grads = allreduce_grads
        self._hvd_passes = int(backward_passes_per_step)
        self._hvd_average_aggregated = bool(average_aggregated_gradients)
        self._hvd_aggregated = None
        self._hvd_counter = None
        self._hvd_local = LocalVariables()

    def register_local_var(self, var) -> None:
        """Mark ``var`` as local to this rank (model parallelism): its gradient is applied
        without any collective (divided by the number of ranks when the optimizer was made
        with ``scale_local_gradients=True``, the default), as in Horovod."""
        self._hvd_local.add(var)

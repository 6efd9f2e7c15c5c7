"""A Ray Train backend for hvdlite: :class:`HvdliteConfig` and :class:`HvdliteTrainer`.

Ray Train (V2) starts the workers, numbers them (world rank; the ranks of a node consecutive,
local rank by node) and calls the backend's ``on_start`` before ``train_func`` runs; there the
workers become one MPI world with the same ranks (:func:`hvdlite.ray.formation.form_world`), so
an unchanged ``hvd.init()`` / ``hvd.DistributedOptimizer`` training function runs in
``train_func``.  ``on_shutdown`` (the run ended, failed, or is being restarted after a failure)
ends the world's launcher processes; Ray then ends the workers.  A restart
(``FailureConfig(max_failures=...)``) starts new workers and a new world; the training function
resumes from ``ray.train.get_checkpoint()``.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Dict, Optional, Union

from ray.train.backend import Backend, BackendConfig
from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

from . import formation
from .world import MpiWorld

log = logging.getLogger("hvdlite.ray")


@dataclasses.dataclass
class HvdliteConfig(BackendConfig):
    """The hvdlite backend's settings.

    Args:
        timeout_s: the bound on each step of forming the workers' MPI world (the workers
            reporting their nodes, starting the MPI proxies, MPI_Init); a step that takes longer
            fails the worker group's start with a message naming it.
    """
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"HvdliteConfig(timeout_s={self.timeout_s!r}): the timeout must be "
                             f"a positive number of seconds.")

    @property
    def backend_cls(self):
        return _HvdliteBackend

    def to_dict(self) -> Dict[str, Any]:
        return {"timeout_s": self.timeout_s}


class _HvdliteBackend(Backend):
    # Each worker sees its node's GPUs (as under Horovod's launcher): the script picks its
    # device with hvd.local_rank(), and CUDA IPC between a node's devices works.
    share_cuda_visible_devices: bool = True

    def __init__(self) -> None:
        self._worlds: dict[int, MpiWorld] = {}   # id(worker group) -> its world

    def on_start(self, worker_group, backend_config: HvdliteConfig) -> None:
        world = formation.form_world(worker_group, len(worker_group), backend_config.timeout_s)
        self._worlds[id(worker_group)] = world

    def on_shutdown(self, worker_group, backend_config: HvdliteConfig) -> None:
        world = self._worlds.pop(id(worker_group), None)
        if world is not None:
            formation.end_world(worker_group, world, backend_config.timeout_s)


class HvdliteTrainer(DataParallelTrainer):
    """A Ray Train trainer for hvdlite (Horovod-style) training functions.

    ``train_loop_per_worker`` calls ``hvd.init()`` (from ``hvdlite.torch``, ``hvdlite.tensorflow``
    or ``hvdlite``) and trains as under ``hvdlite run``; it reports metrics and checkpoints with
    ``ray.train.report`` and resumes from ``ray.train.get_checkpoint()``.  The other arguments
    are :class:`ray.train.v2.api.data_parallel_trainer.DataParallelTrainer`'s.
    """

    def __init__(self, train_loop_per_worker: Union[Callable[[], Any], Callable[[Dict], Any]],
                 *, train_loop_config: Optional[Dict] = None,
                 hvdlite_config: Optional[HvdliteConfig] = None, **kwargs: Any) -> None:
        super().__init__(train_loop_per_worker, train_loop_config=train_loop_config,
                         backend_config=hvdlite_config or HvdliteConfig(), **kwargs)

"""A Ray Train backend for hvdlite: :class:`HvdliteConfig` and :class:`HvdliteTrainer`.

Ray Train (V2) starts the workers, numbers them (world rank; the ranks of a node consecutive,
local rank by node) and calls the backend's ``on_start`` before ``train_func`` runs; there the
workers become one MPI world with the same ranks (:func:`hvdlite.ray.formation.form_world`), so
an unchanged ``hvd.init()`` / ``hvd.DistributedOptimizer`` training function runs in
``train_func``.  ``on_shutdown`` (the run ended, failed, or is being restarted after a failure)
ends the world's launcher processes; Ray then ends the workers.  A restart
(``FailureConfig(max_failures=...)``) starts new workers and a new world; the training function
resumes from ``ray.train.get_checkpoint()``, and an ``hvd.elastic.run`` function also from its
newest ``state.commit()``: the backend keeps a commit server (as ``hvdlite run``'s elastic
driver does) in the trainer's controller, which every world's workers connect to at
``hvd.init()``.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Callable, Dict, Optional, Tuple, Union

from ray.train.backend import Backend, BackendConfig
from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

from hvdlite.common.core import HostUpdateResult, MpiWorld
from hvdlite.runner.elastic.server import Server

from . import elastic, formation

log = logging.getLogger("hvdlite.ray")
REPORT_GRACE_S = 10.0   # at a world's end, how long its hvd.elastic workers may take to report


@dataclasses.dataclass
class HvdliteConfig(BackendConfig):
    """The hvdlite backend's settings.

    Args:
        timeout_s: the bound on each step of forming the workers' MPI world (the workers
            reporting their nodes, starting the MPI proxies, MPI_Init); a step that takes longer
            fails the worker group's start with a message naming it.
        elastic: keep the commits of ``hvd.elastic`` states in the trainer's controller, so
            that a run restarted after a failure resumes an ``@hvd.elastic.run`` function
            from its newest ``state.commit()`` (nothing else changes for other functions).
    """
    timeout_s: float = 60.0
    elastic: bool = True

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"HvdliteConfig(timeout_s={self.timeout_s!r}): the timeout must be "
                             f"a positive number of seconds.")

    @property
    def backend_cls(self):
        return _HvdliteBackend

    def to_dict(self) -> Dict[str, Any]:
        return {"timeout_s": self.timeout_s, "elastic": self.elastic}


class _HvdliteBackend(Backend):
    # Each worker sees its node's GPUs (as under Horovod's launcher): the script picks its
    # device with hvd.local_rank(), and CUDA IPC between a node's devices works.
    share_cuda_visible_devices: bool = True

    def __init__(self) -> None:
        self._worlds: Dict[int, Tuple[MpiWorld, int]] = {}   # id(group) -> world, index
        self._watchers: Dict[int, elastic.DrainWatcher] = {}  # world index -> its watcher
        self._server: Optional[Server] = None   # the commits, for every world of the run
        self._next_world = 0

    def on_start(self, worker_group, backend_config: HvdliteConfig) -> None:
        index = self._next_world
        self._next_world += 1
        if backend_config.elastic:
            env = self._elastic_environment(index)
            formation.get_bounded(worker_group.execute_async(_set_environment, env),
                                  backend_config.timeout_s, "set their environment")
        world = formation.form_world(worker_group, len(worker_group), backend_config.timeout_s)
        self._worlds[id(worker_group)] = (world, index)
        if backend_config.elastic:
            nodes = formation.get_bounded(worker_group.execute_async(_node_id),
                                          backend_config.timeout_s, "report their nodes")
            watcher = self._watchers[index] = elastic.DrainWatcher(self._server, index, nodes)
            watcher.start()

    def on_shutdown(self, worker_group, backend_config: HvdliteConfig) -> None:
        world, index = self._worlds.pop(id(worker_group), (None, 0))
        watcher = self._watchers.pop(index, None)
        if watcher is not None:
            watcher.stop()
        if self._server is not None:
            # The hvd.elastic workers stop at their next commit and hand in their state (a
            # failing world's survivors already are): a resize or a restart that Ray Train
            # decided then loses nothing either.
            elastic.stop_at_next_commit(self._server, index, HostUpdateResult.mixed)
            self._server.wait_for_reports(index, REPORT_GRACE_S)
        if world is not None:
            formation.end_world(worker_group, world, backend_config.timeout_s)
        if self._server is not None:
            self._server.forget(index)

    def _elastic_environment(self, index: int) -> Dict[str, str]:
        """The variables that connect world ``index``'s workers to this controller's commit
        server (started at the first world; it lives as long as the controller)."""
        if self._server is None:   # Ray Train, not this backend, acts on failures: no news
            self._server = elastic.commit_server(report_events=False)
        return elastic.worker_environment(self._server, index)


def _set_environment(env: Dict[str, str]) -> None:
    os.environ.update(env)


def _node_id() -> str:
    import ray
    return ray.get_runtime_context().get_node_id()


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

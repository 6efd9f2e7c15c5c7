"""The Ray actors behind :class:`~hvdlite.ray.RayExecutor`'s workers, and the group calls
:mod:`hvdlite.ray.formation` makes on them.  Shared by the fixed and the elastic executor."""
from __future__ import annotations

import os
import socket
from collections import defaultdict
from typing import Any, Callable, Dict, List, Optional, Sequence

import ray


class Worker:
    """The actor behind each worker (Horovod's ``BaseHorovodWorker``)."""

    executable: Any = None

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def hostname(self) -> str:
        return socket.gethostname()

    def pid(self) -> int:
        return os.getpid()

    def get_gpu_ids(self) -> List[Any]:
        return ray.get_gpu_ids()

    def update_env_vars(self, env_vars: Dict[str, Any]) -> None:
        os.environ.update({k: str(v) for k, v in env_vars.items()})

    def start_executable(self, executable_cls: Optional[type] = None,
                         executable_args: Optional[list] = None,
                         executable_kwargs: Optional[dict] = None) -> None:
        if executable_cls:
            self.executable = executable_cls(*(executable_args or []),
                                             **(executable_kwargs or {}))

    def execute(self, fn: Callable[[Any], Any]) -> Any:
        return fn(self.executable)

    def call(self, fn: Callable, *args: Any) -> Any:
        return fn(*args)


class Group:
    """Started workers in world-rank order, as :mod:`hvdlite.ray.formation` calls them."""

    def __init__(self, workers: list) -> None:
        self.workers = workers

    def execute_async(self, fn: Callable, *args: Any) -> list:
        return [w.call.remote(fn, *args) for w in self.workers]

    def execute_single_async(self, rank: int, fn: Callable, *args: Any):
        return self.workers[rank].call.remote(fn, *args)


def visible_devices(workers: Sequence, nodes: Sequence[str], gpu_ids: Sequence[list]) -> list:
    """Calls that give every worker its node's GPUs in ``CUDA_VISIBLE_DEVICES`` (as Horovod
    does: the script picks its device with ``hvd.local_rank()``, and CUDA IPC between a node's
    devices works).  ``nodes[i]`` and ``gpu_ids[i]`` belong to ``workers[i]``."""
    node_gpus: dict[str, list] = defaultdict(list)
    for node, ids in zip(nodes, gpu_ids):
        node_gpus[node].extend(ids)
    return [w.update_env_vars.remote(
        {"CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in node_gpus[node])})
        for w, node in zip(workers, nodes)]

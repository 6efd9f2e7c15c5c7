"""Horovod's ``horovod.ray.RayExecutor``: a job whose workers are Ray actors.

Same API and semantics as Horovod's (``horovod/ray/runner.py``): ``create_settings``, the
constructor's placement arguments, ``start`` (with an optional executable class), ``run``,
``run_remote``, ``execute`` (``fn(executable)`` on every worker), ``execute_single`` (on rank 0)
and ``shutdown``.  ``hvd.init()`` inside the function gives each worker its world rank, the
world size and its local rank on its node, as in Horovod; underneath, the workers form one MPI
world (:mod:`hvdlite.ray.formation`) instead of Horovod's Gloo rendezvous.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any, Callable, Dict, List, Optional

import ray
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from . import formation
from .actors import Group, Worker, visible_devices
from .elastic import ElasticAdapter
from hvdlite.common.core import MpiWorld


@dataclasses.dataclass
class MiniSettings:
    """The settings ``RayExecutor.create_settings`` returns (Horovod's fields).

    ``timeout_s`` bounds each step of forming the workers' MPI world (Horovod: the Gloo
    rendezvous); ``placement_group_timeout_s`` the wait for the workers' resources."""
    timeout_s: int = 30
    placement_group_timeout_s: int = 100
    ssh_identity_file: Optional[str] = None
    nics: Optional[set] = None
    verbose: int = 1
    elastic: bool = False


class RayExecutor:
    """Run a Horovod-style (hvdlite) job on Ray actors.

    Args:
        settings: from :meth:`create_settings`.
        num_workers: number of workers (packed onto as few nodes as fit).
        num_hosts: instead of ``num_workers``: this many distinct nodes...
        num_workers_per_host: ...with this many workers on each.
        cpus_per_worker: each worker's CPUs (Ray resources).
        use_gpu: give each worker GPUs.
        gpus_per_worker: each worker's GPUs when ``use_gpu`` (default 1).
        use_current_placement_group: run in the placement group this driver runs in, if any.
        min_workers: an elastic job (instead of ``num_workers``): at least this many
            workers; the function uses ``hvd.elastic.run`` (see :mod:`hvdlite.ray.elastic`).
        max_workers: an elastic job: at most this many workers (default: all that fit).
        reset_limit: an elastic job: fail after this many resets.
        cooldown_range: an elastic job: ``(low, high)`` seconds a node whose worker failed
            is set aside (growing with each failure); without it no node is set aside.
        elastic_timeout: an elastic job: how long to wait for room for ``min_workers``.
        override_discovery: an elastic job: find the nodes through Ray (True), or use
            ``settings.discovery`` (False).
    """

    @classmethod
    def create_settings(cls, timeout_s: int = 30, ssh_identity_file: Optional[str] = None,
                        ssh_str: Optional[str] = None, placement_group_timeout_s: int = 100,
                        nics: Optional[set] = None) -> MiniSettings:
        """Horovod's settings object.  ``ssh_*`` and ``nics`` are accepted and unused (no ssh:
        Ray starts the processes; MPICH picks the network)."""
        return MiniSettings(timeout_s=timeout_s, ssh_identity_file=ssh_identity_file,
                            placement_group_timeout_s=placement_group_timeout_s, nics=nics)

    def __init__(self, settings: MiniSettings, num_workers: Optional[int] = None,
                 num_hosts: Optional[int] = None, num_workers_per_host: int = 1,
                 cpus_per_worker: int = 1, use_gpu: bool = False,
                 gpus_per_worker: Optional[int] = None, use_current_placement_group: bool = True,
                 min_workers: Optional[int] = None, max_workers: Optional[int] = None,
                 reset_limit: Optional[int] = None, cooldown_range: Optional[List[int]] = None,
                 elastic_timeout: int = 600, override_discovery: bool = True) -> None:
        if max_workers and (not min_workers or min_workers <= 0):
            raise ValueError("`max_workers` provided without any positive `min_workers`. "
                             "Elastic workloads require a positive `min_workers`")
        if min_workers and num_workers:
            raise ValueError("Both `min_workers` and `num_workers` provided. Only one of them "
                             "is allowed: a workload is either elastic or not.")
        self.settings = settings
        self._elastic: Optional[ElasticAdapter] = None
        if min_workers is not None:
            if num_hosts is not None:
                raise ValueError("RayExecutor: num_hosts places a fixed number of workers; an "
                                 "elastic job (min_workers) places them by the nodes' room.")
            self._elastic = ElasticAdapter(
                settings, min_workers=min_workers, max_workers=max_workers, use_gpu=use_gpu,
                cpus_per_worker=cpus_per_worker, gpus_per_worker=gpus_per_worker,
                override_discovery=override_discovery, reset_limit=reset_limit,
                cooldown_range=cooldown_range, elastic_timeout=elastic_timeout)
            self.workers: list = []
            return
        if num_workers is None and num_hosts is None:
            raise ValueError("RayExecutor: pass num_workers, or num_hosts (with "
                             "num_workers_per_host).")
        if num_workers is not None and num_hosts is not None:
            raise ValueError("RayExecutor: pass num_workers or num_hosts, not both.")
        for name, value in (("num_workers", num_workers), ("num_hosts", num_hosts),
                            ("num_workers_per_host", num_workers_per_host)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"RayExecutor({name}={value!r}): expected a positive integer.")
        self.num_workers = num_workers
        self.num_hosts = num_hosts
        self.num_workers_per_host = num_workers_per_host
        self.cpus_per_worker = cpus_per_worker
        self.use_gpu = use_gpu
        self.gpus_per_worker = gpus_per_worker or 1
        self.use_current_placement_group = use_current_placement_group
        self.workers: list = []
        self._placement_group = None
        self._own_placement_group = False
        self._world: Optional[MpiWorld] = None

    # -- starting ---------------------------------------------------------------------------
    @property
    def _size(self) -> int:
        return self.num_workers or self.num_hosts * self.num_workers_per_host

    def _bundles(self) -> tuple[list[dict], str, list[int]]:
        """Placement-group bundles, strategy, and each worker's bundle index."""
        gpus = self.gpus_per_worker * int(self.use_gpu)
        if self.num_hosts is not None:   # Horovod's ColocatedStrategy: one bundle per node
            per = self.num_workers_per_host
            bundle = {"CPU": self.cpus_per_worker * per, "GPU": gpus * per}
            return ([dict(bundle) for _ in range(self.num_hosts)], "STRICT_SPREAD",
                    [i // per for i in range(self._size)])
        bundle = {"CPU": self.cpus_per_worker, "GPU": gpus}
        return [dict(bundle) for _ in range(self._size)], "PACK", list(range(self._size))

    def _create_workers(self) -> list:
        bundles, strategy, index = self._bundles()
        current = get_current_placement_group() if self.use_current_placement_group else None
        if current is not None and self.num_hosts is None:
            self._placement_group, index = current, [-1] * self._size
        else:
            self._placement_group = ray.util.placement_group(bundles, strategy=strategy)
            self._own_placement_group = True
            ready, _ = ray.wait([self._placement_group.ready()],
                                timeout=self.settings.placement_group_timeout_s)
            if not ready:
                raise TimeoutError(
                    f"RayExecutor: the placement group for {self._size} workers ({bundles}, "
                    f"{strategy}) was not ready within {self.settings.placement_group_timeout_s}"
                    f" s. Make sure the cluster has enough resources (available now: "
                    f"{ray.available_resources()}) or autoscales.")
        remote = ray.remote(Worker)
        return [remote.options(
            num_cpus=self.cpus_per_worker, num_gpus=self.gpus_per_worker * int(self.use_gpu),
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                self._placement_group, placement_group_bundle_index=i,
                placement_group_capture_child_tasks=False)).remote() for i in index]

    def start(self, executable_cls: Optional[type] = None,
              executable_args: Optional[List] = None,
              executable_kwargs: Optional[Dict] = None,
              extra_env_vars: Optional[Dict] = None) -> None:
        """Start the workers, make them one MPI world, and create ``executable_cls(*args,
        **kwargs)`` in each (the object ``execute`` passes to its function).  Raises (after
        ending whatever it started) if any step takes longer than ``settings.timeout_s``."""
        if self._elastic is not None:
            self._elastic.start(executable_cls, executable_args, executable_kwargs,
                                extra_env_vars)
            return
        if self.workers:
            raise RuntimeError("RayExecutor.start(): already started; call shutdown() first.")
        try:
            created = self.workers = self._create_workers()   # shutdown() ends them on failure
            timeout = self.settings.timeout_s
            nodes = formation.get_bounded([w.node_id.remote() for w in created], timeout,
                                   "start (is the cluster short of resources?)")
            # MPI gives each host one block of ranks: order the workers by node, keeping the
            # creation order within a node (local rank = that order).
            by_node: dict[str, list] = defaultdict(list)
            for worker, node in zip(created, nodes):
                by_node[node].append(worker)
            self.workers = [w for node_workers in by_node.values() for w in node_workers]
            env = dict(extra_env_vars or {})
            calls = [w.update_env_vars.remote(env) for w in self.workers] if env else []
            if self.use_gpu:   # every worker sees its node's GPUs (CUDA IPC), as in Horovod
                gpus = formation.get_bounded([w.get_gpu_ids.remote() for w in self.workers],
                                             timeout, "report their GPUs")
                calls += visible_devices(self.workers, nodes_in_order(by_node), gpus)
            formation.get_bounded(calls, timeout, "set their environment")
            self._world = formation.form_world(Group(self.workers), self._size, timeout)
            formation.get_bounded([w.start_executable.remote(executable_cls, executable_args,
                                                      executable_kwargs)
                            for w in self.workers], timeout, "create their executable")
        except BaseException:
            self.shutdown()
            raise

    # -- running ----------------------------------------------------------------------------
    def _check_started(self, what: str) -> None:
        if not self.workers:
            raise RuntimeError(f"RayExecutor.{what}(): the workers are not running; call "
                               f"start() first.")

    def execute(self, fn: Callable[[Any], Any],
                callbacks: Optional[List[Callable]] = None) -> List[Any]:
        """``fn(executable)`` on every worker; the results in rank order.  Elastic: on the
        workers of each world until one finishes (the results are that world's)."""
        if self._elastic is not None:
            return self._elastic.run(fn)
        self._check_started("execute")
        return ray.get([w.execute.remote(fn) for w in self.workers])

    def run(self, fn: Callable[..., Any], args: Optional[List] = None,
            kwargs: Optional[Dict] = None,
            callbacks: Optional[List[Callable]] = None) -> List[Any]:
        """``fn(*args, **kwargs)`` on every worker; the results in rank order.  Elastic: on
        the workers of each world until one finishes (the results are that world's)."""
        if self._elastic is not None:
            args, kwargs = list(args or []), dict(kwargs or {})
            return self._elastic.run(lambda _, f=fn: f(*args, **kwargs))
        return ray.get(self.run_remote(fn, args, kwargs))

    def run_remote(self, fn: Callable[..., Any], args: Optional[List] = None,
                   kwargs: Optional[Dict] = None) -> List[Any]:
        """Like :meth:`run`, but returns the workers' ObjectRefs at once (``ray.get`` them)."""
        if self._elastic is not None:   # Horovod's message
            raise NotImplementedError("ObjectRefs cannot be returned from Elastic runs as the "
                                      "workers are ephemeral")
        self._check_started("run_remote")
        args, kwargs = list(args or []), dict(kwargs or {})
        return [w.execute.remote(lambda _, f=fn: f(*args, **kwargs)) for w in self.workers]

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(executable)`` on the rank 0 worker; its result."""
        if self._elastic is not None:   # Horovod's message
            raise NotImplementedError("Elastic mode does not support execute_single. Please "
                                      "use the execute method instead")
        self._check_started("execute_single")
        return ray.get(self.workers[0].execute.remote(fn))

    # -- ending -----------------------------------------------------------------------------
    def shutdown(self) -> None:
        """End the job: the MPI launcher processes, the workers, and the placement group."""
        if self._elastic is not None:
            self._elastic.shutdown()
            return
        workers, self.workers = self.workers, []
        world, self._world = self._world, None
        if world is not None:
            formation.end_world(Group(workers), world, self.settings.timeout_s)
        for worker in workers:
            ray.kill(worker, no_restart=True)
        if self._own_placement_group and self._placement_group is not None:
            ray.util.remove_placement_group(self._placement_group)
        self._placement_group, self._own_placement_group = None, False


def nodes_in_order(by_node: Dict[str, list]) -> List[str]:
    """The node of each worker, in world-rank order, from the workers grouped by node."""
    return [node for node, workers in by_node.items() for _ in workers]

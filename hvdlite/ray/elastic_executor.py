"""Horovod's older ``horovod.ray.ElasticRayExecutor`` (deprecated there since 0.25 in favour
of ``RayExecutor(min_workers=...)``) and its settings, over :class:`.elastic.ElasticAdapter`."""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

from .elastic import ElasticAdapter


@dataclasses.dataclass
class ElasticSettings:
    """What :meth:`ElasticRayExecutor.create_settings` returns: the fields of Horovod's
    ``ElasticSettings`` that apply here (``discovery`` is set by the executor)."""
    min_num_proc: int = 1
    max_num_proc: Optional[int] = None
    reset_limit: Optional[int] = None
    elastic_timeout: float = 600
    timeout_s: float = 30
    ssh_identity_file: Optional[str] = None
    nics: Optional[set] = None
    cooldown_range: Optional[Tuple[float, float]] = None
    verbose: int = 1
    discovery: Any = None


class ElasticRayExecutor:
    """Horovod's ``horovod.ray.ElasticRayExecutor`` (deprecated there since 0.25 in favour of
    ``RayExecutor(min_workers=...)``), for scripts that still use it: the same elastic job as
    :class:`hvdlite.ray.RayExecutor` with ``min_workers``.

    Args:
        settings: from :meth:`create_settings`.
        use_gpu: give each worker (slot) GPUs.
        cpus_per_slot: each worker's CPUs.
        gpus_per_slot: each worker's GPUs (``use_gpu`` only; default 1).
        env_vars: environment variables set in every worker before it runs the function.
        override_discovery: find the nodes through Ray (True), or use ``settings.discovery``.
    """

    @staticmethod
    def create_settings(min_num_proc: int = 1, max_num_proc: Optional[int] = None,
                        reset_limit: Optional[int] = None, elastic_timeout: float = 600,
                        timeout_s: float = 30, ssh_identity_file: Optional[str] = None,
                        nics: Optional[set] = None, min_np: Optional[int] = None,
                        max_np: Optional[int] = None, **kwargs: Any) -> ElasticSettings:
        """Horovod's settings; ``min_np``/``max_np`` are its deprecated spellings, and of its
        other keyword arguments ``cooldown_range`` and ``verbose`` apply."""
        if min_np is not None:
            warnings.warn("min_np is deprecated, use min_num_proc instead", DeprecationWarning,
                          stacklevel=2)
            min_num_proc = min_np
        if max_np is not None:
            warnings.warn("max_np is deprecated, use max_num_proc instead", DeprecationWarning,
                          stacklevel=2)
            max_num_proc = max_np
        unknown = sorted(set(kwargs) - {"cooldown_range", "verbose"})
        if unknown:
            raise TypeError(f"ElasticRayExecutor.create_settings(): unexpected keyword "
                            f"argument(s) {unknown}")
        return ElasticSettings(min_num_proc=min_num_proc, max_num_proc=max_num_proc,
                               reset_limit=reset_limit, elastic_timeout=elastic_timeout,
                               timeout_s=timeout_s, ssh_identity_file=ssh_identity_file,
                               nics=nics, **kwargs)

    def __init__(self, settings: ElasticSettings, use_gpu: bool = False,
                 cpus_per_slot: float = 1, gpus_per_slot: Optional[float] = None,
                 env_vars: Optional[Dict[str, Any]] = None,
                 override_discovery: bool = True) -> None:
        if gpus_per_slot and not use_gpu:   # Horovod's checks and messages
            raise ValueError("gpus_per_slot is set, but use_gpu is False. use_gpu must be True "
                             "if gpus_per_slot is set. ")
        gpus_per_slot = gpus_per_slot or int(use_gpu)
        if use_gpu and gpus_per_slot < 1:
            raise ValueError(f"gpus_per_slot must be >= 1: Got {gpus_per_slot}.")
        self.settings = settings
        self.use_gpu = use_gpu
        self.cpus_per_slot = cpus_per_slot
        self.gpus_per_slot = gpus_per_slot
        self.env_vars = env_vars or {}
        self._adapter = ElasticAdapter(
            settings, min_workers=settings.min_num_proc, max_workers=settings.max_num_proc,
            use_gpu=use_gpu, cpus_per_worker=cpus_per_slot,
            gpus_per_worker=gpus_per_slot or None, override_discovery=override_discovery,
            reset_limit=settings.reset_limit, cooldown_range=settings.cooldown_range,
            elastic_timeout=settings.elastic_timeout)

    def start(self) -> None:
        """Wait (up to ``elastic_timeout``) until the cluster has room for ``min_num_proc``
        workers."""
        self._adapter.start(extra_env_vars=self.env_vars)

    def run(self, worker_fn: Callable[[], Any],
            callbacks: Optional[List[Callable]] = None) -> List[Any]:
        """``worker_fn()`` (an ``hvd.elastic.run`` training function) on every worker of a
        sequence of worlds until one finishes; that world's return values in rank order.
        ``callbacks`` are accepted and not called (see docs/deviations.md)."""
        return self._adapter.run(lambda _: worker_fn())

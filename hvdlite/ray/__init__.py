"""hvdlite on Ray: Horovod-style jobs whose workers are Ray actors.

* :class:`RayExecutor` - Horovod's ``horovod.ray.RayExecutor`` API (``start``, ``run``,
  ``execute``, ``execute_single``, ``run_remote``, ``shutdown``), with its elastic form
  (``min_workers``/``max_workers``; :class:`ElasticRayError` when such a job cannot go on),
  and Horovod's older :class:`ElasticRayExecutor` for the same.
* :class:`HvdliteTrainer` / :class:`HvdliteConfig` - a Ray Train trainer and backend whose
  workers form one MPI world before ``train_func`` runs, so ``hvd.init()`` works unchanged.

The workers of a job become one MPI world through MPICH's manual launcher (see
:mod:`hvdlite.common.runtime.hydra_world`).  Ray is an optional dependency: ``pip install
"hvdlite[ray]"``.
"""
from typing import TYPE_CHECKING

try:
    import ray as _ray  # noqa: F401
except ImportError as _exc:   # say what to install instead of a bare "No module named 'ray'"
    raise ImportError('hvdlite.ray needs Ray (Ray Train 2.40 or newer), which is not installed: '
                      'pip install "hvdlite[ray]"') from _exc

if TYPE_CHECKING:   # for type checkers and the API reference; loaded lazily below
    from .executor import RayExecutor
    from .train import HvdliteConfig, HvdliteTrainer
    from .elastic import ElasticRayError
    from .elastic_executor import ElasticRayExecutor
    from hvdlite.common.core import WorldError

__all__ = ["RayExecutor", "HvdliteTrainer", "HvdliteConfig", "WorldError", "ElasticRayError",
           "ElasticRayExecutor"]


def __getattr__(name: str):
    # Loaded when first used: ray.train's imports take seconds, which RayExecutor never needs.
    if name == "RayExecutor":
        from .executor import RayExecutor
        return RayExecutor
    if name in ("HvdliteTrainer", "HvdliteConfig"):
        from . import train
        return getattr(train, name)
    if name == "ElasticRayError":
        from .elastic import ElasticRayError
        return ElasticRayError
    if name == "ElasticRayExecutor":
        from .elastic_executor import ElasticRayExecutor
        return ElasticRayExecutor
    if name == "WorldError":
        from hvdlite.common.core import WorldError
        return WorldError
    raise AttributeError(f"module 'hvdlite.ray' has no attribute {name!r}")

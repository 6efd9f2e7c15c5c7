"""Where an estimator's training runs: Horovod's ``Backend`` interface and ``SparkBackend``
(the ranks are the tasks of the active Spark session, :func:`hvdlite.spark.run`)."""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence


class Backend:
    """Runs the training function on ``num_processes()`` ranks and returns their values in
    rank order.  Subclass it to train elsewhere."""

    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (),
            kwargs: Optional[dict] = None, env: Optional[dict] = None) -> list:
        raise NotImplementedError

    def num_processes(self) -> int:
        raise NotImplementedError


class SparkBackend(Backend):
    """The tasks of the active Spark session (Horovod's ``SparkBackend``): ``num_proc``
    (default: the default parallelism), ``env`` for the ranks, and any other argument of
    :func:`hvdlite.spark.run` (``stdout``, ``stderr``, ``prefix_output_with_timestamp``,
    ``start_timeout``, ``verbose``, ``nics``, ``extra_mpi_args``, ``use_mpi``,
    ``use_gloo``)."""

    def __init__(self, num_proc: Optional[int] = None, env: Optional[dict] = None,
                 **run_kwargs: Any) -> None:
        from hvdlite.spark.runner import spark_context
        self.num_proc = num_proc or spark_context().defaultParallelism
        self.env = dict(env or {})
        self.run_kwargs = run_kwargs

    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (),
            kwargs: Optional[dict] = None, env: Optional[dict] = None) -> list:
        from hvdlite.spark.runner import run
        return run(fn, args=args, kwargs=kwargs, num_proc=self.num_proc,
                   env={**self.env, **(env or {})}, **self.run_kwargs)

    def num_processes(self) -> int:
        return self.num_proc

"""hvdlite on Apache Spark: Horovod's ``horovod.spark`` API (``run``, ``run_elastic``, and the
estimators in :mod:`hvdlite.spark.torch` and :mod:`hvdlite.spark.keras`).

Needs PySpark (``pip install hvdlite[spark]``); see docs/spark.md.
"""
from __future__ import annotations

try:
    import pyspark  # noqa: F401 - the clear error belongs here, at import
except ImportError:
    raise ImportError("hvdlite.spark needs PySpark 4: pip install hvdlite[spark]") from None

from .elastic import run_elastic
from .runner import run

__all__ = ["run", "run_elastic"]

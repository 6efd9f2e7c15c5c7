"""Horovod's ``horovod.spark.keras``: :class:`KerasEstimator` and :class:`KerasModel`."""
from .estimator import KerasEstimator, KerasModel

__all__ = ["KerasEstimator", "KerasModel"]

"""Horovod's ``horovod.spark.torch``: :class:`TorchEstimator` and :class:`TorchModel`."""
from .estimator import TorchEstimator, TorchModel

__all__ = ["TorchEstimator", "TorchModel"]

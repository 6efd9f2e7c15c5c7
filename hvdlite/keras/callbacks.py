"""``hvdlite.keras.callbacks``: Horovod's Keras callbacks for the running backend
(:mod:`hvdlite.tensorflow.keras.callbacks` under TensorFlow, :mod:`.portable_callbacks` under
JAX and torch)."""
from .backends import TENSORFLOW, backend_name

if backend_name() == TENSORFLOW:
    from hvdlite.tensorflow.keras.callbacks import (  # noqa: F401
        BestModelCheckpoint, BroadcastGlobalVariablesCallback, LearningRateScheduleCallback,
        LearningRateWarmupCallback, MetricAverageCallback)
else:
    from .portable_callbacks import (  # noqa: F401
        BestModelCheckpoint, BroadcastGlobalVariablesCallback, LearningRateScheduleCallback,
        LearningRateWarmupCallback, MetricAverageCallback)

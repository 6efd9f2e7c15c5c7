"""``hvdlite.keras.callbacks``: the callbacks of :mod:`hvdlite.tensorflow.keras.callbacks`."""
from hvdlite.tensorflow.keras.callbacks import (  # noqa: F401
    BestModelCheckpoint, BroadcastGlobalVariablesCallback, LearningRateScheduleCallback,
    LearningRateWarmupCallback, MetricAverageCallback)

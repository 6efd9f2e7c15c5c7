"""``hvdlite.keras.elastic``: Horovod's ``horovod.keras.elastic``, the same objects as
:mod:`hvdlite.tensorflow.keras.elastic`, for the Keras that ``tf.keras`` is (Keras 3, or tf-keras's
Keras 2 under ``TF_USE_LEGACY_KERAS=1``)."""
from hvdlite.tensorflow.keras.elastic import *  # noqa: F401,F403
from hvdlite.tensorflow.keras.elastic import __all__  # noqa: F401

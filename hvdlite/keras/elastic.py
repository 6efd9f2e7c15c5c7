"""``hvdlite.keras.elastic``: Horovod's ``horovod.keras.elastic``, the same objects as
:mod:`hvdlite.tensorflow.keras.elastic` (Keras 3 is the Keras TensorFlow runs)."""
from hvdlite.tensorflow.keras.elastic import *  # noqa: F401,F403
from hvdlite.tensorflow.keras.elastic import __all__  # noqa: F401

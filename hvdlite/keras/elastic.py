"""``hvdlite.keras.elastic``: Horovod's ``horovod.keras.elastic`` for the running backend
(:mod:`hvdlite.tensorflow.keras.elastic` under TensorFlow, :mod:`.portable_elastic` under JAX
and torch)."""
from .backends import TENSORFLOW, backend_name

if backend_name() == TENSORFLOW:
    from hvdlite.tensorflow.keras.elastic import *  # noqa: F401,F403
    from hvdlite.tensorflow.keras.elastic import __all__  # noqa: F401
else:
    from .portable_elastic import *  # noqa: F401,F403
    from .portable_elastic import __all__  # noqa: F401

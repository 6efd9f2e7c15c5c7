"""``import hvdlite.keras as hvd``: Horovod's ``horovod.keras`` for Keras 3 on every backend.

With ``KERAS_BACKEND=tensorflow`` (Keras 3's default, or tf-keras's Keras 2 under
``TF_USE_LEGACY_KERAS=1``) this is :mod:`hvdlite.tensorflow.keras` under Horovod's other name:
the same functions, classes and callbacks.  With ``KERAS_BACKEND=jax`` or ``torch`` it is
:mod:`.portable`: the same API (``DistributedOptimizer``, the callbacks, ``elastic``,
``allreduce``/``allgather``/``broadcast``, ``broadcast_variables``) with the gradients reduced by
the backend's own hvdlite adapter (``hvdlite.jax`` inside the jitted step, ``hvdlite.torch``).
A script written for ``horovod.keras`` runs after changing only its import.
"""
from .backends import TENSORFLOW, backend_name

if backend_name() == TENSORFLOW:
    from hvdlite.tensorflow.keras import *  # noqa: F401,F403 - the whole Keras adapter
    from hvdlite.tensorflow.keras import load_model  # noqa: F401 - (listed for readers)
    from . import callbacks  # noqa: F401 - hvd.callbacks.* as in horovod.keras
    from . import elastic  # noqa: F401 - hvd.elastic.*: Horovod's elastic API
else:
    from .portable import *  # noqa: F401,F403 - the API for the JAX and torch backends
    from .portable import (Compression, load_model, broadcast_global_variables,  # noqa: F401
                           allreduce, allgather, broadcast, reducescatter, broadcast_variables)
    from . import callbacks  # noqa: F401,E402
    from . import elastic  # noqa: F401,E402

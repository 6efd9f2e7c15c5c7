"""``import hvdlite.keras as hvd``: Horovod's ``horovod.keras`` (its API for standalone Keras).

This is :mod:`hvdlite.tensorflow.keras` under Horovod's other name: the same functions, classes
and callbacks, for the Keras that TensorFlow runs (Keras 3, or tf-keras's Keras 2 under
``TF_USE_LEGACY_KERAS=1``; see that module).  A script
written for ``horovod.keras`` runs after changing only its import, as far as its own Keras
calls still exist in Keras 3.
"""
from hvdlite.tensorflow.keras import *  # noqa: F401,F403 - the whole Keras adapter
from hvdlite.tensorflow.keras import load_model  # noqa: F401 - (listed for readers)

from . import callbacks  # noqa: F401 - hvd.callbacks.* as in horovod.keras
from . import elastic  # noqa: F401 - hvd.elastic.*: Horovod's elastic API

"""``import hvdlite.keras as hvd``: Horovod's ``horovod.keras`` for Keras 3 on every backend.

With ``KERAS_BACKEND=tensorflow`` (Keras 3's default, or tf-keras's Keras 2 under
``TF_USE_LEGACY_KERAS=1``) this is :mod:`hvdlite.tensorflow.keras` under Horovod's other name:
the same functions, classes and callbacks.  With ``KERAS_BACKEND=jax`` or ``torch`` it is
:mod:`.portable`: the same API (``DistributedOptimizer``, the callbacks, ``elastic``,
``allreduce``/``allgather``/``broadcast``, ``broadcast_variables``) with the gradients reduced by
the backend's own hvdlite adapter (``hvdlite.jax`` inside the jitted step, ``hvdlite.torch``).
A script written for ``horovod.keras`` runs after changing only its import.

Under TensorFlow the names are looked up in :mod:`hvdlite.tensorflow.keras` when first used
(PEP 562): that adapter's own modules use this package's backend-neutral pieces
(:mod:`.callback_logic`, :mod:`.elastic_logic`), so importing it here eagerly would make the
two packages wait for each other.
"""
from .backends import TENSORFLOW, backend_name

if backend_name() == TENSORFLOW:
    def __getattr__(name: str):
        import hvdlite.tensorflow.keras as tf_keras
        if name == "__all__":
            return [n for n in dir(tf_keras) if not n.startswith("_")]
        if name in ("callbacks", "elastic"):
            import importlib
            return importlib.import_module(f"{__name__}.{name}")
        return getattr(tf_keras, name)

    def __dir__() -> list[str]:
        import hvdlite.tensorflow.keras as tf_keras
        return sorted(set(dir(tf_keras)) | {"callbacks", "elastic"})
else:
    from .portable import *  # noqa: F401,F403 - the API for the JAX and torch backends
    from .portable import (Compression, load_model, broadcast_global_variables,  # noqa: F401
                           allreduce, allgather, broadcast, reducescatter, broadcast_variables)
    from . import callbacks  # noqa: F401,E402
    from . import elastic  # noqa: F401,E402

"""Horovod's elastic API is not supported; every name here raises a clear
``NotImplementedError`` (see :mod:`hvdlite.common.api.elastic`)."""
from hvdlite.common.core import elastic_unsupported as __getattr__  # noqa: F401 - PEP 562 hook

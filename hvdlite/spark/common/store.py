"""Where an estimator keeps a run's data and results: Horovod's ``Store`` interface, and
``LocalStore`` for a local or shared filesystem path (every executor must see the same path:
a network filesystem, or one machine)."""
from __future__ import annotations

import os
import shutil
from typing import Any


class Store:
    """The paths of a training run and the bytes behind them.  Subclass it for other storage
    (an object store, HDFS): the estimators use only these methods; the data is written by
    Spark (``df.write.parquet(path)``) and read by the ranks with pyarrow from
    :meth:`filesystem` (a ``pyarrow.fs.FileSystem``, local by default)."""

    def __init__(self, prefix_path: str) -> None:
        self.prefix_path = prefix_path

    @staticmethod
    def create(prefix_path: str, **kwargs: Any) -> "Store":
        """A store for ``prefix_path`` (Horovod's factory): a local or shared filesystem path,
        or ``file://`` URL.  Other schemes raise ``ValueError`` naming what to do."""
        if "://" in prefix_path and not prefix_path.startswith("file://"):
            raise ValueError(f"Store.create({prefix_path!r}): hvdlite has LocalStore only (a "
                             f"local or shared filesystem path); subclass "
                             f"hvdlite.spark.common.store.Store for other storage.")
        return LocalStore(prefix_path, **kwargs)

    # --- paths (Horovod's names) ------------------------------------------------------------
    def get_run_path(self, run_id: str) -> str:
        return os.path.join(self.prefix_path, "runs", run_id)

    def get_train_data_path(self, idx: Any = None) -> str:
        return os.path.join(self.prefix_path, "intermediate_train_data" +
                            ("" if idx is None else f".{idx}"))

    def get_val_data_path(self, idx: Any = None) -> str:
        return os.path.join(self.prefix_path, "intermediate_val_data" +
                            ("" if idx is None else f".{idx}"))

    def get_checkpoint_path(self, run_id: str) -> str:
        return os.path.join(self.get_run_path(run_id), "checkpoint")

    def get_logs_path(self, run_id: str) -> str:
        return os.path.join(self.get_run_path(run_id), "logs")

    # --- bytes --------------------------------------------------------------------------------
    def exists(self, path: str) -> bool:
        raise NotImplementedError

    def read(self, path: str) -> bytes:
        raise NotImplementedError

    def write(self, path: str, data: bytes) -> None:
        raise NotImplementedError

    def remove(self, path: str) -> None:
        raise NotImplementedError

    def filesystem(self):
        """The pyarrow filesystem the ranks read the Parquet data with."""
        import pyarrow.fs
        return pyarrow.fs.LocalFileSystem()


class LocalStore(Store):
    """A store on a local or shared filesystem path (``file://`` accepted)."""

    def __init__(self, prefix_path: str, **_: Any) -> None:
        path = prefix_path[len("file://"):] if prefix_path.startswith("file://") else prefix_path
        super().__init__(os.path.abspath(path))
        os.makedirs(self.prefix_path, exist_ok=True)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def read(self, path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def write(self, path: str, data: bytes) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)

    def remove(self, path: str) -> None:
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)

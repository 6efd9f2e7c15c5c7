"""From a Spark DataFrame to the ranks: Parquet in the store, read with pyarrow.

Horovod used petastorm, whose latest release (0.13.1) no longer imports with current pyarrow
(it imports ``pyarrow.filesystem``, which pyarrow has removed; checked with pyarrow 26).  Here
the driver has Spark write the selected columns as Parquet under the store
(``df.write.parquet``: Spark's own writer, run on the executors), and each rank reads its
share with pyarrow: the files' row groups dealt out
round robin (disjoint and covering), or, when there are fewer row groups than ranks, every
``size``-th row.  Vector columns (``pyspark.ml.linalg``) travel as arrays.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

VALIDATION_SEED = 4242


def to_arrays(df: Any, columns: Sequence[str]) -> Any:
    """``df`` with only ``columns``, its ML vector columns turned into arrays of doubles."""
    from pyspark.ml.functions import vector_to_array
    from pyspark.ml.linalg import VectorUDT
    types = {f.name: f.dataType for f in df.schema.fields}
    missing = [c for c in columns if c not in types]
    if missing:
        raise ValueError(f"the DataFrame has no column(s) {missing}; it has {sorted(types)}")
    return df.select(*[vector_to_array(c).alias(c) if isinstance(types[c], VectorUDT) else c
                       for c in columns])


def write_datasets(df: Any, columns: Sequence[str], validation: Any, train_path: str,
                   val_path: str, seed: int = VALIDATION_SEED) -> bool:
    """Write the training data (and the validation data, when ``validation`` is a fraction in
    (0, 1) or the name of a boolean/0-1 column) as Parquet.  Whether there is validation
    data."""
    if validation is None or validation == 0:
        to_arrays(df, columns).write.mode("overwrite").parquet(train_path)
        return False
    if isinstance(validation, str):
        from pyspark.sql import functions as F
        if validation not in df.columns:
            raise ValueError(f"validation={validation!r}: the DataFrame has no such column")
        flag = F.col(validation).cast("boolean")
        to_arrays(df.filter(~flag), columns).write.mode("overwrite").parquet(train_path)
        to_arrays(df.filter(flag), columns).write.mode("overwrite").parquet(val_path)
        return True
    if isinstance(validation, (int, float)) and 0 < validation < 1:
        train, val = df.randomSplit([1 - validation, validation], seed=seed)
        to_arrays(train, columns).write.mode("overwrite").parquet(train_path)
        to_arrays(val, columns).write.mode("overwrite").parquet(val_path)
        return True
    raise ValueError(f"validation={validation!r}: expected a fraction in (0, 1) or the name "
                     f"of a column marking the validation rows")


def pieces(filesystem: Any, path: str) -> list[tuple[str, int]]:
    """Every (file, row group) of the Parquet data set at ``path``, in a fixed order."""
    import pyarrow.fs
    import pyarrow.parquet as pq
    infos = filesystem.get_file_info(pyarrow.fs.FileSelector(path, recursive=True))
    files = sorted(i.path for i in infos if i.type == pyarrow.fs.FileType.File
                   and i.path.endswith(".parquet"))
    found = []
    for name in files:
        with filesystem.open_input_file(name) as f:
            found += [(name, g) for g in range(pq.ParquetFile(f).num_row_groups)]
    return found


def shard_plan(n_pieces: int, rank: int, size: int) -> Optional[list[int]]:
    """The pieces of ``rank`` (round robin), or None when there are fewer pieces than ranks
    (then every rank reads all and keeps every ``size``-th row).  Pure logic."""
    if n_pieces < size:
        return None
    return list(range(rank, n_pieces, size))


def read_shard(filesystem: Any, path: str, rank: int, size: int) -> dict[str, np.ndarray]:
    """This rank's share of the data set at ``path``: column name -> array (array columns as
    2-D arrays)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    found = pieces(filesystem, path)
    plan = shard_plan(len(found), rank, size)
    chosen = found if plan is None else [found[i] for i in plan]
    tables = []
    for name, group in chosen:
        with filesystem.open_input_file(name) as f:
            tables.append(pq.ParquetFile(f).read_row_group(group))
    if not tables:
        raise ValueError(f"the data set at {path} has no rows")
    table = pa.concat_tables(tables)
    if plan is None:
        table = table.take(list(range(rank, table.num_rows, size)))
    return {name: column_array(table.column(name)) for name in table.column_names}


def column_array(column: Any) -> np.ndarray:
    values = column.to_pylist()
    if values and isinstance(values[0], (list, tuple)):
        return np.asarray(values, dtype=np.float64)
    return np.asarray(values)


def stack(columns: dict[str, np.ndarray], names: Sequence[str]) -> np.ndarray:
    """The named columns side by side as one 2-D float32 array (scalars one column each)."""
    parts = [columns[n].reshape(len(columns[n]), -1) for n in names]
    return np.concatenate(parts, axis=1).astype(np.float32)


def matrices(columns: dict[str, np.ndarray], names: Sequence[str]) -> list[np.ndarray]:
    """The named columns as 2-D float32 arrays, one per column (rows by values; a scalar column
    gives one value per row): the models' inputs before their shapes are applied."""
    return [columns[n].reshape(len(columns[n]), -1).astype(np.float32) for n in names]

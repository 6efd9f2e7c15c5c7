"""The Spark ML estimator and model that :class:`~hvdlite.spark.torch.TorchEstimator` and
:class:`~hvdlite.spark.keras.KerasEstimator` share.

``fit(df)``: the selected columns go to the store as Parquet (:mod:`.data`), the framework's
training function runs on ``num_proc`` Spark tasks through :func:`hvdlite.spark.run`, and rank
0's trained model comes back as a Spark ML ``Model``.  ``transform(df)`` adds one
``<label>__output`` column per label column (Horovod's names) with the model's predictions,
computed on the executors by a pandas UDF that loads the model once per partition.
"""
from __future__ import annotations

import uuid
from typing import Any, Callable, Iterator, Optional, Tuple

import numpy as np
import pandas as pd
from pyspark.ml import Estimator, Model

from .backend import Backend, SparkBackend
from .store import Store

# (parameter, default): Horovod's names, where they still make sense here.
COMMON_PARAMS: dict[str, Any] = {
    "num_proc": None, "model": None, "optimizer": None, "loss": None, "metrics": None,
    "feature_cols": None, "label_cols": None, "batch_size": 32, "epochs": 1,
    "validation": None, "store": None, "callbacks": None, "verbose": 1, "shuffle": True,
    "random_seed": None, "run_id": None, "train_steps_per_epoch": None,
    "validation_steps_per_epoch": None, "start_timeout": None, "backend": None,
    # always true here: every rank holds its share in memory
    "inmemory_cache_all": True,
    "val_batch_size": None,
    # Horovod's deprecated shuffle buffer: 0 turns shuffling off; any other size shuffles the
    # whole share (it is in memory), at least as random as a buffer of that size
    "shuffle_buffer_size": None,
    # the estimators train on the CPU: use_gpu=False says so, True raises (check)
    "use_gpu": None,
}
# Horovod parameters that have no meaning here; passing one raises, saying why.
UNSUPPORTED: dict[str, str] = {
    "gradient_compression": "pass compression through hvdlite's DistributedOptimizer in your "
                            "own training function (hvdlite.spark.run)",
    "transformation_fn": "transform the DataFrame with Spark before fit",
    "reader_pool_type": "the ranks read Parquet with pyarrow (no petastorm reader pool)",
    "train_reader_num_workers": "the ranks read Parquet with pyarrow (no petastorm reader)",
    "val_reader_num_workers": "the ranks read Parquet with pyarrow (no petastorm reader)",
    "partitions_per_process": "Spark's writer decides the Parquet files; each rank reads its "
                              "row groups",
    "mp_start_method": "the ranks are processes that Spark's tasks start",
    "transformation_edit_fields": "these describe a petastorm TransformSpec; transform the "
                                  "DataFrame with Spark before fit",
    "transformation_removed_fields": "these describe a petastorm TransformSpec; select the "
                                     "columns with Spark before fit",
    "compress_sparse_cols": "sparse vector columns are written as dense arrays; nothing to "
                            "compress",
    "label_shapes": "a label with as many values as the model's output takes the output's "
                    "shape; reshape other labels in your loss",
}
# Horovod's accessors whose names do not follow the parameter's name.
ACCESSOR_ALIASES: dict[str, str] = {
    "InMemoryCacheAll": "inmemory_cache_all", "ShufflingBufferSize": "shuffle_buffer_size",
    "FeatureColumns": "feature_cols", "LabelColumns": "label_cols",
}


class ParamsMixin:
    """Keyword parameters with Horovod's ``getX()``/``setX()`` accessors (``getBatchSize``)."""

    PARAMS: dict[str, Any] = {}
    # Horovod's parameters that raise here, with why (subclasses add their own).
    REFUSED: dict[str, str] = UNSUPPORTED

    def init_params(self, kwargs: dict[str, Any], owner: str) -> None:
        bad = {k: self.REFUSED[k] for k in kwargs if k in self.REFUSED}
        if bad:
            raise ValueError(f"{owner}: unsupported parameter(s): " + "; ".join(
                f"{k} ({why})" for k, why in bad.items()))
        unknown = sorted(set(kwargs) - set(self.PARAMS))
        if unknown:
            raise TypeError(f"{owner}: unknown parameter(s) {unknown}; known: "
                            f"{sorted(self.PARAMS)}")
        self.values = {**self.PARAMS, **kwargs}

    def __getattr__(self, name: str) -> Callable:
        if name.startswith(("get", "set")) and len(name) > 3:
            key = ACCESSOR_ALIASES.get(name[3:]) or "".join(
                "_" + c.lower() if c.isupper() else c for c in name[3:]).lstrip("_")
            if key in self.__dict__.get("values", {}):
                if name.startswith("get"):
                    return lambda: self.values[key]

                def setter(value):
                    self.values[key] = value
                    return self
                return setter
        raise AttributeError(name)


class HorovodEstimator(ParamsMixin, Estimator):
    """Base of the estimators: the data path and the run; subclasses give the training
    function and the model."""

    NAME = "Estimator"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self.init_params(kwargs, self.NAME)

    def check(self) -> None:
        v = self.values
        for name in ("model", "feature_cols", "label_cols"):
            if not v[name]:
                raise ValueError(f"{self.NAME}: {name} is required")
        for name in ("feature_cols", "label_cols"):
            if isinstance(v[name], str) or not all(isinstance(c, str) for c in v[name]):
                raise ValueError(f"{self.NAME}: {name} must be a list of column names, got "
                                 f"{v[name]!r}")
        if not isinstance(v["batch_size"], int) or v["batch_size"] < 1:
            raise ValueError(f"{self.NAME}: batch_size must be a positive int")
        if not isinstance(v["epochs"], int) or v["epochs"] < 1:
            raise ValueError(f"{self.NAME}: epochs must be a positive int")
        if v["val_batch_size"] is not None and (not isinstance(v["val_batch_size"], int)
                                                or v["val_batch_size"] < 1):
            raise ValueError(f"{self.NAME}: val_batch_size must be a positive int")
        if v["use_gpu"]:
            raise ValueError(f"{self.NAME}: use_gpu=True: the estimators train on the CPU here; "
                             f"for GPUs write the training function with hvdlite.torch or "
                             f"hvdlite.tensorflow.keras and run it with hvdlite.spark.run, each "
                             f"task given a GPU by Spark's GPU scheduling (docs/spark.md)")
        if v["inmemory_cache_all"] is not True:
            raise ValueError(f"{self.NAME}: inmemory_cache_all=False: every rank holds its "
                             f"share of the data in memory here; drop the parameter")
        if v["store"] is None:
            # (a default under /tmp would split the data between machines on a real cluster)
            raise ValueError(f"{self.NAME}: store is required: Store.create('/a/path/every/"
                             f"executor/sees') (hvdlite.spark.common.store)")

    def backend(self) -> Backend:
        """``backend``, else a :class:`SparkBackend` of ``num_proc`` tasks (giving both raises,
        as in Horovod)."""
        v = self.values
        if v["backend"] is not None:
            if v["num_proc"] is not None:
                raise ValueError(f"{self.NAME}: give backend or num_proc, not both")
            return v["backend"]
        extra = {} if v["start_timeout"] is None else {"start_timeout": v["start_timeout"]}
        return SparkBackend(num_proc=v["num_proc"], verbose=v["verbose"], **extra)

    def _fit(self, dataset: Any) -> Model:
        from . import data
        self.check()
        v = self.values
        store: Store = v["store"]
        run_id = v["run_id"] or f"{self.NAME.lower()}_{uuid.uuid4().hex[:12]}"
        train_path = store.get_train_data_path(run_id)
        val_path = store.get_val_data_path(run_id)
        weights = [v["sample_weight_col"]] if v.get("sample_weight_col") else []
        columns = list(dict.fromkeys(list(v["feature_cols"]) + list(v["label_cols"]) + weights))
        has_val = data.write_datasets(dataset, columns, v["validation"], train_path, val_path)
        trainer = self.remote_trainer(store, train_path, val_path if has_val else None)
        results = self.backend().run(trainer, env=self.backend_env())
        # rank 0's (model bytes, history, whatever else its framework returns)
        model_bytes, history, *extra = results[0]
        store.write(store.get_checkpoint_path(run_id), model_bytes)
        return self.make_model(model_bytes, history, run_id, *extra)

    def backend_env(self) -> dict:
        """Variables for the ranks' environment (Keras has Horovod's ``backend_env``)."""
        return {}

    def common_spec(self, store: Store, train_path: str, val_path: Optional[str]) -> dict:
        """What every framework's training function reads (it adds its own)."""
        v = self.values
        return {"metrics": v["metrics"] or [], "callbacks": v["callbacks"] or [],
                "feature_cols": list(v["feature_cols"]), "label_cols": list(v["label_cols"]),
                "batch_size": v["batch_size"], "val_batch_size": v["val_batch_size"],
                "epochs": v["epochs"],
                "shuffle": bool(v["shuffle"]) and v["shuffle_buffer_size"] != 0,
                "seed": v["random_seed"], "verbose": v["verbose"],
                "train_steps_per_epoch": v["train_steps_per_epoch"],
                "validation_steps_per_epoch": v["validation_steps_per_epoch"],
                "store": store, "train_path": train_path, "val_path": val_path}

    def common_model_params(self, history: dict, run_id: str) -> dict:
        """The fitted model's parameters that every framework's model has."""
        v = self.values
        return {"feature_cols": list(v["feature_cols"]), "label_cols": list(v["label_cols"]),
                "history": history, "run_id": run_id}

    # --- the framework's part -------------------------------------------------------------
    def remote_trainer(self, store: Store, train_path: str,
                       val_path: Optional[str]) -> Callable[[], Any]:
        raise NotImplementedError

    def make_model(self, model_bytes: bytes, history: dict, run_id: str,
                   *extra: Any) -> "HorovodModel":
        raise NotImplementedError


class HorovodModel(ParamsMixin, Model):
    """A trained model as a Spark ML ``Model``: ``transform(df)`` predicts."""

    PARAMS = {"feature_cols": None, "label_cols": None, "output_cols": None, "history": None,
              "run_id": None, "model": None, "batch_size": 256}

    def __init__(self, model_bytes: bytes, **kwargs: Any) -> None:
        super().__init__()
        self.init_params(kwargs, type(self).__name__)
        if not self.values["output_cols"]:
            self.values["output_cols"] = [f"{c}__output" for c in self.values["label_cols"]]
        self.model_bytes = model_bytes

    def predictor(self) -> Callable[[bytes], Callable]:
        """A function ``load(model_bytes, executor=True)`` that turns the model's bytes into
        ``predict(columns) -> outputs`` (on the executors; ``executor=False`` on the driver,
        which leaves the process's thread settings alone): ``columns`` holds one 2-D float32
        array per feature column (rows by values), ``outputs`` one 2-D array per model output
        (rows by values)."""
        raise NotImplementedError

    def _transform(self, dataset: Any) -> Any:
        from pyspark.ml.functions import array_to_vector, vector_to_array
        from pyspark.ml.linalg import VectorUDT
        from pyspark.sql import functions as F
        from pyspark.sql.functions import pandas_udf
        from pyspark.sql.types import ArrayType, DoubleType

        v = self.values
        types = {f.name: f.dataType for f in dataset.schema.fields}
        missing = [c for c in v["feature_cols"] if c not in types]
        if missing:
            raise ValueError(f"{type(self).__name__}.transform: the DataFrame has no feature "
                             f"column(s) {missing}")
        inputs = [vector_to_array(c).alias(c) if isinstance(types[c], VectorUDT) else F.col(c)
                  for c in v["feature_cols"]]
        load, model_bytes, batch = self.predictor(), self.model_bytes, v["batch_size"]

        def matrices(columns) -> list:
            return [np.stack(c.to_numpy()).reshape(len(c), -1).astype(np.float32)
                    if len(c) and isinstance(c.iloc[0], (list, np.ndarray))
                    else c.to_numpy().reshape(-1, 1).astype(np.float32) for c in columns]

        def outputs(model, columns) -> list:
            cols = matrices(columns)
            rows = len(cols[0])
            parts = [model([c[i:i + batch] for c in cols]) for i in range(0, rows, batch)]
            return [np.concatenate([p[k] for p in parts]).reshape(rows, -1)
                    for k in range(len(parts[0]))] if parts else []

        # Each output's width decides its column's type, as in Horovod: one value per row
        # gives a double column, more give a Spark ML vector.  (One row, predicted here.)
        sample = dataset.select(*inputs).limit(1).toPandas()
        if len(sample):
            widths = [o.shape[1] for o in outputs(load(model_bytes, executor=False),
                                                  [sample[c] for c in sample.columns])]
        else:
            widths = [2] * len(v["output_cols"])   # no rows: vectors, and nothing in them
        names = v["output_cols"]
        if len(widths) != len(names):
            raise ValueError(f"{type(self).__name__}.transform: the model gives {len(widths)} "
                             f"outputs for {len(names)} output columns {names}")

        def flat(model, columns) -> pd.Series:
            outs = outputs(model, columns)
            if not outs:
                return pd.Series([], dtype=object)
            joined = np.concatenate(outs, axis=1).astype(np.float64)
            return pd.Series(list(joined))

        # (the iterator form loads the model once per partition, not once per batch)
        if len(inputs) == 1:
            def predict(batches: Iterator[pd.Series]) -> Iterator[pd.Series]:
                model = load(model_bytes)
                for column in batches:
                    yield flat(model, (column,))
        else:
            def predict(batches: Iterator[Tuple[pd.Series, ...]]) -> Iterator[pd.Series]:
                model = load(model_bytes)
                for columns in batches:
                    yield flat(model, columns)
        predict_udf = pandas_udf(predict, ArrayType(DoubleType()))

        result = dataset.withColumn("__hvdlite_output", predict_udf(*inputs))
        offset = 0
        for name, width in zip(names, widths):
            values = F.col("__hvdlite_output")
            result = result.withColumn(name, values[offset] if width == 1 else array_to_vector(
                F.slice(values, offset + 1, width)))
            offset += width
        return result.drop("__hvdlite_output")

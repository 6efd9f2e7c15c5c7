"""The training function a ``KerasEstimator`` runs on every rank (through
:func:`hvdlite.spark.run`): ``model.fit`` with hvdlite.tensorflow.keras on this rank's share."""
from __future__ import annotations

import os
import tempfile
from typing import Any, Optional


def model_to_bytes(model: Any) -> bytes:
    """The model in Keras' own ``.keras`` format (architecture, weights, compile state)."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "model.keras")
        model.save(path)
        with open(path, "rb") as f:
            return f.read()


def model_from_bytes(data: bytes, custom_objects: Optional[dict] = None,
                     compile: bool = True) -> Any:
    import keras
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "model.keras")
        with open(path, "wb") as f:
            f.write(data)
        return keras.models.load_model(path, custom_objects=custom_objects, compile=compile)


def shaped(x: Any, model: Any) -> Any:
    """The stacked features in the model's input shape when that is another shape of the same
    size (Horovod's Keras estimator reshapes them so: a 784-vector column into 28x28x1)."""
    import numpy as np
    want = tuple(model.input_shape[1:]) if not isinstance(model.input_shape, list) else None
    if want and None not in want and tuple(x.shape[1:]) != want \
            and int(np.prod(want)) == int(np.prod(x.shape[1:])):
        return x.reshape(len(x), *want)
    return x


def keras_inputs(columns: Any, model: Any) -> Any:
    """The model's input from the feature columns (2-D arrays), as Horovod feeds it: one
    input per column when the model has that many inputs (each in its input's shape), else the
    columns stacked side by side into the single input."""
    import numpy as np
    inputs = getattr(model, "inputs", None) or []
    if len(columns) > 1 and len(inputs) == len(columns):
        shaped_columns = []
        for column, tensor in zip(columns, inputs):
            want = tuple(tensor.shape[1:])
            if None not in want and tuple(column.shape[1:]) != want \
                    and int(np.prod(want)) == int(np.prod(column.shape[1:])):
                column = column.reshape(len(column), *want)
            shaped_columns.append(column)
        return shaped_columns
    return shaped(np.concatenate(list(columns), axis=1), model)


def scaled_optimizer_config(config: dict, factor: float) -> dict:
    """A serialized Keras optimizer with its learning rate times ``factor`` (Horovod scales it
    by the number of ranks).  A learning-rate schedule raises: it cannot be scaled here."""
    inner = dict(config["config"])
    lr = inner.get("learning_rate")
    if not isinstance(lr, (int, float)):
        raise ValueError("KerasEstimator scales the optimizer's learning rate by the number of "
                         "ranks, as Horovod does, and cannot scale a schedule "
                         f"({lr!r}): give a float learning rate and schedule it with a "
                         "callback (hvdlite.tensorflow.keras.callbacks)")
    inner["learning_rate"] = float(lr) * factor
    return {**config, "config": inner}


def train(spec: dict) -> Any:
    """Train; rank 0 returns ``(model in .keras bytes, history)``, the others ``None``."""
    import keras
    import numpy as np
    import tensorflow as tf
    import hvdlite.tensorflow.keras as hvd
    from hvdlite.spark.common import data

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    seed = spec["seed"] if spec["seed"] is not None else 0
    keras.utils.set_random_seed(seed)
    fs = spec["store"].filesystem()
    model = model_from_bytes(spec["model"], spec["custom_objects"], compile=False)

    def load(path):
        columns = data.read_shard(fs, path, rank, size)
        x = keras_inputs(data.matrices(columns, spec["feature_cols"]), model)
        ys = [columns[c] for c in spec["label_cols"]]
        weights = columns[spec["sample_weight_col"]] if spec["sample_weight_col"] else None
        return x, (ys[0] if len(ys) == 1 else tuple(ys)), weights

    def batches(x, y, weights, batch, shuffle, repeat):
        # (a repeated, reshuffled stream: every epoch draws its steps from the whole share)
        x = tuple(x) if isinstance(x, list) else x
        parts = (x, y) if weights is None else (x, y, weights)
        stream = tf.data.Dataset.from_tensor_slices(parts)
        if shuffle:
            stream = stream.shuffle(len(y[0] if isinstance(y, tuple) else y), seed=seed,
                                    reshuffle_each_iteration=True)
        if repeat:
            stream = stream.repeat()
        return stream.batch(batch)

    x, y, w = load(spec["train_path"])
    optimizer = hvd.DistributedOptimizer(keras.optimizers.deserialize(
        scaled_optimizer_config(spec["optimizer"], size)))
    model.compile(optimizer=optimizer, loss=spec["loss"], loss_weights=spec["loss_weights"],
                  metrics=spec["metrics"])
    # Every rank runs the same number of steps (the smallest share decides).
    rows = int(hvd.allreduce(np.array([len(y[0] if isinstance(y, tuple) else y)]), op=hvd.Min,
                             name="rows")[0])
    steps = max(1, rows // spec["batch_size"])
    if spec["train_steps_per_epoch"]:
        steps = min(steps, spec["train_steps_per_epoch"])
    validation = None
    if spec["val_path"]:
        x_val, y_val, w_val = load(spec["val_path"])
        validation = batches(x_val, y_val, w_val, spec["val_batch_size"] or spec["batch_size"],
                             shuffle=False, repeat=False)
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                 hvd.callbacks.MetricAverageCallback(), *spec["callbacks"]]
    history = model.fit(batches(x, y, w, spec["batch_size"], spec["shuffle"], repeat=True),
                        steps_per_epoch=steps, epochs=spec["epochs"],
                        validation_data=validation,
                        validation_steps=spec["validation_steps_per_epoch"],
                        callbacks=callbacks, verbose=2 if spec["verbose"] and rank == 0 else 0)
    result = ((model_to_bytes(model), {k: [float(v) for v in vs]
                                        for k, vs in history.history.items()})
              if rank == 0 else None)
    hvd.shutdown()
    return result

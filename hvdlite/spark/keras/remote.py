"""The training function a ``KerasEstimator`` runs on every rank (through
:func:`hvdlite.spark.run`): ``model.fit`` with hvdlite.tensorflow.keras on this rank's share."""
from __future__ import annotations

from typing import Any


def shaped(x: Any, model: Any) -> Any:
    """The stacked features in the model's input shape when that is another shape of the same
    size (Horovod's Keras estimator reshapes them so: a 784-vector column into 28x28x1)."""
    import numpy as np
    want = tuple(model.input_shape[1:]) if not isinstance(model.input_shape, list) else None
    if want and None not in want and tuple(x.shape[1:]) != want \
            and int(np.prod(want)) == int(np.prod(x.shape[1:])):
        return x.reshape(len(x), *want)
    return x


def train(spec: dict) -> Any:
    """Train; rank 0 returns ``(model in .keras bytes, history)``, the others ``None``."""
    import keras
    import numpy as np
    import tensorflow as tf
    import hvdlite.tensorflow.keras as hvd
    from hvdlite.spark.common import data
    from hvdlite.spark.keras.estimator import model_from_bytes, model_to_bytes

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    keras.utils.set_random_seed(spec["seed"] if spec["seed"] is not None else 0)
    fs = spec["store"].filesystem()

    def load(path):
        columns = data.read_shard(fs, path, rank, size)
        x = data.stack(columns, spec["feature_cols"])
        ys = [columns[c] for c in spec["label_cols"]]
        return x, ys[0] if len(ys) == 1 else ys

    model = model_from_bytes(spec["model"], spec["custom_objects"], compile=False)
    x, y = load(spec["train_path"])
    x = shaped(x, model)
    validation = None
    if spec["val_path"]:
        x_val, y_val = load(spec["val_path"])
        validation = (shaped(x_val, model), y_val)
    optimizer = hvd.DistributedOptimizer(keras.optimizers.deserialize(spec["optimizer"]))
    model.compile(optimizer=optimizer, loss=spec["loss"], loss_weights=spec["loss_weights"],
                  metrics=spec["metrics"])
    # Every rank runs the same number of steps (the shares differ by at most one row).
    rows = int(hvd.allreduce(np.array([len(x)]), op=hvd.Min, name="rows")[0])
    steps = max(1, rows // spec["batch_size"])
    if spec["train_steps_per_epoch"]:
        steps = min(steps, spec["train_steps_per_epoch"])
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                 hvd.callbacks.MetricAverageCallback(), *spec["callbacks"]]
    history = model.fit(x[:steps * spec["batch_size"]], y[:steps * spec["batch_size"]],
                        batch_size=spec["batch_size"], epochs=spec["epochs"],
                        shuffle=spec["shuffle"], validation_data=validation,
                        validation_steps=spec["validation_steps_per_epoch"],
                        callbacks=callbacks, verbose=2 if spec["verbose"] and rank == 0 else 0)
    result = ((model_to_bytes(model), {k: [float(v) for v in vs]
                                        for k, vs in history.history.items()})
              if rank == 0 else None)
    hvd.shutdown()
    return result

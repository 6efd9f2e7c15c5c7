"""``KerasEstimator``: fit a Keras model on a Spark DataFrame with hvdlite (Horovod's
``horovod.spark.keras.KerasEstimator``), Keras 3 on the TensorFlow backend through
:mod:`hvdlite.tensorflow.keras`."""
from __future__ import annotations

from typing import Any, Callable, Optional

from hvdlite.spark.common.estimator import (COMMON_PARAMS, UNSUPPORTED, HorovodEstimator,
                                            HorovodModel)
from hvdlite.spark.common.store import Store

from .remote import model_from_bytes, model_to_bytes


def keras_predictor(custom_objects: Optional[dict]) -> Callable[[bytes], Callable]:
    """A loader of the ``.keras`` bytes: ``predict(columns)`` on the feature columns fed as in
    training (one thread per task)."""
    def load(data: bytes, executor: bool = True) -> Callable:
        from .remote import keras_inputs
        if executor:   # (not on the driver: its TensorFlow is running already)
            import tensorflow as tf
            tf.config.threading.set_intra_op_parallelism_threads(1)
        model = model_from_bytes(data, custom_objects, compile=False)

        def predict(columns):
            out = model.predict_on_batch(keras_inputs(columns, model))
            return [o for o in (out if isinstance(out, (list, tuple)) else [out])]
        return predict
    return load


class KerasModel(HorovodModel):
    """The trained model; ``getModel()`` is the Keras model, ``getHistory()`` the history of
    ``model.fit`` (metrics averaged over the ranks)."""

    PARAMS = {**HorovodModel.PARAMS, "custom_objects": None}

    def predictor(self) -> Callable[[bytes], Callable]:
        return keras_predictor(self.values["custom_objects"])


class KerasEstimator(HorovodEstimator):
    """Horovod's ``KerasEstimator``: ``model`` (a Keras model), ``optimizer`` (a Keras
    optimizer, else the compiled model's; wrapped in ``hvd.DistributedOptimizer`` on the ranks,
    its learning rate scaled by the number of ranks as Horovod does), ``loss``, ``metrics``,
    ``loss_weights``, ``sample_weight_col``, ``custom_objects``, ``feature_cols``,
    ``label_cols``, ``batch_size``, ``val_batch_size``, ``epochs``, ``validation``, ``store``,
    ``num_proc`` or ``backend``, ``backend_env``, ``callbacks`` (Keras callbacks, run on every
    rank after hvdlite's broadcast and metric averaging), ``shuffle``, ``random_seed``,
    ``train_steps_per_epoch``, ``validation_steps_per_epoch``, ``verbose``."""

    NAME = "KerasEstimator"
    PARAMS = {**COMMON_PARAMS, "custom_objects": None, "loss_weights": None,
              "sample_weight_col": None, "backend_env": None}
    REFUSED = {
        **UNSUPPORTED,
        "checkpoint_callback": "rank 0's model after the last epoch comes back (and is kept "
                               "in the store); add your own ModelCheckpoint to callbacks",
    }

    def backend_env(self) -> dict:
        return dict(self.values["backend_env"] or {})

    def remote_trainer(self, store: Store, train_path: str,
                       val_path: Optional[str]) -> Callable[[], Any]:
        import keras
        from .remote import train
        v = self.values
        optimizer = v["optimizer"] or getattr(v["model"], "optimizer", None)
        if optimizer is None or v["loss"] is None:
            raise ValueError("KerasEstimator: loss is required, and optimizer unless the model "
                             "is compiled with one")
        from .remote import scaled_optimizer_config
        scaled_optimizer_config(keras.optimizers.serialize(optimizer), 1)   # raises here, early
        spec = {
            **self.common_spec(store, train_path, val_path),
            "model": model_to_bytes(v["model"]),
            "optimizer": keras.optimizers.serialize(optimizer),
            "sample_weight_col": v["sample_weight_col"],
            "loss": v["loss"], "loss_weights": v["loss_weights"],
            "custom_objects": v["custom_objects"],
        }
        return lambda: train(spec)

    def make_model(self, model_bytes: bytes, history: dict, run_id: str,
                   *extra: Any) -> KerasModel:
        import keras
        v = self.values
        model = model_from_bytes(model_bytes, v["custom_objects"], compile=False)
        # Compiled as Horovod returns it (with the learning rate given, not the scaled one), so
        # that evaluate() works; the optimizer is a fresh copy of yours: its trained state
        # stayed on the ranks (they compiled with hvdlite's wrapper of it).
        optimizer = v["optimizer"] or v["model"].optimizer
        model.compile(optimizer=keras.optimizers.deserialize(
                          keras.optimizers.serialize(optimizer)),
                      loss=v["loss"], loss_weights=v["loss_weights"], metrics=v["metrics"])
        return KerasModel(model_bytes, **self.common_model_params(history, run_id),
                          custom_objects=v["custom_objects"], model=model)

"""``TorchEstimator``: fit a PyTorch model on a Spark DataFrame with hvdlite (Horovod's
``horovod.spark.torch.TorchEstimator``)."""
from __future__ import annotations

from typing import Any, Callable, Optional

from hvdlite.spark.common.estimator import COMMON_PARAMS, HorovodEstimator, HorovodModel
from hvdlite.spark.common.store import Store


def load_torch_model(model_bytes: bytes) -> Callable:
    """``predict(x)`` for the pickled model (eval mode, no gradients; 1 thread per task)."""
    import cloudpickle
    import torch
    torch.set_num_threads(1)
    model = cloudpickle.loads(model_bytes)
    model.eval()

    def predict(x):
        with torch.no_grad():
            return model(torch.from_numpy(x)).numpy()
    return predict


class TorchModel(HorovodModel):
    """The trained model; ``getModel()`` is the ``torch.nn.Module``, ``getHistory()`` the
    per-epoch metrics averaged over the ranks."""

    def predictor(self) -> Callable[[bytes], Callable]:
        return load_torch_model


class TorchEstimator(HorovodEstimator):
    """Horovod's ``TorchEstimator``: ``model`` (a ``torch.nn.Module``), ``optimizer`` (built on
    the model's parameters: its class and hyper-parameters are reused on the ranks), ``loss``
    (``loss(output, label)``, or a list with one per label column), ``metrics``
    (``metric(output, label) -> float``, averaged per epoch), ``feature_cols``, ``label_cols``,
    ``batch_size``, ``epochs``, ``validation`` (a fraction, or a column marking validation
    rows), ``store``, ``num_proc``, ``shuffle``, ``random_seed``, ``train_steps_per_epoch``,
    ``validation_steps_per_epoch``, ``input_shapes`` (reshape of the stacked features, per
    sample), ``loss_constructors`` and ``callbacks`` (called ``callback(epoch, logs)`` on rank
    0 after each epoch)."""

    NAME = "TorchEstimator"
    PARAMS = {**COMMON_PARAMS, "input_shapes": None, "loss_constructors": None,
              "label_dtype": None}

    def remote_trainer(self, store: Store, train_path: str,
                       val_path: Optional[str]) -> Callable[[], Any]:
        import cloudpickle
        from .remote import train
        v = self.values
        if v["optimizer"] is None:
            raise ValueError("TorchEstimator: optimizer is required")
        if v["loss"] is None and not v["loss_constructors"]:
            raise ValueError("TorchEstimator: loss (or loss_constructors) is required")
        spec = {
            "model": cloudpickle.dumps(v["model"]),
            "optimizer_cls": type(v["optimizer"]),
            "optimizer_defaults": dict(v["optimizer"].defaults),
            "loss": v["loss"] or [c() for c in v["loss_constructors"]],
            "metrics": v["metrics"] or [], "callbacks": v["callbacks"] or [],
            "feature_cols": list(v["feature_cols"]), "label_cols": list(v["label_cols"]),
            "batch_size": v["batch_size"], "epochs": v["epochs"], "shuffle": v["shuffle"],
            "seed": v["random_seed"], "input_shapes": v["input_shapes"],
            "train_steps_per_epoch": v["train_steps_per_epoch"],
            "validation_steps_per_epoch": v["validation_steps_per_epoch"],
            "label_dtype": v["label_dtype"], "verbose": v["verbose"],
            "store": store, "train_path": train_path, "val_path": val_path,
        }
        return lambda: train(spec)

    def make_model(self, model_bytes: bytes, history: dict, run_id: str) -> TorchModel:
        import cloudpickle
        v = self.values
        return TorchModel(model_bytes, feature_cols=list(v["feature_cols"]),
                          label_cols=list(v["label_cols"]), history=history, run_id=run_id,
                          model=cloudpickle.loads(model_bytes))

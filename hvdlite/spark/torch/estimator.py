"""``TorchEstimator``: fit a PyTorch model on a Spark DataFrame with hvdlite (Horovod's
``horovod.spark.torch.TorchEstimator``)."""
from __future__ import annotations

from typing import Any, Callable, Optional

from hvdlite.spark.common.estimator import COMMON_PARAMS, HorovodEstimator, HorovodModel
from hvdlite.spark.common.store import Store


def torch_predictor(input_shapes: Any) -> Callable[[bytes], Callable]:
    """A loader of the pickled model: ``predict(x)`` in eval mode, without gradients, on the
    features in the model's input shape (one thread per task)."""
    def load(model_bytes: bytes) -> Callable:
        import cloudpickle
        import torch
        from .remote import shaped
        torch.set_num_threads(1)
        model = cloudpickle.loads(model_bytes)
        model.eval()

        def predict(x):
            with torch.no_grad():
                return model(torch.from_numpy(shaped(x, input_shapes))).numpy()
        return predict
    return load


class TorchModel(HorovodModel):
    """The trained model; ``getModel()`` is the ``torch.nn.Module``, ``getHistory()`` the
    per-epoch metrics averaged over the ranks."""

    PARAMS = {**HorovodModel.PARAMS, "input_shapes": None}

    def predictor(self) -> Callable[[bytes], Callable]:
        return torch_predictor(self.values["input_shapes"])


class TorchEstimator(HorovodEstimator):
    """Horovod's ``TorchEstimator``: ``model`` (a ``torch.nn.Module``), ``optimizer`` (built on
    the model's parameters: its class and hyper-parameters are reused on the ranks), ``loss``
    (``loss(output, label)``, or a list with one per label column), ``metrics``
    (``metric(output, label) -> float``, averaged per epoch), ``feature_cols``, ``label_cols``,
    ``batch_size``, ``epochs``, ``validation`` (a fraction, or a column marking validation
    rows), ``store``, ``num_proc``, ``shuffle``, ``random_seed``, ``train_steps_per_epoch``,
    ``validation_steps_per_epoch``, ``input_shapes`` (reshape of the stacked features, per
    sample), ``backward_passes_per_step``, ``loss_constructors`` and ``callbacks`` (called ``callback(epoch, logs)`` on rank
    0 after each epoch)."""

    NAME = "TorchEstimator"
    PARAMS = {**COMMON_PARAMS, "input_shapes": None, "loss_constructors": None,
              "label_dtype": None, "backward_passes_per_step": 1}

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
            **self.common_spec(store, train_path, val_path),
            "model": cloudpickle.dumps(v["model"]),
            "optimizer_cls": type(v["optimizer"]),
            "optimizer_defaults": dict(v["optimizer"].defaults),
            "loss": v["loss"] or [c() for c in v["loss_constructors"]],
            "input_shapes": v["input_shapes"], "label_dtype": v["label_dtype"],
            "backward_passes_per_step": v["backward_passes_per_step"],
        }
        return lambda: train(spec)

    def make_model(self, model_bytes: bytes, history: dict, run_id: str) -> TorchModel:
        import cloudpickle
        v = self.values
        return TorchModel(model_bytes, **self.common_model_params(history, run_id),
                          input_shapes=v["input_shapes"], model=cloudpickle.loads(model_bytes))

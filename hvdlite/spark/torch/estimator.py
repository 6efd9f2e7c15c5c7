"""``TorchEstimator``: fit a PyTorch model on a Spark DataFrame with hvdlite (Horovod's
``horovod.spark.torch.TorchEstimator``)."""
from __future__ import annotations

from typing import Any, Callable, Optional

from hvdlite.spark.common.estimator import (COMMON_PARAMS, UNSUPPORTED, HorovodEstimator,
                                            HorovodModel)
from hvdlite.spark.common.store import Store


def torch_predictor(input_shapes: Any) -> Callable[[bytes], Callable]:
    """A loader of the pickled model: ``predict(columns)`` in eval mode, without gradients, on
    the feature columns given to ``forward`` as in training (one thread per task)."""
    def load(model_bytes: bytes, executor: bool = True) -> Callable:
        import cloudpickle
        import torch
        from .remote import model_inputs, separate_inputs
        if executor:   # (the driver's own thread count is the user's)
            torch.set_num_threads(1)
        model = cloudpickle.loads(model_bytes)
        model.eval()

        def predict(columns):
            separate = separate_inputs(model, len(columns), input_shapes)
            xs = [torch.from_numpy(x) for x in model_inputs(columns, separate, input_shapes)]
            with torch.no_grad():
                out = model(*xs)
            return [o.numpy() for o in (out if isinstance(out, (list, tuple)) else [out])]
        return predict
    return load


class TorchModel(HorovodModel):
    """The trained model; ``getModel()`` is the ``torch.nn.Module``, ``getHistory()`` the
    per-epoch metrics averaged over the ranks."""

    PARAMS = {**HorovodModel.PARAMS, "input_shapes": None, "optimizer": None}

    def predictor(self) -> Callable[[bytes], Callable]:
        return torch_predictor(self.values["input_shapes"])


class TorchEstimator(HorovodEstimator):
    """Horovod's ``TorchEstimator``: ``model`` (a ``torch.nn.Module``), ``optimizer`` (built on
    the model's parameters; it travels with the model, so its parameter groups and state are
    kept, and its learning rate is scaled by the number of ranks for training, as Horovod
    does), ``loss`` (``loss(output, label)``, one for every label or one per label column) or
    ``loss_constructors``, ``loss_weights`` (default 1/number of labels, as Horovod),
    ``metrics`` (``metric(output, label) -> float`` functions, or Horovod's groups of them),
    ``feature_cols``, ``label_cols``, ``batch_size``, ``val_batch_size``, ``epochs``,
    ``validation`` (a fraction, or a column marking validation rows), ``store``, ``num_proc``
    or ``backend``, ``shuffle``, ``random_seed``, ``train_steps_per_epoch``,
    ``validation_steps_per_epoch``, ``input_shapes`` (reshape of the stacked features, per
    sample), ``backward_passes_per_step`` and ``callbacks`` (called ``callback(epoch, logs)``
    on rank 0 after each epoch).  A label with as many values as its output takes the output's
    shape before the loss (Horovod's rule)."""

    NAME = "TorchEstimator"
    PARAMS = {**COMMON_PARAMS, "input_shapes": None, "loss_constructors": None,
              "loss_weights": None, "label_dtype": None, "backward_passes_per_step": 1}
    REFUSED = {
        **UNSUPPORTED,
        "sample_weight_col": "weight the samples inside your loss function",
        "train_minibatch_fn": "write the training loop with hvdlite.torch and run it with "
                              "hvdlite.spark.run",
    }

    def remote_trainer(self, store: Store, train_path: str,
                       val_path: Optional[str]) -> Callable[[], Any]:
        import cloudpickle
        from .remote import train
        v = self.values
        if v["optimizer"] is None:
            raise ValueError("TorchEstimator: optimizer is required")
        if v["loss"] is None and not v["loss_constructors"]:
            raise ValueError("TorchEstimator: loss (or loss_constructors) is required")
        if v["loss"] is not None and v["loss_constructors"]:
            raise ValueError("TorchEstimator: give loss or loss_constructors, not both")
        spec = {
            **self.common_spec(store, train_path, val_path),
            # pickled together: the optimizer's parameter groups stay this model's parameters
            "model_and_optimizer": cloudpickle.dumps((v["model"], v["optimizer"])),
            "loss": v["loss"] or [c() for c in v["loss_constructors"]],
            "loss_weights": v["loss_weights"],
            "input_shapes": v["input_shapes"], "label_dtype": v["label_dtype"],
            "backward_passes_per_step": v["backward_passes_per_step"],
        }
        return lambda: train(spec)

    def make_model(self, model_bytes: bytes, history: dict, run_id: str,
                   *extra: Any) -> TorchModel:
        import cloudpickle
        v = self.values
        # the trained model and its optimizer, with the learning rate the user gave
        model, optimizer = cloudpickle.loads(extra[0])
        model.eval()
        return TorchModel(model_bytes, **self.common_model_params(history, run_id),
                          input_shapes=v["input_shapes"], model=model, optimizer=optimizer)

"""The training function a ``TorchEstimator`` runs on every rank (through
:func:`hvdlite.spark.run`): hvdlite.torch training on this rank's share of the Parquet data."""
from __future__ import annotations

import inspect
from typing import Any, Optional, Sequence

import numpy as np


def reshaped(x: np.ndarray, shape: Any) -> np.ndarray:
    """``x`` (rows by values) in ``shape``: Horovod's ``[-1, *sample_shape]``, or the sample
    shape alone; None leaves it."""
    if not shape:
        return x
    shape = list(shape)
    if len(shape) > 1 and shape[0] in (-1, None):
        shape = shape[1:]
    return x.reshape(len(x), *shape)


def shaped(x: np.ndarray, input_shapes: Any) -> np.ndarray:
    """The stacked features in the model's input shape: ``input_shapes[0]`` is Horovod's
    ``[-1, *sample_shape]`` (or the sample shape alone)."""
    return reshaped(x, input_shapes[0] if input_shapes else None)


def separate_inputs(model: Any, n_columns: int, input_shapes: Any) -> bool:
    """Whether the feature columns go to ``forward`` as separate arguments (Horovod's rule:
    one argument per column): when there are several and ``input_shapes`` gives one shape per
    column or ``forward`` takes that many positional arguments.  Otherwise they are stacked
    side by side into one input."""
    if n_columns == 1:
        return False
    if input_shapes and len(input_shapes) == n_columns:
        return True
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return True
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return True
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= n_columns


def model_inputs(columns: Sequence[np.ndarray], separate: bool,
                 input_shapes: Any) -> list[np.ndarray]:
    """The arguments of ``forward`` from the feature columns (2-D arrays): one per column in
    ``input_shapes[i]``, or the columns stacked in ``input_shapes[0]``."""
    if separate:
        return [reshaped(c, input_shapes[i] if input_shapes else None)
                for i, c in enumerate(columns)]
    return [shaped(np.concatenate(list(columns), axis=1), input_shapes)]


def as_labels(y: np.ndarray, loss_name: str, dtype: Any):
    import torch
    if dtype is not None:
        return torch.as_tensor(y, dtype=dtype)
    if "CrossEntropy" in loss_name or "NLL" in loss_name:   # class indices
        return torch.as_tensor(y.reshape(-1), dtype=torch.long)
    return torch.as_tensor(y.astype(np.float32))


def per_label(losses: Any, n_labels: int) -> list:
    """One loss per label column: a single loss serves every label (Horovod's rule)."""
    losses = list(losses) if isinstance(losses, (list, tuple)) else [losses]
    if len(losses) == 1:
        return losses * n_labels
    if len(losses) != n_labels:
        raise ValueError(f"TorchEstimator: {len(losses)} losses for {n_labels} label columns; "
                         f"give one loss, or one per label column")
    return losses


def loss_weights_for(weights: Optional[Sequence[float]], n_labels: int) -> list[float]:
    """``loss_weights``, else Horovod's default: every label's loss weighted 1/n."""
    if not weights:
        return [1.0 / n_labels] * n_labels
    if len(weights) != n_labels:
        raise ValueError(f"TorchEstimator: {len(weights)} loss_weights for {n_labels} label "
                         f"columns")
    return [float(w) for w in weights]


def match_labels(outputs: Sequence[Any], labels: Sequence[Any]) -> list:
    """Each label in its output's shape when they hold as many values (Horovod's rule): a
    regression output of shape (batch, 1) against a label column of shape (batch,) would
    otherwise broadcast to (batch, batch) in the loss."""
    return [y.reshape(o.shape) if hasattr(o, "shape") and o.shape != y.shape
            and o.numel() == y.numel() else y for o, y in zip(outputs, labels)]


def metric_table(metrics: Sequence[Any], label_cols: Sequence[str]) -> list[tuple]:
    """``(name, fn, output index)`` for every metric: Horovod's groups (a list with one
    function for every output, or one per output, named ``group_<g>_<label>``), or plain
    functions (named after the function; one function serves every output)."""
    table = []
    for g, entry in enumerate(metrics):
        if isinstance(entry, (list, tuple)):
            fns = list(entry) * len(label_cols) if len(entry) == 1 else list(entry)
            if len(fns) != len(label_cols):
                raise ValueError(f"TorchEstimator: metric group {g} has {len(entry)} "
                                 f"functions for {len(label_cols)} label columns")
            table += [(f"group_{g}_{label}", fn, i)
                      for i, (fn, label) in enumerate(zip(fns, label_cols))]
        elif callable(entry):
            name = getattr(entry, "__name__", type(entry).__name__)
            table += [(name if len(label_cols) == 1 else f"{name}_{label}", entry, i)
                      for i, label in enumerate(label_cols)]
        else:
            raise ValueError(f"TorchEstimator: metrics[{g}] = {entry!r}: give functions "
                             f"metric(output, label), or Horovod's lists of them")
    return table


def scale_lr(optimizer: Any, factor: float) -> None:
    """Every parameter group's learning rate times ``factor`` (Horovod scales it by the
    number of ranks for training and back for the returned optimizer)."""
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] * factor


def train(spec: dict) -> Any:
    """Train; rank 0 returns ``(pickled model, history, pickled optimizer)``, the others
    ``None``."""
    import cloudpickle
    import torch
    import hvdlite.torch as hvd
    from hvdlite.spark.common import data

    torch.set_num_threads(1)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    seed = spec["seed"] if spec["seed"] is not None else 0
    torch.manual_seed(seed)
    fs = spec["store"].filesystem()
    n_labels = len(spec["label_cols"])
    losses = per_label(spec["loss"], n_labels)
    weights = loss_weights_for(spec["loss_weights"], n_labels)
    metrics = metric_table(spec["metrics"], spec["label_cols"])

    # The model and its optimizer travel pickled together, so the optimizer's parameter
    # groups (their own hyper-parameters) and state still point at this model's parameters.
    model, base = cloudpickle.loads(spec["model_and_optimizer"])
    separate = separate_inputs(model, len(spec["feature_cols"]), spec["input_shapes"])

    def load(path):
        columns = data.read_shard(fs, path, rank, size)
        xs = model_inputs(data.matrices(columns, spec["feature_cols"]), separate,
                          spec["input_shapes"])
        ys = [as_labels(columns[c], type(f).__name__, spec["label_dtype"])
              for c, f in zip(spec["label_cols"], losses)]
        return [torch.from_numpy(x) for x in xs], ys

    x_train, y_train = load(spec["train_path"])
    val = load(spec["val_path"]) if spec["val_path"] else None
    scale_lr(base, size)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(base, root_rank=0)
    optimizer = hvd.DistributedOptimizer(
        base, named_parameters=model.named_parameters(),
        backward_passes_per_step=spec["backward_passes_per_step"])

    def outputs_of(outputs):
        return list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]

    def compute(outputs, labels):
        outs = outputs_of(outputs)
        labels = match_labels(outs, labels)
        return sum(w * f(o, y) for f, w, o, y in zip(losses, weights, outs, labels))

    def metrics_of(outputs, labels) -> dict:
        outs = outputs_of(outputs)
        labels = match_labels(outs, labels)
        return {name: float(fn(outs[i], labels[i])) for name, fn, i in metrics}

    # Every rank runs the same number of steps (the smallest share decides).
    n = hvd.allreduce(torch.tensor([len(x_train[0])]), op=hvd.Min, name="rows").item()
    steps = max(1, n // spec["batch_size"])
    if spec["train_steps_per_epoch"]:
        steps = min(steps, spec["train_steps_per_epoch"])
    val_batch = spec["val_batch_size"] or spec["batch_size"]
    history: dict[str, list] = {}
    generator = torch.Generator().manual_seed(seed * 1000 + rank)
    for epoch in range(spec["epochs"]):
        model.train()
        order = (torch.randperm(len(x_train[0]), generator=generator) if spec["shuffle"]
                 else torch.arange(len(x_train[0])))
        totals: dict[str, float] = {"loss": 0.0}
        passes = spec["backward_passes_per_step"]
        for step in range(steps):
            index = order[step * spec["batch_size"]:(step + 1) * spec["batch_size"]]
            if step % passes == 0:
                optimizer.zero_grad()
            outputs = model(*[x[index] for x in x_train])
            labels = [y[index] for y in y_train]
            loss = compute(outputs, labels)
            loss.backward()
            if (step + 1) % passes == 0 or step == steps - 1:
                optimizer.step()
            totals["loss"] += loss.item()
            detached = [o.detach() for o in outputs_of(outputs)]
            for name, value in metrics_of(detached, labels).items():
                totals[name] = totals.get(name, 0.0) + value
        logs = {k: t / steps for k, t in totals.items()}
        if val is not None:
            model.eval()
            count = len(val[0][0]) if not spec["validation_steps_per_epoch"] else min(
                len(val[0][0]), spec["validation_steps_per_epoch"] * val_batch)
            val_totals: dict[str, float] = {}
            with torch.no_grad():
                for start in range(0, count, val_batch):
                    end = min(start + val_batch, count)
                    outputs = model(*[x[start:end] for x in val[0]])
                    labels = [y[start:end] for y in val[1]]
                    # weighted by the batch's rows: the mean over the share
                    parts = {"loss": compute(outputs, labels).item(),
                             **metrics_of(outputs, labels)}
                    for k, value in parts.items():
                        val_totals[k] = val_totals.get(k, 0.0) + value * (end - start)
            logs.update({f"val_{k}": t / max(count, 1) for k, t in val_totals.items()})
        names = sorted(logs)
        averaged = hvd.allreduce(torch.tensor([logs[k] for k in names], dtype=torch.float64),
                                 name=f"metrics.{epoch}")
        for k, value in zip(names, averaged.tolist()):
            history.setdefault(k, []).append(value)
        if rank == 0:
            for callback in spec["callbacks"]:
                callback(epoch, {k: history[k][-1] for k in names})
            if spec["verbose"]:
                print(f"epoch {epoch}: " + "  ".join(f"{k} {history[k][-1]:.4f}"
                                                     for k in names), flush=True)
    result = None
    if rank == 0:
        # the returned optimizer holds the learning rate the user gave (Horovod's too)
        # (the user's optimizer class, not hvdlite's wrapper, with the trained state)
        base.load_state_dict(optimizer.state_dict())
        scale_lr(base, 1.0 / size)
        result = (cloudpickle.dumps(model), history, cloudpickle.dumps((model, base)))
    hvd.shutdown()
    return result

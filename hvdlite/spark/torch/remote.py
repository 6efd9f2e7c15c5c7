"""The training function a ``TorchEstimator`` runs on every rank (through
:func:`hvdlite.spark.run`): hvdlite.torch training on this rank's share of the Parquet data."""
from __future__ import annotations

from typing import Any

import numpy as np


def shaped(x: np.ndarray, input_shapes: Any) -> np.ndarray:
    """The stacked features in the model's input shape: ``input_shapes[0]`` is Horovod's
    ``[-1, *sample_shape]`` (or the sample shape alone)."""
    if not input_shapes:
        return x
    shape = list(input_shapes[0])
    if len(shape) > 1 and shape[0] in (-1, None):
        shape = shape[1:]
    return x.reshape(len(x), *shape)


def as_labels(y: np.ndarray, loss_name: str, dtype: Any):
    import torch
    if dtype is not None:
        return torch.as_tensor(y, dtype=dtype)
    if "CrossEntropy" in loss_name or "NLL" in loss_name:   # class indices
        return torch.as_tensor(y.reshape(-1), dtype=torch.long)
    return torch.as_tensor(y.astype(np.float32))


def train(spec: dict) -> Any:
    """Train; rank 0 returns ``(pickled model, history)``, the others ``None``."""
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

    def load(path):
        columns = data.read_shard(fs, path, rank, size)
        x = shaped(data.stack(columns, spec["feature_cols"]), spec["input_shapes"])
        ys = [columns[c] for c in spec["label_cols"]]
        return torch.from_numpy(x), ys

    losses = spec["loss"] if isinstance(spec["loss"], (list, tuple)) else [spec["loss"]]
    x_train, y_train = load(spec["train_path"])
    y_train = [as_labels(y, type(f).__name__, spec["label_dtype"])
               for y, f in zip(y_train, losses)]
    val = None
    if spec["val_path"]:
        x_val, y_val = load(spec["val_path"])
        val = (x_val, [as_labels(y, type(f).__name__, spec["label_dtype"])
                       for y, f in zip(y_val, losses)])

    model = cloudpickle.loads(spec["model"])
    optimizer = spec["optimizer_cls"](model.parameters(), **spec["optimizer_defaults"])
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(),
        backward_passes_per_step=spec["backward_passes_per_step"])

    def compute(outputs, labels):
        outs = outputs if isinstance(outputs, (list, tuple)) else [outputs] * len(labels)
        return sum(f(o, y) for f, o, y in zip(losses, outs, labels))

    def metrics_of(outputs, labels) -> dict:
        return {getattr(m, "__name__", type(m).__name__): float(m(outputs, labels[0]))
                for m in spec["metrics"]}

    # Every rank runs the same number of steps (the shares differ by at most one row).
    n = hvd.allreduce(torch.tensor([len(x_train)]), op=hvd.Min, name="rows").item()
    steps = max(1, n // spec["batch_size"])
    if spec["train_steps_per_epoch"]:
        steps = min(steps, spec["train_steps_per_epoch"])
    history: dict[str, list] = {}
    generator = torch.Generator().manual_seed(seed * 1000 + rank)
    for epoch in range(spec["epochs"]):
        model.train()
        order = (torch.randperm(len(x_train), generator=generator) if spec["shuffle"]
                 else torch.arange(len(x_train)))
        totals: dict[str, float] = {"loss": 0.0}
        passes = spec["backward_passes_per_step"]
        for step in range(steps):
            index = order[step * spec["batch_size"]:(step + 1) * spec["batch_size"]]
            if step % passes == 0:
                optimizer.zero_grad()
            outputs = model(x_train[index])
            labels = [y[index] for y in y_train]
            loss = compute(outputs, labels)
            loss.backward()
            if (step + 1) % passes == 0 or step == steps - 1:
                optimizer.step()
            totals["loss"] += loss.item()
            for name, value in metrics_of(outputs.detach(), labels).items():
                totals[name] = totals.get(name, 0.0) + value
        logs = {k: t / steps for k, t in totals.items()}
        if val is not None:
            model.eval()
            with torch.no_grad():
                count = len(val[0]) if not spec["validation_steps_per_epoch"] else min(
                    len(val[0]), spec["validation_steps_per_epoch"] * spec["batch_size"])
                outputs = model(val[0][:count])
                labels = [y[:count] for y in val[1]]
                logs["val_loss"] = compute(outputs, labels).item()
                logs.update({f"val_{k}": m for k, m in metrics_of(outputs, labels).items()})
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
    result = (cloudpickle.dumps(model), history) if rank == 0 else None
    hvd.shutdown()
    return result

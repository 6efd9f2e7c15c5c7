"""The digits classifier of examples/pytorch_digits.py, trained on a Ray cluster with Ray Train.

    python examples/ray_digits.py --num-workers 2                 # a local Ray cluster
    python examples/ray_digits.py --address auto --storage-path /shared/runs   # a running one

The training function is the usual hvdlite.torch (Horovod-style) code: ``hvd.init()``, the
broadcasts, ``hvd.DistributedOptimizer``.  What Ray adds: Ray starts the workers (HvdliteTrainer
makes them one MPI world before the function runs), rank 0's checkpoint and the metrics go
through ``ray.train.report``, and with ``--max-failures N`` a run that loses a worker restarts
on new workers from the last checkpoint (``ray.train.get_checkpoint()``).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--use-gpu", action="store_true", help="one GPU per worker (NCCL)")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32, help="per-worker batch size")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate for one worker")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--address", default=None,
                   help="Ray cluster to join ('auto', ray://...); default: start a local one")
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray cluster")
    p.add_argument("--storage-path", default=None,
                   help="where Ray Train keeps checkpoints (shared by all nodes of a cluster)")
    p.add_argument("--max-failures", type=int, default=1,
                   help="restarts from the last checkpoint after a worker is lost")
    p.add_argument("--min-accuracy", type=float, default=0.0,
                   help="exit non-zero if the final test accuracy is below this")
    return p.parse_args(argv)


def train_func(config: dict) -> None:
    """Runs on every Ray Train worker: hvdlite.torch training, as under ``hvdlite run``."""
    import torch
    import ray.train
    import hvdlite.torch as hvd
    import pytorch_digits as digits   # the model, data and epoch loop of the plain example

    hvd.init()
    torch.manual_seed(config["seed"] + hvd.rank())   # the broadcast below makes them equal
    x_train, y_train, x_test, y_test = digits.load_data(config["seed"])
    part = digits.shard(len(x_train))
    x_train, y_train = x_train[part], y_train[part]
    device = torch.device("cpu")
    if config["use_gpu"]:
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    x_train, y_train, x_test, y_test = (t.to(device) for t in (x_train, y_train, x_test, y_test))

    model = digits.DigitsNet().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"] * hvd.size(), momentum=0.9)
    start_epoch = 0
    checkpoint = ray.train.get_checkpoint()   # set when Ray restarts the run after a failure
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            state = torch.load(os.path.join(d, "digits.pt"), map_location=device)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_epoch = state["epoch"] + 1
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    for epoch in range(start_epoch, config["epochs"]):
        loss, acc = digits.train_epoch(model, optimizer, x_train, y_train, config["batch_size"],
                                       epoch)
        metrics = {"epoch": epoch, "loss": loss, "train_accuracy": acc, "start_epoch": start_epoch}
        if epoch == config["epochs"] - 1:
            metrics["test_accuracy"] = digits.evaluate(model, x_test, y_test)
        if hvd.rank() == 0:   # one checkpoint per epoch, from rank 0; every rank reports
            with tempfile.TemporaryDirectory() as d:
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                            "epoch": epoch}, os.path.join(d, "digits.pt"))
                ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d))
        else:
            ray.train.report(metrics)


def main(argv=None) -> int:
    args = parse_args(argv)
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig

    from hvdlite.ray import HvdliteTrainer

    # The workers import pytorch_digits from this directory (shipped to every node by Ray).
    runtime_env = {"working_dir": HERE, "excludes": ["kubernetes/", "checkpoints/", "*.pt"]}
    if args.address:
        ray.init(address=args.address, runtime_env=runtime_env)
    else:
        ray.init(num_cpus=args.num_cpus, include_dashboard=False, runtime_env=runtime_env)
    try:
        trainer = HvdliteTrainer(
            train_func,
            train_loop_config={"epochs": args.epochs, "batch_size": args.batch_size,
                               "lr": args.lr, "seed": args.seed, "use_gpu": args.use_gpu},
            scaling_config=ScalingConfig(num_workers=args.num_workers, use_gpu=args.use_gpu),
            run_config=RunConfig(name="ray_digits",
                                 storage_path=args.storage_path or tempfile.mkdtemp(),
                                 failure_config=FailureConfig(max_failures=args.max_failures)))
        result = trainer.fit()
    finally:
        ray.shutdown()
    accuracy = result.metrics["test_accuracy"]
    print(f"test accuracy: {accuracy:.4f} after {result.metrics['epoch'] + 1} epochs on "
          f"{args.num_workers} workers; last checkpoint: {result.checkpoint.path}", flush=True)
    return 0 if accuracy >= args.min_accuracy else 1


if __name__ == "__main__":
    sys.exit(main())

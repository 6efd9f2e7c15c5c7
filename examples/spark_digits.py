"""The digits classifier of examples/pytorch_digits.py, trained inside a Spark application with
``hvdlite.spark.run`` (Horovod's ``horovod.spark.run``).

    python examples/spark_digits.py                          # a local Spark, 2 processes
    python examples/spark_digits.py --master local-cluster[2,1,1024]   # 2 executor JVMs
    spark-submit --py-files examples/pytorch_digits.py examples/spark_digits.py --num-proc 8

The training function is the usual hvdlite.torch (Horovod-style) code: ``hvd.init()``, the
broadcasts, ``hvd.DistributedOptimizer``.  Spark runs it on ``--num-proc`` tasks of one barrier
stage (they must all fit in the cluster's task slots at once), which form one hvdlite world;
rank 0's trained weights come back to the driver as the function's return value.
"""
from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--master", default=None,
                   help="Spark master for a new session (default: spark-submit's, else local[N])")
    p.add_argument("--num-proc", type=int, default=2, help="hvdlite processes (Spark tasks)")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32, help="per-process batch size")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate for one process")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--min-accuracy", type=float, default=0.0,
                   help="exit non-zero if the final test accuracy is below this")
    return p.parse_args(argv)


def train(config: dict) -> dict:
    """Runs on every rank (a child process of a Spark task): hvdlite.torch training."""
    import torch
    import hvdlite.torch as hvd
    import pytorch_digits as digits   # the model, data and epoch loop of the plain example

    torch.set_num_threads(1)
    hvd.init()
    torch.manual_seed(config["seed"] + hvd.rank())   # the broadcast below makes them equal
    x_train, y_train, x_test, y_test = digits.load_data(config["seed"])
    part = digits.shard(len(x_train))
    x_train, y_train = x_train[part], y_train[part]
    model = digits.DigitsNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"] * hvd.size(), momentum=0.9)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    for epoch in range(config["epochs"]):
        loss, acc = digits.train_epoch(model, optimizer, x_train, y_train,
                                       config["batch_size"], epoch)
        if hvd.rank() == 0:
            print(f"epoch {epoch:3d}  loss {loss:.4f}  train accuracy {acc:.4f}", flush=True)
    accuracy = digits.evaluate(model, x_test, y_test)
    return {"rank": hvd.rank(), "size": hvd.size(), "test_accuracy": accuracy,
            "state": {k: v.numpy() for k, v in model.state_dict().items()}
            if hvd.rank() == 0 else None}


def main(argv=None, spark=None) -> int:
    """``spark``: a running SparkSession to use (the tests'); default: get or create one."""
    args = parse_args(argv)
    from pyspark.sql import SparkSession

    import hvdlite.spark

    if spark is None:
        builder = SparkSession.builder.appName("hvdlite-spark-digits")
        if args.master or "spark.master" not in os.environ.get("PYSPARK_SUBMIT_ARGS", ""):
            builder = builder.master(args.master or f"local[{args.num_proc}]")
        spark = builder.getOrCreate()
    # The ranks import pytorch_digits (with spark-submit, --py-files ships it instead), and
    # this module when it was imported rather than run (then train travels by reference).
    for name in ("pytorch_digits.py", "spark_digits.py"):
        spark.sparkContext.addPyFile(os.path.join(HERE, name))
    results = hvdlite.spark.run(train, args=({"epochs": args.epochs, "lr": args.lr,
                                              "batch_size": args.batch_size,
                                              "seed": args.seed},),
                                num_proc=args.num_proc)
    accuracy = results[0]["test_accuracy"]
    print(f"test accuracy: {accuracy:.4f} after {args.epochs} epochs on "
          f"{results[0]['size']} Spark tasks; rank 0 returned "
          f"{len(results[0]['state'])} weight tensors", flush=True)
    return 0 if accuracy >= args.min_accuracy else 1


if __name__ == "__main__":
    sys.exit(main())

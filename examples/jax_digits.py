"""Data-parallel training of a small classifier on scikit-learn's bundled digits data set, with
JAX and optax.

Runs anywhere without a download:

    hvdlite run -np 2 python examples/jax_digits.py

The same data, model (64-128-64-10 MLP), optimizer (SGD with momentum, learning rate scaled by
the number of ranks) and schedule as examples/pytorch_digits.py, with hvdlite.jax:
  * each rank trains on its own shard of the training set;
  * the training step is one ``jax.jit``-compiled function; inside it
    ``hvd.DistributedOptimizer`` (an optax transformation) averages the gradients across ranks
    in one grouped allreduce before the SGD update;
  * rank 0's initial parameters and optimizer state are broadcast to every rank;
  * per-epoch loss/accuracy are averaged across ranks and printed by rank 0 only;
  * rank 0 writes a checkpoint each epoch (atomically); --resume continues from it;
  * test accuracy is computed over the whole test set (sharded, then summed) at the end.
"""
from __future__ import annotations

import argparse
import os
import pickle
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import hvdlite.jax as hvd


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=32, help="per-rank batch size")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate for one rank "
                   "(scaled by the number of ranks, as Horovod recommends)")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--checkpoint", default="checkpoints/jax_digits.pkl",
                   help="checkpoint path written by rank 0 ('' disables)")
    p.add_argument("--resume", action="store_true",
                   help="continue from --checkpoint if it exists (else start from epoch 0)")
    p.add_argument("--compression", choices=["none", "fp16", "bf16"], default="none",
                   help="gradient compression on the wire")
    p.add_argument("--min-accuracy", type=float, default=0.0,
                   help="exit non-zero if the final test accuracy is below this")
    return p.parse_args(argv)


def init_params(key: jax.Array) -> dict:
    """The MLP of examples/pytorch_digits.py, initialized as torch's nn.Linear does."""
    params = {}
    for name, (fan_in, fan_out) in {"fc1": (64, 128), "fc2": (128, 64), "fc3": (64, 10)}.items():
        key, wk, bk = jax.random.split(key, 3)
        bound = 1.0 / np.sqrt(fan_in)
        params[name] = {"w": jax.random.uniform(wk, (fan_in, fan_out), minval=-bound,
                                                maxval=bound),
                        "b": jax.random.uniform(bk, (fan_out,), minval=-bound, maxval=bound)}
    return params


def forward(params: dict, x: jax.Array) -> jax.Array:
    x = jax.nn.relu(x @ params["fc1"]["w"] + params["fc1"]["b"])
    x = jax.nn.relu(x @ params["fc2"]["w"] + params["fc2"]["b"])
    return x @ params["fc3"]["w"] + params["fc3"]["b"]


def loss_fn(params: dict, x: jax.Array, y: jax.Array):
    logits = forward(params, x)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, logits


def load_data(seed: int):
    """Same split on every rank (fixed seed); the training part is then sharded by rank."""
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    return train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)


def shard(n: int) -> slice:
    """This rank's contiguous slice of n samples (equal sizes, so every rank runs the same
    number of steps)."""
    per_rank = n // hvd.size()
    return slice(hvd.rank() * per_rank, (hvd.rank() + 1) * per_rank)


def save_checkpoint(path: str, state: dict) -> None:
    """Write ``state`` through a temporary file renamed over ``path`` (a job killed while
    writing keeps the previous checkpoint whole)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    partial = path + ".partial"
    with open(partial, "wb") as f:
        pickle.dump(jax.tree_util.tree_map(np.asarray, state), f)
    os.replace(partial, path)


def main(argv=None) -> int:
    args = parse_args(argv)
    hvd.init()
    x_train, x_test, y_train, y_test = load_data(args.seed)
    part = shard(len(x_train))
    x_train, y_train = x_train[part], y_train[part]

    optimizer = hvd.DistributedOptimizer(
        optax.sgd(args.lr * hvd.size(), momentum=args.momentum),
        compression=getattr(hvd.Compression, args.compression))
    params = init_params(jax.random.PRNGKey(args.seed + hvd.rank()))  # differs: broadcast fixes
    opt_state = optimizer.init(params)
    start_epoch = 0
    if args.resume and hvd.rank() == 0 and args.checkpoint and os.path.exists(args.checkpoint):
        with open(args.checkpoint, "rb") as f:
            ckpt = pickle.load(f)
        params = jax.tree_util.tree_map(jnp.asarray, ckpt["params"])
        opt_state = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(opt_state),
                                                 jax.tree_util.tree_leaves(ckpt["opt_state"]))
        start_epoch = ckpt["epoch"] + 1
    start_epoch = hvd.broadcast_object(start_epoch, root_rank=0, name="start_epoch")
    params = hvd.broadcast_parameters(params, root_rank=0)
    opt_state = hvd.broadcast_optimizer_state(opt_state, root_rank=0)

    @jax.jit
    def train_step(params, opt_state, x, y):
        (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        correct = jnp.sum(jnp.argmax(logits, 1) == y)
        return optax.apply_updates(params, updates), opt_state, loss, correct

    if hvd.rank() == 0:
        print(f"training on {hvd.size()} ranks, {len(x_train)} samples per rank, "
              f"epochs {start_epoch}..{args.epochs - 1}", flush=True)
    t0 = time.perf_counter()
    for epoch in range(start_epoch, args.epochs):
        order = np.random.default_rng(1000 * epoch + hvd.rank()).permutation(len(x_train))
        total_loss, correct = 0.0, 0
        for start in range(0, len(x_train), args.batch_size):
            idx = order[start:start + args.batch_size]
            params, opt_state, loss, hits = train_step(params, opt_state, x_train[idx],
                                                       y_train[idx])
            total_loss += float(loss) * len(idx)
            correct += int(hits)
        loss, acc = (float(v) for v in hvd.allreduce(
            jnp.asarray([total_loss / len(x_train), correct / len(x_train)]),
            name="train.metrics"))
        if hvd.rank() == 0:
            print(f"epoch {epoch:3d}  loss {loss:.4f}  train accuracy {acc:.4f}", flush=True)
            if args.checkpoint:
                save_checkpoint(args.checkpoint, {"params": params, "opt_state": opt_state,
                                                  "epoch": epoch})
    part = slice(hvd.rank() * len(x_test) // hvd.size(),
                 (hvd.rank() + 1) * len(x_test) // hvd.size())
    hits = int(jnp.sum(jnp.argmax(forward(params, x_test[part]), 1) == y_test[part]))
    counts = hvd.allreduce(jnp.asarray([hits, len(y_test[part])], jnp.int32), op=hvd.Sum,
                           name="test.counts")
    accuracy = int(counts[0]) / int(counts[1])
    if hvd.rank() == 0:
        print(f"test accuracy: {accuracy:.4f} ({time.perf_counter() - t0:.1f} s of training)",
              flush=True)
    hvd.shutdown()
    return 0 if accuracy >= args.min_accuracy else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""The function the elastic RayExecutor tests run in the workers: an unchanged Horovod elastic
PyTorch script (``hvd.elastic.TorchState``, ``@hvd.elastic.run``, a commit every step) that
logs each step to ``out/steps.jsonl`` and can lose a worker or raise on cue."""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time


def batch(rank: int, step: int):
    """This rank's batch at this step: the same in every world, so a resumed run replays it."""
    import torch
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True) * 0.5 + 1.0


def kill_ancestor(marker: str) -> None:
    """SIGKILL the nearest ancestor process whose command line contains ``marker`` (a Spark
    executor's JVM: its host lost, for the job)."""
    pid = os.getppid()
    while pid > 1:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if marker.encode() in f.read():
                os.kill(pid, signal.SIGKILL)
                return
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().rsplit(")", 1)[1].split()[1])
    raise RuntimeError(f"no ancestor process runs {marker!r}")


def train(config: dict) -> dict:
    """``config``: ``out`` (a directory), ``steps`` (the last step, exclusive), optional
    ``until_file`` (train until rank 0 sees it, up to ``steps``), ``sleep`` (per step),
    ``kill`` ``[world, rank, step]`` (that worker SIGKILLs itself after that step's commit),
    ``kill_ancestor`` ``[world, rank, step]`` with ``ancestor`` (the same, to its nearest
    ancestor whose command line contains ``ancestor``),
    ``raise`` ``[rank, step]`` (that worker raises ValueError) and ``chatty`` (every worker
    writes all the time, from a second thread too, and a second after a failure)."""
    import torch
    import hvdlite.torch as hvd

    hvd.init()
    world = int(os.environ.get("HVDLITE_ELASTIC_WORLD", "0"))
    out = config["out"]
    os.makedirs(os.path.join(out, "pids"), exist_ok=True)
    open(os.path.join(out, "pids", str(os.getpid())), "w").close()
    torch.manual_seed(hvd.rank())   # different on each rank: the state's sync makes them equal
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model=model, optimizer=opt, step=0)
    if config.get("chatty"):   # write all the time, from another thread too
        import logging
        import threading
        me = hvd.rank()
        logging.basicConfig(level=logging.INFO, format=f"log rank {me}: %(message)s")

        def chatter():
            n = 0
            while True:
                logging.info("still here %d", n)
                print(f"rank {me} still here {n}", flush=True)
                n += 1
                time.sleep(0.02)
        threading.Thread(target=chatter, daemon=True).start()

    @hvd.elastic.run
    def loop(state):
        rank = hvd.rank()
        try:
            return steps(state, rank)
        finally:   # after a failure, write a second later, as its world is torn down
            if config.get("chatty") and sys.exc_info()[0] is not None:
                time.sleep(1.0)
                print(f"world {world} rank {rank} leaves at step {state.step}", flush=True)

    def steps(state, rank):
        while state.step < config["steps"]:
            if config.get("raise") == [rank, state.step]:
                raise ValueError(f"a bug on rank {rank} at step {state.step}")
            x, y = batch(rank, state.step)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            if rank == 0:
                with open(os.path.join(out, "steps.jsonl"), "a") as f:
                    f.write(json.dumps({"world": world, "step": state.step,
                                        "size": hvd.size(), "time": time.time()}) + "\n")
            stop = config.get("until_file")
            finished = stop is not None and hvd.broadcast_object(
                os.path.exists(stop) if rank == 0 else None, 0, name="stop")
            state.step += 1
            state.commit()
            if config.get("kill") == [world, rank, state.step - 1]:
                os.kill(os.getpid(), signal.SIGKILL)   # a worker lost mid-training
            if config.get("kill_ancestor") == [world, rank, state.step - 1]:
                kill_ancestor(config["ancestor"])   # e.g. the Spark executor running it
            if finished:
                break
            time.sleep(config.get("sleep", 0))
        result = {"rank": rank, "size": hvd.size(), "world": world, "step": state.step,
                  "host": socket.gethostname(), "local_rank": hvd.local_rank(),
                  "params": [p.detach().numpy().tolist() for p in model.parameters()]}
        with open(os.path.join(out, f"result{rank}.json"), "w") as f:   # (Ray Train drops it)
            json.dump(result, f)
        return result

    return loop(state)

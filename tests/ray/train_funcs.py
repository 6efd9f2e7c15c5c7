"""Training functions the Ray Train tests run in the workers (importable there: the workers'
PYTHONPATH holds this checkout).  An unchanged hvdlite.torch script: hvd.init(), broadcast,
DistributedOptimizer; plus ray.train.report / get_checkpoint for checkpoints."""
from __future__ import annotations

import json
import os
import signal
import tempfile
import time


def batch(rank: int, step: int):
    """This rank's batch at this step (the same on every attempt, so a restart replays it)."""
    import torch
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True) * 0.5 + 1.0


def _more(step: int, size: int, config: dict) -> bool:
    """Whether to run this step: ``config["steps"]`` steps; with ``grow_to``, also until the
    world has grown to that size and run ``steps_after_growth`` steps there (at most
    ``max_steps`` in all, so that a resize that never comes ends the run)."""
    if step < config["steps"]:
        return True
    if "grow_to" not in config or step >= config["max_steps"]:
        return False
    done = config.get("_steps_grown", 0)
    if size >= config["grow_to"]:
        config["_steps_grown"] = done + 1
        return done < config["steps_after_growth"]
    return True


def linear(config: dict) -> None:
    import torch
    import ray.train
    import hvdlite.torch as hvd

    hvd.init()
    rank = hvd.rank()
    out = config["out"]
    os.makedirs(os.path.join(out, "pids"), exist_ok=True)
    open(os.path.join(out, "pids", str(os.getpid())), "w").close()
    torch.manual_seed(rank)   # different on each rank: the broadcast makes them equal
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"))
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"] + 1
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    step = start
    while _more(step, hvd.size(), config):
        kill = config.get("kill_rank_at_step")
        marker = os.path.join(out, "killed")
        if kill and rank == kill[0] and step == kill[1] and not os.path.exists(marker):
            time.sleep(1.5)   # Ray Train collects the reports so far (it polls every 0.5 s)
            with open(marker, "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)   # a worker lost mid-training
        x, y = batch(rank, step)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        metrics = {"step": step, "start": start, "loss": loss.item(), "time": time.time(),
                   "size": hvd.size(), "local_rank": hvd.local_rank()}
        if rank == 0:
            with open(os.path.join(out, "steps.jsonl"), "a") as f:
                f.write(json.dumps(metrics) + "\n")
            with tempfile.TemporaryDirectory() as d:
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step},
                           os.path.join(d, "state.pt"))
                ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d))
        else:
            ray.train.report(metrics)
        time.sleep(config.get("sleep", 0))   # a longer step (the resize test needs the time)
        step += 1
    torch.save(model.state_dict(), os.path.join(out, f"rank{rank}.pt"))

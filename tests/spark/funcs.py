"""Functions the Spark tests run on the ranks (imported there: tests/ is on the executors'
PYTHONPATH, see conftest)."""
from __future__ import annotations

import os
import signal
import time


def collectives(extra: int) -> dict:
    """Every kind of collective on values whose exact results are known; returns what each
    gave on this rank, with the rank's place in the world."""
    import numpy as np
    import torch
    import hvdlite.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    base = torch.arange(12, dtype=torch.float64) * (rank + 1)
    gathered = hvd.allgather(torch.full((rank + 1, 2), float(rank)), name="gather")
    alltoall_in = torch.arange(size * 2, dtype=torch.int64) + 100 * rank
    out = {
        "rank": rank, "size": size, "local_rank": hvd.local_rank(),
        "local_size": hvd.local_size(), "cross_size": hvd.cross_size(),
        "sum": hvd.allreduce(base, op=hvd.Sum, name="sum").numpy(),
        "average": hvd.allreduce(base, name="avg").numpy(),
        "max": hvd.allreduce(torch.tensor([rank * 3 - 1]), op=hvd.Max, name="max").numpy(),
        "gathered": gathered.numpy(),
        "broadcast": hvd.broadcast(torch.tensor([rank + 0.5]), root_rank=size - 1,
                                   name="bcast").numpy(),
        "alltoall": hvd.alltoall(alltoall_in, name="a2a").numpy(),
        "object": hvd.broadcast_object({"from": rank}, root_rank=0),
        "env": os.environ.get("HVDLITE_TEST_SPARK_ENV"), "extra": extra,
        "pid": os.getpid(),
    }
    print(f"rank {rank} says hello", flush=True)
    hvd.shutdown()
    return {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in out.items()}


def fail_on(rank_to_fail: int, how: str) -> None:
    """Every rank loops on allreduces; ``rank_to_fail`` raises ValueError (``how="raise"``) or
    SIGKILLs itself (``"kill"``) or its executor's JVM (``"executor"``) after a few steps."""
    import torch
    import hvdlite.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    for step in range(100000):
        hvd.allreduce(torch.ones(4), name="loop")
        if step == 20 and hvd.rank() == rank_to_fail:
            if how == "raise":
                raise ValueError(f"a bug on rank {hvd.rank()} at step {step}")
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            from tests.ray.elastic_funcs import kill_ancestor
            kill_ancestor("CoarseGrainedExecutorBackend")
        time.sleep(0.01)

"""A Ray driver for tests/multihost/test_ray.py, run inside a simulated host (a node of the
bed's Ray cluster): connects to the cluster and runs one hvdlite.ray job, then prints
``RESULT <json>``.

argv: mode (``executor``, ``trainer`` or ``elastic``), the cluster's address, this node's
address, and a directory every host sees (the jobs' logs and results).
"""
from __future__ import annotations

import json
import os
import sys


def collectives():
    import socket

    import numpy as np

    import hvdlite as hvd
    hvd.init()
    x = hvd.allreduce(np.arange(4, dtype=np.float64) * (hvd.rank() + 1), op=hvd.Sum, name="x")
    return {"rank": hvd.rank(), "local_rank": hvd.local_rank(), "local_size": hvd.local_size(),
            "cross_rank": hvd.cross_rank(), "cross_size": hvd.cross_size(),
            "host": socket.gethostname(), "sum": x.tolist()}


def main() -> None:
    mode, address, node_ip, out = sys.argv[1:5]
    import ray
    ray.init(address=address, _node_ip_address=node_ip)
    from hvdlite.ray import HvdliteTrainer, RayExecutor
    from tests.ray import elastic_funcs
    settings = RayExecutor.create_settings(timeout_s=60)
    if mode == "executor":
        executor = RayExecutor(settings, num_hosts=2, num_workers_per_host=2)
        executor.start()
        try:
            result = executor.run(collectives)
        finally:
            executor.shutdown()
    elif mode == "trainer":
        from ray.train import RunConfig, ScalingConfig
        trainer = HvdliteTrainer(
            elastic_funcs.train, train_loop_config={"out": out, "steps": 8},
            scaling_config=ScalingConfig(num_workers=4),
            run_config=RunConfig(storage_path=os.path.join(out, "storage")))
        fit = trainer.fit()
        result = {"error": repr(fit.error) if fit.error else None}
    elif mode == "elastic":
        executor = RayExecutor(settings, min_workers=2, max_workers=4, cpus_per_worker=1)
        executor.start()
        result = executor.run(elastic_funcs.train, args=[{
            "out": out, "steps": 100000, "until_file": os.path.join(out, "stop"),
            "sleep": 0.1}])
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

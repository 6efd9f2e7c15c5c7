"""Resizing through Ray Train: ``ScalingConfig(num_workers=(1, 2))`` starts on the one CPU the
cluster has, and when a node joins, Ray Train restarts the run on 2 workers, which form a new
2-rank MPI world and resume from the last checkpoint."""
from __future__ import annotations

import json
import os
import tempfile
import threading
import time

import pytest

ray = pytest.importorskip("ray", reason="hvdlite.ray needs Ray: pip install 'hvdlite[ray]'")
torch = pytest.importorskip("torch")

from ray.cluster_utils import Cluster  # noqa: E402
from ray.train import FailureConfig, RunConfig, ScalingConfig  # noqa: E402

from hvdlite.ray import HvdliteTrainer  # noqa: E402
from tests.ray import train_funcs  # noqa: E402
from tests.ray.procs import launcher_processes, ray_environment  # noqa: E402

pytestmark = pytest.mark.timeout(200)


@pytest.fixture(scope="module")
def cluster():
    ray_environment()
    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": 1, "include_dashboard": False})
    ray.init(address=cluster.address)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def _steps(out):
    path = os.path.join(out, "steps.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_a_joining_node_grows_the_run_from_its_checkpoint(cluster):
    out = tempfile.mkdtemp()
    trainer = HvdliteTrainer(
        train_funcs.linear,
        train_loop_config={"out": out, "steps": 3, "grow_to": 2, "steps_after_growth": 3,
                           "max_steps": 300, "sleep": 0.2},
        scaling_config=ScalingConfig(num_workers=(1, 2), elastic_resize_monitor_interval_s=1),
        run_config=RunConfig(storage_path=tempfile.mkdtemp(),
                             failure_config=FailureConfig(max_failures=1)))
    results: dict = {}
    fit = threading.Thread(target=lambda: results.update(result=trainer.fit()), daemon=True)
    fit.start()
    deadline = time.monotonic() + 90
    while len(_steps(out)) < 3 and time.monotonic() < deadline:   # running on 1 worker
        time.sleep(0.2)
    assert {s["size"] for s in _steps(out)} == {1}
    cluster.add_node(num_cpus=1)   # (Ray's test cluster adds nodes from the main thread only)
    added = time.time()
    fit.join(150)
    assert not fit.is_alive() and results["result"].error is None
    steps = _steps(out)
    small = [s for s in steps if s["size"] == 1]
    grown = [s for s in steps if s["size"] == 2]
    assert small and len(grown) == 3 and steps == small + grown
    assert [s["step"] for s in small] == list(range(len(small)))
    assert 0 < grown[0]["start"] <= small[-1]["step"] + 1   # resumed from a checkpoint
    assert [s["step"] for s in grown] == list(range(grown[0]["start"], grown[0]["start"] + 3))
    print(f"\nresize: first 2-worker step {grown[0]['time'] - added:.1f} s after the node joined")
    states = [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(2)]
    for key in states[0]:
        assert torch.equal(states[0][key], states[1][key]), key
    deadline = time.monotonic() + 20
    while launcher_processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert launcher_processes() == []

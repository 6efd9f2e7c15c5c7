"""Resizing through Ray Train: ``ScalingConfig(num_workers=(1, 2))`` starts on the one CPU the
cluster has, and when a node joins, Ray Train restarts the run on 2 workers, which form a new
2-rank MPI world and resume from the last checkpoint."""
from __future__ import annotations

import os
import tempfile
import threading
import time

import pytest

ray = pytest.importorskip("ray", reason="hvdlite.ray needs Ray: pip install 'hvdlite[ray]'")
torch = pytest.importorskip("torch")

from ray.train import FailureConfig, RunConfig, ScalingConfig  # noqa: E402

from hvdlite.ray import HvdliteTrainer  # noqa: E402
from tests.ray import train_funcs  # noqa: E402
from tests.ray.procs import (drain, launcher_processes, node_cluster, read_steps,  # noqa: E402
                             wait_for)

pytestmark = pytest.mark.timeout(200)


@pytest.fixture(scope="module")
def cluster():
    # Ray Train sizes a restart by the cluster's resources, a draining node's included: after
    # the drain it first waits this long for the old size (60 s by default), then goes smaller.
    os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = "20"
    with node_cluster(head_cpus=1) as cluster:
        yield cluster


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
    while len(read_steps(out)) < 3 and time.monotonic() < deadline:   # running on 1 worker
        time.sleep(0.2)
    assert {s["size"] for s in read_steps(out)} == {1}
    cluster.add_node(num_cpus=1)   # (Ray's test cluster adds nodes from the main thread only)
    added = time.time()
    fit.join(150)
    assert not fit.is_alive() and results["result"].error is None
    steps = read_steps(out)
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


def test_a_drained_node_makes_an_elastic_function_commit_and_go_on_without_it(cluster):
    """Ray's preemption notice under HvdliteTrainer: when a node of the run is being drained,
    the workers of an ``@hvd.elastic.run`` function stop at their next commit with rank 0's
    state handed in, and Ray Train's restart, on the nodes that stay, resumes from it with
    nothing rolled back."""
    from tests.ray import elastic_funcs
    while ray.cluster_resources().get("CPU", 0) < 3:   # (the first test may have added one)
        node = cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
    out = tempfile.mkdtemp()
    stop = os.path.join(out, "stop")
    trainer = HvdliteTrainer(
        elastic_funcs.train,
        train_loop_config={"out": out, "steps": 100000, "until_file": stop, "sleep": 0.1},
        scaling_config=ScalingConfig(num_workers=(1, 3), elastic_resize_monitor_interval_s=1),
        run_config=RunConfig(storage_path=tempfile.mkdtemp(),
                             failure_config=FailureConfig(max_failures=2)))
    results: dict = {}
    fit = threading.Thread(target=lambda: results.update(result=trainer.fit()), daemon=True)
    fit.start()
    try:
        wait_for("3 steps on 3 workers", lambda: sum(s["size"] == 3 for s in read_steps(out)) >= 3)
        full = max(s["world"] for s in read_steps(out))
        drain(cluster, node.node_id, deadline_s=300)
        drained = time.monotonic()
        wait_for("3 steps after the drain", lambda: sum(
            s["world"] > full for s in read_steps(out)) >= 3)
        went_on = time.monotonic() - drained
    finally:
        open(stop, "w").close()
        fit.join(150)
    assert not fit.is_alive() and results["result"].error is None
    steps = read_steps(out)
    assert [s["step"] for s in steps] == list(range(len(steps)))   # nothing rolled back
    sizes = {}
    for s in steps:
        sizes.setdefault(s["world"], s["size"])
    assert sizes[full] == 3 and sizes[max(sizes)] == 2, sizes
    print(f"\ndrain notice -> 3 steps on the nodes that stay: {went_on:.1f} s")

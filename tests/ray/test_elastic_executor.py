"""Horovod's elastic RayExecutor (``min_workers``/``max_workers``) on a local Ray cluster of
several nodes: a worker lost mid-training and the run going on from the last commit, bitwise
equal to an uninterrupted run; a node joining (the world grows at the next commit) and a node
being drained, Ray's preemption notice (the world shrinks at the next commit, nothing rolled
back); a bug ending the job with its exception; and no process of a job left afterwards."""
from __future__ import annotations

import os
import tempfile
import threading
import time

import pytest

ray = pytest.importorskip("ray", reason="hvdlite.ray needs Ray: pip install 'hvdlite[ray]'")
pytest.importorskip("torch")


from hvdlite.ray import ElasticRayExecutor, RayExecutor  # noqa: E402
from hvdlite.ray.elastic import ElasticRayError  # noqa: E402
from tests.ray import elastic_funcs  # noqa: E402
from tests.ray.procs import (drain, launcher_processes, node_cluster, read_steps,  # noqa: E402
                             wait_for, wait_gone)

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def cluster():
    with node_cluster(head_cpus=2) as cluster:
        yield cluster


def _pids(out):
    return [int(p) for p in os.listdir(os.path.join(out, "pids"))]


def _executor(**kwargs):
    settings = RayExecutor.create_settings(timeout_s=60)
    executor = RayExecutor(settings, cpus_per_worker=1, **kwargs)
    executor.start()
    return executor


def _nothing_left(out):
    assert wait_gone(_pids(out)) == []
    deadline = time.monotonic() + 20
    while launcher_processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert launcher_processes() == []


def _world_starts(steps):
    """{world: (first step, size)} from the steps log."""
    starts = {}
    for s in steps:
        starts.setdefault(s["world"], (s["step"], s["size"]))
    return starts


def test_the_elastic_arguments_are_checked_as_horovod_checks_them():
    settings = RayExecutor.create_settings()
    with pytest.raises(ValueError, match="min_workers"):
        RayExecutor(settings, max_workers=2)
    with pytest.raises(ValueError, match="Only one of them"):
        RayExecutor(settings, num_workers=2, min_workers=1)
    with pytest.raises(ValueError, match="max_workers"):
        RayExecutor(settings, min_workers=3, max_workers=2)
    with pytest.raises(ValueError, match="lower limit"):
        RayExecutor(settings, min_workers=1, cooldown_range=(0, 10))
    executor = RayExecutor(settings, min_workers=1)
    with pytest.raises(NotImplementedError, match="ephemeral"):
        executor.run_remote(lambda: 0)
    with pytest.raises(NotImplementedError, match="execute_single"):
        executor.execute_single(lambda _: 0)
    with pytest.raises(RuntimeError, match="start"):
        executor.run(lambda: 0)


def test_a_lost_worker_resumes_from_the_last_commit_bitwise_as_if_never_lost(cluster):
    executor = _executor(min_workers=2, max_workers=2)
    try:
        clean = tempfile.mkdtemp()
        reference = executor.run(elastic_funcs.train, args=[{"out": clean, "steps": 12}])
        out = tempfile.mkdtemp()
        started = time.monotonic()
        results = executor.run(elastic_funcs.train,
                               args=[{"out": out, "steps": 12, "kill": [0, 1, 4]}])
        took = time.monotonic() - started
    finally:
        executor.shutdown()
    assert [r["rank"] for r in results] == [0, 1] and {r["world"] for r in results} == {1}
    steps = read_steps(out)
    assert [s["step"] for s in steps] == list(range(12))   # nothing repeated, nothing lost
    assert _world_starts(steps) == {0: (0, 2), 1: (5, 2)}
    # the same parameters, to the bit, as the run that lost nothing
    assert results[0]["params"] == results[1]["params"] == reference[0]["params"]
    reset = steps[5]["time"] - steps[4]["time"]
    print(f"\nrun with a worker lost after step 4: {took:.1f} s; step 4 to step 5 (the "
          f"reset): {reset:.1f} s")
    _nothing_left(out)
    _nothing_left(clean)


def test_workers_that_write_all_the_time_survive_a_lost_worker(cluster):
    """Issue 54 under the elastic RayExecutor: every worker prints and logs every 20 ms (and
    the survivor once more a second after the failure); the run resets and finishes."""
    executor = _executor(min_workers=2, max_workers=2)
    out = tempfile.mkdtemp()
    try:
        results = executor.run(elastic_funcs.train, args=[{"out": out, "steps": 10,
                                                           "kill": [0, 1, 4], "chatty": True}])
    finally:
        executor.shutdown()
    assert [r["rank"] for r in results] == [0, 1] and {r["world"] for r in results} == {1}
    assert [s["step"] for s in read_steps(out)] == list(range(10))
    _nothing_left(out)


def test_an_exception_in_the_function_ends_the_job_with_it(cluster):
    executor = _executor(min_workers=2, max_workers=2)
    out = tempfile.mkdtemp()
    try:
        with pytest.raises(ElasticRayError, match="rank 1 .* raised ValueError: a bug on "
                           "rank 1 at step 2") as caught:
            executor.run(elastic_funcs.train, args=[{"out": out, "steps": 10,
                                                     "raise": [1, 2]}])
    finally:
        executor.shutdown()
    assert isinstance(caught.value.__cause__, ValueError)
    assert {s["world"] for s in read_steps(out)} == {0}   # not retried
    _nothing_left(out)


def test_horovods_older_elastic_ray_executor_runs_the_same_job(cluster):
    with pytest.warns(DeprecationWarning, match="min_np is deprecated"):
        settings = ElasticRayExecutor.create_settings(min_np=2, max_num_proc=2, timeout_s=60)
    with pytest.raises(ValueError, match="gpus_per_slot is set, but use_gpu is False"):
        ElasticRayExecutor(settings, gpus_per_slot=1)
    executor = ElasticRayExecutor(settings, cpus_per_slot=1, env_vars={"HVDLITE_TEST_VAR": "7"})
    executor.start()
    out = tempfile.mkdtemp()

    def train():   # Horovod calls the function with no arguments
        return {**elastic_funcs.train({"out": out, "steps": 3}),
                "var": os.environ.get("HVDLITE_TEST_VAR")}

    results = executor.run(train)
    assert [(r["rank"], r["size"], r["step"], r["var"]) for r in results] == [
        (0, 2, 3, "7"), (1, 2, 3, "7")]
    _nothing_left(out)


def test_too_few_resources_fail_within_the_elastic_timeout(cluster):
    settings = RayExecutor.create_settings(timeout_s=30)
    executor = RayExecutor(settings, min_workers=8, elastic_timeout=2)
    started = time.monotonic()
    with pytest.raises(ElasticRayError, match="room for 8 workers .* hold only 2"):
        executor.start()
    assert time.monotonic() - started < 15


def test_a_joining_node_grows_the_world_and_a_drained_node_shrinks_it(cluster):
    out = tempfile.mkdtemp()
    stop = os.path.join(out, "stop")
    executor = _executor(min_workers=1, max_workers=3)
    results: dict = {}

    def run():
        try:
            results["value"] = executor.run(
                elastic_funcs.train,
                args=[{"out": out, "steps": 100000, "until_file": stop, "sleep": 0.1}])
        except BaseException as exc:   # noqa: BLE001 - reported by the test
            results["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        wait_for("3 steps on 2 workers", lambda: len(read_steps(out)) >= 3)
        node = cluster.add_node(num_cpus=1)   # from the main thread, as Ray's Cluster wants
        added = time.monotonic()
        wait_for("3 steps on 3 workers",
                  lambda: sum(s["size"] == 3 for s in read_steps(out)) >= 3)
        grown = time.monotonic() - added
        drain(cluster, node.node_id, deadline_s=120)
        drained = time.monotonic()
        wait_for("3 steps on 2 workers after the drain",
                  lambda: sum(s["world"] == 2 for s in read_steps(out)) >= 3)
        shrunk = time.monotonic() - drained
        open(stop, "w").close()
        thread.join(120)
    finally:
        open(stop, "w").close()
        thread.join(120)
        executor.shutdown()
    assert "error" not in results, results.get("error")
    steps = read_steps(out)
    starts = _world_starts(steps)
    assert [size for _, size in (starts[w] for w in sorted(starts))] == [2, 3, 2]
    # Every world starts where the one before stopped: each stop shipped rank 0's live state.
    assert [s["step"] for s in steps] == list(range(len(steps)))
    final = results["value"]
    assert len(final) == 2 and final[0]["params"] == final[1]["params"]
    gaps = [b["time"] - a["time"] for a, b in zip(steps, steps[1:]) if a["world"] != b["world"]]
    print(f"\nnode joined -> 3 workers training: {grown:.1f} s; drain notice -> 2 workers "
          f"training: {shrunk:.1f} s; the last step of a world to the first of the next: "
          f"{', '.join(f'{g:.1f} s' for g in gaps)}")
    _nothing_left(out)

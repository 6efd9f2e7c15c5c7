"""hvdlite.spark.run and run_elastic on real Spark clusters: local-cluster[2,1,1024] (two
executor JVMs) and local[3]; every rank a real process, every Spark job bounded."""
from __future__ import annotations

import io
import itertools
import json
import os
import sys
import time

import pytest

from tests.ray import elastic_funcs
from tests.spark import funcs
from tests.spark.conftest import bounded, require_spark

require_spark()   # (at collection: skips or fails the module)
import hvdlite.spark as hvdlite_spark  # noqa: E402
from hvdlite.spark.elastic import task_slots  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MARKERS = (b"hvdlite.runner.task", b"hydra_pmi_proxy", b"HVDLITE_PMI", b"-launcher\x00manual")


def leftovers() -> list[str]:
    """Processes of an hvdlite.spark job still running on this machine (ranks, proxies,
    placeholders, mpiexec)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if any(mark in cmdline for mark in MARKERS):
            text = cmdline.replace(b"\0", b" ").decode(errors="replace")
            found.append(f"{pid}: {text[:120]}")
    return found


def assert_nothing_left(within_s: float = 20.0) -> None:
    deadline = time.monotonic() + within_s
    while leftovers() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert leftovers() == []


def wait_for_slots(session, slots: int, within_s: float = 90.0) -> None:
    """Until the cluster runs ``slots`` tasks at once again (a killed executor is replaced)."""
    deadline = time.monotonic() + within_s
    while task_slots(session.sparkContext) < slots:
        assert time.monotonic() < deadline, "the killed executor was not replaced"
        time.sleep(0.5)


def check_collectives(results: list, size: int) -> None:
    assert [r["rank"] for r in results] == list(range(size))
    for r in results:
        assert r["size"] == size and r["cross_size"] == 1
        assert r["local_size"] == size and r["local_rank"] == r["rank"]   # one host
        assert r["sum"] == [i * size * (size + 1) / 2 for i in range(12)]
        assert r["average"] == [i * (size + 1) / 2 for i in range(12)]
        assert r["max"] == [3 * (size - 1) - 1]
        assert r["gathered"] == [[float(k)] * 2 for k in range(size) for _ in range(k + 1)]
        assert r["broadcast"] == [size - 1 + 0.5]
        k = r["rank"]
        assert r["alltoall"] == [v + 100 * src for src in range(size) for v in (2 * k, 2 * k + 1)]
        assert r["object"] == {"from": 0}
    assert len({r["pid"] for r in results}) == size


# --- local-cluster: two executor JVMs --------------------------------------------------------
def test_run_on_two_executors_forms_one_world_with_exact_collectives(spark_cluster):
    out, err = io.StringIO(), io.StringIO()
    results = bounded(spark_cluster, lambda: hvdlite_spark.run(
        funcs.collectives, args=(7,), num_proc=2, env={"HVDLITE_TEST_SPARK_ENV": "yes"},
        stdout=out, stderr=err))
    check_collectives(results, 2)
    assert {r["env"] for r in results} == {"yes"} and {r["extra"] for r in results} == {7}
    lines = out.getvalue().splitlines()
    assert "[0]<stdout>:rank 0 says hello" in lines and "[1]<stdout>:rank 1 says hello" in lines
    assert_nothing_left()


def test_the_digits_example_trains_through_run(spark_cluster):
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        import spark_digits
        status = bounded(spark_cluster, lambda: spark_digits.main(
            ["--num-proc", "2", "--epochs", "10", "--min-accuracy", "0.95"],
            spark=spark_cluster))
    finally:
        sys.path.remove(os.path.join(ROOT, "examples"))
    assert status == 0


def test_an_exception_on_one_rank_fails_the_job_with_that_ranks_error(spark_cluster):
    with pytest.raises(RuntimeError) as info:
        bounded(spark_cluster, lambda: hvdlite_spark.run(funcs.fail_on, args=(1, "raise"),
                                                         num_proc=2, stderr=io.StringIO()))
    assert "rank 1's traceback" in str(info.value)
    assert "a bug on rank 1 at step 20" in str(info.value)
    assert isinstance(info.value.__cause__, ValueError)
    assert_nothing_left()


def test_a_rank_killed_mid_job_fails_the_job_and_leaves_nothing(spark_cluster):
    with pytest.raises(RuntimeError) as info:
        bounded(spark_cluster, lambda: hvdlite_spark.run(funcs.fail_on, args=(1, "kill"),
                                                         num_proc=2, stderr=io.StringIO()))
    assert "RankFailed: rank 1 (Spark partition" in str(info.value)
    assert "was killed by signal 9 (SIGKILL)" in str(info.value)
    assert_nothing_left()


def test_a_lost_executor_fails_the_job_and_leaves_nothing(spark_cluster):
    wait_for_slots(spark_cluster, 2)
    with pytest.raises(RuntimeError) as info:
        bounded(spark_cluster, lambda: hvdlite_spark.run(funcs.fail_on, args=(1, "executor"),
                                                         num_proc=2, stderr=io.StringIO()))
    assert "hvdlite.spark.run()" in str(info.value)
    assert_nothing_left()
    wait_for_slots(spark_cluster, 2)


def test_too_few_task_slots_end_at_the_start_timeout_naming_the_tasks(spark_cluster):
    wait_for_slots(spark_cluster, 2)
    started = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        bounded(spark_cluster, lambda: hvdlite_spark.run(funcs.collectives, args=(0,),
                                                         num_proc=3, start_timeout=4))
    assert time.monotonic() - started < 60
    message = str(info.value)
    assert "within the start timeout (4 s)" in message
    assert "Tasks (partitions) [0, 1, 2] never started" in message
    assert "needs 3 free task slots; the cluster offers 2" in message
    assert_nothing_left()
    # and the cluster is free again: a job that fits runs
    check_collectives(bounded(spark_cluster, lambda: hvdlite_spark.run(
        funcs.collectives, args=(0,), num_proc=2, stdout=io.StringIO())), 2)


def steps_by_world(out: str) -> list[tuple[int, int, int, int]]:
    """(world, size, first step, last step) of each world, from rank 0's step log."""
    with open(os.path.join(out, "steps.jsonl")) as f:
        steps = [json.loads(line) for line in f]
    return [(w, s, group[0]["step"], group[-1]["step"]) for (w, s), group in
            ((key, list(g)) for key, g in itertools.groupby(
                steps, key=lambda e: (e["world"], e["size"])))]


def test_run_elastic_survives_a_lost_executor_and_grows_back(spark_cluster, tmp_path):
    wait_for_slots(spark_cluster, 2)
    config = {"out": str(tmp_path), "steps": 40, "sleep": 0.15, "kill_ancestor": [0, 1, 5],
              "ancestor": "CoarseGrainedExecutorBackend"}
    results = bounded(spark_cluster, lambda: hvdlite_spark.run_elastic(
        elastic_funcs.train, args=[config], num_proc=2, min_num_proc=1, max_num_proc=2,
        start_timeout=60, elastic_timeout=60, stdout=io.StringIO(), stderr=io.StringIO()),
        timeout_s=300)
    worlds = steps_by_world(str(tmp_path))
    # world 0 lost an executor after committing step 5; the next world resumed right after it
    # with the executor that remained, and the world grew back when Spark replaced it.
    assert worlds[0][:2] == (0, 2) and worlds[0][3] == 5
    assert worlds[1][1] == 1 and worlds[1][2] == 6
    assert worlds[-1][1] == 2 and worlds[-1][3] == 39
    for before, after in zip(worlds, worlds[1:]):
        assert after[2] == before[3] + 1   # nothing lost beyond the last commit
    assert [r["rank"] for r in results] == [0, 1]
    assert {r["step"] for r in results} == {40} and {r["size"] for r in results} == {2}
    assert results[0]["params"] == results[1]["params"]
    assert_nothing_left()


def test_run_elastic_ends_with_the_functions_own_error(spark_cluster, tmp_path):
    wait_for_slots(spark_cluster, 2)
    with pytest.raises(RuntimeError) as info:
        bounded(spark_cluster, lambda: hvdlite_spark.run_elastic(
            elastic_funcs.train, args=[{"out": str(tmp_path), "steps": 10, "raise": [1, 3]}],
            num_proc=2, stdout=io.StringIO(), stderr=io.StringIO()))
    assert "a bug on rank 1 at step 3" in str(info.value)
    assert isinstance(info.value.__cause__, ValueError)
    assert_nothing_left()


def test_run_elastic_checks_its_arguments(spark_cluster):
    with pytest.raises(ValueError, match="min_num_proc=3 is above max_num_proc=2"):
        hvdlite_spark.run_elastic(funcs.collectives, num_proc=2, min_num_proc=3,
                                  max_num_proc=2)
    with pytest.raises(ValueError, match="use_gloo"):
        hvdlite_spark.run(funcs.collectives, use_gloo=True)
    with pytest.raises(ValueError, match="start_timeout must be positive"):
        hvdlite_spark.run(funcs.collectives, start_timeout=0)


# --- local[3]: three tasks in the driver's JVM -----------------------------------------------
def test_run_at_three_processes_by_default_parallelism(spark_local3):
    out = io.StringIO()
    results = bounded(spark_local3, lambda: hvdlite_spark.run(
        funcs.collectives, args=(3,), stdout=out, prefix_output_with_timestamp=True))
    check_collectives(results, 3)
    tagged = [line for line in out.getvalue().splitlines() if "<stdout>:rank" in line]
    assert len(tagged) == 3 and all(line[0].isalpha() and "[" in line for line in tagged)
    assert_nothing_left()


def test_run_elastic_at_three_resumes_after_a_killed_rank(spark_local3, tmp_path):
    results = bounded(spark_local3, lambda: hvdlite_spark.run_elastic(
        elastic_funcs.train, args=[{"out": str(tmp_path), "steps": 12, "kill": [0, 2, 4]}],
        num_proc=3, stdout=io.StringIO(), stderr=io.StringIO()), timeout_s=300)
    worlds = steps_by_world(str(tmp_path))
    assert [(w, s) for w, s, _, _ in worlds] == [(0, 3), (1, 3)]
    assert worlds[0][3] == 4 and worlds[1][2] == 5 and worlds[1][3] == 11
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert results[0]["params"] == results[1]["params"] == results[2]["params"]
    assert_nothing_left()


def test_run_elastic_stops_at_the_reset_limit(spark_local3, tmp_path):
    from hvdlite.spark.elastic import ElasticSparkError
    with pytest.raises(ElasticSparkError, match="resets during the elastic job exceeded the "
                                                "limit: 0"):
        bounded(spark_local3, lambda: hvdlite_spark.run_elastic(
            elastic_funcs.train, args=[{"out": str(tmp_path), "steps": 12, "kill": [0, 2, 4]}],
            num_proc=3, reset_limit=0, stdout=io.StringIO(), stderr=io.StringIO()))
    assert [(w, s) for w, s, _, _ in steps_by_world(str(tmp_path))] == [(0, 3)]
    assert_nothing_left()

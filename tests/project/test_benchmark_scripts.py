"""The allreduce benchmark runs end to end on a short schedule (2 and 3 ranks) and checks its own
results against numpy: a benchmark that nobody runs rots.  Its timings are never asserted."""
import json
import os
import signal
import subprocess
import sys

import pytest

from tests.mpi_harness import REPO, run_job

SHORT = ["--sizes", "4K,1M", "--small-count", "8", "--small-kib", "4", "--after-compute-ms", "2",
         "--iterations", "20", "--min-iterations", "5", "--time-budget", "0.5", "--blocks", "2"]


@pytest.mark.parametrize("np_", [2, 3])
def test_allreduce_benchmark_short_run(tmp_path, np_):
    out = tmp_path / "result.json"
    job = run_job(np_, [sys.executable, str(REPO / "benchmarks" / "allreduce_benchmark.py"),
                        *SHORT, "--json", str(out)], timeout=180)
    assert not job.timed_out, job.output
    assert job.returncode == 0, job.output
    result = json.loads(out.read_text())
    assert [size["bytes"] for size in result["sizes"]] == [4096, 1 << 20]
    assert all(size["correct"] for size in result["sizes"]), job.output
    assert result["small"]["correct"] and result["small"]["count"] == 8
    after = result["after_compute"]
    assert after["correct"] and after["compute_ms"] == 2.0
    assert after["hvdlite"]["iterations"] >= 5 and after["raw"]["iterations"] >= 5
    assert "one-float allreduce after 2-2.4 ms" in job.stdout
    if np_ == 2:
        assert "targets:" in job.stdout


FRAMEWORK_SHORT = ["--small-count", "6", "--small-kib", "4", "--large-mib", "1",
                   "--iterations", "10", "--min-iterations", "3", "--time-budget", "0.3",
                   "--blocks", "2"]


@pytest.mark.parametrize("framework,variants", [
    ("torch", {"torch allreduce (sync)", "torch allreduce_async_",
               "torch grouped_allreduce_async"}),
    ("tf", {"tf allreduce (eager)", "tf allreduce in tf.function",
            "tf grouped_allreduce in tf.function", "TensorFlow alone: t + 0 in tf.function"})])
def test_framework_benchmark_short_run(tmp_path, framework, variants):
    """benchmarks/framework_benchmark.py times every adapter variant against raw MPI and
    checks each one's results against numpy (a wrong result fails the job)."""
    pytest.importorskip("torch" if framework == "torch" else "tensorflow")
    out = tmp_path / "result.json"
    job = run_job(2, [sys.executable, str(REPO / "benchmarks" / "framework_benchmark.py"),
                      "--framework", framework, *FRAMEWORK_SHORT, "--json", str(out)],
                  timeout=300)
    assert not job.timed_out, job.output
    assert job.returncode == 0, job.output
    groups = json.loads(out.read_text())["groups"]
    assert set(groups) == {"lone", "round", "large"}
    assert groups["round"]["count"] == 6
    for group in groups.values():
        names = set(group["variants"])
        assert "raw MPI (one Allreduce of all the bytes)" in names
        for name, v in group["variants"].items():
            assert v["iterations"] >= 3, (name, v)
            if name.startswith("TensorFlow alone"):   # timed references: no collective
                assert v["correct"] is None, (name, v)
            else:
                assert v["correct"] is True, (name, v)
    assert variants <= set(groups["round"]["variants"])


def _run_driver(script: str, args: list[str], timeout: float) -> str:
    """Run a benchmark driver (it launches mpiexec jobs itself) in its own process group, kill
    the whole group if it hangs; return its output, failing the test on a non-zero exit."""
    cmd = [sys.executable, str(REPO / "benchmarks" / script), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)   # the benchmark, its mpiexec and the ranks
        output, _ = proc.communicate()
        pytest.fail(f"{script} hung\n{output}")
    assert proc.returncode == 0, output
    return output


def test_gradient_buckets_benchmark_short_run():
    """benchmarks/gradient_buckets.py runs its five configurations (bare, per gradient and
    bucketed, at 1 and 2 ranks) on the 130-tensor model and prints its table."""
    output = _run_driver("gradient_buckets.py", ["--rounds", "1", "--batch-size", "4",
                                                 "--num-iters", "1", "--num-batches-per-iter",
                                                 "2", "--timeout", "120"], timeout=600)
    for row in ("| bare-1 |", "| per-gradient-1 |", "| buckets-1@1 |", "| per-gradient-2 |",
                "| buckets-2@1 |"):
        assert row in output, output
    assert "efficiency" in output and "overhead" in output


TINY = ["--batch-size", "8", "--num-warmup-batches", "1", "--num-batches-per-iter", "2",
        "--num-iters", "2"]


@pytest.mark.parametrize("framework,via", [("torch", "mpi"), ("torch", "ddp"), ("tf", "mpi")])
def test_reference_training_reports_throughput(tmp_path, framework, via):
    """benchmarks/reference_training.py (the data-parallel loops hvdlite is measured against)
    trains at 2 ranks and writes the synthetic benchmarks' JSON result."""
    out = tmp_path / "result.json"
    job = run_job(2, [sys.executable, str(REPO / "benchmarks" / "reference_training.py"),
                      "--framework", framework, "--via", via, *TINY, "--json", str(out)],
                  timeout=240)
    assert not job.timed_out, job.output
    assert job.returncode == 0, job.output
    result = json.loads(out.read_text())
    assert (result["framework"], result["via"], result["ranks"]) == (framework, via, 2), result
    assert result["params"] > 5_000_000 and result["total"] > 0, result


def test_reference_training_refuses_ddp_for_tensorflow():
    job = run_job(1, [sys.executable, str(REPO / "benchmarks" / "reference_training.py"),
                      "--framework", "tf", "--via", "ddp"], timeout=120)
    assert job.returncode == 2 and "--via ddp is PyTorch's" in job.output, job.output


def test_training_scaling_prints_every_configuration():
    """benchmarks/training_scaling.py runs its seven PyTorch configurations (one short round)
    and prints the table and the ratios the README quotes."""
    output = _run_driver("training_scaling.py", ["--rounds", "1", "--batch-size", "8",
                                                 "--num-iters", "1", "--num-batches-per-iter",
                                                 "2", "--timeout", "120"], timeout=900)
    for row in ("| bare-1 |", "| hvd-1 |", "| hvd-2 |", "| bare-2 |", "| lockstep-2 |",
                "| mpi-2 |", "| ddp-2 |"):
        assert row in output, output
    for line in ("scaling efficiency at 2 ranks", "lockstep ceiling", "share of the lockstep",
                 "against a blocking mpi4py Allreduce loop", "against DDP over gloo"):
        assert line in output, output


def test_cross_host_ranks_lone_case_with_its_floors(tmp_path):
    """benchmarks/cross_host_ranks.py (the ranks' side of cross_host_benchmark.py) on one host:
    the lone case and its two floor references (the negotiation's AND beside the data, in the
    caller's thread and behind two thread hand-offs) run, and each result is checked."""
    out = tmp_path / "result.json"
    job = run_job(2, [sys.executable, str(REPO / "benchmarks" / "cross_host_ranks.py"),
                      "--sizes", "", "--small-count", "0", "--gather-sizes", "",
                      "--iterations", "20", "--min-iterations", "5", "--time-budget", "0.5",
                      "--blocks", "2", "--json", str(out)], timeout=180)
    assert not job.timed_out, job.output
    assert job.returncode == 0, job.output
    lone = json.loads(out.read_text())["lone"]
    assert lone["correct"], job.output
    for variant in ("raw", "flat", "hierarchical", "flat_no_early", "floor_and_data",
                    "floor_handed_off"):
        assert lone[variant]["iterations"] >= 5, (variant, lone[variant])
    assert "(floor thread)" in job.stdout and "(floor caller)" in job.stdout, job.stdout


def test_launcher_benchmark_short_run(tmp_path):
    """torchrun against mpiexec (issue 48): both launches run the checked workload; the table
    has a row per size and the small round.  Timings are not asserted."""
    pytest.importorskip("torch")
    out = tmp_path / "launchers.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "launcher_benchmark.py"),
                           "--np", "2", "--rounds", "1", "--short", "--json", str(out)],
                          capture_output=True, text=True, timeout=600, start_new_session=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {"4 KiB", "1 MiB", "8 x 4 KiB"}
    assert all(set(r) == {"mpiexec.hvd", "mpiexec.raw", "torchrun.hvd", "torchrun.raw"}
               for r in rows.values())


@pytest.mark.parametrize("np_", [2, 3])
def test_grouped_benchmark_short_run(tmp_path, np_):
    """benchmarks/grouped_benchmark.py checks every kind's grouped result against numpy before
    timing it (a wrong result fails the job) and reports grouped against raw per kind."""
    out = tmp_path / "grouped.json"
    job = run_job(np_, [sys.executable, str(REPO / "benchmarks" / "grouped_benchmark.py"),
                        "--counts", "3,7", "--iterations", "3", "--blocks", "1",
                        "--json", str(out)], timeout=180)
    assert not job.timed_out, job.output
    assert job.returncode == 0, job.output
    rows = json.loads(out.read_text())
    assert [(r["kind"], r["count"]) for r in rows] == [
        (kind, n) for kind in ("allreduce", "allgather", "reducescatter") for n in (3, 7)]
    assert all(r["raw_us"] > 0 and r["grouped_us"] > 0 for r in rows)
    assert "grouped/raw" in job.stdout

"""The allreduce benchmark runs end to end on a short schedule (2 and 3 ranks) and checks its own
results against numpy: a benchmark that nobody runs rots.  Its timings are never asserted."""
import json
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

"""benchmarks/compression_benchmark.py runs end to end in a tiny configuration: a small MLP, 2
timed steps per compression, 2 hosts x 2 ranks under a brief 10gbit cap, and the 1-rank job;
every result has its bytes and its floor, the table prints the floor column, and no cap is
left.  Timings are never asserted.  Skipped like the other multi-host tests (conftest.py), a
failure with HVDLITE_TEST_REQUIRE_HOSTS=1."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from tests.mpi_harness import REPO
from tests.multihost import link
from tests.multihost.hosts import unavailable_reason

RATE = "10gbit"
COMPRESSIONS = ["none", "fp16", "powersgd1", "powersgd2", "powersgd4"]


def _unavailable(message: str) -> None:
    if os.environ.get("HVDLITE_TEST_REQUIRE_HOSTS") == "1":
        pytest.fail(message + " (HVDLITE_TEST_REQUIRE_HOSTS=1)", pytrace=False)
    pytest.skip(message)


@pytest.mark.parametrize("framework", ["torch", "keras"])
def test_compression_benchmark_tiny_run(tmp_path, framework):
    reason = unavailable_reason()
    if reason:
        _unavailable(f"multi-host tests need Linux namespaces: {reason}")
    reason = link.unavailable_reason()
    if reason is None and link.root_qdisc()[1] != "0:":
        reason = f"lo already has a root qdisc ({link.root_qdisc()[2]}); not touching it"
    if reason:
        _unavailable(f"the benchmark's capped job needs tc on lo as root: {reason}")
    pytest.importorskip("torch" if framework == "torch" else "tensorflow")
    out = tmp_path / "compression.json"
    proc = subprocess.Popen(   # (its own process group: a timeout kills all it started)
        [sys.executable, str(REPO / "benchmarks" / "compression_benchmark.py"),
         "--widths", "64,256", "--steps", "2", "--warmup", "1", "--start-iter", "1",
         "--no-digits", "--no-unshaped", "--link", RATE, "--timeout", "150", "--json", str(out),
         "--framework", framework],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        link.remove_ours()
        pytest.fail(f"the benchmark timed out\n{output}")
    assert proc.returncode == 0, output
    assert not link.shaped(), "a cap was left on lo"
    documents = json.loads(out.read_text())
    assert set(documents) == {"single", RATE}, output
    assert documents["single"]["ranks"] == 1
    capped = documents[RATE]
    assert capped.get("framework", "torch") == framework
    assert capped["ranks"] == 4 and capped["hosts"] == 2
    results = {r["compression"]: r for r in capped["results"]}
    assert list(results) == COMPRESSIONS
    gradients = 4 * capped["params"]
    assert results["none"]["bytes"]["total"] == gradients
    assert results["fp16"]["bytes"]["total"] == gradients // 2
    for name in COMPRESSIONS:
        r = results[name]
        assert r["link_bytes"] == 2 * r["bytes"]["total"]   # 2(H-1) x bytes, H = 2
        assert r["floor_ms"] == pytest.approx(r["link_bytes"] / link.parse_rate(RATE) * 1e3)
        assert r["step_ms"] > 0 and len(r["step_ms_all"]) == 2
    for name in COMPRESSIONS[2:]:   # PowerSGD's factors: far fewer bytes than the gradients
        assert 0 < results[name]["bytes"]["P"] < gradients
    assert results["powersgd1"]["bytes"]["total"] < results["powersgd4"]["bytes"]["total"]
    assert "floor ms" in output and "step/floor" in output and "lo capped at 10 Gbit/s" in output

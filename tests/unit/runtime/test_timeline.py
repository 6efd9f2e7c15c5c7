"""Timeline recording and file format (hvdlite/common/runtime/timeline.py), in one process: what the
engine's calls turn into, the JSON written, and start/stop.  The multi-rank behaviour (rank 0
only, real negotiation and backends) is tests/core/test_timeline.py."""
import json

import pytest

import hvdlite
from hvdlite.common.runtime import timeline
from hvdlite.common.core import __all__ as public_names


def read(path):
    events = json.loads(path.read_text())
    rows = {e["pid"]: e["args"]["name"] for e in events
            if e.get("ph") == "M" and e["name"] == "process_name"}
    return [(rows[e["pid"]], e["ph"], e.get("name")) for e in events if e.get("ph") != "M"]


@pytest.fixture(autouse=True)
def no_timeline_left():
    yield
    timeline.stop()


def test_an_operation_from_negotiation_to_completion(tmp_path):
    path = tmp_path / "t.json"
    timeline.start(str(path))
    tl = timeline.ACTIVE
    tl.negotiate_start("g", "allreduce")
    tl.negotiate_tick("g", "allreduce", 1)       # a peer's request: no second span
    tl.negotiate_start("g", "allreduce")          # seen again: still one span
    tl.negotiate_end("g", "allreduce")
    tl.activity(["g"], "MEMCPY_IN_FUSION_BUFFER")
    tl.activity(["g"], "SHARED_WINDOW_ALLREDUCE")
    tl.op_end(["g"])
    tl.op_end(["g"])                              # completed twice: nothing more
    timeline.stop()
    assert read(path) == [
        ("g", "B", "NEGOTIATE_ALLREDUCE"), ("g", "X", "1"), ("g", "E", None),
        ("g", "B", "ALLREDUCE"), ("g", "B", "QUEUE"),
        ("g", "E", None), ("g", "B", "MEMCPY_IN_FUSION_BUFFER"),
        ("g", "E", None), ("g", "B", "SHARED_WINDOW_ALLREDUCE"),
        ("g", "E", None), ("g", "E", None)]


def test_failed_negotiation_is_an_error_instant(tmp_path):
    path = tmp_path / "t.json"
    timeline.start(str(path))
    timeline.ACTIVE.negotiate_start("bad", "broadcast")
    timeline.ACTIVE.negotiate_end("bad", "broadcast", error="shapes differ")
    timeline.ACTIVE.activity(["bad"], "MPI_BROADCAST")   # not processed: ignored
    timeline.stop()
    events = json.loads(path.read_text())
    assert [e["args"]["message"] for e in events if e.get("name") == "ERROR"] == ["shapes differ"]
    assert [x[1:] for x in read(path)] == [("B", "NEGOTIATE_BROADCAST"), ("E", None),
                                            ("i", "ERROR")]


def test_stop_closes_open_spans_and_the_array(tmp_path):
    path = tmp_path / "t.json"
    timeline.start(str(path), mark_cycles=True)
    tl = timeline.ACTIVE
    tl.cycle()
    tl.negotiate_start("a", "allgather")
    tl.negotiate_start("b", "allreduce")
    tl.negotiate_end("b", "allreduce")
    timeline.stop()
    got = json.loads(path.read_text())   # valid JSON
    phases = {}
    for e in got:
        if e.get("ph") in ("B", "E"):
            phases[e["pid"]] = phases.get(e["pid"], 0) + (1 if e["ph"] == "B" else -1)
    assert set(phases.values()) == {0}, got
    assert any(e.get("name") == "CYCLE_START" and e["s"] == "g" for e in got)
    assert timeline.ACTIVE is None


def test_cycles_unmarked_by_default_and_restart_replaces(tmp_path):
    first, second = tmp_path / "1.json", tmp_path / "2.json"
    timeline.start(str(first))
    timeline.ACTIVE.cycle()
    timeline.ACTIVE.negotiate_start("x", "allreduce")
    timeline.start(str(second))          # closes the first file
    timeline.ACTIVE.negotiate_start("y", "allreduce")
    timeline.stop()
    timeline.stop()                      # nothing running: nothing happens
    one = json.loads(first.read_text())
    assert not any(e.get("name") == "CYCLE_START" for e in one)
    assert {x[0] for x in read(first)} == {"x"} and {x[0] for x in read(second)} == {"y"}


def test_flushes_while_running(tmp_path, monkeypatch):
    monkeypatch.setattr(timeline, "FLUSH_SECONDS", 0.01)
    path = tmp_path / "t.json"
    timeline.start(str(path))
    timeline.ACTIVE.negotiate_start("live", "allreduce")
    import time
    deadline = time.monotonic() + 10
    while "live" not in path.read_text() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "NEGOTIATE_ALLREDUCE" in path.read_text(), "nothing written before stop()"


@pytest.mark.parametrize("bad", ["", None, 3])
def test_bad_paths(tmp_path, bad):
    with pytest.raises(ValueError, match="file path"):
        timeline.start(bad)
    with pytest.raises(ValueError, match="cannot write the timeline file"):
        timeline.start(str(tmp_path / "missing" / "t.json"))
    assert timeline.ACTIVE is None


def test_horovod_names_are_public():
    import hvdlite.torch as hvd_torch   # TF and Keras re-export the same public list
    assert {"start_timeline", "stop_timeline"} <= set(public_names)
    assert callable(hvdlite.start_timeline) and callable(hvdlite.stop_timeline)
    assert hvd_torch.start_timeline is hvdlite.start_timeline
    assert hvd_torch.stop_timeline is hvdlite.stop_timeline
    with pytest.raises(ValueError, match="init"):
        hvdlite.start_timeline("/tmp/never.json")


def test_negotiation_starts_at_submission(tmp_path):
    import time
    path = tmp_path / "t.json"
    timeline.start(str(path))
    submitted = time.monotonic()
    time.sleep(0.05)   # the background thread was busy; it takes the entry only now
    timeline.ACTIVE.negotiate_start("late", "allreduce", submitted)
    timeline.ACTIVE.negotiate_end("late", "allreduce")
    timeline.ACTIVE.negotiate_start("early", "allreduce", submitted - 3600)   # before the start
    timeline.stop()
    events = json.loads(path.read_text())
    rows = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    begins = {(rows[e["pid"]], e["name"]): e["ts"] for e in events if e.get("ph") == "B"}
    waited = begins[("late", "ALLREDUCE")] - begins[("late", "NEGOTIATE_ALLREDUCE")]
    assert waited >= 45_000, f"negotiation began when taken, not when submitted ({waited} us)"
    assert begins[("early", "NEGOTIATE_ALLREDUCE")] >= 0   # clamped to the timeline's start

"""Horovod Timeline (hvdlite/common/runtime/timeline.py) under real MPI launches.

argv[1]: "env"  -- HOROVOD_TIMELINE / HOROVOD_TIMELINE_MARK_CYCLES are set for every rank (the
                   test passes them); only rank 0 may write the file;
         "api"  -- hvd.start_timeline / hvd.stop_timeline: argument errors, stop, restart with
                   cycle marks, replacing a running timeline, per-rank paths (only rank 0's file
                   may exist).
Rank 0 parses the JSON it wrote after hvd.shutdown() (which closes the file) and checks rows,
spans, nesting, ticks per rank and activities.
"""
import json
import os
import sys
from collections import defaultdict

import numpy as np

import hvdlite as hvd
from tests.workers.nodes import intranode  # noqa: E402
from hvdlite.common.runtime import state
from hvdlite.common.runtime import timeline
from tests.workers.core_refs import attempt
from tests.workers.core_cases import direct_copies_expected
from tests.workers._report import Reporter

MODE = sys.argv[1]
OUT = os.environ["HVDLITE_TEST_OUT"]


def load(path: str) -> dict:
    """{tensor: [events in file order]} plus "" for global events; asserts B/E nesting."""
    with open(path) as f:
        events = json.load(f)   # a stopped timeline is a complete JSON array
    names = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e["name"] == "process_name"}
    rows = defaultdict(list)
    for e in events:
        if e.get("ph") != "M":
            rows[names[e["pid"]] if e["pid"] else ""].append(e)
    for tensor, evs in rows.items():
        depth, last = 0, -1.0
        for e in evs:
            assert e["ts"] >= last, f"{tensor}: timestamps go backwards: {evs}"
            last = e["ts"]
            depth += {"B": 1, "E": -1}.get(e["ph"], 0)
            assert depth >= 0, f"{tensor}: an E without its B: {evs}"
        assert depth == 0, f"{tensor}: {depth} spans left open: {evs}"
    return rows


def spans(evs: list) -> list[tuple[int, str]]:
    """(nesting depth, name) of every span, in order."""
    out, depth = [], 0
    for e in evs:
        if e["ph"] == "B":
            out.append((depth, e["name"]))
            depth += 1
        elif e["ph"] == "E":
            depth -= 1
    return out


def ticks(evs: list) -> list[int]:
    return sorted(int(e["name"]) for e in evs if e["ph"] == "X")


def run_env_mode() -> None:
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    r = Reporter(rank)
    small = [np.full(10000, rank + i, np.float32) for i in range(2)]   # 80 KB: fused
    big = np.full(1 << 19, rank, np.float32)                           # 2 MiB: single
    seen_backend = []

    def work():
        for step in range(4):   # step 0 negotiates in full, later steps hit the cache
            hs = [hvd.allreduce_async(x, name=f"tl.small.{i}", op=hvd.Sum)
                  for i, x in enumerate(small)]
            got = [h.wait() for h in hs]
            assert all(g[0] == sum(range(size)) + size * i for i, g in enumerate(got)), got
            got = hvd.grouped_allreduce(small, name="tl.group", op=hvd.Sum)
            assert all(g[0] == sum(range(size)) + size * i for i, g in enumerate(got)), got
        assert hvd.allreduce(big, name="tl.big", op=hvd.Sum)[0] == sum(range(size))
        seen_backend.append(intranode(state.engine()))   # (checked after shutdown)
        assert hvd.allgather(np.arange(rank + 1), name="tl.gather").size == \
            size * (size + 1) // 2
        assert hvd.broadcast(np.full(3, rank), root_rank=0, name="tl.bcast")[0] == 0
        bad = attempt(lambda: hvd.allreduce(np.ones(rank + 1), name="tl.bad"))
        assert isinstance(bad, hvd.TensorMismatchError), bad
        # only rank 0 records; the others never open the (shared) path
        assert (timeline.ACTIVE is not None) == (rank == 0), timeline.ACTIVE
    r.case("timeline.env.operations", work)
    hvd.shutdown()
    path = os.environ["HOROVOD_TIMELINE"]

    def check():
        assert timeline.ACTIVE is None, "shutdown left the timeline running"
        if rank != 0:
            return
        rows = load(path)
        for name in ("tl.small.0", "tl.small.1", "tl.big", "tl.gather", "tl.bcast", "tl.bad"):
            assert name in rows, f"no row for {name}; rows: {sorted(rows)}"
        s0 = spans(rows["tl.small.0"])
        fused = [(0, "NEGOTIATE_ALLREDUCE"), (0, "ALLREDUCE"), (1, "QUEUE"),
                 (1, "MEMCPY_IN_FUSION_BUFFER"), (1, "SHARED_WINDOW_ALLREDUCE"),
                 (1, "MEMCPY_OUT_FUSION_BUFFER")]
        if size == 2:   # two ranks reduce straight into the outputs: no separate copy-out
            assert s0[:5] == fused[:5] and fused[5] not in s0, s0
        else:
            assert s0[:6] == fused, s0
        assert [n for d, n in s0].count("ALLREDUCE") == 4, s0
        assert [n for d, n in s0].count("NEGOTIATE_ALLREDUCE") == 4, s0
        # a grouped allreduce negotiates as one request under the group's name, every step
        # (its row closes when its members' rows take over)...
        group_row = spans(rows["tl.group.group2"])
        assert [n for d, n in group_row].count("NEGOTIATE_ALLREDUCE") == 4, group_row
        assert ticks(rows["tl.group.group2"]) == list(range(size)), rows["tl.group.group2"]
        # ...and each member is processed on its own row, fused like single tensors
        for member in ("tl.group.0", "tl.group.1"):
            m = [n for d, n in spans(rows[member])]
            assert m.count("ALLREDUCE") == 4 and "SHARED_WINDOW_ALLREDUCE" in m, (member, m)
        # the first (full) negotiation shows every rank's request as a tick
        assert ticks(rows["tl.small.0"]) == list(range(size)), rows["tl.small.0"]
        # one large tensor: direct copies between the ranks' memory where the kernel allows
        big_path = ("DIRECT_COPIES_ALLREDUCE" if direct_copies_expected(seen_backend[0])
                    else "SHARED_WINDOW_ALLREDUCE")
        assert (1, big_path) in spans(rows["tl.big"]), spans(rows["tl.big"])
        assert spans(rows["tl.gather"]) == [(0, "NEGOTIATE_ALLGATHER"), (0, "ALLGATHER"),
                                            (1, "QUEUE"), (1, "MPI_ALLGATHER")]
        assert spans(rows["tl.bcast"])[1:] == [(0, "BROADCAST"), (1, "QUEUE"),
                                               (1, "MPI_BROADCAST")]
        errors = [e for e in rows["tl.bad"] if e["ph"] == "i"]
        assert len(errors) == 1 and "tl.bad" in errors[0]["args"]["message"], rows["tl.bad"]
        assert spans(rows["tl.bad"]) == [(0, "NEGOTIATE_ALLREDUCE")], rows["tl.bad"]
        cycles = [e for e in rows[""] if e.get("name") == "CYCLE_START"]
        assert len(cycles) >= 4, f"HOROVOD_TIMELINE_MARK_CYCLES=1 marked {len(cycles)} cycles"
    r.case("timeline.env.file", check)
    r.write()


def run_api_mode() -> None:
    def before_init():
        err = attempt(lambda: hvd.start_timeline(os.path.join(OUT, "early.json")))
        assert isinstance(err, ValueError) and "init" in str(err), err
        assert not os.path.exists(os.path.join(OUT, "early.json"))
    before = attempt(before_init)
    hvd.init()
    rank = hvd.rank()
    r = Reporter(rank)
    files = [os.path.join(OUT, f"{stem}.{rank}.json") for stem in ("one", "two", "three")]

    def work():
        if isinstance(before, BaseException):
            raise before
        for bad in ("", None):
            err = attempt(lambda: hvd.start_timeline(bad))
            assert isinstance(err, ValueError), f"start_timeline({bad!r}) gave {err!r}"
        if rank == 0:
            err = attempt(lambda: hvd.start_timeline(os.path.join(OUT, "no", "such", "x.json")))
            assert isinstance(err, ValueError) and "no/such" in str(err), err
        hvd.start_timeline(files[0])
        hvd.allreduce(np.ones(4), name="tl.api.1")
        hvd.stop_timeline()
        hvd.stop_timeline()   # twice: nothing happens
        hvd.allreduce(np.ones(4), name="tl.api.2")
        hvd.start_timeline(files[1], mark_cycles=True)
        hvd.allreduce(np.ones(4), name="tl.api.3")
        hvd.start_timeline(files[2])   # replaces the running one
        hvd.allreduce(np.ones(4), name="tl.api.4")
        hvd.barrier()
        for path in files:
            assert os.path.exists(path) == (rank == 0), f"{path} exists on rank {rank}"
    r.case("timeline.api.calls", work)
    hvd.shutdown()   # closes the third file

    def check():
        if rank != 0:
            return
        one, two, three = (load(path) for path in files)
        assert "tl.api.1" in one and "tl.api.2" not in one, sorted(one)
        assert not [e for e in one[""] if e.get("name") == "CYCLE_START"]
        assert "tl.api.3" in two and "tl.api.4" not in two, sorted(two)
        assert [e for e in two[""] if e.get("name") == "CYCLE_START"], "no cycle marks"
        assert "tl.api.4" in three and "tl.api.3" not in three, sorted(three)
        assert spans(three["tl.api.4"])[:2] == [(0, "NEGOTIATE_ALLREDUCE"), (0, "ALLREDUCE")]
    r.case("timeline.api.files", check)
    r.write()


if MODE == "env":
    run_env_mode()
else:
    run_api_mode()

#!/usr/bin/env python3
"""The ranks' side of ``cross_host_benchmark.py``: flat against hierarchical allreduce, and
small messages, against raw MPI, in one job whose ranks span hosts.

Run it under MPI with the ranks on several hosts (``cross_host_benchmark.py`` does that on
simulated hosts)::

    mpiexec -n 4 -hosts a:2,b:2 python benchmarks/cross_host_ranks.py --json out.json

Cases, each timed in interleaved blocks with :mod:`allreduce_benchmark`'s machinery (warm-up,
barriers around every block, each rank's median per iteration, maximised over the ranks):

* ``large``: for each ``--sizes`` buffer, raw ``comm.Allreduce`` (out of place), hvdlite's
  in-place ``hvd.allreduce_`` with the hierarchical path off (``flat``: one MPI allreduce over
  every rank) and on (``hierarchical``);
* ``lone``: one ``--lone-kib`` allreduce (out of place, ``hvd.allreduce``): raw, flat,
  hierarchical, and flat without early reductions (``engine/early.py``); and two floors of any
  negotiated design, timed alongside: the negotiation's bitwise AND (of hvdlite's size) and the
  data allreduce started together and polled in the caller's thread, and the same run by a bare
  background thread that takes the request from a queue and sets a flag the caller polls (the
  two thread hand-offs, with none of hvdlite's bookkeeping);
* ``round``: ``--small-count`` tensors of ``--small-kib`` submitted with
  ``hvd.allreduce_async_`` and all waited for, against one raw ``Allreduce`` of their total
  bytes: raw, flat, hierarchical;
* ``gather``: for each ``--gather-sizes`` (bytes per rank), ``hvd.allgather`` against raw
  ``comm.Allgather``: raw, flat, hierarchical allgather.

The hierarchical path is switched on and off on every rank between blocks (after a barrier, with
nothing in flight), so both run in the same job, on the same buffers.  Every variant is checked
against numpy once.

With ``--link RATE`` (``cross_host_benchmark.py --link`` caps ``lo`` at that rate and passes it
on) every result also carries its *link floor*: the fewest bytes that must cross between hosts
for that collective (``tests/multihost/link.py``: 2(H-1) x S for an allreduce of S bytes over H
hosts, the rows of the other hosts' ranks for an allgather) over the link's rate, all hosts
sharing that one link in both directions.  The tables print it beside each result, with each
variant's time over it.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import queue
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))   # for tests.multihost.link
import allreduce_benchmark as ab  # noqa: E402  (sets OMP_NUM_THREADS, imports this hvdlite)
from allreduce_benchmark import MPI, Case, KIB, hvd, np  # noqa: E402

from hvdlite.common.data_paths.hier_plan import SMALL_BYTES  # noqa: E402
from hvdlite.common.runtime import state  # noqa: E402
from tests.multihost import link  # noqa: E402  (stdlib only: rates and floors)

VARIANTS = ("raw", "flat", "hierarchical")
# The lone case's further variants: (key, row label, what it is).
LONE_EXTRAS = (("flat_no_early", "(no early)", "flat without early reductions"),
               ("floor_and_data", "(floor caller)",
                "reference: the AND and the data allreduce together, caller's thread"),
               ("floor_handed_off", "(floor thread)",
                "reference: the same by a bare background thread (two hand-offs)"))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=ab.parse_sizes, default=ab.parse_sizes("16MiB,32MiB,64MiB"))
    p.add_argument("--lone-kib", type=int, default=4, help="0 skips the lone case")
    p.add_argument("--small-count", type=int, default=200)
    p.add_argument("--small-kib", type=int, default=16)
    p.add_argument("--gather-sizes", type=ab.parse_sizes, default=ab.parse_sizes("4KiB,4MiB"),
                   help="allgather: bytes per rank (empty: none)")
    p.add_argument("--iterations", type=int, default=ab.DEFAULT_MAX_ITERATIONS)
    p.add_argument("--min-iterations", type=int, default=ab.DEFAULT_MIN_ITERATIONS)
    p.add_argument("--time-budget", type=float, default=6.0, metavar="S")
    p.add_argument("--blocks", type=int, default=ab.DEFAULT_BLOCKS)
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--link", metavar="RATE", type=link.parse_rate,
                   help="the rate lo is capped at (tc's notation, 1gbit): print link floors")
    return p.parse_args(argv)


def host_slots(comm) -> list[int]:
    """Ranks per host, in rank order (hosts numbered by their first rank)."""
    hosts = comm.allgather(MPI.Get_processor_name())
    return [hosts.count(h) for h in dict.fromkeys(hosts)]


def with_floor(result: dict, link_bytes: float, args) -> dict:
    """``result`` with its link floor (bytes between hosts, and ms at ``--link``) added."""
    if args.link is not None:
        result["link_bytes"] = link_bytes
        result["floor_ms"] = link.floor_ms(link_bytes, args.link)
    return result


def hierarchical(on: bool) -> None:
    """Switch the global set's hierarchical allreduce and allgather on or off on this rank
    (every rank does it at the same point, after a barrier)."""
    path = state.engine().path("hierarchical")
    path.allreduce_on = path.allgather_on = on


def barrier_with(on: bool | None, comm, early: bool = True):
    """The barrier of a variant's blocks: raw MPI's, or hvdlite's after setting the path (and
    switching early reductions on or off, as every rank does at the same point)."""
    if on is None:
        return comm.Barrier

    def barrier() -> None:
        hierarchical(on)
        state.engine().early_on = early   # (in effect from the round after the barrier)
        hvd.barrier()
    return barrier


def timings(cases: dict[str, Case], comm) -> dict:
    return {name: dataclasses.asdict(ab.summarize(case.samples, comm))
            for name, case in cases.items()}


def check(step, verify, on: bool | None, comm) -> bool:
    """Run ``step`` once with the path as ``on`` says; ``verify()`` on every rank."""
    if on is not None:
        hierarchical(on)
    step()
    return ab.agree(verify(), comm)


def bench_large(nbytes: int, args, comm) -> dict:
    count = nbytes // 4
    send = ab.rank_data(count, comm.Get_rank())
    recv = np.empty_like(send)
    work = np.empty_like(send)
    want = ab.expected_sum(count, comm.Get_size())
    name = f"cross.large.{nbytes}"

    def hvd_step():
        hvd.allreduce_(work, op=hvd.Sum, name=name)

    def refill():
        np.copyto(work, send)
    ok = check(lambda: comm.Allreduce(send, recv, op=MPI.SUM),
               lambda: np.array_equal(recv, want), None, comm)
    for on in (False, True):
        refill()
        ok &= check(hvd_step, lambda: np.array_equal(work, want), on, comm)
    cases = {"raw": Case(lambda: comm.Allreduce(send, recv, op=MPI.SUM), comm.Barrier),
             "flat": Case(hvd_step, barrier_with(False, comm), prepare=refill),
             "hierarchical": Case(hvd_step, barrier_with(True, comm), prepare=refill)}
    ab.measure(list(cases.values()), ab.iterations_for(nbytes, args), args, comm)
    return {"bytes": nbytes, "correct": ok, **timings(cases, comm)}


def bench_lone(args, comm) -> dict:
    count = args.lone_kib * KIB // 4
    send = ab.rank_data(count, comm.Get_rank())
    recv = np.empty_like(send)
    want = ab.expected_sum(count, comm.Get_size())
    got = {}

    def hvd_step():
        got["out"] = hvd.allreduce(send, op=hvd.Sum, name="cross.lone")
    floors = _Floors(send, recv, comm)
    ok = check(lambda: comm.Allreduce(send, recv, op=MPI.SUM),
               lambda: np.array_equal(recv, want), None, comm)
    for step in (floors.and_with_data, floors.handed_off):
        recv.fill(0)
        ok &= check(step, lambda: np.array_equal(recv, want) and floors.all_set(), None, comm)
    for on in (False, True):
        ok &= check(hvd_step, lambda: np.array_equal(got["out"], want), on, comm)
    cases = {"raw": Case(lambda: comm.Allreduce(send, recv, op=MPI.SUM), comm.Barrier),
             "flat": Case(hvd_step, barrier_with(False, comm)),
             "hierarchical": Case(hvd_step, barrier_with(True, comm)),
             "flat_no_early": Case(hvd_step, barrier_with(False, comm, early=False)),
             "floor_and_data": Case(floors.and_with_data, comm.Barrier),
             "floor_handed_off": Case(floors.handed_off, comm.Barrier)}
    try:
        ab.measure(list(cases.values()), ab.iterations_for(send.nbytes, args), args, comm)
    finally:
        floors.close()
    return {"bytes": send.nbytes, "correct": ok, "extras": LONE_EXTRAS,
            **timings(cases, comm)}


class _Floors:
    """The two floors of the lone case (see the module's docstring): what a negotiated lone
    allreduce costs at the wire, in the caller's thread and behind two thread hand-offs."""

    def __init__(self, send: np.ndarray, recv: np.ndarray, comm) -> None:
        self.send, self.recv, self.comm = send, recv, comm
        self.negotiation = comm.Dup()
        words = 2 * state.engine().controller.cache.num_words + 2   # the AND's size
        self.bits = np.full(words, -1, dtype=np.int64)
        self.agreed = np.zeros_like(self.bits)
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="floor", daemon=True)
        self._thread.start()

    def and_with_data(self) -> None:
        negotiation = self.negotiation.Iallreduce(self.bits, self.agreed, op=MPI.BAND)
        data = self.comm.Iallreduce(self.send, self.recv, op=MPI.SUM)
        while not (negotiation.Test() & data.Test()):   # (both tested every time)
            os.sched_yield()

    def handed_off(self) -> None:
        done = [False]
        self._requests.put(done)
        while not done[0]:
            os.sched_yield()

    def all_set(self) -> bool:
        return bool((self.agreed == -1).all())

    def _serve(self) -> None:
        while True:
            done = self._requests.get()
            if done is None:
                return
            self.and_with_data()
            done[0] = True

    def close(self) -> None:
        self._requests.put(None)
        self._thread.join()
        self.negotiation.Free()


def bench_round(args, comm) -> dict:
    count = args.small_kib * KIB // 4
    rank, size = comm.Get_rank(), comm.Get_size()
    sources = [ab.rank_data(count, rank, offset=i) for i in range(args.small_count)]
    tensors = [s.copy() for s in sources]
    total = np.concatenate(sources)
    total_out = np.empty_like(total)

    def hvd_step():
        ab.small_round(tensors)

    def refill():
        ab.refill(tensors, sources)

    def verify():
        return all(np.array_equal(t, ab.expected_sum(count, size, offset=i))
                   for i, t in enumerate(tensors))
    ok = check(lambda: comm.Allreduce(total, total_out, op=MPI.SUM),
               lambda: np.array_equal(total_out, np.concatenate(
                   [ab.expected_sum(count, size, offset=i) for i in range(len(sources))])),
               None, comm)
    for on in (False, True):
        refill()
        ok &= check(hvd_step, verify, on, comm)
    cases = {"raw": Case(lambda: comm.Allreduce(total, total_out, op=MPI.SUM), comm.Barrier),
             "flat": Case(hvd_step, barrier_with(False, comm), prepare=refill),
             "hierarchical": Case(hvd_step, barrier_with(True, comm), prepare=refill)}
    ab.measure(list(cases.values()), ab.iterations_for(total.nbytes, args), args, comm)
    return {"count": args.small_count, "tensor_bytes": count * 4, "bytes": total.nbytes,
            "correct": ok, **timings(cases, comm)}


def bench_gather(nbytes: int, args, comm) -> dict:
    count = nbytes // 4
    rank, size = comm.Get_rank(), comm.Get_size()
    send = ab.rank_data(count, rank)
    recv = np.empty(count * size, dtype=send.dtype)
    want = np.concatenate([ab.rank_data(count, r) for r in range(size)])
    got = {}
    name = f"cross.gather.{nbytes}"

    def hvd_step():
        got["out"] = hvd.allgather(send, name=name)
    ok = check(lambda: comm.Allgather(send, recv), lambda: np.array_equal(recv, want), None, comm)
    for on in (False, True):
        ok &= check(hvd_step, lambda: np.array_equal(got["out"], want), on, comm)
    cases = {"raw": Case(lambda: comm.Allgather(send, recv), comm.Barrier),
             "flat": Case(hvd_step, barrier_with(False, comm)),
             "hierarchical": Case(hvd_step, barrier_with(True, comm))}
    ab.measure(list(cases.values()), ab.iterations_for(recv.nbytes, args), args, comm)
    return {"bytes": nbytes, "correct": ok, **timings(cases, comm)}


def line(label: str, result: dict) -> str:
    raw, flat, hier = (result[v]["median_ms"] for v in VARIANTS)
    spread = " ".join(f"{v[:4]} {result[v]['p10_ms']:.3f}-{result[v]['p90_ms']:.3f}"
                      for v in VARIANTS)
    floor = result.get("floor_ms")
    beside = "" if floor is None else f" {floor:>9.3f} " + " ".join(
        f"{link.over_floor(t, floor):>10}" for t in (hier, flat, raw))
    return (f"{label:>16} {raw:>9.3f} {flat:>9.3f} {hier:>9.3f} {flat / hier:>9.2f}x "
            f"{hier / raw:>8.2f}x {flat / raw:>8.2f}x{beside}  "
            f"{'ok' if result['correct'] else 'WRONG'}   (p10-p90: {spread})")


FLOOR_HEADER = (f" {'floor ms':>9} {'hier/floor':>10} {'flat/floor':>10} {'raw/floor':>10}")


def main(argv=None) -> int:
    args = parse_args(argv)
    comm = MPI.COMM_WORLD.Dup()
    hvd.init()
    env = ab.environment(comm)
    path = state.engine().path("hierarchical")
    slots = host_slots(comm)
    hosts = len(slots)
    shaping = ("link: unshaped (loopback at memory speed; no floor)" if args.link is None else
               f"link: lo capped at {link.format_rate(args.link)}, shared by every host in both "
               f"directions; floor = bytes that must cross between hosts / that rate")
    ab.say("hvdlite across hosts: flat against hierarchical allreduce, raw MPI alongside",
           *ab.environment_lines(env),
           f"local size {hvd.local_size()} x {hvd.cross_size()} hosts (rank 0's view); "
           f"ranks per host {'+'.join(map(str, slots))}", shaping, "",
           f"{'case':>16} {'raw ms':>9} {'flat ms':>9} {'hier ms':>9} {'flat/hier':>10} "
           f"{'hier/raw':>9} {'flat/raw':>9}" + ("" if args.link is None else FLOOR_HEADER))
    large = []
    for nbytes in args.sizes:
        large.append(with_floor(bench_large(nbytes, args, comm),
                                link.allreduce_floor_bytes(nbytes, hosts), args))
        ab.say(line(ab.format_size(nbytes), large[-1]))
    lone = None
    if args.lone_kib > 0:
        lone = bench_lone(args, comm)
        with_floor(lone, link.allreduce_floor_bytes(lone["bytes"], hosts), args)
        ab.say(line(f"lone {args.lone_kib} KiB", lone))
        for variant, label, meaning in LONE_EXTRAS:
            value = lone[variant]["median_ms"]
            beside = ("" if args.link is None else
                      f" (floor {lone['floor_ms']:.3f} ms: "
                      f"{link.over_floor(value, lone['floor_ms'])})")
            ab.say(f"{label:>16} {'':>9} {value:>9.3f} {'':>9} {'':>10} {'':>9} "
                   f"{value / lone['raw']['median_ms']:>8.2f}x   {meaning}{beside}")
    rounds = None
    if args.small_count > 0:
        rounds = bench_round(args, comm)
        with_floor(rounds, link.allreduce_floor_bytes(rounds["bytes"], hosts), args)
        ab.say(line(f"{args.small_count}x{args.small_kib} KiB", rounds))
    gathers = []
    for nbytes in args.gather_sizes:
        gathers.append(with_floor(bench_gather(nbytes, args, comm),
                                  link.allgather_floor_bytes(nbytes, slots), args))
        ab.say(line(f"gather {ab.format_size(nbytes)}", gathers[-1]))
    used = comm.allreduce(path.allreduces, op=MPI.MIN)
    gathered = comm.allreduce(path.allgathers, op=MPI.MIN)
    early = comm.allreduce(state.engine().early_reductions, op=MPI.MIN)
    ab.say("", f"hierarchical allreduce batches / allgathers on the slowest-counting rank: "
           f"{used} / {gathered}; early reductions: {early} (HVDLITE_EARLY_REDUCTIONS="
           f"{int(state.engine().config.early_reductions)}); times are each rank's median "
           f"per iteration, max over ranks; raw = one MPI Allreduce (Allgather) of the same "
           f"bytes")
    correct = all(r["correct"] for r in large + gathers + [lone, rounds] if r is not None)
    if args.json and comm.Get_rank() == 0:
        Path(args.json).write_text(json.dumps({
            "environment": env, "link_bytes_per_s": args.link, "slots": slots, "large": large,
            "lone": lone, "round": rounds, "gather": gathers, "hierarchical_batches": used,
            "hierarchical_allgathers": gathered},
            indent=2) + "\n")
    # the path must have run whatever it takes (batches and results of 64 KiB or more)
    reduced = [*args.sizes, max(args.lone_kib, 0) * KIB,
               max(args.small_count, 0) * args.small_kib * KIB]
    ran_as_expected = ((used > 0) == any(n >= SMALL_BYTES for n in reduced)
                       and (gathered > 0) == any(n * comm.Get_size() >= SMALL_BYTES
                                                 for n in args.gather_sizes))
    hvd.barrier()
    hvd.shutdown()
    comm.Free()
    return 0 if correct and ran_as_expected else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:   # noqa: BLE001 - take every rank down rather than leave them waiting
        import traceback
        traceback.print_exc()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)

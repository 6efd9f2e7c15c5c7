"""The modeled network of link.py: rates and link floors (pure arithmetic), and a real token
bucket on ``lo`` that is on while held and gone after a normal exit, an exception, SIGTERM,
SIGINT, SIGKILL (the guard) and the time limit.

The real tests need root and tc; without them they are skipped with the reason, or fail with
HVDLITE_TEST_REQUIRE_HOSTS=1 (as the other multi-host tests).  Each holds the cap well under a
second, at 10gbit, since every loopback connection on the machine is capped meanwhile.
"""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time

import pytest

from tests.mpi_harness import REPO, run_job
from tests.multihost import link

RATE = "10gbit"
MIB = 1 << 20
# A process that takes the cap, says so, and sleeps (killed by the tests).
HOLDER = ("import sys, time; sys.path.insert(0, sys.argv[1]); "
          "from tests.multihost import link; "
          "cap = link.LinkCap(sys.argv[2], limit_s=float(sys.argv[3])); cap.start(); "
          "print('capped', flush=True); time.sleep(60)")


# --- rates and floors --------------------------------------------------------------------------
@pytest.mark.parametrize("text, bytes_per_s", [
    ("1gbit", 125e6), ("10gbit", 1.25e9), ("500mbit", 62.5e6), ("1Gbit", 125e6),
    ("100kbit", 12.5e3), ("8000", 1e3), ("2.5gbit", 312.5e6), ("100mbps", 100e6),
    ("1gibit", 2**30 / 8), ("1mibps", 2**20)])
def test_parse_rate(text, bytes_per_s):
    assert link.parse_rate(text) == pytest.approx(bytes_per_s)


@pytest.mark.parametrize("text", ["", "gbit", "1 gigabit", "-1gbit", "0mbit", "1xbit", "1gb"])
def test_parse_rate_refuses(text):
    with pytest.raises(ValueError):
        link.parse_rate(text)


def test_format_rate():
    assert link.format_rate(125e6) == "1 Gbit/s"
    assert link.format_rate(1.25e9) == "10 Gbit/s"
    assert link.format_rate(62.5e6) == "500 Mbit/s"


def test_allreduce_bytes_across_two_hosts_of_two():
    s = 16 * MIB
    # a flat ring 0-1-2-3-0: edges 1-2 and 3-0 cross, each carrying 2(P-1)/P = 1.5 S
    assert link.ring_allreduce_link_bytes(s, [2, 2]) == 3 * s
    # one allreduce of each half between the two hosts' ranks of equal local rank: 2 x S/2 each
    assert link.hierarchical_allreduce_link_bytes(s, [2, 2]) == 2 * s
    assert link.allreduce_floor_bytes(s, 2) == 2 * s
    # 1 Gbit/s = 125e6 bytes/s: 2 x 16 MiB take 268.4 ms
    assert link.floor_ms(link.allreduce_floor_bytes(s, 2), link.parse_rate("1gbit")) == \
        pytest.approx(2 * s / 125e6 * 1e3)
    assert link.floor_ms(2 * s, link.parse_rate("1gbit")) == pytest.approx(268.435456)


@pytest.mark.parametrize("slots", [[2, 2], [3, 1], [1, 2, 1], [4, 4, 4], [1, 1], [2, 3]])
def test_the_floor_is_the_least_over_the_algorithms(slots):
    s = 64 * MIB
    floor = link.allreduce_floor_bytes(s, len(slots))
    assert floor == 2 * (len(slots) - 1) * s
    assert link.hierarchical_allreduce_link_bytes(s, slots) == floor
    assert link.ring_allreduce_link_bytes(s, slots) >= floor
    if min(slots) > 1:   # several ranks on every host: the flat ring moves more than the floor
        assert link.ring_allreduce_link_bytes(s, slots) > floor


def test_nothing_crosses_within_one_host():
    assert link.allreduce_floor_bytes(MIB, 1) == 0
    assert link.ring_allreduce_link_bytes(MIB, [4]) == 0
    assert link.hierarchical_allreduce_link_bytes(MIB, [4]) == 0
    assert link.allgather_floor_bytes(MIB, [4]) == 0


def test_allgather_floor():
    # each host receives the rows of the other host's ranks
    assert link.allgather_floor_bytes(MIB, [2, 2]) == 4 * MIB
    assert link.allgather_floor_bytes(MIB, [3, 1]) == (1 + 3) * MIB
    assert link.allgather_floor_bytes(MIB, [1, 2, 1]) == (3 + 2 + 3) * MIB


def test_bad_layouts():
    with pytest.raises(ValueError):
        link.ring_allreduce_link_bytes(MIB, [])
    with pytest.raises(ValueError):
        link.allgather_floor_bytes(MIB, [2, 0])
    with pytest.raises(ValueError):
        link.allreduce_floor_bytes(MIB, 0)


# --- the real cap ------------------------------------------------------------------------------
def unavailable(message: str) -> None:
    """Skip, or fail with HVDLITE_TEST_REQUIRE_HOSTS=1 (as conftest.py does for the hosts)."""
    if os.environ.get("HVDLITE_TEST_REQUIRE_HOSTS") == "1":
        pytest.fail(message + " (HVDLITE_TEST_REQUIRE_HOSTS=1)", pytrace=False)
    pytest.skip(message)


@pytest.fixture
def lo():
    """Skip (or fail, with HVDLITE_TEST_REQUIRE_HOSTS=1) where lo cannot be shaped; afterwards
    check that no cap of ours is left (and remove one if it is, so one failure stays one)."""
    reason = link.unavailable_reason()
    if reason is None and link.root_qdisc()[1] != "0:":
        reason = f"lo already has a root qdisc ({link.root_qdisc()[2]}); not touching it"
    if reason:
        unavailable(f"link tests need tc on lo as root: {reason}")
    yield
    left = link.shaped()
    link.remove_ours()
    assert not left, "a cap was left on lo"


def tc_show() -> str:
    return subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True,
                          text=True, timeout=30).stdout


def wait_unshaped(seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while link.shaped():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


class Holder:
    """A process of its own group that holds the cap (HOLDER); killed with its group at the
    end, whatever happened."""

    def __init__(self, limit_s: float = 60) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(REPO), RATE, str(limit_s)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)

    def __enter__(self) -> "Holder":
        ready, _, _ = select.select([self.proc.stdout], [], [], 30)
        line = self.proc.stdout.readline() if ready else ""
        if line.strip() != "capped":
            self.__exit__()
            pytest.fail(f"the holder did not take the cap: {line!r} {self.proc.stderr.read()}")
        return self

    def wait(self, timeout: float = 20) -> int:
        return self.proc.wait(timeout)

    def __exit__(self, *exc) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.proc.stdout.close()
        self.proc.stderr.close()


def test_cap_is_on_inside_and_off_after(lo):
    with link.LinkCap(RATE) as cap:
        shown = tc_show()
        assert "tbf 51: root" in shown and "rate 10Gbit" in shown, shown
        assert cap.bytes_per_s == 1.25e9
    assert "tbf" not in tc_show()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL   # handlers restored


def test_cap_is_removed_on_an_exception(lo):
    with pytest.raises(ZeroDivisionError):
        with link.LinkCap(RATE):
            assert link.shaped()
            1 / 0
    assert "tbf" not in tc_show()


def test_sigint_removes_the_cap_and_raises_keyboardinterrupt(lo):
    with pytest.raises(KeyboardInterrupt):
        with link.LinkCap(RATE):
            assert link.shaped()
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)   # (the handler interrupts this)
    assert "tbf" not in tc_show()


def test_sigterm_to_the_holder_removes_the_cap(lo):
    with Holder() as holder:
        assert "tbf 51: root" in tc_show()
        holder.proc.send_signal(signal.SIGTERM)
        assert holder.wait() == 128 + signal.SIGTERM   # SystemExit: its finally blocks ran
        assert "tbf" not in tc_show()


def test_sigkill_to_the_holder_leaves_the_guard_to_remove_it(lo):
    with Holder() as holder:
        assert link.shaped()
        os.killpg(holder.proc.pid, signal.SIGKILL)   # the guard is in a session of its own
        holder.wait()
        assert wait_unshaped(10), tc_show()


def test_the_guard_lifts_a_cap_held_too_long(lo):
    with Holder(limit_s=0.5) as holder:
        assert wait_unshaped(10), tc_show()
        assert holder.proc.poll() is None   # the holder still runs; only the cap went


def test_refuses_a_root_qdisc_not_its_own(lo):
    subprocess.run(["tc", "qdisc", "replace", "dev", "lo", "root", "handle", "52:", "tbf",
                    "rate", RATE, "burst", link.BURST, "latency", link.LATENCY],
                   check=True, timeout=30)
    try:
        with pytest.raises(link.LinkUnavailable, match="already has a root qdisc"):
            with link.LinkCap(RATE):
                pass
        assert "tbf 52: root" in tc_show()   # left as it was
        assert not link.remove_ours()        # not ours: never removed
        assert "tbf 52: root" in tc_show()
    finally:
        subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], timeout=30)
    assert "tbf" not in tc_show()


def test_unavailable_without_root_or_tc(monkeypatch):
    monkeypatch.setattr(link.shutil, "which", lambda name: None)
    assert "tc (iproute2)" in (link.unavailable_reason() or "")
    with pytest.raises(link.LinkUnavailable, match="tc"):
        link.LinkCap(RATE).start()
    monkeypatch.undo()
    monkeypatch.setattr(link.shutil, "which", lambda name: "/usr/sbin/tc")
    monkeypatch.setattr(link.os, "geteuid", lambda: 1000)
    if sys.platform.startswith("linux"):
        assert "root" in (link.unavailable_reason() or "")
        with pytest.raises(link.LinkUnavailable, match="root"):
            link.LinkCap(RATE).start()


def test_over_floor():
    assert link.over_floor(105.0, 100.0) == "1.05x"
    assert link.over_floor(1.0, 0.0) == "-"   # nothing crosses: no ratio


# --- the benchmark's ranks print the floors (no cap needed: they only compute them) -----------
def test_cross_host_ranks_prints_a_floor_beside_every_result(tmp_path):
    """benchmarks/cross_host_ranks.py --link on 2 ranks of one host: nothing crosses, so every
    floor is 0 and no ratio is printed (small cases only: the hierarchical path needs several
    hosts).  The ranks only compute floors; they cap nothing."""
    out = tmp_path / "result.json"
    job = run_job(2, [sys.executable, str(REPO / "benchmarks" / "cross_host_ranks.py"),
                      "--sizes", "", "--small-count", "4", "--small-kib", "4",
                      "--gather-sizes", "4KiB", "--iterations", "5", "--min-iterations", "3",
                      "--time-budget", "0.2", "--blocks", "1", "--link", "1gbit",
                      "--json", str(out)], timeout=120)
    assert not job.timed_out and job.returncode == 0, job.output
    result = json.loads(out.read_text())
    assert result["link_bytes_per_s"] == 125e6 and result["slots"] == [2]
    for case in [*result["large"], result["lone"], result["round"], *result["gather"]]:
        assert case["floor_ms"] == 0 and case["link_bytes"] == 0, case
    assert "floor ms" in job.stdout and "hier/floor" in job.stdout, job.stdout
    assert "lo capped at 1 Gbit/s" in job.stdout, job.stdout


def test_cross_host_benchmark_under_a_cap(lo, tmp_path):
    """benchmarks/cross_host_benchmark.py --link 10gbit on the 2 + 2 bed, one 1 MiB case (the
    cap is on for the few seconds the job runs): every result has its floor, 2 x 1 MiB at
    10 Gbit/s, and no cap is left."""
    from tests.multihost.hosts import unavailable_reason
    if unavailable_reason():
        unavailable(f"multi-host tests need Linux namespaces: {unavailable_reason()}")
    out = tmp_path / "cross.json"
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "benchmarks" / "cross_host_benchmark.py"), "--runs", "1",
         "--sizes", "1MiB", "--small-count", "0", "--link", RATE, "--timeout", "90",
         "--json", str(out), "--", "--lone-kib", "0", "--gather-sizes", "",
         "--min-iterations", "3", "--iterations", "5", "--time-budget", "0.2", "--blocks", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"the benchmark timed out\n{output}")
    assert proc.returncode == 0, output
    assert not link.shaped(), tc_show()
    (case,) = json.loads(out.read_text())["runs"][0]["large"]
    assert case["link_bytes"] == 2 * MIB
    assert case["floor_ms"] == pytest.approx(2 * MIB / 1.25e9 * 1e3)
    assert "lo capped at 10 Gbit/s" in output and "hier/floor" in output, output


def test_link_reference_under_a_cap(lo):
    """benchmarks/link_reference.py: four TCP flows under a 10 Gbit/s cap (for a second or
    so), each size's times against its floor, and no cap left."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "link_reference.py"), "--link", RATE,
         "--sizes", "1MiB,2MiB", "--repeat", "2"],
        capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not link.shaped(), tc_show()
    assert "lo capped at 10 Gbit/s" in proc.stdout, proc.stdout
    floors = [line for line in proc.stdout.splitlines() if line.startswith("S = ")]
    assert [line.split(":")[0] for line in floors] == ["S = 1 MiB", "S = 2 MiB"], proc.stdout
    assert "floor 1.7 ms" in floors[0] and "floor 3.4 ms" in floors[1], proc.stdout

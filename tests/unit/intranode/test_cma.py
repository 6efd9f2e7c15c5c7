"""The cross-memory attach binding (hvdlite/common/intranode/cma.py) between two real processes:
this
test and a child it starts (the multi-rank behaviour is tested under mpiexec in
tests/core/test_cma.py and by steady.large_single)."""
import errno
import os
import subprocess
import sys

import numpy as np
import pytest

from hvdlite.common.intranode import cma

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="cross-memory attach is Linux's")

# The child holds 1 MiB of known bytes and a zeroed 1 MiB, prints their addresses, then prints
# what the zeroed one holds once told to (after the parent wrote into it).
CHILD = r"""
import sys, numpy as np
data = (np.arange(1 << 18, dtype=np.uint32) * 7 + 3)
inbox = np.zeros(1 << 18, dtype=np.uint32)
print(data.ctypes.data, inbox.ctypes.data, flush=True)
sys.stdin.readline()
print(int(inbox.astype(np.uint64).sum()), int(inbox[0]), int(inbox[-1]), flush=True)
"""


@pytest.fixture
def child():
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        data_at, inbox_at = map(int, proc.stdout.readline().split())
        yield proc, data_at, inbox_at
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_read_and_write_another_process(child):
    proc, data_at, inbox_at = child
    copier = cma.load()
    assert copier is not None
    got = np.empty(1 << 18, dtype=np.uint32)
    try:
        copier.read(proc.pid, data_at, got)
    except OSError as exc:
        if exc.errno == errno.EPERM and os.environ.get("HVDLITE_TEST_CMA_OPTIONAL") == "1":
            pytest.skip(f"this machine forbids cross-memory attach between processes: {exc}")
        raise   # (see tests/workers/core_cases.py: direct_copies_expected)
    np.testing.assert_array_equal(got, np.arange(1 << 18, dtype=np.uint32) * 7 + 3)
    mine = np.arange(1 << 18, dtype=np.uint32) + 1
    copier.write(proc.pid, inbox_at, mine)
    proc.stdin.write("\n")
    proc.stdin.flush()
    total, first, last = map(int, proc.stdout.readline().split())
    assert (total, first, last) == (int(mine.astype(np.uint64).sum()), 1, 1 << 18)


def test_partial_ranges_and_empty_copies(child):
    proc, data_at, _ = child
    copier = cma.load()
    got = np.zeros(5, dtype=np.uint32)
    copier.read(proc.pid, data_at + 4 * 1000, got)
    np.testing.assert_array_equal(got, (np.arange(1000, 1005) * 7 + 3).astype(np.uint32))
    copier.read(proc.pid, 0, np.empty(0, dtype=np.uint32))   # nothing to copy: no call at all


def test_errors_name_the_process_and_the_reason(child):
    proc, data_at, _ = child
    copier = cma.load()
    with pytest.raises(OSError) as info:
        copier.read(proc.pid, 8, np.empty(4, dtype=np.uint8))   # an unmapped address
    assert info.value.errno == errno.EFAULT
    assert f"in process {proc.pid}" in str(info.value) and "0x8" in str(info.value)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=30)
    with pytest.raises(OSError) as info:
        copier.write(gone.pid, data_at, np.ones(4, dtype=np.uint8))
    assert info.value.errno == errno.ESRCH
    assert "No such process" in str(info.value) and "process_vm_writev" in str(info.value)


def test_own_process():
    copier = cma.load()
    src = np.arange(100, dtype=np.float64)
    dst = np.zeros(100, dtype=np.float64)
    copier.read(os.getpid(), src.ctypes.data, dst)
    np.testing.assert_array_equal(dst, src)


@pytest.mark.parametrize("text,scope", [("0\n", 0), ("1", 1), ("3\n", 3), ("junk", None),
                                        (None, None)])
def test_yama_scope(tmp_path, text, scope):
    path = tmp_path / "ptrace_scope"
    if text is not None:
        path.write_text(text)
    assert cma.yama_scope(str(path)) == scope


def test_allow_tracer_declares_or_says_why():
    if cma.yama_scope() is None:   # no Yama in this kernel: the option does not exist
        with pytest.raises(OSError) as info:
            cma.allow_tracer(os.getppid())
        assert info.value.errno == errno.EINVAL
        assert f"prctl(PR_SET_PTRACER, {os.getppid()}) failed: Invalid argument" in str(info.value)
    else:
        cma.allow_tracer(os.getppid())
        cma.allow_tracer(0)   # withdrawn again: this test process stays as it was


# A sibling's view: under Yama's ptrace_scope 1 it may read a process that declared their
# common parent (as each rank declares its launcher), and not one that did not.
SIBLING = r"""
import sys, numpy as np
from hvdlite.common.intranode import cma
pid, address = map(int, sys.argv[1:3])
got = np.empty(4, dtype=np.uint32)
try:
    cma.load().read(pid, address, got)
except OSError as exc:
    print("refused", exc.errno)
else:
    print("read", *got.tolist())
"""


@pytest.mark.skipif(cma.yama_scope() != 1, reason="needs a kernel with Yama's ptrace_scope 1 "
                                                  "(elsewhere the declaration changes nothing)")
@pytest.mark.parametrize("declare", [True, False])
def test_declared_launcher_lets_siblings_in(declare):
    code = CHILD.replace("import sys, numpy as np",
                         "import os, sys, numpy as np\nfrom hvdlite.common import cma\n"
                         + ("cma.allow_tracer(os.getppid())" if declare else ""))
    target = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        data_at, _ = map(int, target.stdout.readline().split())
        out = subprocess.run([sys.executable, "-c", SIBLING, str(target.pid), str(data_at)],
                             capture_output=True, text=True, timeout=60, check=True).stdout
    finally:
        target.kill()
        target.wait(timeout=30)
    assert out.split() == (["read", "3", "10", "17", "24"] if declare
                           else ["refused", str(errno.EPERM)]), out


def test_ancestors_and_parents(tmp_path):
    chain = cma.ancestors()
    assert chain[0] == os.getppid() and 1 not in chain and len(set(chain)) == len(chain)
    # A process whose name holds a space and parentheses ("pid (name) state ppid ..." in /proc).
    odd = tmp_path / "x) (y z"
    odd.symlink_to(sys.executable)
    proc = subprocess.Popen([str(odd), "-c", "import sys; sys.stdin.readline()"],
                            stdin=subprocess.PIPE)
    try:
        assert cma._parent(proc.pid) == os.getpid()
        assert cma.ancestors(proc.pid) == [os.getpid()] + cma.ancestors()
    finally:
        proc.kill()
        proc.wait(timeout=30)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=30)
    assert cma._parent(gone.pid) is None and cma.ancestors(gone.pid) == []


@pytest.mark.parametrize("lineages,common", [
    ([[5, 4, 3], [7, 4, 3], [4, 3]], 4),   # rank 2 a child of 4, the others under wrappers
    ([[5, 4], [5, 4], None], 5),           # a rank without Yama's view is left out
    ([[5, 4], [6]], None),                 # only process 1 in common
    ([None, None], None),
    ([[9, 8]], 9),
])
def test_nearest_common_ancestor(lineages, common):
    assert cma.nearest_common_ancestor(lineages) == common


def test_one_declaration_for_every_process_set(monkeypatch):
    """The bookkeeping behind each rank's prctl(PR_SET_PTRACER) (pure logic: the calls are
    recorded; tests/core/test_cma.py runs it under mpiexec)."""
    from hvdlite.common.intranode import direct_copies as da
    calls = []
    monkeypatch.setattr(da.cma, "allow_tracer", calls.append)
    monkeypatch.setattr(da, "_launcher", None)
    monkeypatch.setattr(da, "_launcher_users", 0)
    allow, release = da._let_in_launcher, da._release_launcher
    assert allow([[7, 4, 3], [8, 4, 3]]) == (4, None) and calls == [4]
    assert allow([[7, 4, 3], [7, 4, 3]]) == (4, None) and calls == [4]   # inside: nothing new
    declared, why = allow([[9, 2], [9, 2]])   # outside: declaring 9 would shut out the first
    assert declared is None and "another process set let in process 4" in why and calls == [4]
    release()
    assert calls == [4]        # the first set still uses it
    release()
    assert calls == [4, 0]     # no set does: withdrawn
    assert allow([[9, 2], [9, 2]]) == (9, None) and calls == [4, 0, 9]
    assert allow([[5], [6]])[0] is None and calls == [4, 0, 9]   # never process 1

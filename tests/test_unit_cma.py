"""The cross-memory attach binding (hvdlite/common/cma.py) between two real processes: this
test and a child it starts (the multi-rank behaviour is tested under mpiexec in
tests/test_core_cma.py and by steady.large_single)."""
import errno
import os
import subprocess
import sys

import numpy as np
import pytest

from hvdlite.common import cma

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

"""The intra-node shared-memory fusion window's edge cases (see
hvdlite/common/intranode/shared_window.py):
too little free space in /dev/shm (a warning and a correct MPI fallback), and a window that is
freed at shutdown and made anew after a second init().

argv[1]: "no_space" (pretend /dev/shm is full), "space_runs_out" (full only after the first
window was made) or "reinit".
"""
import logging
import sys

import numpy as np

import hvdlite as hvd
from tests.workers.nodes import intranode  # noqa: E402
from hvdlite.common.runtime import state
from hvdlite.common.intranode import shared_window
from tests.workers.core_refs import allreduce_expected, check_array
from tests.workers._report import Reporter

MODE = sys.argv[1]
if MODE == "no_space":
    shared_window.shm_space = lambda: 0


class Captured(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


captured = Captured()
logging.getLogger("hvdlite").addHandler(captured)
hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
r = Reporter(RANK)


def big_group(tag, n=30000):
    """Three tensors of ``n`` float32 in one group: one fused batch (360 KB by default, large
    enough for the window)."""
    xs = [[np.arange(n, dtype=np.float32) * (k + 1) + i for k in range(SIZE)]
          for i in range(3)]
    got = hvd.grouped_allreduce([x[RANK] for x in xs], op=hvd.Sum, name=tag)
    for i, (x, g) in enumerate(zip(xs, got)):
        check_array(f"{tag}[{i}]", g, allreduce_expected(x, "float32", "Sum", SIZE))
    return intranode(state.engine()).shared


def no_space_falls_back():
    shared = big_group("nospace.1")
    big_group("nospace.2")
    assert shared._disabled and shared.batches == 0, "the window was used without space"
    warnings = [m for m in captured.messages if "too little free space" in m]
    assert len(warnings) == 1, f"expected one warning, got {captured.messages}"
    assert "HVDLITE_SHM_WINDOW_MB=0" in warnings[0], warnings[0]


def space_runs_out_frees_the_window():
    shared = big_group("runsout.1")   # fits: a 1 MiB-slot window is made
    assert shared.batches == 1 and shared._win is not None
    shared_window.shm_space = lambda: 0
    big_group("runsout.2", n=100000)   # 1.2 MB needs a larger window: refused
    big_group("runsout.3")             # would fit the old window, but the path is off for good
    assert shared._disabled and shared._win is None, "the refused window was kept"
    assert shared.batches == 1, "batches went through shared memory after it was turned off"
    warnings = [m for m in captured.messages if "too little free space" in m]
    assert len(warnings) == 1, f"expected one warning, got {captured.messages}"


def reinit_gets_a_new_window():
    first = big_group("reinit.1")
    assert first.batches == 1 and first._win is not None
    hvd.shutdown()
    assert first._win is None, "shutdown left the window allocated"
    hvd.init()
    second = big_group("reinit.2")
    assert second is not first and second.batches == 1


if MODE == "no_space":
    r.case("shm.no_space_falls_back", no_space_falls_back)
elif MODE == "space_runs_out":
    r.case("shm.space_runs_out_frees_the_window", space_runs_out_frees_the_window)
else:
    r.case("shm.reinit_gets_a_new_window", reinit_gets_a_new_window)
r.write()
hvd.shutdown()

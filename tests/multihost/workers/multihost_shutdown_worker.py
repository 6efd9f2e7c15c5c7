"""The end of a training script on two hosts: every rank has used its host's shared-memory
window (a process set per host, 2+2 ranks), and the last rank reaches ``hvd.shutdown()`` half a
second after the others, as ranks of real jobs do.  Reports after the shutdown, so a job whose
ranks abort at exit (in MPI_Finalize) is seen by its exit status."""
import time

import numpy as np

import hvdlite as hvd
from tests.workers.nodes import intranode  # noqa: E402
from hvdlite.common.runtime import registry
from tests.workers._report import Reporter

HOST_SETS = [hvd.ProcessSet([0, 1]), hvd.ProcessSet([2, 3])]
hvd.init(process_sets=HOST_SETS)
RANK, SIZE = hvd.rank(), hvd.size()
r = Reporter(RANK)
mine = HOST_SETS[RANK // 2]


def window_used():
    hvd.grouped_allreduce([np.ones(30000, np.float32)] * 3, op=hvd.Sum, name="late",
                          process_set=mine)
    shared = intranode(registry.process_set_engine(mine, "test")[0]).shared
    assert shared.batches == 1, f"the host's window reduced {shared.batches} batches, not 1"


r.case("window_used", window_used)
if RANK == SIZE - 1:
    time.sleep(0.5)
hvd.shutdown()
r.case("shut_down", lambda: None)
r.write()

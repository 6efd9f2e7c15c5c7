"""hvd.init() with an invalid HVDLITE_*/HOROVOD_* setting on some ranks.

usage: core_init_settings_worker.py VARIABLE VALUE WHERE
  WHERE: "all", or the one rank whose environment gets VARIABLE=VALUE.

Every rank must raise ValueError from init() (naming the variable and the ranks whose settings
are invalid) instead of some ranks waiting for ever in init's collectives; then, with the
variable removed, init() again must work and an allreduce give the right result.
"""
import os
import sys

import numpy as np
from mpi4py import MPI

import hvdlite as hvd
from tests.workers.core_refs import check_exact
from tests.workers._report import Reporter

VARIABLE, VALUE, WHERE = sys.argv[1], sys.argv[2], sys.argv[3]
RANK, SIZE = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
BAD = list(range(SIZE)) if WHERE == "all" else [int(WHERE) % SIZE]
r = Reporter(RANK)

if RANK in BAD:
    os.environ[VARIABLE] = VALUE


def init_refused():
    try:
        hvd.init()
    except ValueError as exc:
        message = str(exc)
    else:
        raise AssertionError("init() accepted the invalid setting")
    print(f"[init-settings rank {RANK}] caught ValueError: {message}", file=sys.stderr, flush=True)
    knob = VARIABLE.split("_", 1)[1]   # the name without HVDLITE_/HOROVOD_
    assert repr(VALUE) in message and knob in message, message
    assert f"Invalid settings on ranks {BAD}" in message, message
    assert not hvd.is_initialized()


def init_after_fixing():
    os.environ.pop(VARIABLE, None)
    hvd.init()
    assert hvd.size() == SIZE and hvd.rank() == RANK
    x = np.arange(7, dtype=np.int64) * (RANK + 1)
    check_exact("after", hvd.allreduce(x, op=hvd.Sum, name="after"),
                np.arange(7, dtype=np.int64) * sum(range(1, SIZE + 1)))


r.case("init_refused", init_refused)
r.case("init_after_fixing", init_after_fixing)
r.write()
hvd.shutdown()

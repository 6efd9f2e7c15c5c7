"""Topology queries and lifecycle on every rank."""
import numpy as np

import hvdlite as hvd
from tests.workers._report import Reporter

r = Reporter(int(__import__("os").environ.get("PMI_RANK", "0")))


def before_init():
    try:
        hvd.rank()
    except ValueError as exc:
        assert "hvd.init()" in str(exc)
    else:
        raise AssertionError("rank() before init() did not raise")
    # The collectives outside the engine name the call that came too early.
    for call, named in ((lambda: hvd.add_process_set([0]), "hvd.add_process_set()"),
                        (lambda: hvd.remove_process_set(hvd.ProcessSet([0])),
                         "hvd.remove_process_set()")):
        try:
            call()
        except hvd.NotInitializedError as exc:
            assert str(exc).endswith(f"call hvd.init() before {named}."), str(exc)
        else:
            raise AssertionError(f"{named} before init() did not raise")


r.case("before_init_raises", before_init)
hvd.init()
hvd.init()  # second call is a no-op
from mpi4py import MPI  # noqa: E402

world = MPI.COMM_WORLD


def topology():
    assert hvd.is_initialized()
    assert hvd.size() == world.Get_size()
    assert hvd.rank() == world.Get_rank()
    assert hvd.local_size() == world.Get_size()       # one host in tests
    assert hvd.local_rank() == world.Get_rank()
    assert hvd.cross_size() == 1 and hvd.cross_rank() == 0
    assert hvd.is_homogeneous()
    assert hvd.mpi_threads_supported() is True
    assert hvd.mpi_built() and hvd.mpi_enabled()
    assert not hvd.gloo_built() and not hvd.gloo_enabled()


def shutdown_then_op():
    hvd.shutdown()
    assert not hvd.is_initialized()
    try:
        hvd.allreduce(np.ones(3))
    except ValueError as exc:
        assert "not been initialized" in str(exc)
    else:
        raise AssertionError("op after shutdown did not raise")


def reinit():
    hvd.init()
    out = hvd.allreduce(np.full(4, hvd.rank(), dtype=np.int64), op=hvd.Sum, name="after.reinit")
    assert out.tolist() == [sum(range(hvd.size()))] * 4, out


r.case("topology", topology)
r.case("shutdown_then_op", shutdown_then_op)
r.case("reinit", reinit)
r.write()

"""Processes a rank starts itself: forked children (DataLoader workers' default) get hvdlite's
queries but a clear error for anything that needs MPI or the background thread; spawned and
forkserver children that call hvd.init() get a clear error instead of MPICH's PMI abort; the
rank itself keeps working; PyTorch DataLoader workers of either start method feed real training.

Everything runs under the ``__main__`` guard: 'spawn' children import this module again.
"""
import multiprocessing as mp
import os
import queue
import threading

import numpy as np

import hvdlite as hvd
from tests.workers._report import Reporter

CHILD_TIMEOUT = 60.0   # seconds; a child that hangs fails its case


def run_child(method: str, target, *args):
    """Run ``target(queue, *args)`` in a ``method`` child; return what it put on the queue."""
    ctx = mp.get_context(method)
    q = ctx.Queue()
    child = ctx.Process(target=target, args=(q, *args))
    child.start()
    try:
        return q.get(timeout=CHILD_TIMEOUT)
    except queue.Empty:
        raise AssertionError(f"the {method} child reported nothing within {CHILD_TIMEOUT} s "
                             f"(hung?)") from None
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()
            child.join()


def outcome(fn):
    """("ok", result) or (exception class name, message), picklable for the queue."""
    try:
        return "ok", fn()
    except Exception as exc:  # noqa: BLE001 - the parent checks it
        return type(exc).__name__, str(exc)


# --- bodies run in the children ------------------------------------------------------------
def child_queries(q):
    q.put(outcome(lambda: (hvd.is_initialized(), hvd.rank(), hvd.size(), hvd.local_rank(),
                           hvd.local_size(), hvd.init(), hvd.rank())))


def child_collectives(q):
    x = np.arange(4.0)
    calls = {
        "allreduce": lambda: hvd.allreduce(x, name="c.ar"),
        "allreduce_async": lambda: hvd.allreduce_async(x, name="c.ara"),
        "allreduce_": lambda: hvd.allreduce_(x.copy(), name="c.ar_"),
        "allreduce_average_float32": lambda: hvd.allreduce(x.astype(np.float32), op=hvd.Average,
                                                           name="c.avg"),
        "allgather": lambda: hvd.allgather(x, name="c.ag"),
        "broadcast": lambda: hvd.broadcast(x, 0, name="c.bc"),
        "grouped_allreduce": lambda: hvd.grouped_allreduce([x, x + 1], name="c.gar"),
        "barrier": hvd.barrier,
        "broadcast_object": lambda: hvd.broadcast_object({"a": 1}, 0),
        "process_set_op": lambda: hvd.allreduce(x, process_set=hvd.global_process_set,
                                                name="c.ps"),
        "add_process_set": lambda: hvd.add_process_set([0]),
    }
    q.put({label: outcome(fn) for label, fn in calls.items()})


def child_shutdown_then_init(q):
    first = outcome(hvd.shutdown)
    q.put((first, hvd.is_initialized(), outcome(hvd.init)))


def child_init_and_shutdown(q):
    q.put((outcome(hvd.init), outcome(lambda: hvd.rank()), outcome(hvd.shutdown)))


def spawned_init(q):
    q.put(outcome(hvd.init))


# --- checks in the rank --------------------------------------------------------------------
def check_forked_refusal(label, got):
    kind, message = got
    assert kind == "RankChildProcessError", f"{label} in a forked child: {got}"
    for fragment in (f"forked from rank {RANK}'s process (pid {os.getpid()})",
                     "hvd.rank()", "Run collective operations in the rank's own process"):
        assert fragment in message, f"{label}: message lacks {fragment!r}: {message}"


def fork_queries_work():
    got = run_child("fork", child_queries)
    assert got == ("ok", (True, RANK, SIZE, hvd.local_rank(), hvd.local_size(), None, RANK)), got


def fork_collectives_refused():
    got = run_child("fork", child_collectives)
    for label, result in got.items():
        check_forked_refusal(label, result)


def fork_shutdown_then_init_refused():
    first, initialized, again = run_child("fork", child_shutdown_then_init)
    assert first == ("ok", None), first
    assert not initialized
    check_forked_refusal("init() after shutdown()", again)


def fork_lock_held_at_fork():
    """Forking while another thread holds hvdlite's init/shutdown lock must not leave the
    child's init()/shutdown() blocked on a lock that nobody there will release."""
    from hvdlite.common.runtime import state
    held, release = threading.Event(), threading.Event()

    def hold():
        with state.lock:
            held.set()
            release.wait(CHILD_TIMEOUT + 10)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(10)
        got = run_child("fork", child_init_and_shutdown)
    finally:
        release.set()
        holder.join()
    assert got == (("ok", None), ("ok", RANK), ("ok", None)), got


def spawned_init_refused(method):
    kind, message = run_child(method, spawned_init)
    assert kind == "RankChildProcessError", (kind, message)
    for fragment in (f"rank {RANK}'s process (pid {os.getpid()})", "if __name__",
                     "Only the processes the MPI launcher started"):
        assert fragment in message, f"message lacks {fragment!r}: {message}"


def parent_keeps_working():
    xs = [np.arange(6, dtype=np.int64) * (k + 1) for k in range(SIZE)]
    got = hvd.allreduce(xs[RANK], op=hvd.Sum, name="parent.after_children")
    np.testing.assert_array_equal(got, sum(xs))
    got = hvd.allgather(np.full((RANK + 1, 2), RANK, dtype=np.int32), name="parent.gather")
    np.testing.assert_array_equal(got, np.concatenate(
        [np.full((k + 1, 2), k, dtype=np.int32) for k in range(SIZE)]))


# --- PyTorch DataLoader workers feeding DistributedOptimizer -----------------------------------
class Shard:
    """A map-style data set (module level, so 'spawn' workers can unpickle it)."""

    def __init__(self, rank: int, n: int = 48) -> None:
        self.rank = rank
        rng = np.random.default_rng(100 + rank)
        self.x = rng.standard_normal((n, 8)).astype(np.float32)
        self.y = (self.x.sum(axis=1) > 0).astype(np.int64)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def check_worker_queries(worker_id: int) -> None:
    """worker_init_fn for forked workers: hvdlite's queries work there (an error here fails
    the DataLoader, and with it the case)."""
    import torch.utils.data
    shard = torch.utils.data.get_worker_info().dataset
    assert (hvd.rank(), hvd.size()) == (shard.rank, SIZE), (hvd.rank(), hvd.size(), shard.rank)


def train_with_loader(method: str):
    import torch
    import hvdlite.torch as hvd_torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    hvd_torch.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd_torch.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    loader = torch.utils.data.DataLoader(
        Shard(RANK), batch_size=8, num_workers=2, multiprocessing_context=method,
        worker_init_fn=check_worker_queries if method == "fork" else None, persistent_workers=False)
    steps = 0
    for _ in range(2):
        for x, y in loader:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            steps += 1
    assert steps == 12, steps
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = hvd_torch.allgather(flat.unsqueeze(0), name=f"loader.{method}.params")
    for k in range(SIZE):
        assert torch.equal(every[k], flat), f"rank {k}'s parameters differ from rank {RANK}'s"


if __name__ == "__main__":
    hvd.init()
    RANK, SIZE = hvd.rank(), hvd.size()
    r = Reporter(RANK)
    r.case("fork.queries_work", fork_queries_work)
    r.case("fork.collectives_refused", fork_collectives_refused)
    r.case("fork.shutdown_then_init_refused", fork_shutdown_then_init_refused)
    r.case("fork.lock_held_at_fork", fork_lock_held_at_fork)
    r.case("spawn.init_refused", spawned_init_refused, "spawn")
    r.case("forkserver.init_refused", spawned_init_refused, "forkserver")
    r.case("parent_keeps_working", parent_keeps_working)
    r.case("torch.dataloader_fork_workers", train_with_loader, "fork")
    r.case("torch.dataloader_spawn_workers", train_with_loader, "spawn")
    r.write()
    hvd.shutdown()

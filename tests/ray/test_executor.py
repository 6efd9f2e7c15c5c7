"""Horovod's RayExecutor API on a local Ray cluster: 2 and 3 workers, ranks and sizes as
Horovod gives them, an allreduce checked against numpy, Horovod's execute/execute_single
semantics, and a shutdown that leaves no process of the job running."""
from __future__ import annotations

import re

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="hvdlite.ray needs Ray: pip install 'hvdlite[ray]'")

from hvdlite.ray import RayExecutor  # noqa: E402
from tests.ray.procs import children, start_ray, stop_ray, wait_gone  # noqa: E402

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module", autouse=True)
def cluster():
    start_ray(num_cpus=6)   # the 3-worker executor lives until the module ends
    yield
    stop_ray()


def _collectives(scale):
    import hvdlite as hvd
    hvd.init()
    x = np.arange(6, dtype=np.float64) * (hvd.rank() + 1) * scale
    return {"rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(),
            "local_size": hvd.local_size(), "cross_size": hvd.cross_size(),
            "sum": hvd.allreduce(x, op=hvd.Sum, name="sum").tolist(),
            "avg": hvd.allreduce(x, op=hvd.Average, name="avg").tolist(),
            "gathered": hvd.allgather(np.array([hvd.rank()] * (hvd.rank() + 1)),
                                      name="ag").tolist()}


class Counter:
    """An executable class: execute() passes each worker's instance to the function."""

    def __init__(self, start, step=1):
        self.value, self.step = start, step

    def bump(self):
        self.value += self.step
        return self.value


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"{n}workers")
def executor(request):
    settings = RayExecutor.create_settings(timeout_s=60)
    ex = RayExecutor(settings, num_workers=request.param, cpus_per_worker=1)
    ex.start(executable_cls=Counter, executable_args=[10], executable_kwargs={"step": 5})
    yield ex
    ex.shutdown()


def test_run_gives_horovod_ranks_and_exact_collectives(executor):
    n = executor.num_workers
    results = executor.run(_collectives, args=[2.0])
    assert [r["rank"] for r in results] == list(range(n))
    assert {r["size"] for r in results} == {n}
    # one node: local rank = rank, one cross rank
    assert [r["local_rank"] for r in results] == list(range(n))
    assert {(r["local_size"], r["cross_size"]) for r in results} == {(n, 1)}
    expected = sum(np.arange(6, dtype=np.float64) * (r + 1) * 2.0 for r in range(n))
    gathered = [r for r in range(n) for _ in range(r + 1)]
    for r in results:
        assert r["sum"] == expected.tolist()
        assert r["avg"] == (expected / n).tolist()
        assert r["gathered"] == gathered


def test_run_kwargs_and_run_remote(executor):
    def f(a, b=0):
        import hvdlite as hvd
        return (hvd.rank(), a + b)
    n = executor.num_workers
    assert executor.run(f, args=[1], kwargs={"b": 2}) == [(r, 3) for r in range(n)]
    refs = executor.run_remote(f, args=[4])
    assert ray.get(refs, timeout=60) == [(r, 4) for r in range(n)]


def test_execute_passes_the_executable(executor):
    n = executor.num_workers
    assert executor.execute(lambda c: c.bump()) == [15] * n
    assert executor.execute_single(lambda c: c.bump()) == 20   # rank 0's, not a list
    assert executor.execute(lambda c: c.value) == [20] + [15] * (n - 1)


def test_shutdown_leaves_no_process():
    ex = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=2)
    ex.start()
    assert ex.run(lambda: __import__("hvdlite").init() or 1) == [1, 1]
    from hvdlite.ray import member
    workers = ex.run(lambda: __import__("os").getpid())
    proxies = [p for p in ray.get([w.call.remote(lambda: member.hydra_member.proxy_pid())
                                   for w in ex.workers], timeout=30) if p]
    assert len(proxies) == 1   # one host, one proxy
    placeholders = children(proxies[0])
    assert len(placeholders) == 2
    launcher = ex._world.pid
    ex.shutdown()
    assert wait_gone([launcher, *proxies, *placeholders, *workers]) == []


def test_start_needs_a_worker_count():
    settings = RayExecutor.create_settings()
    with pytest.raises(ValueError, match="pass num_workers"):
        RayExecutor(settings)
    with pytest.raises(ValueError, match="Both `min_workers` and `num_workers`"):
        RayExecutor(settings, num_workers=2, min_workers=1)
    with pytest.raises(ValueError, match=r"RayExecutor\(num_workers=0\): expected a positive"):
        RayExecutor(settings, num_workers=0)
    with pytest.raises(RuntimeError, match="call start\\(\\) first"):
        RayExecutor(settings, num_workers=1).run(print)


def test_start_without_the_resources_fails_clearly_and_leaves_nothing():
    settings = RayExecutor.create_settings(timeout_s=10, placement_group_timeout_s=2)
    ex = RayExecutor(settings, num_workers=2, cpus_per_worker=100)
    with pytest.raises(TimeoutError, match=r"placement group for 2 workers .* was not ready "
                                           r"within 2 s\. Make sure the cluster has enough"):
        ex.start()
    assert ex.workers == [] and ex._placement_group is None   # start() cleaned up


def test_workers_of_a_running_world_cannot_join_another(executor):
    from hvdlite.ray import WorldError, formation
    from hvdlite.ray.actors import Group as _Group
    n = executor.num_workers
    message = (re.escape(f"ranks {list(range(n))} (pids ") + r".*\) already belong to an MPI "
               r"world; a worker process joins one world only")
    with pytest.raises(WorldError, match=message):
        formation.form_world(_Group(executor.workers), n, 30)
    assert [r["size"] for r in executor.run(_collectives, args=[1.0])] == [n] * n   # still works


class Broken:
    def __init__(self):
        raise RuntimeError("executable refuses to start")


def test_a_failing_start_raises_and_leaves_no_process():
    from tests.ray.procs import launcher_processes
    before = set(launcher_processes())   # the module's other executors' (still running)
    ex = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=2)
    with pytest.raises(ray.exceptions.RayTaskError, match="executable refuses to start"):
        ex.start(executable_cls=Broken)
    assert ex.workers == [] and ex._world is None
    assert set(launcher_processes()) - before == set()


def test_workers_are_ended_when_start_fails_before_the_world(monkeypatch):
    from hvdlite.ray import WorldError, executor as executor_module
    ex = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=2)
    created = []
    real_create = ex._create_workers
    monkeypatch.setattr(ex, "_create_workers", lambda: created.extend(real_create()) or created)

    def no_nodes(refs, timeout_s, what):
        raise WorldError(f"the Ray workers did not {what} within {timeout_s:g} s")
    monkeypatch.setattr(executor_module.formation, "get_bounded", no_nodes)
    with pytest.raises(WorldError, match="did not start"):
        ex.start()
    assert len(created) == 2 and ex.workers == []
    for worker in created:   # killed by start()'s cleanup
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(worker.node_id.remote(), timeout=30)

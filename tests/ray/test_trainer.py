"""HvdliteTrainer (the Ray Train backend) on a local Ray cluster: an unchanged hvdlite.torch
training function on 2 workers (parameters bitwise identical across ranks and equal to the
single-process computation of Horovod's averaged gradients), checkpoints through
ray.train.report, a worker killed mid-training and the run completing from the last checkpoint,
and nothing of the job left running afterwards."""
from __future__ import annotations

import json
import time

import pytest

ray = pytest.importorskip("ray", reason="hvdlite.ray needs Ray: pip install 'hvdlite[ray]'")
torch = pytest.importorskip("torch")

from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig  # noqa: E402

from hvdlite.ray import HvdliteConfig, HvdliteTrainer  # noqa: E402
from tests.ray import train_funcs  # noqa: E402
from tests.ray.procs import launcher_processes, start_ray, stop_ray, wait_gone  # noqa: E402

pytestmark = pytest.mark.timeout(240)
STEPS = 6


@pytest.fixture(scope="module", autouse=True)
def cluster():
    start_ray(num_cpus=4)
    yield
    stop_ray()


def _fit(tmp_path, name, **config):
    out = tmp_path / "out"
    out.mkdir()
    trainer = HvdliteTrainer(
        train_funcs.linear, train_loop_config={"out": str(out), "steps": STEPS, **config},
        hvdlite_config=HvdliteConfig(timeout_s=60),
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        run_config=RunConfig(name=name, storage_path=str(tmp_path / "storage"),
                             failure_config=FailureConfig(max_failures=1),
                             checkpoint_config=CheckpointConfig(num_to_keep=2)))
    began = time.time()
    result = trainer.fit()
    # nothing of the job is left: its workers (every attempt's), mpiexec, proxies, placeholders
    workers = [int(p.name) for p in (out / "pids").iterdir()]
    assert wait_gone(workers) == []
    deadline = time.monotonic() + 20
    while launcher_processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert launcher_processes() == []
    return result, out, began


def _steps(out):
    """Rank 0's record of each step it finished, every attempt's, in order."""
    return [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]


def _reference():
    """Horovod's arithmetic in one process: both ranks start from rank 0's parameters and
    step with the average of the two ranks' gradients."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(STEPS):
        grads = []
        for rank in range(2):
            model.zero_grad()
            x, y = train_funcs.batch(rank, step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, g0, g1 in zip(model.parameters(), *grads):
            p.grad = (g0 + g1) / 2
        opt.step()
    return model.state_dict()


def test_two_workers_train_identically(tmp_path):
    result, out, began = _fit(tmp_path, "identical")
    assert result.error is None
    assert result.metrics["step"] == STEPS - 1 and result.metrics["size"] == 2
    assert result.checkpoint is not None
    steps = _steps(out)
    assert [s["step"] for s in steps] == list(range(STEPS))
    print(f"\nstart-up: first step done {steps[0]['time'] - began:.1f} s after fit()")
    states = [torch.load(out / f"rank{r}.pt") for r in range(2)]
    reference = _reference()
    for key in states[0]:
        assert torch.equal(states[0][key], states[1][key]), key   # bitwise, across ranks
        torch.testing.assert_close(states[0][key], reference[key], rtol=1e-6, atol=1e-7)


def test_worker_killed_mid_training_resumes_from_last_checkpoint(tmp_path):
    result, out, began = _fit(tmp_path, "killed", kill_rank_at_step=[1, 3])
    assert result.error is None
    killed_at = float((out / "killed").read_text())
    steps = _steps(out)
    first = [s for s in steps if s["time"] < killed_at]
    second = [s for s in steps if s["time"] > killed_at]
    # rank 1 died at step 3: the restart resumes after the last checkpoint Ray had collected
    # (normally step 2's; Ray drops reports it had not collected yet when the failure is seen)
    assert [(s["start"], s["step"]) for s in first] == [(0, 0), (0, 1), (0, 2)]
    start = second[0]["start"]
    assert 1 <= start <= 3   # from a checkpoint, not from scratch
    assert [(s["start"], s["step"]) for s in second] == [(start, k) for k in range(start, STEPS)]
    assert result.metrics["step"] == STEPS - 1
    resumed = second[0]["time"]
    print(f"\nrecovery: first report after the restart {resumed - killed_at:.1f} s after the "
          f"kill")
    states = [torch.load(out / f"rank{r}.pt") for r in range(2)]
    reference = _reference()   # the replayed steps give the uninterrupted run's parameters
    for key in states[0]:
        assert torch.equal(states[0][key], states[1][key]), key
        torch.testing.assert_close(states[0][key], reference[key], rtol=1e-6, atol=1e-7)


def test_config_refuses_a_bad_timeout():
    with pytest.raises(ValueError, match=r"HvdliteConfig\(timeout_s=0\): the timeout must be"):
        HvdliteConfig(timeout_s=0)


def test_an_elastic_function_resumes_from_its_last_commit_without_checkpoints(tmp_path):
    """``@hvd.elastic.run`` under HvdliteTrainer: the survivors hand the newest commit to the
    trainer's controller before Ray restarts the run, and the restarted run's rank 0 resumes
    from it (no ray.train checkpoint is ever written)."""
    from tests.ray import elastic_funcs
    out = tmp_path / "out"
    out.mkdir()
    trainer = HvdliteTrainer(
        elastic_funcs.train,
        train_loop_config={"out": str(out), "steps": 12, "kill": [0, 1, 4]},
        hvdlite_config=HvdliteConfig(timeout_s=60),
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        run_config=RunConfig(name="elastic", storage_path=str(tmp_path / "storage"),
                             failure_config=FailureConfig(max_failures=1)))
    result = trainer.fit()
    assert result.error is None and result.checkpoint is None
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(12))   # nothing repeated, nothing lost
    assert [(s["world"], s["step"]) for s in steps if s["step"] in (4, 5)] == [(0, 4), (1, 5)]
    results = [json.loads((out / f"result{r}.json").read_text()) for r in range(2)]
    assert results[0]["params"] == results[1]["params"] and results[0]["world"] == 1
    assert wait_gone([int(p.name) for p in (out / "pids").iterdir()]) == []
    print(f"\nelastic under Ray Train: step 4 to step 5 (the restart): "
          f"{steps[5]['time'] - steps[4]['time']:.1f} s")

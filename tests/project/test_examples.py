"""The examples, run for real under mpiexec on a short schedule.

The digits examples must reach their accuracy bar (they exit non-zero below --min-accuracy);
the PyTorch one is also checked to write a checkpoint and resume from it.  The synthetic
benchmarks must report a positive throughput in their JSON output.
"""
import json
import re
import sys

import pytest

from tests.mpi_harness import REPO, run_job

EXAMPLES = REPO / "examples"


def _run(np_, script, args, timeout=300):
    job = run_job(np_, [sys.executable, str(EXAMPLES / script), *args], timeout=timeout)
    assert not job.timed_out, f"{script} timed out\n{job.output}"
    assert job.returncode == 0, f"{script} exited {job.returncode}\n{job.output}"
    return job


def _accuracy(stdout: str) -> float:
    found = re.findall(r"test accuracy:? ([0-9.]+)", stdout)
    assert found, f"no test accuracy printed:\n{stdout[-3000:]}"
    return float(found[-1])


@pytest.mark.parametrize("np_", [2, 3])
def test_pytorch_digits_trains_checkpoints_and_resumes(np_, tmp_path):
    ckpt = tmp_path / "digits.pt"
    job = _run(np_, "pytorch_digits.py", ["--epochs", "20", "--min-accuracy", "0.95",
                                          "--checkpoint", str(ckpt)])
    assert _accuracy(job.stdout) >= 0.95
    assert job.stdout.count("epoch ") == 20, "progress must be printed once per epoch (rank 0)"
    assert ckpt.exists(), "rank 0 did not write the checkpoint"
    resumed = _run(np_, "pytorch_digits.py", ["--epochs", "22", "--resume",
                                              "--min-accuracy", "0.95", "--checkpoint", str(ckpt)])
    assert "epochs 20..21" in resumed.stdout, resumed.stdout[-2000:]
    assert resumed.stdout.count("epoch ") == 2
    assert _accuracy(resumed.stdout) >= 0.95


def test_pytorch_digits_resume_without_a_checkpoint_starts_afresh(tmp_path):
    """What a Kubernetes job's first start does (examples/kubernetes/): --resume, no file yet."""
    ckpt = tmp_path / "new" / "digits.pt"
    job = _run(2, "pytorch_digits.py", ["--epochs", "3", "--resume", "--checkpoint", str(ckpt)])
    assert "epochs 0..2" in job.stdout and job.stdout.count("epoch ") == 3, job.output
    assert ckpt.exists() and not (tmp_path / "new" / "digits.pt.partial").exists()


def test_pytorch_digits_checkpoint_survives_a_failed_write(tmp_path):
    """A write that dies half-way (here: an object that cannot be pickled, after the file was
    opened; in a job: a kill) leaves the previous checkpoint loadable."""
    import torch
    sys.path.insert(0, str(EXAMPLES))
    try:
        import pytorch_digits
    finally:
        sys.path.remove(str(EXAMPLES))
    path = str(tmp_path / "digits.pt")
    pytorch_digits.save_checkpoint(path, {"epoch": 4, "weights": torch.ones(1000)})
    with pytest.raises(Exception):
        pytorch_digits.save_checkpoint(path, {"epoch": 5, "weights": torch.zeros(1000),
                                              "unpicklable": lambda: None})
    state = torch.load(path)
    assert state["epoch"] == 4 and torch.equal(state["weights"], torch.ones(1000))


@pytest.mark.parametrize("script,extra", [
    ("pytorch_synthetic_benchmark.py", ["--model", "mlp"]),
    ("pytorch_synthetic_benchmark.py", ["--model", "convnet", "--fp16-allreduce"]),
    ("tensorflow2_synthetic_benchmark.py", ["--model", "mlp"]),
    ("pytorch_synthetic_benchmark.py", ["--model", "resnet10"]),
    ("tensorflow2_synthetic_benchmark.py", ["--model", "resnet10"]),
    ("pytorch_synthetic_benchmark.py", ["--no-distributed-optimizer", "--lockstep"]),
    ("tensorflow2_synthetic_benchmark.py", ["--no-distributed-tape", "--lockstep"]),
])
def test_synthetic_benchmarks_report_throughput(script, extra, tmp_path):
    out = tmp_path / "result.json"
    _run(2, script, [*extra, "--batch-size", "16", "--num-warmup-batches", "1",
                     "--num-batches-per-iter", "2", "--num-iters", "2", "--json", str(out)])
    result = json.loads(out.read_text())
    assert result["ranks"] == 2 and result["total"] > 0, result
    assert result["lockstep"] == ("--lockstep" in extra), result
    if "resnet10" in extra:   # the same ~5M-parameter model in both frameworks
        assert result["params"] == 4_903_242, result


@pytest.mark.parametrize("script", ["pytorch_synthetic_benchmark.py",
                                    "tensorflow2_synthetic_benchmark.py"])
def test_synthetic_benchmarks_refuse_lockstep_with_the_wrapper(script):
    """--lockstep measures synchronous steps without gradient exchange, so it needs the bare
    optimizer/tape; with the wrapper it would silently measure something else."""
    job = run_job(1, [sys.executable, str(EXAMPLES / script), "--lockstep"], timeout=120)
    assert job.returncode == 2 and "--lockstep goes with" in job.output, job.output


@pytest.mark.parametrize("script", ["keras_digits.py", "tensorflow2_digits.py"])
def test_tensorflow_digits_reach_accuracy(script):
    job = _run(2, script, ["--min-accuracy", "0.95"])
    assert _accuracy(job.stdout) >= 0.95

"""hvdlite under a real SLURM (issue 48): ``srun --mpi=pmi2`` forms one world (the torch
collectives' whole case list at 2 and 3 tasks, the digits example), plain ``srun`` is a
LaunchError on every task, ``hvdlite run`` inside ``salloc`` starts the allocation's tasks, and
docs/slurm.md's batch script runs under ``sbatch --wait``."""
import re
import sys

import pytest

from tests.mpi_harness import REPO, STALL_SAFETY_NET_ENV, check_job, run_command
from tests.torch.workers import torch_collectives_worker as W

pytest.importorskip("torch")
TIMEOUT = 300


def _srun(slurm, np_, argv, mpi="pmi2", timeout=TIMEOUT, env=None):
    cmd = ["srun", f"--mpi={mpi}", "-n", str(np_), "--time=10", *argv]
    return run_command(cmd, np_, timeout=timeout, env={**slurm.env, **(env or {})})


@pytest.mark.parametrize("np_", [2, 3])
def test_torch_collectives_pass_exactly_under_srun_pmi2(slurm, np_):
    job = _srun(slurm, np_, [sys.executable, str(REPO / "tests/torch/workers/"
                                                        "torch_collectives_worker.py"), "main"],
                env=STALL_SAFETY_NET_ENV)
    check_job(job, np_)
    for rank, report in enumerate(job.results):
        assert set(report) == set(W.main_cases(np_)), f"rank {rank}"
        failed = {k: v for k, v in report.items() if v is not None}
        assert not failed, f"rank {rank}: {failed}\n{job.output}"


def test_digits_example_trains_under_srun(slurm, tmp_path):
    job = _srun(slurm, 2, [sys.executable, str(REPO / "examples/pytorch_digits.py"), "--epochs",
                           "20", "--min-accuracy", "0.95", "--checkpoint",
                           str(tmp_path / "d.pt")])
    assert job.returncode == 0, job.output
    assert "training on 2 ranks" in job.stdout
    assert float(re.findall(r"test accuracy: ([0-9.]+)", job.stdout)[-1]) >= 0.95


def test_plain_srun_is_a_launch_error_on_every_task(slurm):
    job = _srun(slurm, 2, [sys.executable, "-c",
                           "import hvdlite as hvd; hvd.init(); print('alone', hvd.size())"],
                mpi="none", timeout=120)
    assert job.returncode not in (0, None), job.output
    errors = re.findall(r"LaunchError: (.*)", job.stderr)
    assert len(errors) == 2 and "alone" not in job.stdout, job.output
    assert all("SLURM's srun" in e and "srun --mpi=pmi2" in e and "world of 1" in e
               for e in errors), errors


def test_hvdlite_run_inside_salloc_starts_the_allocations_tasks(slurm):
    code = ("import numpy as np, hvdlite as hvd; hvd.init(); "
            "s = hvd.allreduce(np.ones(1) * (hvd.rank() + 1), op=hvd.Sum, name='s'); "
            "print(f'rank {hvd.rank()} of {hvd.size()} sum {s[0]:.0f}', flush=True)")
    cmd = ["salloc", "-n", "3", "--time=10", sys.executable, "-m", "hvdlite.runner", "run",
           sys.executable, "-c", code]
    job = run_command(cmd, 3, timeout=TIMEOUT, env=slurm.env)
    assert job.returncode == 0, job.output
    assert sorted(re.findall(r"rank (\d) of 3 sum 6", job.stdout)) == ["0", "1", "2"], job.output


def test_the_docs_batch_script_runs_under_sbatch(slurm, tmp_path):
    text = (REPO / "docs/slurm.md").read_text()
    script = text.split("<!-- sbatch script: run by tests/slurm/test_srun.py -->\n```bash\n")[1]
    script = script.split("```")[0].replace(" \\\n", " ")
    path = tmp_path / "digits.sbatch"
    path.write_text(script)
    out = tmp_path / "out.txt"
    # one node here: the script's 2 nodes x 2 tasks become 1 x 2 (options override #SBATCH)
    (tmp_path / "examples").symlink_to(REPO / "examples")   # the script's relative path
    job = run_command(["sbatch", "--wait", "--nodes=1", "--ntasks-per-node=2",
                       f"--output={out}", f"--chdir={tmp_path}", str(path)], 2, timeout=TIMEOUT,
                      env={**slurm.env, "PATH": f"{sys.executable.rsplit('/', 1)[0]}:"
                                                 "/usr/local/bin:/usr/bin:/bin"})
    log = out.read_text() if out.exists() else ""
    assert job.returncode == 0, job.output + log
    assert "training on 2 ranks" in log and float(
        re.findall(r"test accuracy: ([0-9.]+)", log)[-1]) >= 0.95, log
    assert list(tmp_path.glob("digits-*.pt")), "the script's checkpoint was not written"

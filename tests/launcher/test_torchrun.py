"""hvdlite under the launchers that follow torchrun's env:// convention, on one machine (issue
48): torchrun itself, the PyTorchJob layout (one process per pod, started with the Training
Operator's variables), and every misuse a clear LaunchError on every process, never a world
of 1.  Across simulated hosts: tests/multihost/test_torchrun.py."""
import re
import shlex
import time

import pytest

from tests.launcher import env_launch
from tests.mpi_harness import STALL_SAFETY_NET_ENV, REPO, check_job, run_command
from tests.torch.workers import torch_collectives_worker as W

pytest.importorskip("torch")
WORKER = "launcher/workers/env_world_worker.py"
CASES = {"identity", "topology", "collectives", "process_set"}


def _all_passed(job, np_, cases=CASES):
    check_job(job, np_)
    for rank, report in enumerate(job.results):
        assert set(report) == set(cases), f"rank {rank} reported {sorted(report)}"
        failed = {k: v for k, v in report.items() if v is not None}
        assert not failed, f"rank {rank}: {failed}\n{job.output}"


@pytest.mark.parametrize("np_", [2, 3])
def test_torchrun_standalone_forms_one_world(np_):
    _all_passed(env_launch.torchrun(np_, [WORKER]), np_)


@pytest.mark.parametrize("np_", [2, 3])
def test_torch_collectives_pass_exactly_under_torchrun(np_):
    """The whole main case list of tests/torch/test_collectives.py, launched by torchrun."""
    job = env_launch.torchrun(np_, ["torch/workers/torch_collectives_worker.py", "main"],
                              timeout=300, env=STALL_SAFETY_NET_ENV)
    _all_passed(job, np_, W.main_cases(np_))


def test_torchrun_with_a_c10d_rendezvous_and_two_agents():
    """``--nnodes 2 --rdzv-backend c10d --rdzv-endpoint``: two torchrun agents (as on two
    nodes; here both on this machine, so the 4 ranks share one host)."""
    port = env_launch.free_port()
    more = ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
            f"127.0.0.1:{port}", "--rdzv-id", "hvdlite-c10d"]
    one = shlex.join(env_launch.torchrun_argv(2, [WORKER], *more))
    script = f"{one} & {one} & wait"
    job = run_command(["/bin/sh", "-c", script], 4, timeout=180)
    _all_passed(job, 4)


@pytest.mark.parametrize("np_", [2, 3])
def test_pytorchjob_layout_one_process_per_pod(np_):
    """No torchrun: each process gets RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, as the Training
    Operator sets them; rank 0 serves the rendezvous for the formation."""
    _all_passed(env_launch.env_processes(np_, [WORKER]), np_)


def test_digits_example_trains_under_torchrun(tmp_path):
    job = run_command(env_launch.torchrun_argv(
        2, [str(REPO / "examples/pytorch_digits.py"), "--epochs", "20", "--min-accuracy",
            "0.95", "--checkpoint", str(tmp_path / "digits.pt")]), 2, timeout=300)
    assert job.returncode == 0, job.output
    accuracy = float(re.findall(r"test accuracy:? ([0-9.]+)", job.stdout)[-1])
    assert accuracy >= 0.95


# --- misuse: a clear error on every process, never a world of 1 ---------------------------
def _fails_everywhere(job, np_, *words):
    assert not job.timed_out, job.output
    assert job.returncode not in (0, None), job.output
    errors = re.findall(r"LaunchError: (.*)", job.stdout + job.stderr)
    assert len(errors) >= np_, f"expected a LaunchError from each of {np_} processes\n{job.output}"
    for word in words:
        assert all(word in e for e in errors), f"{word!r} missing from {errors}"
    return errors


INIT_AFTER_MPI = ("from mpi4py import MPI; import hvdlite as hvd; hvd.init(); "
                  "print('trained alone', hvd.size())")


def test_mpi_initialised_before_init_under_torchrun_is_an_error():
    """torchrun stops the other workers as soon as one fails, so the error is checked on the
    first; the next test checks every process without torchrun's stopping."""
    job = run_command(env_launch.torchrun_argv(2, ["-c", INIT_AFTER_MPI]), 2, timeout=120)
    _fails_everywhere(job, 1, "torchrun", "world of 1", "already initialised")
    assert "trained alone" not in job.stdout


def test_mpi_initialised_before_init_is_an_error_on_every_process():
    job = env_launch.env_processes(2, ["-c", INIT_AFTER_MPI], timeout=60)
    errors = _fails_everywhere(job, 2, "env://", "world of 1", "already initialised")
    assert "trained alone" not in job.stdout
    assert any("rank 1 of 2" in e for e in errors) and any("rank 0 of 2" in e for e in errors)


def test_a_process_that_never_arrives_is_named():
    """WORLD_SIZE=3 but only ranks 0 and 1 start: both fail within the start timeout, rank 0
    naming rank 2 and the rendezvous."""
    started = time.monotonic()
    job = env_launch.env_processes(3, ["-c", "import hvdlite as hvd; hvd.init()"], ranks=[0, 1],
                                   env={"HVDLITE_START_TIMEOUT": "4"}, timeout=60)
    errors = _fails_everywhere(job, 2, "within 4 s")
    assert time.monotonic() - started < 40
    assert any("ranks [2] never arrived" in e for e in errors), errors


@pytest.mark.parametrize("variables, words", [
    # Open MPI's variables: MPICH's MPI_Init would abort, so init() stops before it
    ({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0"},
     ["Open MPI's mpirun", "mpi4py uses MPICH", "same MPI"]),
    ({"SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "0", "SLURM_STEP_ID": "0"},
     ["SLURM's srun", "world of 1", "srun --mpi=pmi2"]),
])
def test_a_launcher_that_said_more_processes_than_mpi_formed(variables, words):
    """A process whose launcher's variables say N but whose MPI cannot form that world
    (another MPI's mpirun, srun without a PMI plugin MPICH speaks); tests/launcher/
    test_open_mpi.py runs Open MPI's real mpirun."""
    job = env_launch.env_processes(1, ["-c", "import hvdlite as hvd; hvd.init()"], env={
        "RANK": "", "WORLD_SIZE": "", **variables}, timeout=60)
    _fails_everywhere(job, 1, *words)


def test_missing_master_port_is_named():
    job = env_launch.env_processes(2, ["-c", "import hvdlite as hvd; hvd.init()"],
                                   env={"MASTER_PORT": ""}, timeout=60)
    _fails_everywhere(job, 2, "MASTER_PORT")


def test_a_rank_killed_on_another_node_ends_the_others_with_rank_exited_error():
    """Two torchrun agents (two "nodes"); a rank of the second one is SIGKILLed: the first
    node's ranks (whose agent does not know) raise RankExitedError within 10 s."""
    port = env_launch.free_port()
    more = ["--nnodes", "2", "--node-rank", "{node}", "--master-addr", "127.0.0.1",
            "--master-port", str(port)]
    body = ("import os, signal, time, sys\n"
            "import numpy as np\n"
            "import hvdlite as hvd\n"
            "hvd.init()\n"
            "if hvd.rank() == 3:\n"
            "    time.sleep(1); os.kill(os.getpid(), signal.SIGKILL)\n"
            "t = time.monotonic()\n"
            "try:\n"
            "    for i in range(600):\n"
            "        hvd.allreduce(np.ones(4), name=f't{i}'); time.sleep(0.05)\n"
            "except hvd.HvdliteError as e:\n"
            "    print(f'rank {hvd.rank()} {type(e).__name__} after {time.monotonic() - t:.1f}')\n"
            "    sys.exit(3)\n")
    cmds = [shlex.join(env_launch.torchrun_argv(2, ["-c", body],
                                                *[m.format(node=node) for m in more]))
            for node in (0, 1)]
    job = run_command(["/bin/sh", "-c", f"{cmds[0]} & {cmds[1]} & wait"], 4, timeout=120)
    assert not job.timed_out, job.output
    found = re.findall(r"rank ([01]) RankExitedError after ([0-9.]+)", job.stdout)
    assert {r for r, _ in found} == {"0", "1"}, job.output
    assert all(float(t) < 10 for _, t in found), found


def test_torchrun_restarts_form_a_new_world_each_time():
    """``--max-restarts 1``: rank 1 dies in the first attempt; torchrun starts every worker
    again, and the second attempt forms a new world under keys of its own (the restart count)
    and trains to the end."""
    body = ("import os, sys\n"
            "import numpy as np\n"
            "import hvdlite as hvd\n"
            "hvd.init()\n"
            "attempt = os.environ['TORCHELASTIC_RESTART_COUNT']\n"
            "got = hvd.allreduce(np.ones(3), op=hvd.Sum, name='x')\n"
            "if attempt == '0' and hvd.rank() == 1:\n"
            "    os._exit(7)\n"
            "hvd.barrier()\n"
            "print(f'attempt {attempt} rank {hvd.rank()} of {hvd.size()} sum {got[0]:.0f}')\n")
    job = run_command(env_launch.torchrun_argv(2, ["-c", body], "--standalone",
                                               "--max-restarts", "1"), 2, timeout=180)
    assert job.returncode == 0, job.output
    done = sorted(re.findall(r"attempt 1 rank (\d) of 2 sum 2", job.stdout))
    assert done == ["0", "1"], job.output


def test_worlds_formed_one_after_another_on_one_store():
    """torchrun's agent keeps one store across the rounds of an elastic job, and a membership
    change restarts the workers with the same TORCHELASTIC_RESTART_COUNT: a world formed after
    another on the same store (this test serves it, as the agent does) must not take the
    earlier world's keys, at the same size or another."""
    import datetime
    from torch.distributed import TCPStore
    port = env_launch.free_port()
    store = TCPStore("127.0.0.1", port, None, True, datetime.timedelta(seconds=30),
                     wait_for_workers=False)
    agent = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "same",
             "TORCHELASTIC_RESTART_COUNT": "0", "MASTER_PORT": str(port)}
    try:
        for np_ in (2, 2, 3):
            _all_passed(env_launch.env_processes(np_, [WORKER], env=agent), np_)
        assert int(store.add("hvdlite/world/same/0/generation", 0)) == 3
    finally:
        del store


def test_hvd_elastic_resumes_from_the_last_commit_after_a_torchrun_restart():
    """Commits live in torchrun's agent store (it outlives the workers): after rank 1 dies,
    the restarted world resumes from the newest commit (epoch 5, or 4 if rank 0's paced
    shipping had not sent 5 yet), with the committed total, and runs the reset callbacks."""
    job = run_command(env_launch.torchrun_argv(
        2, ["launcher/workers/torchrun_elastic_worker.py"], "--standalone", "--max-restarts",
        "1"), 2, timeout=180)
    assert job.returncode == 0, job.output
    lines = re.findall(r"attempt 1 rank (\d) resumed at (\d) epoch 8 total (\d+) resets (\d)",
                       job.stdout)
    assert sorted(r for r, *_ in lines) == ["0", "1"], job.output
    for _, resumed, total, resets in lines:
        assert int(resumed) in (4, 5) and int(total) == 16 and resets == "1", lines

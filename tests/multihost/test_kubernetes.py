"""What the Kubeflow MPI Operator's launcher pod runs for examples/kubernetes/digits-mpijob.yaml,
run from the head on hosts named and reached as the operator's worker pods (issue 35, item 7).

The command is the manifest's own (its image paths mapped onto this checkout), with the
operator's environment (HYDRA_HOST_FILE pointing at a hostfile of ``host:slots`` lines written as
the operator writes it) and the container's.  The first launch loses a rank on the second
worker, killed mid-training (an out-of-memory kill, a lost node); the job must end with nothing
left on any host.  The second launch is what the operator runs next, the same command: it must
resume from the last checkpoint and reach the accuracy bar.  The stand-in is the pods' ssh: it
takes logins on the manifest's sshd port only.
"""
import re
import sys
import threading
import time

from tests.launcher import kubernetes_example as K
from tests.multihost import procs
from tests.multihost.hosts import check_host_job

TIMEOUT = 240
EPOCHS = 20   # the manifest's --epochs


def _wait_for_checkpoint(path, epoch: int, launch: threading.Thread, deadline: float) -> int:
    """The epoch of ``path`` once rank 0 has saved ``epoch`` or later."""
    import torch
    while time.monotonic() < deadline and launch.is_alive():
        if path.exists():
            saved = torch.load(path)["epoch"]   # whole: it is renamed into place
            if saved >= epoch:
                return saved
        time.sleep(0.1)
    raise AssertionError(f"no checkpoint of epoch {epoch} or later was written in time")


def _kill_ranks(bed, host: str) -> list[str]:
    """SIGKILL the ranks running on ``host``; their command lines."""
    ns = bed.hosts[host].pid_ns
    ranks = [pid for pid in procs.pids() if procs.pid_ns(pid) == ns
             and "pytorch_digits.py" in procs.cmdline(pid)
             and not procs.cmdline(pid).startswith("/bin/sh")]
    killed = [procs.cmdline(pid) for pid in ranks]
    procs.kill(ranks)
    return killed


def test_operator_launch_resumes_after_a_rank_is_killed(operator_bed):
    job = K.mpijob()
    assert operator_bed.names == K.worker_names(job)
    hostfile = operator_bed.root / "jobs" / "mpi-hostfile"   # the operator's /etc/mpi/hostfile
    hostfile.write_text(K.operator_hostfile(job))
    checkpoints = operator_bed.root / "checkpoints"   # the workers' shared volume
    checkpoint = checkpoints / "digits.pt"
    command = K.on_this_machine(K.launcher_argv(job), checkpoints)
    assert str(checkpoint) in command
    env = {**K.container_env(job, "Launcher"), **K.operator_env(str(hostfile))}

    first: list = []
    launch = threading.Thread(target=lambda: first.append(
        operator_bed.run(command, 0, timeout=TIMEOUT, env=env)))
    launch.start()
    try:
        _wait_for_checkpoint(checkpoint, 2, launch, time.monotonic() + TIMEOUT)
        killed = _kill_ranks(operator_bed, operator_bed.names[1])
    finally:
        launch.join()
    (first,) = first
    assert killed, f"no rank found on the second worker\n{first.output}"
    check_host_job(first, 0, expect_success=False)
    assert first.returncode not in (0, None), first.output
    assert first.stdout.count("epoch ") < EPOCHS, "the job ended before the kill"

    import torch
    saved = torch.load(checkpoint)["epoch"]
    second = operator_bed.run(command, 0, timeout=TIMEOUT, env=env)
    check_host_job(second, 0)
    assert "training on 2 ranks" in second.stdout, second.output
    assert f"epochs {saved + 1}..{EPOCHS - 1}" in second.stdout, second.output
    assert second.stdout.count("epoch ") == EPOCHS - 1 - saved, second.output
    accuracy = [float(a) for a in re.findall(r"test accuracy: ([0-9.]+)", second.stdout)]
    assert accuracy and accuracy[-1] >= 0.95, second.output


def test_launch_reaches_the_workers_as_the_operator_configures_them(operator_bed):
    """Hydra reaches each worker by the hostfile's name on the manifest's port; the operator's
    HYDRA_LAUNCH_EXTRA_ARGS is not a variable MPICH 5's Hydra reads (it reads
    HYDRA_LAUNCHER_EXTRA_ARGS), so its ``-o ConnectionAttempts=10`` reaches no ssh."""
    job = K.mpijob()
    hostfile = operator_bed.root / "jobs" / "mpi-hostfile-hello"
    hostfile.write_text(K.operator_hostfile(job))
    log = operator_bed.root / "standin.log"
    since = log.stat().st_size if log.exists() else 0
    argv = K.launcher_argv(job)
    hello = [sys.executable, "-c", "import os, socket; "
             "os.write(1, (socket.gethostname() + '\\n').encode())"]
    # the manifest's launcher options, another command
    options = K.on_this_machine(argv[:argv.index("python")], operator_bed.root)
    result = operator_bed.run(options + hello, 0, timeout=60,
                              env={**K.container_env(job, "Launcher"),
                                   **K.operator_env(str(hostfile))})
    check_host_job(result, 0)
    assert sorted(result.stdout.split()) == operator_bed.names
    with open(log) as f:
        f.seek(since)
        text = f.read()
    assert "ConnectionAttempts" not in text
    port = str(K.ssh_port(job))
    for host in operator_bed.names:
        assert f'["-x", "-p", "{port}", "{host}", ' in text, text

"""examples/kubernetes/digits-pytorchjob.yaml as Kubeflow's Training Operator runs it, on hosts
named as its pods (issue 48): each pod's container command (image paths mapped onto this
checkout) with the variables the operator sets there, one process per pod; and the same pods
running torchrun with two processes each, configured by the operator's PET_* variables alone.
The digits example must reach its accuracy bar in both."""
import re

import pytest

from tests.launcher import kubernetes_example as K
from tests.multihost.pods import on_hosts

pytest.importorskip("torch")
TIMEOUT = 240


def _accuracy(job) -> float:
    found = re.findall(r"test accuracy:? ([0-9.]+)", job.stdout)
    assert found, job.output
    return float(found[-1])


def test_pytorchjob_one_process_per_pod_trains(pytorchjob_bed, tmp_path):
    pods = K.pytorchjob_pods(K.pytorchjob())
    assert [env["RANK"] for _, env, _ in pods] == ["0", "1"]
    commands = {pod: ["env", *(f"{k}={v}" for k, v in env.items()),
                      *K.on_this_machine(argv, tmp_path)] for pod, env, argv in pods}
    job = on_hosts(pytorchjob_bed, commands, 0, {}, timeout=TIMEOUT)
    assert not job.timed_out and job.returncode == 0, job.output
    assert "training on 2 ranks" in job.stdout, job.output
    assert _accuracy(job) >= 0.95


def test_pytorchjob_with_torchrun_in_each_pod_trains(pytorchjob_bed, tmp_path):
    """``torchrun --nproc-per-node 2 script`` in each pod: torchrun reads PET_NNODES,
    PET_NODE_RANK, PET_MASTER_ADDR and PET_MASTER_PORT (the operator's), so the command names
    nothing else; 4 ranks on 2 pods."""
    import sys
    pods = K.pytorchjob_pods(K.pytorchjob(), nproc_per_pod=2)
    commands = {}
    for pod, env, argv in pods:
        script = K.on_this_machine(argv, tmp_path)[1:]   # drop "python"
        commands[pod] = ["env", *(f"{k}={v}" for k, v in env.items()), sys.executable, "-m",
                         "torch.distributed.run", "--nproc-per-node", "2", *script]
    job = on_hosts(pytorchjob_bed, commands, 0, {}, timeout=TIMEOUT)
    assert not job.timed_out and job.returncode == 0, job.output
    assert _accuracy(job) >= 0.95
    assert "training on 4 ranks" in job.stdout, job.output

"""examples/kubernetes/ as the Kubeflow MPI Operator v2 reads it, for the tests that check the
files (tests/launcher/test_kubernetes_example.py) and the one that runs the launcher's command on
simulated hosts (tests/multihost/test_kubernetes.py).

What the operator does with an MPIJob of ``mpiImplementation: MPICH`` is written down here from
its source (kubeflow/mpi-operator, pkg/controller/mpi_job_controller.go: ``newConfigMap``,
``mpichEnvVars``, ``launcherEnvVars``, ``newLauncherPodTemplate``, ``newWorker``): it writes a
hostfile of ``<job>-worker-<i>.<job>.<namespace>.svc:<slotsPerWorker>`` lines, one per worker in
order, mounts it at /etc/mpi/hostfile in the launcher, and sets HYDRA_HOST_FILE to it,
HYDRA_LAUNCH_EXTRA_ARGS to ``-o ConnectionAttempts=10`` and K_MPI_JOB_ROLE to ``launcher``.
"""
from __future__ import annotations

import sys
from pathlib import Path

from tests.mpi_harness import REPO

DIRECTORY = REPO / "examples" / "kubernetes"
MANIFEST = DIRECTORY / "digits-mpijob.yaml"
DOCKERFILE = DIRECTORY / "Dockerfile"
IMAGE_REPO = Path("/opt/hvdlite")   # where the Dockerfile copies this repository
CHECKPOINTS = Path("/checkpoints")  # where the workers mount the checkpoint volume
OPERATOR_HOSTFILE = "/etc/mpi/hostfile"


def documents() -> list[dict]:
    import yaml
    return [doc for doc in yaml.safe_load_all(MANIFEST.read_text()) if doc]


def mpijob() -> dict:
    (job,) = [doc for doc in documents() if doc.get("kind") == "MPIJob"]
    return job


def replica(job: dict, role: str) -> dict:
    return job["spec"]["mpiReplicaSpecs"][role]


def container(job: dict, role: str) -> dict:
    return replica(job, role)["template"]["spec"]["containers"][0]


def launcher_argv(job: dict) -> list[str]:
    """What the launcher container runs (command, then args)."""
    main = container(job, "Launcher")
    return list(main.get("command", [])) + list(main.get("args", []))


def worker_names(job: dict) -> list[str]:
    """The workers' host names as the operator writes them into the hostfile."""
    name = job["metadata"]["name"]
    namespace = job["metadata"].get("namespace", "default")
    count = replica(job, "Worker")["replicas"]
    return [f"{name}-worker-{index}.{name}.{namespace}.svc" for index in range(count)]


def operator_hostfile(job: dict) -> str:
    """The hostfile the operator mounts in the launcher (MPICH's ``host:slots`` lines)."""
    slots = job["spec"].get("slotsPerWorker", 1)
    return "".join(f"{host}:{slots}\n" for host in worker_names(job))


def operator_env(hostfile: str) -> dict[str, str]:
    """The variables the operator adds to an MPICH launcher container."""
    return {"K_MPI_JOB_ROLE": "launcher", "HYDRA_HOST_FILE": hostfile,
            "HYDRA_LAUNCH_EXTRA_ARGS": "-o ConnectionAttempts=10"}


def container_env(job: dict, role: str) -> dict[str, str]:
    return {item["name"]: item["value"] for item in container(job, role).get("env", [])}


def ssh_port(job: dict) -> int:
    """The port the workers' sshd listens on (what their readiness probe tries)."""
    return int(container(job, "Worker")["readinessProbe"]["tcpSocket"]["port"])


def on_this_machine(argv: list[str], checkpoints: Path) -> list[str]:
    """The launcher's command with the image's paths replaced by this checkout's: ``hvdlite``
    and ``python`` by this Python, /opt/hvdlite by the repository, /checkpoints by
    ``checkpoints``.  Every other word is kept as it is."""
    out = []
    for word in argv:
        if word == "hvdlite":
            out += [sys.executable, "-m", "hvdlite.runner"]
        elif word == "python":
            out.append(sys.executable)
        elif word.startswith(f"{IMAGE_REPO}/"):
            out.append(str(REPO / Path(word).relative_to(IMAGE_REPO)))
        elif word.startswith(f"{CHECKPOINTS}/"):
            out.append(str(checkpoints / Path(word).relative_to(CHECKPOINTS)))
        else:
            out.append(word)
    return out


# --- the PyTorchJob (Kubeflow Training Operator v1) ------------------------------------------
# What the operator sets in each pod's containers, from its source (kubeflow/training-operator,
# pkg/controller.v1/pytorch/envvar.go, setPodTemplateEnv): MASTER_ADDR and PET_MASTER_ADDR are
# the master pod's name ``<job>-master-0`` (for every pod, the master included), MASTER_PORT and
# PET_MASTER_PORT the master container's ``pytorchjob-port``, WORLD_SIZE the replicas times the
# processes per pod, RANK and PET_NODE_RANK the pod's index (the master 0, worker i: i + 1),
# PET_NNODES the number of pods, PYTHONUNBUFFERED=1.
PYTORCHJOB = DIRECTORY / "digits-pytorchjob.yaml"


def pytorchjob() -> dict:
    import yaml
    (job,) = [doc for doc in yaml.safe_load_all(PYTORCHJOB.read_text())
              if doc and doc.get("kind") == "PyTorchJob"]
    return job


def torch_container(job: dict, role: str) -> dict:
    return job["spec"]["pytorchReplicaSpecs"][role]["template"]["spec"]["containers"][0]


def pytorchjob_pods(job: dict, nproc_per_pod: int = 1) -> list[tuple[str, dict, list[str]]]:
    """(pod name, the variables the operator sets there with the container's own, the
    container's command) for every pod, the master first."""
    name = job["metadata"]["name"]
    specs = job["spec"]["pytorchReplicaSpecs"]
    master = f"{name}-master-0"
    port = next(p["containerPort"] for p in torch_container(job, "Master")["ports"]
                if p["name"] == "pytorchjob-port")
    pods = [(master, "Master", 0)] + [(f"{name}-worker-{i}", "Worker", i + 1)
                                      for i in range(specs["Worker"]["replicas"])]
    out = []
    for pod, role, rank in pods:
        main = torch_container(job, role)
        env = {item["name"]: item["value"] for item in main.get("env", [])}
        env.update({"MASTER_ADDR": master, "MASTER_PORT": str(port),
                    "WORLD_SIZE": str(len(pods) * nproc_per_pod), "RANK": str(rank),
                    "PYTHONUNBUFFERED": "1", "PET_MASTER_ADDR": master,
                    "PET_MASTER_PORT": str(port), "PET_NNODES": str(len(pods)),
                    "PET_NODE_RANK": str(rank)})
        out.append((pod, env, list(main.get("command", [])) + list(main.get("args", []))))
    return out

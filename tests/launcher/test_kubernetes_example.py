"""examples/kubernetes/ checked without Kubernetes or Docker: the MPIJob manifest has what the
Kubeflow MPI Operator v2 requires (its validation rules, pkg/apis/kubeflow/validation), and the
manifest, the Dockerfile and docs/kubernetes.md agree with each other (image, ssh port, user,
paths, versions).  tests/multihost/test_kubernetes.py runs the launcher's command itself."""
from __future__ import annotations

import importlib.metadata
import re
import sys

import pytest

from hvdlite.runner import launch
from tests.launcher import kubernetes_example as K
from tests.mpi_harness import REPO

yaml = pytest.importorskip("yaml", reason="PyYAML reads the manifest (pip install pyyaml; the "
                                          "docs extra installs it)")
DOCS_PAGE = REPO / "docs" / "kubernetes.md"


@pytest.fixture(scope="module")
def job() -> dict:
    return K.mpijob()


def _dockerfile() -> str:
    return K.DOCKERFILE.read_text()


def _arg_default(name: str) -> str:
    match = re.search(rf"^ARG {name}=(\S+)$", _dockerfile(), re.MULTILINE)
    assert match, f"the Dockerfile declares no ARG {name}=..."
    return match.group(1)


def test_manifest_holds_a_volume_claim_and_an_mpich_mpijob(job):
    kinds = [doc["kind"] for doc in K.documents()]
    assert kinds == ["PersistentVolumeClaim", "MPIJob"]
    assert job["apiVersion"] == "kubeflow.org/v2beta1"
    spec = job["spec"]
    assert spec["mpiImplementation"] == "MPICH"
    assert spec["slotsPerWorker"] == 1
    assert spec["launcherCreationPolicy"] == "WaitForWorkersReady"
    assert spec["runPolicy"]["cleanPodPolicy"] in ("None", "Running", "All")
    assert spec["runPolicy"]["backoffLimit"] >= 1, "a failed launch must be retried (resumed)"


def test_manifest_passes_the_operators_validation(job):
    """The rules of ValidateMPIJob (mpi-operator pkg/apis/kubeflow/validation/validation.go)."""
    name = job["metadata"]["name"]
    workers = K.replica(job, "Worker")["replicas"]
    last = f"{name}-worker-{workers - 1}"
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", last) and len(last) <= 63
    assert K.replica(job, "Launcher")["replicas"] == 1
    assert workers == 2
    for role in ("Launcher", "Worker"):
        spec = K.replica(job, role)
        assert spec["restartPolicy"] in ("Never", "OnFailure"), role
        assert spec["template"]["spec"]["containers"], role
    assert job["spec"]["sshAuthMountPath"]


def test_one_image_built_as_the_docs_and_the_dockerfile_say(job):
    images = {K.container(job, role)["image"] for role in ("Launcher", "Worker")}
    assert len(images) == 1, images
    build = f"docker build -f examples/kubernetes/Dockerfile -t {images.pop()} ."
    assert build in _dockerfile() and build in DOCS_PAGE.read_text()


def test_ssh_settings_agree(job):
    port = _arg_default("SSH_PORT")
    argv = K.launcher_argv(job)
    assert argv[argv.index("-p") + 1] == port == str(K.ssh_port(job))
    user_id = int(_arg_default("USER_ID"))
    for role in ("Launcher", "Worker"):
        assert K.replica(job, role)["template"]["spec"]["securityContext"]["runAsUser"] == user_id
    home = "/home/mpiuser"
    assert job["spec"]["sshAuthMountPath"] == f"{home}/.ssh"
    dockerfile = _dockerfile()
    assert 'useradd --create-home --uid "$USER_ID" mpiuser' in dockerfile
    assert f"HostKey {home}/.ssh/id_rsa" in dockerfile   # the key the operator mounts there
    worker = K.container(job, "Worker")
    assert worker["command"] == ["/usr/sbin/sshd", "-De", "-f", f"{home}/.sshd_config"]
    assert f"> {home}/.sshd_config" in dockerfile and "openssh-server" in dockerfile


def test_launcher_command_is_hvdlite_run_of_the_digits_example_with_resume(job):
    argv = K.launcher_argv(job)
    assert argv[:2] == ["hvdlite", "run"]
    args = launch.parse_args(argv[1:])
    assert args.np is None and args.hosts is None and args.hostfile is None, \
        "the hosts and -np come from the operator's hostfile"
    assert args.command[0] == "python"
    script = args.command[1]
    assert script == f"{K.IMAGE_REPO}/examples/pytorch_digits.py"
    assert (REPO / "examples" / "pytorch_digits.py").exists()
    assert "COPY . /opt/hvdlite" in _dockerfile()
    sys.path.insert(0, str(REPO / "examples"))
    try:
        import pytorch_digits
    finally:
        sys.path.remove(str(REPO / "examples"))
    options = pytorch_digits.parse_args(args.command[2:])
    assert options.resume and options.checkpoint.startswith(f"{K.CHECKPOINTS}/")


def test_checkpoints_are_on_a_shared_volume_every_worker_mounts(job):
    (claim,) = [doc for doc in K.documents() if doc["kind"] == "PersistentVolumeClaim"]
    assert "ReadWriteMany" in claim["spec"]["accessModes"]
    pod = K.replica(job, "Worker")["template"]["spec"]
    (volume,) = pod["volumes"]
    assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    (mount,) = K.container(job, "Worker")["volumeMounts"]
    assert mount["name"] == volume["name"] and mount["mountPath"] == str(K.CHECKPOINTS)


def test_dockerfile_pins_what_the_tests_run_with():
    dockerfile = _dockerfile()
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert re.search(rf"^FROM python:{re.escape(python)}-", dockerfile, re.MULTILINE), python
    torch = importlib.metadata.version("torch").split("+")[0]
    assert (f"torch=={torch} --index-url https://download.pytorch.org/whl/cpu"
            in dockerfile)
    for package in ("mpich", "mpi4py", "numpy", "ml_dtypes", "cloudpickle", "scikit-learn"):
        assert f"{package}=={importlib.metadata.version(package)}" in dockerfile, package
    assert "pip install --no-cache-dir --no-deps /opt/hvdlite" in dockerfile


def test_docker_build_context_leaves_the_environment_out():
    ignored = (REPO / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored


def test_operator_hostfile_as_the_operator_writes_it(job):
    assert K.operator_hostfile(job) == ("hvdlite-digits-worker-0.hvdlite-digits.default.svc:1\n"
                                        "hvdlite-digits-worker-1.hvdlite-digits.default.svc:1\n")


def test_command_on_this_machine_replaces_only_the_image_paths(job, tmp_path):
    argv = K.launcher_argv(job)
    local = K.on_this_machine(argv, tmp_path)
    assert local[:3] == [sys.executable, "-m", "hvdlite.runner"]
    assert str(REPO / "examples" / "pytorch_digits.py") in local
    assert str(tmp_path / "digits.pt") in local
    kept = [word for word in argv if word not in ("hvdlite", "python")
            and not word.startswith(("/opt/hvdlite/", "/checkpoints/"))]
    assert [word for word in local if word in kept] == kept
    assert len(local) == len(argv) + 2


def test_pytorchjob_manifest_has_what_the_training_operator_requires(job):
    """examples/kubernetes/digits-pytorchjob.yaml (issue 48): a kubeflow.org/v1 PyTorchJob with
    one Master and Workers whose container is named ``pytorch`` (the operator sets its
    variables there), the master's ``pytorchjob-port`` (MASTER_PORT, where rank 0 serves the
    rendezvous), the MPIJob example's image, and the same training command in every pod."""
    torch_job = K.pytorchjob()
    assert torch_job["apiVersion"] == "kubeflow.org/v1"
    specs = torch_job["spec"]["pytorchReplicaSpecs"]
    assert set(specs) == {"Master", "Worker"} and specs["Master"]["replicas"] == 1
    image = K.container(job, "Launcher")["image"]
    commands = set()
    for role in specs:
        main = K.torch_container(torch_job, role)
        assert main["name"] == "pytorch" and main["image"] == image, role
        assert specs[role]["restartPolicy"] in ("Never", "OnFailure", "ExitCode"), role
        commands.add(tuple(main["command"]))
    assert len(commands) == 1
    ports = K.torch_container(torch_job, "Master")["ports"]
    assert [p["name"] for p in ports] == ["pytorchjob-port"]
    assert "digits-pytorchjob.yaml" in DOCS_PAGE.read_text()

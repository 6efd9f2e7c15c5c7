"""Which launcher the environment names, and the error when MPI's world disagrees (issue 48);
the env:// formation's pure parts (rank order on the hosts, store keys)."""
import pytest

from hvdlite.common.runtime import launch_env as L
from hvdlite.common.runtime.env_world import rank_order, store_prefix

TORCHRUN = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "a",
            "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "x"}


@pytest.mark.parametrize("environ, kind, launcher, size, rank", [
    ({}, L.NONE, "no launcher", None, None),
    ({"PMI_RANK": "1", "PMI_SIZE": "2"}, L.MPI, "PMI launcher", 2, 1),
    ({"OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_RANK": "2"}, L.MPI, "Open MPI", 3, 2),
    ({"PMI_ID": "0", "PMI_PORT": "h:1"}, L.MPI, "manual launch", None, 0),
    ({"PMIX_RANK": "5"}, L.MPI, "PMIx", None, 5),
    (TORCHRUN, L.ENV, "torchrun", 4, 1),
    ({k: v for k, v in TORCHRUN.items() if k != "TORCHELASTIC_RUN_ID"}, L.ENV, "env://", 4, 1),
    ({"SLURM_STEP_NUM_TASKS": "8", "SLURM_PROCID": "3"}, L.SLURM, "srun", 8, 3),
    # a batch script (no step of several tasks) is one process, whatever the allocation
    ({"SLURM_NTASKS": "8", "SLURM_JOB_ID": "7"}, L.NONE, "no launcher", None, None),
    # mpiexec inside a PyTorchJob pod or an allocation: the MPI launcher's variables win
    ({**TORCHRUN, "PMI_RANK": "0", "PMI_SIZE": "2"}, L.MPI, "PMI", 2, 0),
    ({"SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "0", "PMI_RANK": "0", "PMI_SIZE": "2"},
     L.MPI, "PMI", 2, 0),
    # torchrun inside srun: torchrun's world, not the step's
    ({**TORCHRUN, "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "0"}, L.ENV, "torchrun", 4, 1),
    ({"WORLD_SIZE": "x", "RANK": "0"}, L.NONE, "no launcher", None, None),
])
def test_detect(environ, kind, launcher, size, rank):
    got = L.detect(environ)
    assert (got.kind, got.size, got.rank) == (kind, size, rank)
    assert launcher in got.launcher


def test_matching_worlds_and_unknown_sizes_are_no_error():
    assert L.mismatch_error(L.detect(TORCHRUN), 4, 1) is None
    assert L.mismatch_error(L.detect({"PMI_ID": "0"}), 3, 0) is None
    assert L.mismatch_error(L.detect({}), 1, 0) is None


def test_the_mismatch_error_names_the_launcher_its_variables_and_what_to_do():
    msg = L.mismatch_error(L.detect(TORCHRUN), 1, 0, initialised_before=True)
    assert "torchrun (RANK=1, WORLD_SIZE=4" in msg and "rank 1 of 4" in msg
    assert "world of 1" in msg and "4 separate jobs" in msg and "already initialised" in msg
    msg = L.mismatch_error(L.detect({"SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1"}), 1, 0)
    assert "srun --mpi=pmi2" in msg and "SLURM_STEP_NUM_TASKS=2" in msg
    msg = L.mismatch_error(L.detect({"OMPI_COMM_WORLD_SIZE": "2"}), 1, 0)
    assert "Open MPI's mpirun" in msg and "same MPI" in msg


@pytest.mark.parametrize("hosts, segments, mpi_rank", [
    (["a", "a", "b", "b"], [("a", 2), ("b", 2)], [0, 1, 2, 3]),
    (["a"], [("a", 1)], [0]),
    # a host's ranks need not be consecutive: Hydra numbers host by host, RANK orders later
    (["a", "b", "a", "b"], [("a", 2), ("b", 2)], [0, 2, 1, 3]),
    (["b", "a", "a"], [("b", 1), ("a", 2)], [0, 1, 2]),
])
def test_rank_order(hosts, segments, mpi_rank):
    assert rank_order(hosts) == (segments, mpi_rank)


def test_store_prefix_separates_runs_and_restarts():
    first = store_prefix({"TORCHELASTIC_RUN_ID": "r", "TORCHELASTIC_RESTART_COUNT": "0"})
    again = store_prefix({"TORCHELASTIC_RUN_ID": "r", "TORCHELASTIC_RESTART_COUNT": "1"})
    other = store_prefix({"TORCHELASTIC_RUN_ID": "s", "TORCHELASTIC_RESTART_COUNT": "0"})
    assert len({first, again, other}) == 3 and store_prefix({}) == "hvdlite/world/env/0"


@pytest.mark.parametrize("environ, torch_ok, words", [
    ({}, True, ["no launcher", "world of 1"]),
    ({"SLURM_JOB_ID": "9"}, True, ["allocation 9", "hvdlite run"]),
    ({"PMI_RANK": "0", "PMI_SIZE": "2"}, True, ["joins the MPI world"]),
    (TORCHRUN, True, ["forms the world of 4", "a:29500", "served by rank 0"]),
    ({**TORCHRUN, "TORCHELASTIC_USE_AGENT_STORE": "True"}, True, ["torchrun agent"]),
    (TORCHRUN, False, ["would fail", "needs torch"]),
    ({**TORCHRUN, "MASTER_PORT": ""}, True, ["would fail", "MASTER_PORT not set"]),
    ({"SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "0"}, True, ["LaunchError", "pmi2"]),
])
def test_forecast(environ, torch_ok, words):
    text = L.forecast(L.detect(environ), environ, torch_ok)
    assert all(w in text for w in words), text


def test_check_build_says_what_this_environment_would_do():
    import os
    import subprocess
    import sys
    env = {**os.environ, **TORCHRUN}
    out = subprocess.run([sys.executable, "-m", "hvdlite.runner", "--check-build"], env=env,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert "This environment: torchrun (RANK=1, WORLD_SIZE=4" in out


def test_pmix_launches_and_a_library_that_cannot_join_them():
    ompi = L.detect({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1"})
    pmix = L.detect({"PMIX_RANK": "0"})
    assert L.pmix_launch(ompi) and L.pmix_launch(pmix)
    assert not L.pmix_launch(L.detect({"PMI_RANK": "0", "PMI_SIZE": "2"}))
    assert not L.pmix_launch(L.detect(TORCHRUN))
    msg = L.library_error(ompi, "MPICH Version: 5.0.2")
    assert "Open MPI's mpirun" in msg and "rank 1 of 2" in msg and "mpi4py uses MPICH" in msg
    assert "Intel(R) MPI" in L.library_error(pmix, "Intel(R) MPI Library 2021.10")
    assert L.library_error(ompi, "Open MPI v4.1.4, package: Debian") is None
    assert L.library_error(ompi, None) is None

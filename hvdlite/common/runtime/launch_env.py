"""Which launcher started this process, read from its environment, and whether the MPI world
that formed matches what that launcher said.

A process that belongs to an N-process job but trains in a world of 1 gives no error and wrong
results (N separate trainings).  Every launcher says in the environment how many processes it
started; :func:`detect` reads that, and :func:`mismatch_error` turns a disagreement with the MPI
world into one clear message.  Pure logic over a mapping, unit-tested.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Optional

# The kinds, in the order detect() tries them: an MPI launcher's own variables win (a job that
# mpiexec started inside a SLURM allocation or a PyTorchJob pod also has those variables).
MPI = "mpi"
ENV = "env"        # torchrun and everything that follows its env:// convention
SLURM = "slurm"    # srun without an MPI plugin that MPI understands
NONE = "none"

# What launchers set, per kind, for messages: the variables named there are the ones seen.
_MPI_SIZE_VARIABLES = (
    ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "Open MPI's mpirun"),
    ("PMI_SIZE", "PMI_RANK", "a PMI launcher (MPICH's or Intel MPI's mpiexec, srun --mpi=pmi2)"),
    ("PMIX_SIZE", "PMIX_RANK", "a PMIx launcher (prterun, srun --mpi=pmix)"),
)
# Rank variables without a size (the size is MPI's to tell): Hydra's manual launch (hvdlite's
# Ray and torchrun formations), PMIx.
_MPI_RANK_ONLY = (("PMI_ID", "MPICH's manual launch"), ("PMIX_RANK", "a PMIx launcher"))


@dataclasses.dataclass(frozen=True)
class Launch:
    """What the environment says about the job this process belongs to."""

    kind: str                   # MPI, ENV, SLURM or NONE
    launcher: str               # in words, for messages
    size: Optional[int]         # the number of processes the launcher started (None: unknown)
    rank: Optional[int]         # this process's rank among them (None: unknown)
    seen: tuple[tuple[str, str], ...] = ()   # the variables it was read from

    def describe(self) -> str:
        """``launcher (VAR=value, ...)``."""
        seen = ", ".join(f"{k}={v}" for k, v in self.seen)
        return f"{self.launcher} ({seen})" if seen else self.launcher


def _integer(text: Optional[str]) -> Optional[int]:
    text = (text or "").strip()
    return int(text) if text.isdigit() else None


def _pick(environ: Mapping[str, str], names) -> tuple[tuple[str, str], ...]:
    return tuple((name, environ[name]) for name in names if environ.get(name, "").strip())


def detect(environ: Mapping[str, str]) -> Launch:
    """The launcher that ``environ`` (a process's environment) says started this process."""
    for size_var, rank_var, name in _MPI_SIZE_VARIABLES:
        size = _integer(environ.get(size_var))
        if size is not None:
            return Launch(MPI, name, size, _integer(environ.get(rank_var)),
                          _pick(environ, (size_var, rank_var)))
    for rank_var, name in _MPI_RANK_ONLY:
        if _integer(environ.get(rank_var)) is not None:
            return Launch(MPI, name, None, _integer(environ.get(rank_var)),
                          _pick(environ, (rank_var,)))
    size, rank = _integer(environ.get("WORLD_SIZE")), _integer(environ.get("RANK"))
    if size is not None and rank is not None:
        torchrun = bool(environ.get("TORCHELASTIC_RUN_ID", "").strip())
        return Launch(ENV, "torchrun" if torchrun else
                      "an env:// launcher (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)",
                      size, rank, _pick(environ, ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                  "MASTER_ADDR", "MASTER_PORT")))
    # srun sets SLURM_STEP_NUM_TASKS in each task of a job step (a batch script itself is no
    # step of several tasks, so `python train.py` there is one process, as it should be).
    size = _integer(environ.get("SLURM_STEP_NUM_TASKS"))
    if size is not None:
        return Launch(SLURM, "SLURM's srun", size, _integer(environ.get("SLURM_PROCID")),
                      _pick(environ, ("SLURM_STEP_NUM_TASKS", "SLURM_PROCID", "SLURM_STEP_ID",
                                      "SLURM_JOB_ID")))
    return Launch(NONE, "no launcher", None, None)


def how_to_launch(launch: Launch) -> str:
    """What to do instead, for a launch that did not form its world."""
    if launch.kind == SLURM:
        return ("Under SLURM, start the ranks with `srun --mpi=pmi2 ...` (the MPI plugin that "
                "the MPICH wheel understands; `srun --mpi=list` shows those your cluster has), or "
                "run `hvdlite run -np N python train.py` once inside the allocation.")
    if launch.kind == ENV:
        return ("Under torchrun or an env:// launcher, hvd.init() forms the world itself: make "
                "sure nothing initialised MPI before it (no `from mpi4py import MPI` ahead of "
                "hvd.init()), and that every process got the same WORLD_SIZE.")
    if launch.kind == MPI:
        return ("The launcher and the MPI library mpi4py uses must be the same MPI: with the "
                "MPICH wheel, use the `mpiexec` or `hvdlite run` of the same environment (put "
                "its bin/ first on PATH); another MPI's mpirun starts processes that cannot "
                "join each other.")
    return "Launch with `hvdlite run -np N python train.py`, mpiexec, torchrun or srun."


def pmix_launch(launch: Launch) -> bool:
    """Whether Open MPI's launcher (or another PMIx one) started this process: a Hydra-family
    MPI library (MPICH's wheel, Intel MPI) cannot even initialise there."""
    return launch.kind == MPI and any(name.startswith(("OMPI_", "PMIX_"))
                                      for name, _ in launch.seen)


def library_error(launch: Launch, library: Optional[str]) -> Optional[str]:
    """The error for a PMIx launch (:func:`pmix_launch`) of a process whose mpi4py uses an MPI
    of MPICH's family (``library``: its version line), which aborts in ``MPI_Init`` with
    "unsupported PMI version PMIx"; None when they fit or the library is unknown."""
    if not library or "Open MPI" in library or not any(
            family in library for family in ("MPICH", "Intel(R) MPI")):
        return None
    said = f"rank {launch.rank} of {launch.size}" if launch.size is not None \
        else f"rank {launch.rank}"
    return (f"hvd.init(): this process was started by {launch.describe()} as {said}, but "
            f"mpi4py uses {library.split(',')[0]}, which cannot join a world that Open MPI's "
            f"launcher (PMIx) starts: its MPI_Init would abort. {how_to_launch(launch)}")


def mismatch_error(launch: Launch, mpi_size: int, mpi_rank: int,
                   initialised_before: bool = False) -> Optional[str]:
    """The error when the MPI world does not match the launch (None when it does, or when the
    launcher did not say a size).  ``initialised_before``: MPI was initialised before
    ``hvd.init()`` (so hvdlite could not form the world itself)."""
    if launch.size is None or launch.size == mpi_size:
        return None
    said = f"rank {launch.rank} of {launch.size}" if launch.rank is not None \
        else f"{launch.size} processes"
    before = (" MPI was already initialised before hvd.init() (by `from mpi4py import MPI` or "
              "another library), so hvdlite could not form the launcher's world." 
              if initialised_before else "")
    return (f"hvd.init(): this process was started by {launch.describe()} as {said}, but MPI "
            f"formed a world of {mpi_size} (this process is its rank {mpi_rank}). Training "
            f"would go on as {max(1, launch.size // max(mpi_size, 1))} separate jobs that "
            f"never exchange gradients, so hvdlite stops here.{before} "
            f"{how_to_launch(launch)}")


def forecast(launch: Launch, environ: Mapping[str, str], torch_available: bool) -> str:
    """What ``hvd.init()`` would do in this environment, in one sentence (``hvdlite
    --check-build`` prints it).  Pure logic."""
    said = launch.describe()
    if launch.kind == NONE:
        where = (f" (inside SLURM allocation {environ['SLURM_JOB_ID']}: `hvdlite run` there "
                 f"takes the allocation's nodes)" if environ.get("SLURM_JOB_ID") else "")
        return (f"no launcher{where}: hvd.init() forms a world of 1; start N processes with "
                f"hvdlite run, mpiexec, torchrun or srun --mpi=pmi2.")
    if launch.kind == MPI:
        return f"{said}: hvd.init() joins the MPI world it started."
    if launch.kind == SLURM:
        return (f"{said} without a PMI plugin that MPI speaks: MPI would form a world of 1 and "
                f"hvd.init() stops with LaunchError. {how_to_launch(launch)}")
    if (launch.size or 0) <= 1:
        return f"{said}: one process, a world of 1."
    missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if not environ.get(v, "").strip()]
    if missing:
        return f"{said}: hvd.init() would fail: {' and '.join(missing)} not set."
    if not torch_available:
        return (f"{said}: hvd.init() would fail: forming this world needs torch (its TCPStore "
                f"is the rendezvous).")
    agent = environ.get("TORCHELASTIC_USE_AGENT_STORE", "").strip().lower() == "true"
    return (f"{said}: hvd.init() forms the world of {launch.size} through the rendezvous at "
            f"{environ['MASTER_ADDR']}:{environ['MASTER_PORT']} "
            f"({'torchrun agent' if agent else 'served by rank 0'}'s store); every process "
            f"must call it within HVDLITE_START_TIMEOUT.")

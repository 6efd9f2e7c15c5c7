"""DistributedOptimizer in randomly drawn configurations (fixed seeds) at 2 and 3 ranks, each
against a single-process reference built from every rank's gradients; ranks use random
subsets of the model, so gradients are missing on some ranks, on all, or the first time a
sparse embedding is reduced (see tests/torch/workers/torch_optimizer_fuzz_worker.py, whose
``draw_config(seed)`` shows each seed's configuration)."""
import pytest

from tests.mpi_harness import STALL_SAFETY_NET_ENV
from tests.torch.workers import torch_cases as C

SEEDS = list(range(12))   # cover sparse embeddings, closures, clipping, groups, fp16, bpps 2
WORKER = "torch/workers/torch_optimizer_fuzz_worker.py"
TIMEOUT = 300


def _job(mpi_job, np_):
    return mpi_job(np_, [WORKER, ",".join(map(str, SEEDS))], timeout=TIMEOUT,
                   env=STALL_SAFETY_NET_ENV)


@pytest.mark.parametrize("np_", C.NP_VALUES)
def test_every_seed_reported(mpi_job, np_):
    C.check_reported_cases(_job(mpi_job, np_), np_, [f"seed{s}" for s in SEEDS])


@pytest.mark.parametrize("np_, seed", [(n, s) for n in C.NP_VALUES for s in SEEDS])
def test_random_configuration(mpi_job, np_, seed):
    C.check_case(_job(mpi_job, np_), np_, f"seed{seed}")

"""hvdlite.torch SyncBatchNorm under real MPI launches (2 and 3 ranks).

Every rank feeds its own, differently sized batch; the worker compares outputs, gradients and
running statistics with one ``nn.BatchNorm*d`` applied to the concatenation of all ranks' batches
(see tests/torch/workers/torch_syncbn_worker.py, which imports the case list from here).
"""
import pytest

from tests.mpi_harness import STALL_SAFETY_NET_ENV
from tests.torch.workers import torch_cases as C

WORKER = "torch/workers/torch_syncbn_worker.py"
TIMEOUT = 240

_TRAIN = [f"train.{shape}.{dtype}" for shape in ("1d", "1d_seq", "2d", "3d")
          for dtype in ("float64", "float32")]
SYNCBN_CASES = [
    "api.isinstance_and_state_dict",
    "api.bad_input_raises_locally",
    *_TRAIN,
    "train.2d_channels_last.float64",
    "train.momentum_none.float64",
    "train.affine_false.float64",
    "train.no_running_stats.float64",
    "train.empty_rank.float64",
    "train.large_mean.float32",
    "train.float16",
    "train.bfloat16",
    "train.no_grad_forward",
    "edge.all_ranks_empty",
    "edge.global_count_one_raises",
    "eval.uses_running_stats_without_communication",
    "collectives.one_allreduce_forward_one_backward",
    "model.distributed_optimizer",
]


def _job(mpi_job, np):
    return mpi_job(np, [WORKER], timeout=TIMEOUT, env=STALL_SAFETY_NET_ENV)


# one rank too: SyncBatchNorm then takes nn.BatchNorm's own path
NP_VALUES = (1, *C.NP_VALUES, 4)


@pytest.mark.parametrize("np", NP_VALUES)
def test_worker_reports_every_case(mpi_job, np):
    C.check_reported_cases(_job(mpi_job, np), np, SYNCBN_CASES)


@pytest.mark.parametrize("np, case", [pytest.param(n, case, id=f"np{n}-{case}")
                                      for n in NP_VALUES for case in SYNCBN_CASES])
def test_sync_batch_norm(mpi_job, np, case):
    C.check_case(_job(mpi_job, np), np, case)

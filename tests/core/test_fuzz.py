"""Randomized mixed collectives under real MPI launches (2 and 3 ranks), in several engine
configurations: random operations, names, orders, timings, threads and process sets, each
result checked against numpy (see tests/core/workers/core_fuzz_worker.py).

The seeds are fixed, so a failure reproduces: rerun the worker by hand with the seed and flags
of the failing case, e.g. ``mpiexec -n 3 python tests/core/workers/core_fuzz_worker.py 4 25
--sets`` with the configuration's environment.
"""
import pytest

from tests.mpi_harness import assert_case_passed, assert_every_case_reported

TIMEOUT = 300
STEPS = 25
# name -> (environment, worker flags, seeds)
CONFIGS = {
    "default": ({}, [], [0, 1, 2]),
    "threads_and_sets": ({}, ["--threads", "--sets"], [3, 4, 5]),
    "small_cache_small_fusion": ({"HVDLITE_CACHE_CAPACITY": "3",
                                  "HVDLITE_FUSION_THRESHOLD": "4096"}, ["--threads"], [6, 7]),
    "no_cache_no_fusion": ({"HVDLITE_CACHE_CAPACITY": "0", "HVDLITE_FUSION_THRESHOLD": "0"},
                           ["--sets"], [8, 9]),
    "long_cycle_no_shared_memory": ({"HVDLITE_CYCLE_TIME": "20", "HVDLITE_SHM_WINDOW_MB": "0",
                                     "HVDLITE_RESULT_POOL_MB": "0"}, [], [10, 11]),
}
NP_VALUES = (2, 3)


def _job(mpi_job, np_, config):
    env, flags, seeds = CONFIGS[config]
    argv = ["core/workers/core_fuzz_worker.py", ",".join(map(str, seeds)), str(STEPS), *flags]
    return mpi_job(np_, argv, timeout=TIMEOUT, env=env)


def _params():
    return [pytest.param(n, config, seed, id=f"np{n}-{config}-seed{seed}")
            for n in NP_VALUES for config, (_, _, seeds) in CONFIGS.items() for seed in seeds]


@pytest.mark.parametrize("np_,config,seed", _params())
def test_random_steps(mpi_job, np_, config, seed):
    assert_case_passed(_job(mpi_job, np_, config), np_, f"seed{seed}")


@pytest.mark.parametrize("np_", NP_VALUES)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_every_seed_reported(mpi_job, np_, config):
    assert_every_case_reported(_job(mpi_job, np_, config), np_,
                               [f"seed{s}" for s in CONFIGS[config][2]])

"""Real ``hvdlite run -np 2`` jobs with horovodrun's --config-file, --tcp, --thread-affinity,
--prefix-output-with-timestamp, --log-with-timestamp and the autotune flags, all in one launch (each launch costs
seconds of the CI's budget); the parsing is tested in tests/unit/runner/."""
from __future__ import annotations

import json
import os
import re
import sys

import pytest

from tests.launcher.test_hvdlite_run import _output, run_cli

# Each rank reports, after an allreduce (so that its engine thread runs), the cores its engine
# threads may run on (Linux pins a thread by its native id), the variables --tcp set and the
# fusion threshold the engine parsed, and the autotune settings its engine runs with.
WORKER = (
    "import json, os, sys, threading, numpy as np, hvdlite as hvd\n"
    "from hvdlite.common.config import Config\n"
    "from hvdlite.common.runtime import state\n"
    "hvd.init()\n"
    "tuner = state.engine().retuner\n"
    "opts = tuner.manager.options if tuner is not None else None\n"
    "hvd.allreduce(np.ones(3), name='x')\n"
    "cores = []\n"
    "for t in threading.enumerate():\n"
    "    if t.name == 'hvdlite-engine':\n"
    "        with open(f'/proc/self/task/{t.native_id}/status') as f:\n"
    "            cores += [l.split(':')[1].strip() for l in f\n"
    "                      if l.startswith('Cpus_allowed_list')]\n"
    "env = {k: os.environ.get(k) for k in ('MPIR_CVAR_CH4_NETMOD', 'FI_PROVIDER',\n"
    "                                      'NCCL_IB_DISABLE')}\n"
    "report = {'rank': hvd.rank(), 'local': hvd.local_rank(), 'cores': cores, 'env': env,\n"
    "          'fusion': Config.from_env().fusion_threshold,\n"
    "          'autotune': opts and [opts.warmup_samples, opts.steps_per_sample,\n"
    "                                opts.bayes_opt_max_samples, opts.gaussian_process_noise,\n"
    "                                opts.log_file]}\n"
    "print('PROBE ' + json.dumps(report), flush=True)\n"
    "print(f'err {hvd.rank()}', file=sys.stderr, flush=True)\n"
)
STAMP = r"\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4}"   # time.asctime(), Horovod's prefix


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread affinity is Linux's")
def test_config_file_tcp_thread_affinity_and_timestamps(tmp_path):
    cores = sorted(os.sched_getaffinity(0))
    wanted = [cores[-1], cores[0]]   # local rank 0 on the last core, 1 on the first
    config = tmp_path / "horovod.yaml"
    config.write_text("controller: mpi\nparams:\n  fusion_threshold_mb: 2\n"
                      f"library_options:\n  thread_affinity: '{wanted[0]},{wanted[1]}'\n"
                      "logging:\n  with_timestamp: true\n"
                      "autotune:\n  enabled: true\n  log_file: tune.csv\n"
                      "  warmup_samples: 2\n  steps_per_sample: 4\n")
    result = run_cli(["run", "-np", "2", "--config-file", str(config), "--tcp",
                      "--prefix-output-with-timestamp", "--verbose",
                      "--autotune-bayes-opt-max-samples", "7",
                      "--autotune-gaussian-process-noise", "0.5", sys.executable, "-c",
                      WORKER], cwd=tmp_path)
    assert result.returncode == 0, _output(result)
    lines = result.stdout.splitlines()
    reports = {}
    for line in lines:   # every line of the ranks' output carries Horovod's prefix
        match = re.fullmatch(rf"{STAMP}\[(\d)\]<stdout>:PROBE (.*)", line)
        assert match, _output(result)
        reports[int(match.group(1))] = match.group(2)
    assert sorted(reports) == [0, 1], _output(result)
    for rank, text in reports.items():
        report = json.loads(text)
        assert report["rank"] == rank
        assert report["cores"] and set(report["cores"]) == {str(wanted[report["local"]])}, text
        assert report["env"] == {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp",
                                 "NCCL_IB_DISABLE": "1"}
        assert report["fusion"] == 2 * 2**20
        # autotune from the file and the command line; the log's path made absolute
        assert report["autotune"] == [2, 4, 7, 0.5, str(tmp_path / "tune.csv")], text
        assert re.search(rf"^{STAMP}\[{rank}\]<stderr>:err {rank}$", result.stderr, re.M)
    assert (tmp_path / "tune.csv").read_text().startswith(
        "hierarchical_allreduce,hierarchical_allgather,torus_allreduce,cache_enabled,")
    # the launcher's own lines (--verbose) carry a timestamp: logging.with_timestamp
    assert re.search(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}\] hvdlite: MPI: ",
                     result.stderr, re.M), _output(result)

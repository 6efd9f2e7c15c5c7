"""hvdlite.tensorflow.SyncBatchNormalization in one process, without mpiexec (``hvd.init()``
gives a job of one rank): there it must be exactly ``keras.layers.BatchNormalization``.

The worker of tests/tensorflow/test_syncbn.py runs as a plain subprocess (TensorFlow stays out of
the pytest process); every case compares with Keras' own layer, one case bit for bit.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from tests.mpi_harness import STALL_SAFETY_NET_ENV, TESTS, base_env
from tests.tensorflow.workers.tf_syncbn_cases import cases_for

pytest.importorskip("tensorflow")

_result: dict = {}


def _single_rank_report() -> dict:
    if "report" not in _result:
        out = tempfile.mkdtemp(prefix="hvdlite-test-")
        try:
            worker = TESTS / "tensorflow/workers/tf_syncbn_worker.py"
            proc = subprocess.run([sys.executable, str(worker)],
                                  env=base_env({"HVDLITE_TEST_OUT": out, **STALL_SAFETY_NET_ENV}),
                                  capture_output=True, text=True, timeout=300)
            path = os.path.join(out, "rank0.json")
            report = json.load(open(path)) if os.path.exists(path) else None
        finally:
            shutil.rmtree(out, ignore_errors=True)
        _result["report"] = (proc.returncode, report, proc.stdout[-3000:] + proc.stderr[-3000:])
    return _result["report"]


def test_single_rank_reports_every_case():
    code, report, output = _single_rank_report()
    assert code == 0 and report is not None, output
    assert sorted(report) == sorted(cases_for(1))


@pytest.mark.parametrize("case", cases_for(1))
def test_single_rank(case):
    code, report, output = _single_rank_report()
    assert report is not None, output
    assert case in report, f"case not reported\n{output}"
    assert report[case] is None, report[case]

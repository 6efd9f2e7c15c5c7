"""Optional frameworks stay optional: each adapter imports without the other framework."""
import subprocess
import sys

import pytest

CHECK = "import sys, {mod}; bad = [m for m in {forbidden!r} if m in sys.modules]; print(bad); " \
        "sys.exit(1 if bad else 0)"


@pytest.mark.parametrize("mod,forbidden", [
    ("hvdlite", ["torch", "tensorflow", "mpi4py.MPI"]),
    ("hvdlite.torch", ["tensorflow", "keras"]),
    ("hvdlite.tensorflow", ["torch"]),
    ("hvdlite.tensorflow.keras", ["torch"]),
    ("hvdlite.keras", ["torch"]),
])
def test_import_isolation(mod, forbidden):
    proc = subprocess.run([sys.executable, "-c", CHECK.format(mod=mod, forbidden=forbidden)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"importing {mod} also imported {proc.stdout.strip()}\n" \
                                 f"{proc.stderr[-2000:]}"


ALIAS_CHECK = """
import hvdlite.keras as hk, hvdlite.tensorflow.keras as tk
import hvdlite.keras.callbacks as cb
names = [n for n in dir(tk) if not n.startswith('_')]
missing = [n for n in names if getattr(hk, n, None) is not getattr(tk, n)
           and n not in ('callbacks', 'elastic')]
assert not missing, missing
for n in ('BroadcastGlobalVariablesCallback', 'MetricAverageCallback',
          'LearningRateScheduleCallback', 'LearningRateWarmupCallback', 'BestModelCheckpoint'):
    assert getattr(hk.callbacks, n) is getattr(tk.callbacks, n), n
assert cb is hk.callbacks
import hvdlite.keras.elastic as ke, hvdlite.tensorflow.keras.elastic as tke
assert hk.elastic is ke and all(getattr(ke, n) is getattr(tke, n) for n in tke.__all__)
print('ok')
"""


def test_hvdlite_keras_is_the_keras_adapter_under_horovods_other_name():
    """``horovod.keras`` scripts change only their import: hvdlite.keras offers every name of
    hvdlite.tensorflow.keras (the same objects), its callbacks and its elastic API."""
    proc = subprocess.run([sys.executable, "-c", ALIAS_CHECK], capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.parametrize("mod", ["hvdlite", "hvdlite.torch", "hvdlite.tensorflow",
                                 "hvdlite.tensorflow.keras", "hvdlite.keras"])
def test_build_queries_answer_truthfully(mod):
    """Horovod's build queries exist in every adapter (its scripts call them before init);
    those for back ends hvdlite does not have say False."""
    code = (f"import {mod} as hvd; "
            "assert all(getattr(hvd, q)() is False for q in ('gloo_built', 'gloo_enabled', "
            "'ddl_built', 'ccl_built', 'rocm_built', 'sycl_built')), 'a query says True'; "
            "assert hvd.mpi_built() is True; print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]

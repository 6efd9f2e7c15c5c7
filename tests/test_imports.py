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
])
def test_import_isolation(mod, forbidden):
    proc = subprocess.run([sys.executable, "-c", CHECK.format(mod=mod, forbidden=forbidden)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"importing {mod} also imported {proc.stdout.strip()}\n" \
                                 f"{proc.stderr[-2000:]}"

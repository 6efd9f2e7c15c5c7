"""hvdlite.jax stays an optional adapter: without JAX its import says what to install, and it
imports neither torch nor TensorFlow."""
import subprocess
import sys

import pytest

from tests.mpi_harness import REPO


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=REPO)


def test_import_without_jax_says_what_to_install():
    proc = _python("import sys; sys.modules['jax'] = None\n"
                   "try:\n    import hvdlite.jax\nexcept ImportError as e:\n    print(e)\n"
                   "else:\n    print('imported')")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "pip install hvdlite[jax]" in proc.stdout, proc.stdout


def test_import_isolation_and_one_rank_use():
    pytest.importorskip("jax")
    proc = _python(
        "import sys, jax, jax.numpy as jnp, hvdlite.jax as hvd\n"
        "bad = [m for m in ('torch', 'tensorflow') if m in sys.modules]\n"
        "assert not bad, bad\n"
        "hvd.init()\n"
        "assert float(jax.jit(hvd.allreduce)(jnp.ones(()) * 3)) == 3.0\n"
        "assert hvd.mpi_built() is True and hvd.gloo_built() is False\n"
        "print('ok')")
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]

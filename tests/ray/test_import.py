"""Without Ray, ``import hvdlite.ray`` says what to install."""
import subprocess
import sys

from tests.ray.procs import REPO


def test_import_without_ray_says_what_to_install():
    # sys.modules["ray"] = None makes "import ray" fail as if Ray were not installed.
    code = "import sys; sys.modules['ray'] = None; import hvdlite.ray"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode != 0
    assert 'ImportError: hvdlite.ray needs Ray' in done.stderr
    assert 'pip install "hvdlite[ray]"' in done.stderr


def test_hvdlite_imports_without_ray():
    code = "import sys; sys.modules['ray'] = None; import hvdlite, hvdlite.torch"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr

#!/usr/bin/env bash
# One command for a machine with an NVIDIA GPU: versions (nvidia-smi, torch, CuPy, NCCL, MPI),
# `hvdlite run --check-build`, a 2-rank MPI world, the GPU test set (tests/gpu) and the per-step
# overhead benchmark against DDP (benchmarks/gpu_step_overhead.py). Every step runs under its own timeout and the script goes on
# after a failed step; the summary at the end lists each step's status, and the exit status is
# non-zero if the tests or the benchmark failed.
#
#   bash scripts/gpu_check.sh                 # every step
#   bash scripts/gpu_check.sh info tests      # only some: info, tests, bench
#
# The log (and the benchmark's JSON, the tests' JUnit XML) go to $OUT when it is set.
# Environment knobs: PYTHON (interpreter; default: the first of .venv/bin/python, python3, python
# whose torch sees a GPU), GPU_CHECK_TEST_TIMEOUT (s, default 480), GPU_CHECK_BENCH_TIMEOUT
# (s, default 330), GPU_CHECK_PYTEST_ARGS (extra pytest arguments, e.g. "-k staged"),
# GPU_CHECK_BENCH_ARGS (benchmark arguments; default "--rounds 2 --blocks 4 --steps 30 --warmup 10",
# about 80 s on an H100).
#
# MPI: the tests and the benchmark launch ranks with mpiexec (the one next to $PYTHON first, then
# PATH). A GPU image without MPI (or whose mpi4py loads another MPI) needs the mpi4py and MPICH
# wheels for its Python in .whl/ (ignored by git): `pip download --no-deps --only-binary=:all:
# --python-version 3.12 --platform manylinux_2_28_x86_64 -d .whl mpi4py==4.1.2 mpich==5.0.2`.
# Carry .whl along; this script installs them first (verified on an H100 image, 2026-11-26).
set -u
cd "$(dirname "$0")/.." || exit 2
REPO="$PWD"
STEPS=("$@")
[ ${#STEPS[@]} -eq 0 ] && STEPS=(info tests bench)
TEST_TIMEOUT="${GPU_CHECK_TEST_TIMEOUT:-480}"
BENCH_TIMEOUT="${GPU_CHECK_BENCH_TIMEOUT:-330}"
OUT_DIR="${OUT:-}"

want() {   # want STEP: was STEP asked for?
  local s
  for s in "${STEPS[@]}"; do [ "$s" = "$1" ] && return 0; done
  return 1
}

run_step() {   # run_step NAME SECONDS CMD...: run with a timeout, record and report the status
  local name="$1" secs="$2" rc shown
  shift 2
  shown="$*"
  shown="${shown//$'\n'/ }"
  [ "${#shown}" -gt 160 ] && shown="${shown:0:160}..."
  echo
  echo "===== [$name] $shown (timeout ${secs}s)"
  local started=$SECONDS
  timeout --kill-after=20 "$secs" "$@"
  rc=$?
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    echo "===== [$name] TIMED OUT after ${secs}s"
  else
    echo "===== [$name] exit status $rc after $((SECONDS - started))s"
  fi
  RESULTS+=("$name: $( [ "$rc" -eq 0 ] && echo ok || echo "FAILED (exit $rc)")")
  return "$rc"
}

pick_python() {
  local cand
  if [ -n "${PYTHON:-}" ]; then echo "$PYTHON"; return; fi
  for cand in .venv/bin/python python3 python; do
    if command -v "$cand" >/dev/null 2>&1 && timeout 120 "$cand" -c \
        'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
      echo "$cand"; return
    fi
  done
  for cand in .venv/bin/python python3 python; do   # no GPU seen: still report, then skip
    if command -v "$cand" >/dev/null 2>&1; then echo "$cand"; return; fi
  done
  echo python3
}

use_carried_mpich() {   # use_carried_mpich DIR: make mpi4py load the MPICH carried under DIR
  # mpi4py's wheels pick an MPI ABI at import; an image's own Open MPI (a system libmpi) would
  # win, and every rank would then start as a singleton of its own under MPICH's mpiexec (seen
  # on an H200 image, 2026-11-26: the 2-rank jobs failed).
  local lib
  lib="$(find "$1" -name 'libmpi.so.12' 2>/dev/null | head -1)"
  if [ -n "$lib" ]; then
    export MPI4PY_LIBMPI="$lib" MPI4PY_MPIABI=mpich
    export LD_LIBRARY_PATH="$(dirname "$lib")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    echo "mpi4py will load MPICH from $lib"
  else
    echo "WARNING: no libmpi.so.12 under $1: mpi4py keeps the MPI it finds (jobs of 2+ ranks"
    echo "WARNING: need mpi4py and mpiexec from the same MPI)"
  fi
}

install_carried_wheels() {
  # Into a folder of its own, first on PYTHONPATH and PATH, so the carried mpi4py and mpiexec win
  # over the image's. pip --target installs a wheel's scripts (MPICH's bin/) but drops its data
  # libraries (lib/libmpi.so.12), so MPICH's lib/ is unpacked from the wheel itself.
  compgen -G ".whl/*.whl" >/dev/null || return 0
  local site=/tmp/hvdlite-site mpich_libs=/tmp/hvdlite-mpich wheel
  echo "===== installing carried wheels: $(ls .whl/*.whl | xargs -n1 basename | tr '\n' ' ')"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" .whl/*.whl || { echo "WARNING: wheel install failed"; return 1; }
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  export PATH="$site/bin:$PATH"
  for wheel in .whl/mpich-*.whl; do
    [ -e "$wheel" ] || continue
    "$PY" -c 'import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    z.extractall(sys.argv[2], [n for n in z.namelist() if "/data/lib/" in n])' \
      "$wheel" "$mpich_libs" || echo "WARNING: could not unpack $wheel's libraries"
  done
  use_carried_mpich "$mpich_libs"
}

VERSIONS_PY='
import importlib, platform, sys
print(f"python {platform.python_version()} at {sys.executable}")
def show(label, fn):
    try:
        print(f"{label}: {fn()}")
    except Exception as exc:
        print(f"{label}: unavailable ({type(exc).__name__}: {exc})")
def torch_info():
    import torch
    s = f"{torch.__version__}, CUDA {torch.version.cuda}, cudnn {torch.backends.cudnn.version()}"
    s += f", cuda available {torch.cuda.is_available()}, {torch.cuda.device_count()} device(s)"
    for i in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(i)
        s += f"; cuda:{i} {torch.cuda.get_device_name(i)} (sm_{major}{minor})"
    return s
def cupy_info():
    import cupy
    rt = cupy.cuda.runtime
    return (f"{cupy.__version__}, runtime {rt.runtimeGetVersion()}, driver {rt.driverGetVersion()}, "
            f"{rt.getDeviceCount()} device(s)")
def nccl_info():
    from hvdlite.common.gpu import cuda
    from hvdlite.runner.check_build import nccl_version_string
    code = cuda.nccl_version()
    if not code:
        return f"NOT usable ({cuda._import_nccl()[2]})"
    from cupy.cuda import nccl
    return f"{nccl_version_string(code)} (code {code}; CuPy built against {nccl.get_build_version()})"
def mpi_info():
    import mpi4py
    from mpi4py import MPI
    return f"mpi4py {mpi4py.__version__}; " + MPI.Get_library_version().splitlines()[0].strip()
def mpiexec_info():
    from tests.mpi_harness import mpiexec_path
    return mpiexec_path()
show("torch", torch_info)
show("cupy", cupy_info)
show("nccl (via hvdlite)", nccl_info)
show("numpy", lambda: importlib.import_module("numpy").__version__)
show("ml_dtypes", lambda: importlib.import_module("ml_dtypes").__version__)
show("pytest", lambda: importlib.import_module("pytest").__version__)
show("mpi", mpi_info)
show("mpiexec (as the tests find it)", mpiexec_info)
'

main() {
  RESULTS=()
  local failed=0
  echo "hvdlite GPU check, $(date -u '+%Y-%m-%d %H:%M:%S UTC'), repo $REPO, steps: ${STEPS[*]}"
  PY="$(pick_python)"
  echo "python: $PY"
  export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"   # hvdlite need not be installed
  export PYTHONUNBUFFERED=1
  install_carried_wheels

  if want info; then
    echo
    echo "===== [nvidia-smi]"
    if command -v nvidia-smi >/dev/null 2>&1; then
      timeout 60 nvidia-smi || echo "nvidia-smi failed (exit $?)"
    else
      echo "nvidia-smi not found"
    fi
    run_step versions 180 "$PY" -c "$VERSIONS_PY"
    run_step check-build 120 "$PY" -m hvdlite.runner run --check-build
    # The 2-rank jobs need mpiexec and mpi4py from the same MPI: one world of 2, not 2 singletons.
    run_step mpi-2-ranks 60 "$(command -v mpiexec || echo mpiexec)" -n 2 "$PY" -c \
      'from mpi4py import MPI; c = MPI.COMM_WORLD; n = c.allreduce(1)
print(f"rank {c.Get_rank()} of {c.Get_size()} on {MPI.Get_processor_name()}: allreduce(1) = {n}")
assert c.Get_size() == n == 2, "mpiexec and mpi4py are not the same MPI"'
  fi

  # mpiexec: the same search as tests/mpi_harness.py
  if ! "$PY" -c 'from tests.mpi_harness import mpiexec_path; mpiexec_path()' >/dev/null 2>&1; then
    echo
    echo "!!!!! no mpiexec found (next to $PY or on PATH): every multi-process GPU test and the"
    echo "!!!!! benchmark will fail. Carry the wheels: on a machine with PyPI access, in the"
    echo "!!!!! repo root: pip download --no-deps --only-binary=:all: --python-version 3.12"
    echo "!!!!!   --platform manylinux_2_28_x86_64 -d .whl mpi4py==4.1.2 mpich==5.0.2"
    echo "!!!!!   (match this machine's Python),"
    echo "!!!!! carry .whl, and run this script again (it installs .whl/*.whl first)."
  fi

  if want tests; then
    local junit=()
    [ -n "$OUT_DIR" ] && junit=(--junitxml "$OUT_DIR/gpu_tests.xml")
    # shellcheck disable=SC2086  # GPU_CHECK_PYTEST_ARGS is split on purpose
    run_step tests "$TEST_TIMEOUT" "$PY" -m pytest -q -rfEs tests/gpu "${junit[@]}" \
      ${GPU_CHECK_PYTEST_ARGS:-} || failed=1
  fi

  if want bench; then
    local json=()
    [ -n "$OUT_DIR" ] && json=(--json "$OUT_DIR/gpu_step_overhead.json")
    # shellcheck disable=SC2086
    run_step bench "$BENCH_TIMEOUT" "$PY" benchmarks/gpu_step_overhead.py "${json[@]}" \
      ${GPU_CHECK_BENCH_ARGS:---rounds 2 --blocks 4 --steps 30 --warmup 10} || failed=1
  fi

  echo
  echo "===== summary"
  local line
  for line in "${RESULTS[@]}"; do echo "  $line"; done
  return "$failed"
}

if [ -n "$OUT_DIR" ]; then
  mkdir -p "$OUT_DIR"
  set -o pipefail
  main 2>&1 | tee "$OUT_DIR/gpu_check.log"
  exit "${PIPESTATUS[0]}"
fi
main

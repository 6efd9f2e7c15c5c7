#!/usr/bin/env bash
# Create (or update) the project's virtual environment in .venv with everything the examples
# and the test suite need: hvdlite itself (editable), numpy, mpi4py, the MPICH wheel (a working
# mpiexec), PyTorch's CPU wheel, TensorFlow CPU, JAX (CPU) with optax, scikit-learn, pytest,
# MkDocs (the suite builds the docs), Ray (hvdlite.ray) and PySpark (hvdlite.spark; it needs
# a Java 17+ runtime). Safe to run repeatedly.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
# torch is pinned: an unpinned torch pulls several GB of CUDA packages.
TORCH_SPEC="${HVDLITE_TORCH_SPEC:-torch==2.13.0}"
TF_SPEC="${HVDLITE_TF_SPEC:-tensorflow-cpu==2.21.0}"
TF_KERAS_SPEC="${HVDLITE_TF_KERAS_SPEC:-tf-keras==2.21.0}"
# JAX's CPU wheels and optax (hvdlite.jax, Keras 3's JAX backend), pinned like torch and TF.
JAX_SPEC="${HVDLITE_JAX_SPEC:-jax==0.10.2 jaxlib==0.10.2 optax==0.2.8}"

if [ ! -x .venv/bin/python ]; then
  echo "[bootstrap] creating .venv with $($PYTHON --version)"
  "$PYTHON" -m venv .venv
fi
stamp=".venv/.hvdlite-installed"
want="$(cat setup.py scripts/bootstrap.sh | sha256sum | cut -c1-16)"
want="$want $TORCH_SPEC $TF_SPEC $TF_KERAS_SPEC $JAX_SPEC"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "[bootstrap] installing hvdlite and its test/example/docs dependencies"
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet "$TORCH_SPEC" "$TF_SPEC" $JAX_SPEC \
    -e ".[test,examples,docs,ray,spark,jax]"
  # Keras 2 for the tf-keras tests (TF_USE_LEGACY_KERAS=1): matched to TensorFlow, and without
  # its dependency on the full `tensorflow` wheel (tensorflow-cpu is already there).
  .venv/bin/python -m pip install --quiet --no-deps "$TF_KERAS_SPEC"
  echo "$want" > "$stamp"
fi
# The venv's MPICH mpiexec must win over any other MPI on PATH (a foreign mpiexec fails
# to launch it with a PMI error).
export PATH="$PWD/.venv/bin:$PATH"

#!/usr/bin/env bash
# The main job: a real 2-rank data-parallel training run of examples/pytorch_digits.py on
# scikit-learn's bundled digits data set, launched with `hvdlite run`. Bootstraps .venv first.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bootstrap.sh
export OMP_NUM_THREADS=1
NP="${NP:-2}"
exec .venv/bin/hvdlite run -np "$NP" .venv/bin/python examples/pytorch_digits.py \
  --min-accuracy 0.95 "$@"

#!/usr/bin/env bash
# Run the whole test suite (unit tests + real multi-process MPI tests). Bootstraps .venv first.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bootstrap.sh
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
# pytest exits 5 when it collected no tests: that is a failure here, as is any other non-zero.
exec .venv/bin/python -m pytest -q "$@"

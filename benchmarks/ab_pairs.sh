#!/usr/bin/env bash
# Run the allreduce, framework, cross-host and training-scaling benchmarks on two revisions in
# alternating pairs (base, head, base, head, ...), so that a drifting machine hits both alike.
# Usage: benchmarks/ab_pairs.sh BASE_REV [PAIRS] [OUT_DIR]   (run as root for the cross-host one)
# Each benchmark imports hvdlite from its own checkout; BASE_REV is checked out in a worktree.
set -uo pipefail
cd "$(dirname "$0")/.."
base_rev=${1:?usage: benchmarks/ab_pairs.sh BASE_REV [PAIRS] [OUT_DIR]}
pairs=${2:-3}
out=${3:-/tmp/ab_pairs}
head_dir=$PWD
base_dir=$(mktemp -d /tmp/ab_base.XXXXXX)
git worktree add -q --detach "$base_dir" "$base_rev"
trap 'git worktree remove --force "$base_dir"' EXIT
mkdir -p "$out"
export PATH=$head_dir/.venv/bin:$PATH OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
py=$head_dir/.venv/bin/python

bench() {  # bench SIDE DIR I: every benchmark once, from checkout DIR
  local side=$1 dir=$2 i=$3
  (cd "$dir" &&
    timeout -k 5 300 mpiexec -n 2 "$py" benchmarks/allreduce_benchmark.py \
      --sizes 4KiB,1MiB,16MiB --json "$out/allreduce.$side.$i.json" >"$out/allreduce.$side.$i.log" 2>&1
    timeout -k 5 300 mpiexec -n 2 "$py" benchmarks/framework_benchmark.py --framework torch \
      --large-mib 16 --json "$out/framework.$side.$i.json" >"$out/framework.$side.$i.log" 2>&1
    timeout -k 5 600 "$py" benchmarks/cross_host_benchmark.py --layout 2+2 --runs 1 \
      --sizes 16MiB --json "$out/cross_host.$side.$i.json" -- --time-budget 2 \
      >"$out/cross_host.$side.$i.log" 2>&1
    timeout -k 5 600 "$py" benchmarks/training_scaling.py --ranks 2 --rounds 1 --no-references \
      >"$out/training.$side.$i.log" 2>&1)
  echo "$(date +%T) $side $i done (exit $?)"
}

for i in $(seq 1 "$pairs"); do
  bench base "$base_dir" "$i"
  bench head "$head_dir" "$i"
done
echo "logs and JSON in $out"

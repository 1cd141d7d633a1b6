#!/usr/bin/env bash
# Time one of flashnumba's implementations at an earlier commit (ab/flashnumba, from scripts/ab_package.sh) and at
# the working tree in the same call on the GPU machine, the peers beside the latter:
#   IMPLS="flashnumba_wgmma" PEERS="torch_sdpa_flash torch_sdpa_cudnn" bash scripts/ab_bench.sh NAME BENCH_ARGS...
# writes $OUT/NAME-before and $OUT/NAME-after (bench.json, plots) and NAME.log (both tables).
set -uo pipefail
OUT=${OUT:-out}; name=${1:?usage: bash scripts/ab_bench.sh NAME BENCH_ARGS...}; shift
export PYTHONUNBUFFERED=1 NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
impls=${IMPLS:-flashnumba_wgmma}
{
  echo "=== before: $(cat ab/REV 2>/dev/null || echo ab/flashnumba) $(date -u +%FT%TZ)"
  PYTHONPATH=$PWD/ab timeout ${BENCH_TIMEOUT:-280} python3 -m flashnumba bench "$@" --impls $impls \
    --out "$OUT/$name-before" 2>&1 | grep -v "it/s"
  echo "=== after: $(git rev-parse --short HEAD 2>/dev/null) $(date -u +%FT%TZ)"
  PYTHONPATH=$PWD timeout ${BENCH_TIMEOUT:-280} python3 -m flashnumba bench "$@" --impls $impls ${PEERS:-} \
    --out "$OUT/$name-after" 2>&1 | grep -v "it/s"
} | tee "$OUT/$name.log"

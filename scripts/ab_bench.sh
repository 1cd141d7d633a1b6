#!/usr/bin/env bash
# Time one of flashnumba's implementations at an earlier commit (ab/flashnumba, from scripts/ab_package.sh) and at
# the working tree in the same call on the GPU machine, the peers beside the latter:
#   IMPLS="flashnumba_wgmma" PEERS="torch_sdpa_flash torch_sdpa_cudnn" bash scripts/ab_bench.sh NAME BENCH_ARGS...
# writes $OUT/NAME-before and $OUT/NAME-after (bench.json, plots) and NAME.log (both tables). Each side runs with
# python -P: plain `python -m` puts the working directory (the repository's root, holding the working tree's
# package) first on the import path, ahead of PYTHONPATH, and the "before" side would time the working tree too.
set -uo pipefail
OUT=${OUT:-out}; name=${1:?usage: bash scripts/ab_bench.sh NAME BENCH_ARGS...}; shift
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
impls=${IMPLS:-flashnumba_wgmma}
{
  echo "=== before: $(cat ab/REV 2>/dev/null || echo ab/flashnumba) $(date -u +%FT%TZ)"
  PYTHONPATH=$PWD/ab python3 -P -c "import flashnumba; print('package:', flashnumba.__file__)" 2>&1 | tail -1
  PYTHONPATH=$PWD/ab timeout ${BENCH_TIMEOUT:-280} python3 -P -m flashnumba bench "$@" --impls $impls \
    --out "$OUT/$name-before" 2>&1 | grep -v "it/s"
  echo "=== after: $(git rev-parse --short HEAD 2>/dev/null) $(date -u +%FT%TZ)"
  PYTHONPATH=$PWD python3 -P -c "import flashnumba; print('package:', flashnumba.__file__)" 2>&1 | tail -1
  PYTHONPATH=$PWD timeout ${BENCH_TIMEOUT:-280} python3 -P -m flashnumba bench "$@" --impls $impls ${PEERS:-} \
    --out "$OUT/$name-after" 2>&1 | grep -v "it/s"
} | tee "$OUT/$name.log"

#!/usr/bin/env bash
# The package as it was at an earlier commit, beside the working tree, so that one call on the GPU can time the
# two in the same run: `bash scripts/ab_package.sh REV` writes ab/flashnumba (ignored by git); then
#   PYTHONPATH=$PWD/ab python -P -m flashnumba bench ... --impls flashnumba_wgmma --out out/before
#   PYTHONPATH=$PWD python -P -m flashnumba bench ... --impls flashnumba_wgmma torch_sdpa_flash --out out/after
# (-P: without it `python -m` imports the working directory's package first; scripts/ab_bench.sh does both)
# (their compiled kernels are kept apart: the disk cache's key holds the kernels' source). The device tool carries
# the folder with carry=["ab"].
set -euo pipefail
rev=${1:?usage: bash scripts/ab_package.sh REV}
rm -rf ab
mkdir -p ab
git archive "$rev" flashnumba | tar -x -C ab
git rev-parse --short "$rev" > ab/REV
echo "ab/flashnumba: flashnumba at $(cat ab/REV)"

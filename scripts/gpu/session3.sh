export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 FLASHNUMBA_CACHE_DIR=$PWD/.gpucache NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
mkdir -p $OUT
(
echo "=== wgmma tests $(date +%T)"; FLASHNUMBA_FAILURE_LOG=$OUT/fail-wgmma.log timeout 200 python -m pytest -q -p no:cacheprovider -rfE -n 16 --durations=3 tests/test_wgmma.py 2>&1 | tail -6
head -c 3000 $OUT/fail-wgmma.log 2>/dev/null
echo "=== tiles $(date +%T)"; timeout 80 python scripts/gpu/wgmma_tiles.py
echo "=== sanitize $(date +%T)"
for tool in memcheck racecheck synccheck; do timeout 55 compute-sanitizer --tool $tool --report-api-errors no --print-limit 10 python scripts/sanitize_wgmma.py > $OUT/sanitize-$tool.txt 2>&1; tail -2 $OUT/sanitize-$tool.txt; done
echo "=== bench $(date +%T)"
timeout 150 python -m flashnumba bench --seqlens 4096 16384 --head-dims 64 128 --causal both --dtypes float16 --passes fwd --impls flashnumba_wgmma flashnumba_tc torch_sdpa_flash torch_sdpa_cudnn --both-modes --out $OUT/bench-wgmma 2>&1 | grep -v "it/s" | tail -33
echo "=== decode prelaunch $(date +%T)"; timeout 45 python scripts/decode_profile.py prelaunch 32 8192
) > $OUT/gpu3.log 2>&1
tar czf $OUT/gpucache.tgz .gpucache 2>/dev/null
cat $OUT/gpu3.log | tail -c 11000

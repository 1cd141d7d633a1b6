export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 FLASHNUMBA_CACHE_DIR=$PWD/.gpucache NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
mkdir -p $OUT
(
echo "=== hopper tests"; FLASHNUMBA_FAILURE_LOG=$OUT/fail-hopper.log timeout 150 python -m pytest -q -p no:cacheprovider -rfE tests/test_ptx_hopper.py 2>&1 | tail -15
echo "=== memcheck hopper"; timeout 120 compute-sanitizer --tool memcheck --report-api-errors no --print-limit 20 python -m pytest -q -p no:cacheprovider tests/test_ptx_hopper.py 2>&1 | tail -8
echo "=== torch kvcache"; FLASHNUMBA_FAILURE_LOG=$OUT/fail-torch.log timeout 150 python -m pytest -q -p no:cacheprovider -rfE -n 8 tests/test_torch.py -k kvcache 2>&1 | tail -15
echo "=== prelaunch 32 8192"; timeout 60 python scripts/decode_profile.py prelaunch 32 8192
echo "=== host 32 8192"; timeout 60 python scripts/decode_profile.py host 32 8192 | head -45
echo "=== deep 32 32768 paged/contig"; DEEP_QUICK=1 timeout 60 python scripts/decode_profile.py deep 32 32768 256; DEEP_QUICK=1 timeout 50 python scripts/decode_profile.py deep 32 32768
echo "=== splits paged 32768"; timeout 60 python scripts/decode_profile.py splits 32 32768 256
) > $OUT/gpu1.log 2>&1
tar czf $OUT/gpucache.tgz .gpucache 2>/dev/null
tail -c 11000 $OUT/gpu1.log

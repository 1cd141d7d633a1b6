export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 FLASHNUMBA_CACHE_DIR=$PWD/.gpucache NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
mkdir -p $OUT
echo "=== wgmma tests $(date +%T)"; FLASHNUMBA_FAILURE_LOG=$OUT/fail-wgmma.log timeout 100 python -m pytest -q -p no:cacheprovider -rfE -n 16 -k "gpu_sizes" tests/test_wgmma.py > $OUT/tests.log 2>&1; tail -3 $OUT/tests.log; head -c 2000 $OUT/fail-wgmma.log 2>/dev/null
echo "=== bench $(date +%T)"
timeout 100 python -m flashnumba bench --seqlens 4096 16384 --head-dims 64 128 --causal both --dtypes float16 --passes fwd --impls flashnumba_wgmma torch_sdpa_flash torch_sdpa_cudnn --both-modes --out $OUT/bench-wgmma 2>&1 | grep -v "it/s" | tail -25

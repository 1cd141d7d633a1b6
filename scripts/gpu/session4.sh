export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 FLASHNUMBA_CACHE_DIR=$PWD/.gpucache NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
mkdir -p $OUT
(
echo "=== ncu $(date +%T)"; timeout 120 ncu --profile-from-start off --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis python scripts/gpu/wgmma_ncu.py > $OUT/ncu-wgmma.txt 2>&1; tail -3 $OUT/ncu-wgmma.txt
echo "=== bench decode $(date +%T)"; timeout 220 python -m flashnumba bench --decode --out $OUT/decode 2>&1 | grep -v "it/s" | tail -40
) > $OUT/gpu4.log 2>&1
cat $OUT/gpu4.log | tail -c 9000

#!/usr/bin/env bash
# Nsight Compute on flashnumba's tensor-core forward and backward and on torch's FlashAttention-2 (flash backend),
# same float16 shape: tensor-pipe use, issue activity, stall reasons, registers, shared-memory bank conflicts and
# the instruction mix per opcode. Usage (device tool): SHAPES="4096:64 4096:128" bash scripts/ncu_compare.sh
# (MODES="tc": flashnumba's alone; NCU_ARGS="-k regex:backward": its backward kernels alone)
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
METRICS=gpu__time_duration.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
METRICS=$METRICS,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__warps_active.avg.pct_of_peak_sustained_active
METRICS=$METRICS,smsp__inst_executed.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum
METRICS=$METRICS,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum,l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum
METRICS=$METRICS,sass__inst_executed_per_opcode
# the stall reasons: average warps stalled for each reason per issued instruction (WarpStateStats' breakdown)
METRICS=$METRICS,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio
for shape in ${SHAPES:-4096:64 4096:128}; do
  n=${shape%%:*}; d=${shape##*:}
  for mode in ${MODES:-tc fa2}; do
    echo "=== $mode seqlen $n head_dim $d"
    timeout ${NCU_TIMEOUT:-120} ncu --profile-from-start off --clock-control none ${NCU_ARGS:-} --section LaunchStats \
      --section Occupancy --section WarpStateStats --metrics $METRICS --print-metric-instances ${NCU_INSTANCES:-details} \
      python3 scripts/ncu_profile.py $n $d $mode > "$OUT/ncu-$mode-$n-$d.txt" 2>&1
    echo "exit $?"; grep -E "^  [a-zA-Z_].*\(|gpu__time_duration|hmma_cycles|issue_active" "$OUT/ncu-$mode-$n-$d.txt" | head -40
  done
done

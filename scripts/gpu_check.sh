#!/usr/bin/env bash
# One call on the GPU machine: info, the test suite with the GPU profile, the comparison with torch SDPA,
# compute-sanitizer, the demo, the backward's memory, the benchmark, the notebooks (each a STEP).
# Usage (device tool): bash scripts/gpu_check.sh   (logs under $OUT)
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
# every case of the offline compile tests (the GPU profile's default too; per push without a GPU: a few)
export FLASHNUMBA_FULL_COMPILE=1
# Measured on the H200 (2026-11-29): info+tests+crosscheck+sanitize(SANITIZE_CASES=defaults)+demo+memory 364 s
# (tests 214 s with 16 workers); the float32 bench sweep with --passes fwd bwd --max-call-ms 250, 369 s;
# the notebooks 300 s. One call may take 10 minutes: split them across calls.
STEPS=${STEPS:-"info tests crosscheck sanitize demo memory bench"}
# The whole GPU profile no longer fits one call (2026-12-02: two thirds of it, without the Hopper tests, in 430 s
# with cold compiles): SHARD=1, 2, 3 or 4 runs one part of the test files (TESTS, where given, wins; the checker's
# test_flashnumba_passes alone takes about 5 minutes, the Hopper tests about 4.5).
case ${SHARD:-} in
  1) SHARD_TESTS="tests/test_forward.py tests/test_backward.py tests/test_tc.py tests/test_bf16.py tests/test_dropout.py
       tests/test_varlen.py tests/test_features.py tests/test_tf32.py" ;;
  2) SHARD_TESTS="tests --ignore=tests/test_forward.py --ignore=tests/test_backward.py --ignore=tests/test_tc.py
       --ignore=tests/test_bf16.py --ignore=tests/test_dropout.py --ignore=tests/test_varlen.py
       --ignore=tests/test_features.py --ignore=tests/test_tf32.py --ignore=tests/test_wgmma.py
       --ignore=tests/test_ptx_hopper.py --ignore=tests/test_check.py" ;;
  3) SHARD_TESTS="tests/test_wgmma.py tests/test_ptx_hopper.py" ;;
  4) SHARD_TESTS="tests/test_check.py" ;;
  *) SHARD_TESTS=tests ;;
esac
# A variant of the Hopper forward (bench impl flashnumba_wgmma_$1): the tests of files $2 that -k "$3" selects, then
# the forward timed beside the default one, FlashAttention-2 and cuDNN (logs tests-$1.log, bench-$1.log, $OUT/$1/)
hopper_forward_variant() {
  FLASHNUMBA_FAILURE_LOG="$OUT/failures.log" timeout ${TEST_TIMEOUT:-300} python3 -m pytest -p no:cacheprovider \
    -n ${PYTEST_WORKERS:-12} -v --tb=short $2 -k "$3" > "$OUT/tests-$1.log" 2>&1
  echo "pytest exit $?"; grep -E "PASSED|passed|failed|FAILED" "$OUT/tests-$1.log" | tail -14
  timeout ${BENCH_TIMEOUT:-300} python3 -m flashnumba bench --seqlens 4096 16384 --head-dims 64 128 --causal both \
    --dtypes float16 --passes fwd --impls flashnumba_wgmma flashnumba_wgmma_$1 torch_sdpa_flash torch_sdpa_cudnn \
    --both-modes --out "$OUT/$1" 2>&1 | grep -v "it/s" | tee "$OUT/bench-$1.log"
}
for step in $STEPS; do
  echo "=== $step $(date -u +%FT%TZ)"
  case $step in
    info) python3 -m flashnumba info; nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv ;;
    tests) # pytest-xdist, where installed, spreads the (CPU-bound) Numba compilations over processes; -v names each
           # test as it ends, so a part cut by its time limit still says which tests ran
           workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n ${PYTEST_WORKERS:-16}" || echo "-o addopts=-ra")
           FLASHNUMBA_FAILURE_LOG="$OUT/failures.log" timeout ${TEST_TIMEOUT:-330} python3 -m pytest -v -p no:cacheprovider --tb=short -rfE $workers \
             --durations=25 --hypothesis-show-statistics ${TESTS:-$SHARD_TESTS} > "$OUT/tests.log" 2>&1
           echo "pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | tail -15
           grep -h "^FAILED" "$OUT/failures.log" 2>/dev/null ;;  # written as failures happen
    demo) python3 -m flashnumba demo 2>&1 | tee "$OUT/demo.log" ;;
    sanitize) # SANITIZE_SCRIPTS: the forward/backward kernels', the decoding kernels' and flex_attention's awkward
      # shapes (SANITIZE_FLEX_SHAPES=one: flex_attention's first shape only); SANITIZE_TOOLS="memcheck racecheck
      # synccheck": the Hopper kernels' named barriers and mbarriers checked too
      for script in ${SANITIZE_SCRIPTS:-scripts/sanitize.py scripts/sanitize_decode.py scripts/sanitize_flex.py}; do
        for tool in ${SANITIZE_TOOLS:-memcheck racecheck}; do
          timeout ${SANITIZE_TIMEOUT:-300} compute-sanitizer --tool $tool --report-api-errors no --print-limit 20 python3 $script \
            > "$OUT/sanitize_$tool.txt" 2>&1
          echo "$script $tool: exit $?"; tail -3 "$OUT/sanitize_$tool.txt"; cat "$OUT/sanitize_$tool.txt" >> "$OUT/sanitize.log"
          rm "$OUT/sanitize_$tool.txt"
        done
      done ;;
    crosscheck) python3 scripts/crosscheck_torch.py 2>&1 | tee "$OUT/crosscheck.log" ;;
    memory) python3 scripts/backward_memory.py 4096 16384 2>&1 | tee "$OUT/backward_memory.log" ;;
    notebooks) # executed in place (scripts/run_notebook.py: no Jupyter on the GPU machine), copied to $OUT
      (cd notebooks && timeout ${NOTEBOOK_TIMEOUT:-540} python3 ../scripts/run_notebook.py ${NOTEBOOKS:-*.ipynb}) \
        2>&1 | tee "$OUT/notebooks.log"; cp notebooks/*.ipynb "$OUT"/ ;;
    sweep) # SWEEPS="tc tc_dq tc_dkdv" SWEEP_ARGS="--seqlen 4096": python -m flashnumba sweep, one family after another
      for family in ${SWEEPS:-tc tc_dq tc_dkdv}; do
        timeout ${SWEEP_TIMEOUT:-300} python3 -m flashnumba sweep $family --out "$OUT" ${SWEEP_ARGS:-} 2>&1 \
          | tee "$OUT/sweep-$family.log"
      done ;;
    latency) python3 -m flashnumba bench --latency --out "$OUT" 2>&1 | tee "$OUT/latency.log" ;;
    tf32wgmma) # 3xTF32 on Hopper's wgmma: its products chained in the accumulator or each k-step from zero (the
      # error), its tests (forward and backward: GPU sizes, the property tests, the error against float32's) and its
      # tiles' speed (the backward's beside the mma.sync one's)
      python3 scripts/tf32_wgmma_error.py --draws ${TF32_DRAWS:-50} 2>&1 | tee "$OUT/tf32-wgmma-error.txt"
      timeout ${TEST_TIMEOUT:-400} python3 -m pytest -q -p no:cacheprovider -n ${PYTEST_WORKERS:-16} -rP --tb=short \
        tests/test_wgmma_tf32.py > "$OUT/tests-wgmma-tf32.log" 2>&1
      echo "pytest exit $?"; grep -E "chained=|passed|failed|^FAILED" "$OUT/tests-wgmma-tf32.log" | tail -12
      timeout ${TILES_TIMEOUT:-200} python3 scripts/tf32_wgmma_tiles.py --backward 2>&1 \
        | tee "$OUT/tiles-3xtf32-wgmma.log" ;;
    train) timeout ${TRAIN_TIMEOUT:-420} python3 examples/train_tiny_gpt.py --out "$OUT" ${TRAIN_ARGS:-} 2>&1 | tee "$OUT/train.log" ;;
    capped) # the GPU profile with the shared memory per block capped as on smaller GPUs (64 KB: T4; 99 KB: RTX, L4)
      for cap in ${CAPS:-65536 101376}; do
        FLASHNUMBA_MAX_SHARED_BYTES=$cap FLASHNUMBA_GPU_EXAMPLES=${CAP_EXAMPLES:-20} FLASHNUMBA_FAILURE_LOG="$OUT/failures_cap$cap.log" \
          timeout ${CAP_TIMEOUT:-240} \
          python3 -m pytest -q -p no:cacheprovider --tb=short -rfE -n ${PYTEST_WORKERS:-16} ${CAP_TESTS:-tests} \
          > "$OUT/tests_cap$cap.log" 2>&1
        echo "cap $cap: pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests_cap$cap.log" | tail -8
        grep -h "^FAILED" "$OUT/failures_cap$cap.log" 2>/dev/null
      done ;;
    persistent) # the persistent Hopper forward (config.hopper_persistent): its tests (the drawn one: the same bits as
      # the per-tile blocks), then its timing
      hopper_forward_variant persistent "tests/test_wgmma.py tests/test_flex.py" persistent ;;
    three) # the Hopper forward with three warpgroups (block_m 192, 512 threads): its simulator-sized test and the
      # drawn property (which draws those tiles among others) on the GPU, then its timing
      hopper_forward_variant three tests/test_wgmma.py "ping_pong or (drawn_shapes_and_options_gpu and not backward)" ;;
    flextiles) # the causal mask_mod with a block mask beside the built-in causal kernel, at several tiles
      timeout ${FLEX_TIMEOUT:-300} python3 scripts/flex_tiles.py 2>&1 | tee "$OUT/flex-tiles.log" ;;
    flex) # flex_attention beside torch FlexAttention (FLEX_ARGS="--backward --head-dims 64": the backward pass too,
      # one head dim; FLEX_SKIP="no block mask": the rows whose name holds that text left out)
      timeout ${FLEX_TIMEOUT:-540} python3 scripts/flex_bench.py --out "$OUT" ${FLEX_ARGS:-} \
        ${FLEX_SKIP:+--skip "$FLEX_SKIP"} 2>&1 | tee "$OUT/flex.log" ;;
    compilelog) # whether the assembler's figures (registers, spills) survive CUDA's compute cache
      python3 scripts/compile_log_check.py 2>&1 | tee "$OUT/compile-log-check.log" ;;
    cache) # the kernel disk cache back in parts of 15 MB (files come back at most 16 MiB each); where the call ran
      # with FLASHNUMBA_CACHE_DIR=$PWD/.gpucache and .gpucache carried, `cat gpucache.tgz.* | tar xz` here restores
      # it for the next call's carry, and the warm cache spares that call the compiles
      cache=${FLASHNUMBA_CACHE_DIR:-.gpucache}
      tar czf - -C "$(dirname "$cache")" "$(basename "$cache")" | split -b 15000000 - "$OUT/gpucache.tgz."
      ls -la "$OUT"/gpucache.tgz.* ;;
    bench) timeout ${BENCH_TIMEOUT:-600} python3 -m flashnumba bench --out "$OUT/bench" ${BENCH_ARGS:-} 2>&1 | grep -v "it/s" | tee "$OUT/bench.log" ;;
  esac
done

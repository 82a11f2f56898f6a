#!/bin/bash
# One device call for the Mosaic GPU decode kernel: GPU tests, per-kernel breakdown of one call
# (ncu durations), stall profile of one kernel launch, shared-memory bank conflicts, bench main
# table per context, the combine alone per tiling (time_combine), kernel and call per variant
# (time_mosaic_decode), extra commands. Every step has its own timeout and writes under $OUT;
# the summary comes last. Usage (device machine, repo root):
#   STEPS="tests combine time breakdown stalls conflicts bench" CONTEXTS=131072,163840 ROWS=1,4,6 \
#   TESTS_K="compiled" COMBINE_VARIANTS=default,cols=32 TIME_CONTEXTS=131072 \
#   TIME_VARIANTS=default,module=decode_rev \
#   EXTRA='python3 -m experiments.kernel_lab.time_mosaic_decode 262144 1,4' \
#   bash experiments/kernel_lab/mosaic_round.sh
set -u
export PYTHONPATH=$PWD:$PWD/tests PYTHONUNBUFFERED=1 JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}
# jax's persistent compilation cache: identical programs (the bench's contiguous and ring cases,
# whose tables are arguments) compile once per call
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jax_cache}
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEPS=${STEPS:-"tests breakdown stalls bench"}
CONTEXTS=${CONTEXTS:-131072,163840}
ROWS=${ROWS:-1,4,6}
STALL_CTX=${STALL_CTX:-131072}
STALL_ROWS=${STALL_ROWS:-1}
SUMMARY=$OUT/summary.txt; : > "$SUMMARY"
say() { echo "$@" | tee -a "$SUMMARY"; }
t0=$SECONDS
has() { [[ " $STEPS " == *" $1 "* ]]; }

if has tests; then
  KVJAX_TEST_GPU=1 timeout ${TESTS_S:-200} python3 -m pytest -q -p no:warnings \
    ${TESTS_FILES:-tests/test_span_attention_mosaic_decode.py} -k "gpu${TESTS_K:+ and ($TESTS_K)}" \
    --junitxml=$OUT/tests.xml > $OUT/pytest.log 2>&1
  say "== tests ($((SECONDS - t0)) s)"; python3 -m experiments.kernel_lab.junit_summary $OUT/tests.xml 2>&1 \
    | tee -a "$SUMMARY" || tail -5 $OUT/pytest.log | tee -a "$SUMMARY"
fi
if has combine; then
  timeout ${COMBINE_S:-150} python3 -m experiments.kernel_lab.time_combine ${COMBINE_PARTS:-128} \
    ${COMBINE_ROWS:-1,4,6} ${COMBINE_VARIANTS:-default} > $OUT/combine.log 2>&1
  say "== combine alone ($((SECONDS - t0)) s)"; cat $OUT/combine.log | tee -a "$SUMMARY"
fi
if has time; then
  timeout ${TIME_S:-200} python3 -m experiments.kernel_lab.time_mosaic_decode ${TIME_CONTEXTS:-131072} \
    ${TIME_ROWS:-1,4} ${TIME_VARIANTS:-default} > $OUT/time.log 2>&1
  say "== kernel / call ($((SECONDS - t0)) s)"; cat $OUT/time.log | tee -a "$SUMMARY"
fi
if has breakdown; then
  timeout ${BREAKDOWN_S:-120} ncu --clock-control none --csv --metrics gpu__time_duration.sum \
    python3 -m experiments.kernel_lab.dump_mosaic_decode ${BREAKDOWN_ROWS:-1} ${BREAKDOWN_CTX:-131072} call \
    > $OUT/bd.csv 2>&1
  say "== breakdown of one call ($((SECONDS - t0)) s)"
  python3 -m experiments.kernel_lab.ncu_durations $OUT/bd.csv ${BREAKDOWN_TAIL:-6} 2>&1 | tee -a "$SUMMARY"
fi
if has stalls; then
  # the kernel-only mode of dump_mosaic_decode launches the span kernel once per row count;
  # STALL_MODE=call runs whole calls (STALL_REGEX=kvjax_span_combine: the combine's profile)
  timeout ${STALLS_S:-200} ncu --clock-control none --csv --kernel-name "regex:${STALL_REGEX:-mosaic}" \
    --launch-skip 0 --launch-count 1 --print-metric-instances details --section LaunchStats \
    --section Occupancy --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__inst_executed.sum,sass__inst_executed_per_opcode" \
    python3 -m experiments.kernel_lab.dump_mosaic_decode $STALL_ROWS $STALL_CTX ${STALL_MODE:-kernel} > $OUT/stalls.csv 2>&1
  say "== stalls, decode kernel ${STALL_CTX} S=${STALL_ROWS} ($((SECONDS - t0)) s)"
  python3 -m experiments.kernel_lab.ncu_report stalls $OUT/stalls.csv decode mosaic 2>&1 | tee -a "$SUMMARY"
fi
if has conflicts; then
  # shared-memory load wavefronts and bank conflicts of the span kernel
  f=$OUT/conflicts.csv
  timeout ${CONFLICTS_S:-120} ncu --clock-control none --csv --kernel-name "regex:${STALL_REGEX:-mosaic}" \
    --launch-skip 0 --launch-count 1 --metrics \
    l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,smsp__inst_executed_op_shared_ld.sum,gpu__time_duration.sum,smsp__inst_executed.sum \
    python3 -m experiments.kernel_lab.dump_mosaic_decode $STALL_ROWS $STALL_CTX > "$f" 2>&1
  say "== smem conflicts ($((SECONDS - t0)) s)"
  python3 -m experiments.kernel_lab.ncu_report metrics "$f" 2>&1 | tee -a "$SUMMARY"
fi
if has bench; then
  for c in ${CONTEXTS//,/ }; do
    timeout ${BENCH_S:-150} python3 -m experiments.bench_span_attention --out_dir=$OUT/b$c \
      --sweep=false --check=false --contexts=$c --rows=$ROWS --mosaic --reference_max_rows=0 \
      --copy_probe_mib=0 --max_seconds=${BENCH_MAX_S:-120} ${BENCH_FLAGS:-} > $OUT/bench_$c.log 2>&1
    say "== bench $c ($((SECONDS - t0)) s)"; grep "kind=main" $OUT/bench_$c.log | tee -a "$SUMMARY"
    grep -q "kind=main" $OUT/bench_$c.log || tail -4 $OUT/bench_$c.log | tee -a "$SUMMARY"
  done
fi
if [ -n "${EXTRA:-}" ]; then
  timeout ${EXTRA_S:-200} bash -c "$EXTRA" > $OUT/extra.log 2>&1
  say "== extra: $EXTRA ($((SECONDS - t0)) s)"; tail -${EXTRA_TAIL:-30} $OUT/extra.log | tee -a "$SUMMARY"
fi
echo; echo "######## summary"; cat "$SUMMARY"

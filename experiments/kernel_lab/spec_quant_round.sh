#!/usr/bin/env bash
# One GPU round of the speculative round's host work and the quantized weights, each step's log
# under $OUT, a short table last:
#   1. the quantized-matmul kernel compiled for the GPU against its reference (tests, KVJAX_TEST_GPU=1)
#   2. bench_gemv: GB/s of "xla" and "pallas" quantized products and of a bf16 dot, 27B shapes
#   3. bench_spec --oracle_mtp at 128K, n_max 3: replay, host and device rollback (MTP drafting as one
#      program, layouts kept by key, pinned-host snapshots)
#   4. bench_decode --weight_type=q4_k at 32K (weights kept quantized, "xla" product)
#   5. bench_spec --profile at 128K, n_max 3, replay: each round phase's wall time beside the kernels
#      and copies inside it (`speculative.PhaseClock` annotations, `timeline.phase_device`)
# Args: the steps to run (default: 1 2 3 4).  bash experiments/kernel_lab/spec_quant_round.sh 2 3
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1 OUT=${OUT:-runs/spec_quant_round}
mkdir -p "$OUT"
steps=${*:-1 2 3 4}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
python3 -c 'import jax; print("jax", jax.__version__, jax.devices())'
step() {  # $1 name, then the command
  local name=$1; shift
  local t0=$SECONDS
  "$@" > "$OUT/$name.log" 2>&1
  echo "== $name rc=$? $((SECONDS - t0)) s"
  grep -v '^[IW][0-9]\{4\} ' "$OUT/$name.log" | tail -n 14
}
for s in $steps; do
  case $s in
    1) step quant_tests env KVJAX_TEST_GPU=1 JAX_PLATFORMS=cuda,cpu python3 -m pytest -q -p no:cacheprovider \
         tests/test_quant_matmul.py -k gpu ;;
    2) step bench_gemv python3 -m experiments.bench_gemv --rows=1,4,256 --out="$OUT/gemv.json" ;;
    3) for rb in replay host device; do
         step "spec_$rb" python3 -m experiments.bench_spec --model=qwen38_27b --arena_mib=2240 --attn_impl=auto \
           --contexts=131072 --decode_tokens=48 --n_max=3 --acceptance=0.75 --allow_divergence --oracle_mtp \
           --width_context=0 --rollback=$rb --out="$OUT/spec_$rb"
       done ;;
    5) step spec_profile python3 -m experiments.bench_spec --model=qwen38_27b --arena_mib=2240 --attn_impl=auto \
         --contexts=131072 --decode_tokens=24 --n_max=3 --acceptance=0.75 --allow_divergence --oracle_mtp \
         --width_context=0 --rollback=replay --profile --out="$OUT/spec_profile"
       grep "^phase " "$OUT/spec_profile.log" ;;
    4) step decode_q4k python3 -m experiments.bench_decode --contexts=32768 --arena_mib=2240 --attn_impl=auto \
         --weight_type=q4_k --decode_steps=16 --out="$OUT/decode_q4k" ;;
  esac
done

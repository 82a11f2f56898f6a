#!/usr/bin/env bash
# One GPU round of the decode's weight reads (issue: quantized weights, joined products), each
# step's log under $OUT, a short table last:
#   1. probe_planar_gemv: XLA's fused reductions over quantized blocks (ggml's rows, planes) against
#      the bf16 dot, 27B shapes, S = 1 and 4
#   2. bench_gemv: the "planar" product (planes, XLA's reductions) beside "pallas_gemv" and the bf16 dot
#   3. bench_decode at 32K (the weights' share): bf16 joined / parts, Q4_K and Q8_0 "planar", Q4_K "pallas_gemv"
# Args: the steps to run (default: 1 2 3).  bash experiments/kernel_lab/weights_round.sh 1 3
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1 OUT=${OUT:-runs/weights_round}
mkdir -p "$OUT"
steps=${*:-1 2 3}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
step() {  # $1 name, $2 seconds, then the command
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name rc=$? $((SECONDS - t0)) s"
  grep -v '^[IW][0-9]\{4\} ' "$OUT/$name.log" | grep -v '^{' | tail -n 16
}
decode() {  # $1 name, then bench_decode flags
  local name=$1; shift
  step "$name" 200 python3 -m experiments.bench_decode --contexts=32768 --arena_mib=2240 --attn_impl=auto \
    --decode_steps=16 --check_steps=8 --out="$OUT/$name" "$@"
}
for s in $steps; do
  case $s in
    1) step planar 150 python3 -m experiments.kernel_lab.probe_planar_gemv --out="$OUT/planar" ;;
    2) step gemv_planar 120 python3 -m experiments.bench_gemv --implementations=planar,pallas_gemv,bf16 --rows=1,4 \
         --formats=q8_0,q4_0,q4_k --shapes=ffn_gate.weight,ffn_down.weight,attn_qkv.weight --rounds=3 \
         --out="$OUT/gemv_planar.json" ;;
    3) decode bf16_joined
       decode bf16_parts --nofuse
       decode q4k_planar --weight_type=q4_k --weights_impl=planar
       decode q8_planar --weight_type=q8_0 --weights_impl=planar
       decode q4k_gemv --weight_type=q4_k --weights_impl=pallas_gemv ;;
  esac
done

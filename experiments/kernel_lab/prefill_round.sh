#!/usr/bin/env bash
# One GPU round of the prefill's micro-batch: bench_generate --prefill_only at the given contexts for
# each ubatch (each its own process and compilation cache), prefill tok/s and MFU side by side.
#   bash experiments/kernel_lab/prefill_round.sh 8192,65536 256 512 [extra bench_generate flags]
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1 OUT=${OUT:-runs/prefill_round}
ctx=${1:-8192,65536}; shift || true
ubatches=()
while [ $# -gt 0 ] && [[ $1 =~ ^[0-9]+$ ]]; do ubatches+=("$1"); shift; done
[ ${#ubatches[@]} -gt 0 ] || ubatches=(256 512)
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for u in "${ubatches[@]}"; do
  t0=$SECONDS
  python3 -m experiments.bench_generate --model=qwen38_27b --arena_mib=2240 --attn_impl=auto --prefill_only \
    --contexts="$ctx" --ubatch="$u" --compile_cache_dir="/tmp/prefill-cache-$u" --out="$OUT/u$u" "$@" \
    > "$OUT/u$u.log" 2>&1
  echo "== ubatch $u rc=$? $((SECONDS - t0)) s"
  grep -v '^[IW][0-9]\{4\} ' "$OUT/u$u.log" | grep -v '^{' | tail -n 3
done

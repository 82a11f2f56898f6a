#!/usr/bin/env bash
# One GPU round of the user's path: bench_generate with a cold persistent compilation cache, then
# the same cache in a second process (warm), each logging its persistent-cache keys (cold.keys,
# warm.keys; their diff printed). Args: contexts (cold), contexts (warm), extra flags.
#   bash experiments/kernel_lab/generate_round.sh 32768,131072 131072 --kinds=fixed
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1 OUT=${OUT:-runs/generate_round}
cold=${1:-32768,131072}; warm=${2-131072}; shift 2 || true   # an empty second argument: no warm run
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
python3 -c 'import jax; print("jax", jax.__version__, jax.devices())'
cache=/tmp/kvjax-jax-cache
run() {  # $1 name, $2 contexts, then flags
  local name=$1 ctx=$2; shift 2
  JAX_EXPLAIN_CACHE_MISSES=${EXPLAIN:-0} python3 -m experiments.bench_generate --model=qwen38_27b --contexts="$ctx" --arena_mib=2240 --attn_impl=auto \
    --n_predict=1024 --compile_cache_dir=$cache --cache_key_log="$OUT/$name.keys" --out="$OUT/$name" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name rc=$? ($(du -sh $cache 2>/dev/null | cut -f1) cache)"
  grep -v '^[IW][0-9]\{4\} ' "$OUT/$name.log" | grep -v '^{' | tail -n 12
}
mkdir -p "$OUT"
run cold "$cold" "$@"
if [ -n "$warm" ]; then
  run warm "$warm" --compare=false "$@"
  # the programs the second process compiled again, and the key component that differed
  python3 -m experiments.kernel_lab.cache_key_diff "$OUT/cold.keys" "$OUT/warm.keys" | head -n 20
fi

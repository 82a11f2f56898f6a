#!/usr/bin/env bash
# One GPU call: the 27B streamed decode at one context under several variants (XLA flags, bench
# flags), one process each; the first variant also dumps the group steps' optimized HLO and prints
# where XLA scheduled the in-step copies. Table last.
#   VARIANTS="name|xla flags|bench flags;..." CONTEXT=131072 bash experiments/kernel_lab/stream_variants.sh
set -uo pipefail
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
export JAX_PLATFORMS=cuda PYTHONUNBUFFERED=1
OUT=${OUT:-runs/stream_variants}
mkdir -p "$OUT"
IFS=';' read -ra VS <<< "${VARIANTS:-base||}"
first=1
for v in "${VS[@]}"; do
  IFS='|' read -r name xflags bflags <<< "$v"
  dump=""
  if [ $first = 1 ]; then dump="--xla_dump_to=/tmp/dump --xla_dump_hlo_module_re=.*group_step.*"; first=0; fi
  flags_env="$(echo "$xflags $dump" | xargs)"    # an XLA_FLAGS of blanks is read as a file name
  if [ -n "$flags_env" ]; then export XLA_FLAGS="$flags_env"; else unset XLA_FLAGS; fi
  python3 -m experiments.bench_decode --contexts="${CONTEXT:-131072}" --arena_mib=2240 \
    --attn_impl=auto --check_steps=0 --decode_steps=8 --out="$OUT/$name" $bflags > "$OUT/$name.log" 2>&1
  echo "$name rc=$? $(tail -1 "$OUT/$name.log")"
done
python3 -m experiments.kernel_lab.hlo_schedule /tmp/dump | cut -c1-1500

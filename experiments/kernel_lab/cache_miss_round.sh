#!/usr/bin/env bash
# One GPU round on the persistent compilation cache's misses between processes (a second process
# compiles every layer step and wave step again: docs/PERFORMANCE.md, "The user's path", row K).
#  1. The 27B layer step lowered in two processes (`probe_cache_key`, at context $1): the module
#     texts and each attention kernel's payload (Triton `ir` / `opaque`, Mosaic GPU `module`)
#     compared; the first differing lines printed.
#  2. A phased generation at context $2 in two processes on one cache, every lowered module dumped
#     (JAX_DUMP_IR_TO); the layer / wave step modules paired by name and order and compared.
# Results (texts, diffs, key logs) in $OUT/cache_miss.tgz.
#   bash experiments/kernel_lab/cache_miss_round.sh 131072 131072
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1 OUT=${OUT:-runs/cache_miss_round}
probe_ctx=${1:-131072}; gen_ctx=${2:-131072}
work=/tmp/cache_miss; rm -rf "$work"; mkdir -p "$work" "$OUT"
for t in a b; do
  OUT=$work python3 -m experiments.kernel_lab.probe_cache_key "$t" --context="$probe_ctx" > "$work/probe_$t.log" 2>&1
  echo "probe $t rc=$?"
done
d=$work/probe_cache_key
cat "$d/a/summary.txt" "$d/b/summary.txt" 2>/dev/null
diff "$d/a/payloads.txt" "$d/b/payloads.txt" && echo "payloads: the same in both processes"
for f in $(cd "$d/a" && ls group_step_*.mlir payload_*.txt 2>/dev/null); do
  cmp -s "$d/a/$f" "$d/b/$f" || { echo "== $f differs"; diff "$d/a/$f" "$d/b/$f" | head -c 1500; echo; }
done
for t in a b; do
  JAX_DUMP_IR_TO=$work/dump_$t python3 -m experiments.bench_generate --model=qwen38_27b --contexts="$gen_ctx" \
    --kinds=phased --arena_mib=2240 --attn_impl=auto --n_predict=16 --compare=false \
    --compile_cache_dir=$work/cache --cache_key_log="$work/gen_$t.keys" --out="$work/gen_$t" > "$work/gen_$t.log" 2>&1
  echo "generation $t rc=$?"
done
python3 -m experiments.kernel_lab.cache_key_diff "$work/gen_a.keys" "$work/gen_b.keys" | head -n 12
python3 - "$work/dump_a" "$work/dump_b" <<'EOF' | tee "$work/dump_diff.txt"
# the step modules of two dumps paired by program name and order; the first differing lines of each pair
import difflib, os, re, sys
def steps(folder):
  out = {}
  for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
    m = re.search(r"(jit__(?:group_step|wave_step|group_attn_begin|mtp_step))", name)
    if m and name.endswith(".mlir"):
      out.setdefault(m.group(1), []).append(os.path.join(folder, name))
  return out
a, b = steps(sys.argv[1]), steps(sys.argv[2])
for prog in sorted(a):
  for i, (fa, fb) in enumerate(zip(a[prog], b.get(prog, []))):
    ta, tb = open(fa, errors="replace").read(), open(fb, errors="replace").read()
    if ta == tb:
      print(f"{prog} #{i}: same ({len(ta)} chars)")
      continue
    print(f"{prog} #{i}: DIFFERS ({os.path.basename(fa)} / {os.path.basename(fb)})")
    diff = difflib.unified_diff(ta.splitlines(), tb.splitlines(), lineterm="", n=0)
    for line in list(diff)[:12]:
      print("   ", line[:300])
EOF
(cd "$work" && tar czf "$OUT/cache_miss.tgz" --exclude=cache --exclude='dump_*' . && tar czf "$OUT/dumps.tgz" dump_a dump_b 2>/dev/null)
ls -la "$OUT"

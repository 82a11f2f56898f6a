#!/bin/bash
# Where the v2 span kernel's warps stall, per SASS instruction: ncu's source counters (warp
# state samples) of one kernel launch, exported as the SASS source page (CSV, gzipped under
# $OUT) and summed by opcode and by instruction (`ncu_report.py sources`). Answers which loads
# the long_scoreboard stalls wait on: LDL (register spills), LDG (page table), or others.
#   bash experiments/gpu/stall_sources.sh [rows] [context] [kernel options, as time_mosaic2.py]
set -u
export PYTHONPATH=$PWD:$PWD/tests PYTHONUNBUFFERED=1 JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
ROWS=${1:-1}; CTX=${2:-131072}; OPTS=${3:-}
opt=(); [ -n "$OPTS" ] && opt=(kernel "$OPTS")
t0=$SECONDS
timeout ${NCU_S:-180} ncu --clock-control none --kernel-name regex:mosaic --launch-skip 0 \
  --launch-count 1 --section SourceCounters --section WarpStateStats -f -o "$OUT/src" \
  python3 experiments/gpu/dump_mosaic2.py "$ROWS" "$CTX" "${opt[@]}" > "$OUT/src_run.log" 2>&1
echo "== ncu source counters, v2 kernel ${CTX} S=${ROWS} ${OPTS} ($((SECONDS - t0)) s)"
tail -3 "$OUT/src_run.log"
ncu --import "$OUT/src.ncu-rep" --page source --csv --print-source sass > "$OUT/sass.csv" \
  2> "$OUT/sass.err" || tail -5 "$OUT/sass.err"
gzip -kf "$OUT/sass.csv"
rm -f "$OUT/src.ncu-rep"     # large; the CSV carries what the summary reads
python3 experiments/gpu/ncu_report.py sources "$OUT/sass.csv" ${TOP:-30}

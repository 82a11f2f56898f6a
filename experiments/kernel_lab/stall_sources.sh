#!/bin/bash
# Where the Mosaic GPU decode kernel's warps stall, per SASS instruction: ncu's source counters (warp
# state samples) of one kernel launch, exported as the SASS source page (CSV, gzipped under
# $OUT) and summed by opcode and by instruction (`ncu_report.py sources`). Answers which loads
# the long_scoreboard stalls wait on: LDL (register spills), LDG (page table), or others.
#   bash experiments/kernel_lab/stall_sources.sh [rows] [context]
set -u
export PYTHONPATH=$PWD:$PWD/tests PYTHONUNBUFFERED=1 JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
ROWS=${1:-1}; CTX=${2:-131072}
t0=$SECONDS
timeout ${NCU_S:-180} ncu --clock-control none --kernel-name regex:mosaic --launch-skip 0 \
  --launch-count 1 --section SourceCounters --section WarpStateStats -f -o "$OUT/src" \
  python3 -m experiments.kernel_lab.dump_mosaic_decode "$ROWS" "$CTX" > "$OUT/src_run.log" 2>&1
echo "== ncu source counters, decode kernel ${CTX} S=${ROWS} ($((SECONDS - t0)) s)"
tail -3 "$OUT/src_run.log"
ncu --import "$OUT/src.ncu-rep" --page source --csv --print-source sass > "$OUT/sass.csv" \
  2> "$OUT/sass.err" || tail -5 "$OUT/sass.err"
gzip -kf "$OUT/sass.csv"
rm -f "$OUT/src.ncu-rep"     # large; the CSV carries what the summary reads
python3 -m experiments.kernel_lab.ncu_report sources "$OUT/sass.csv" ${TOP:-30}

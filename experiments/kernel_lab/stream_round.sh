#!/usr/bin/env bash
# One GPU call of a streamed-decode round: the copy/compute overlap microbenchmark, then the 27B
# decode bench with device timelines. Details under $OUT; the bench's table last.
#   bash experiments/kernel_lab/stream_round.sh            (env: CONTEXTS, BENCH_FLAGS, OVERLAP_FLAGS, SKIP_OVERLAP)
set -uo pipefail
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export JAX_PLATFORMS=cuda PYTHONUNBUFFERED=1
OUT=${OUT:-runs/stream_round}
mkdir -p "$OUT"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
if [ -z "${SKIP_OVERLAP:-}" ]; then
  python3 -m experiments.bench_overlap --out="$OUT/overlap" ${OVERLAP_FLAGS:-} > "$OUT/overlap.log" 2>&1
  tail -12 "$OUT/overlap.log"
fi
python3 -m experiments.bench_decode --contexts="${CONTEXTS:-32768,131072}" --arena_mib=2240 --attn_impl=auto \
  --out="$OUT/bd" ${BENCH_FLAGS:-} > "$OUT/bd.log" 2>&1
rc=$?
grep -v '^{' "$OUT/bd.log" | tail -60
exit $rc

# Sourced by the ncu scripts (call_breakdown.sh, opcode_mix.sh): environment and arguments.
#   source experiments/kernel_lab/profile_args.sh <prefix> "<config k=v;k=v>" <context> <rows>
# Sets cfg, ctx, rows and name (<prefix>_<config>_<context>_<rows>, a file name under $OUT).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
cfg="$2"; ctx="$3"; rows="$4"
# an empty config would run the whole benchmark under ncu: name at least one option
[ -n "$cfg" ] || { echo "$(basename "$0"): give a config, e.g. decode=asm" >&2; exit 2; }
name=${1}_$(echo "$cfg" | tr ';=' '_-')_${ctx}_$rows

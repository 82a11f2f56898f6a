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
#   6. the planar GEMVs and "pallas_q8" compiled against their interpretation, rows alone, x's blocks
#      (tests, KVJAX_TEST_GPU=1)
#   7. bench_gemv, Q4_K at 1 and 4 rows: "pallas_q8" tile candidates, the default first
#      (block_n:block_groups:split_k:min_programs:sum_each_step:grouped:warps:stages:dot:prefetch:x_blocks)
#   8. bench_spec --oracle_mtp at 32K, n_max 3, with Q4_K: the products "pallas_q8", "pallas_dot" and
#      "pallas" on one card
#   9. bench_decode at 32K with Q4_K ("pallas_q8") under three XLA command-buffer settings: the
#      default, every captured run however short (--xla_gpu_graph_min_graph_size=1), none
#      (--xla_gpu_enable_command_buffer=): is the host's launch cost (bench_decode's `disp`) the bound?
#  10. bench_decode at 32K with Q4_K ("pallas_q8"): a sequence's forwards donating their states and hidden
#      rows (the default) or not (KVJAX_DONATE_STATES=0), each under XLA's default command buffers and with
#      every captured run (--xla_gpu_graph_min_graph_size=1): do inputs at fixed addresses let the graphs
#      replay rather than be recorded again each call?
#  11. the Gated DeltaNet rows kernel (`kvjax_pallas.delta_rule.rows`) compiled against the oracle, rows alone
#      against rows together (tests, KVJAX_TEST_GPU=1; probe_gdn_rows: the same and us a call); bench_spec --oracle_mtp at 32K with Q4_K ("pallas_q8")
#      and bench_decode at 32K, each with the rows kernel (the default on a GPU) and with XLA's token scan
#      (KVJAX_GDN_ROWS=xla)
#  12. fewer kernels a forward: the prologue and fused-rows kernels compiled against their interpretation
#      (tests, KVJAX_TEST_GPU=1), then bench_decode at 32K with Q4_K ("pallas_q8") with x made by the
#      quantizing kernel (the default), with XLA making it first (KVJAX_Q8_PROLOGUE=0), and with the rows
#      kernel in place of the Gated DeltaNet's rows from its projections (KVJAX_GDN_ROWS=triton; "fused" is the
#      GPU's default), each with --host_profile, the default also with --profile (the resident and the
#      streamed forward's kernels: at 32K with every page resident the streamed forward took 16.05 ms, its
#      host enqueue 14.5, against the plain cache's 10.62 / 7.0 on 2026-12-07: is the extra time the host's
#      (the cProfile) or the device's (the kernel tables)?);
#      bench_spec --oracle_mtp at 32K with the default and with the rows kernel
#  13. the card's rows of the quantized-weights goals, most wanted first: the prologue / fused-rows GPU
#      tests, bench_spec --oracle_mtp at 32K with Q4_K ("pallas_q8"), bench_decode with Q4_K at 32K (--profile
#      and --host_profile: the resident and the streamed forward's kernels) and at 128K / 256K (the streamed
#      tables), bench_gemv Q4_K / Q8_0 against the bf16 dot at the 27B's shapes, 1 and 4 rows
#  14. the rest of the card's rows, most wanted first: how a Pallas Triton kernel rounds float32 to bfloat16
#      (probe_bf16_cast) and the prologue GPU tests (the kernels now round by integer operations), bench_spec
#      --oracle_mtp at 32K with Q4_K ("pallas_q8") again (the spread), bench_decode at 32K with Q4_K (--profile:
#      the kernel tables), resident decode at 32K with Q8_0 ("pallas_q8") and with bf16 weights (joined; on a
#      card under 100 GB unjoined),
#      bench_gemv, bench_spec --oracle_mtp at 128K with Q4_K
#  15. the user's path with Q4_K ("pallas_q8"): bench_generate (api.load_model / make_kv / generate, a cold
#      compilation cache of its own) at 32K with bench_decode's forward beside it, then at 128K, 256 tokens each
#      (GEN_CONTEXTS="32768" for the first alone)
# Each step's log ($OUT/logs/NAME.log) and the files under $OUT's folders go into $OUT/details.tar after it.
# Args: the steps to run (default: 1 2 3 4).  bash experiments/kernel_lab/spec_quant_round.sh 2 3
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1 OUT=${OUT:-runs/spec_quant_round}
mkdir -p "$OUT/logs"
steps=${*:-1 2 3 4}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
python3 -c 'import jax; print("jax", jax.__version__, jax.devices())'
step() {  # $1 name, then the command
  local name=$1; shift
  local t0=$SECONDS
  "$@" > "$OUT/logs/$name.log" 2>&1
  echo "== $name rc=$? $((SECONDS - t0)) s"
  grep -v '^[IW][0-9]\{4\} ' "$OUT/logs/$name.log" | tail -n 14
  # the logs and the files under $OUT's folders into one tar (only so many files come back from the machine)
  (cd "$OUT" && find . -mindepth 2 -type f | sort > .packed && [ -s .packed ] && tar -rf details.tar -T .packed \
     && xargs rm -f < .packed; rm -f .packed)
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
       tar -xOf "$OUT/details.tar" ./logs/spec_profile.log | grep "^phase " ;;
    4) step decode_q4k python3 -m experiments.bench_decode --contexts=32768 --arena_mib=2240 --attn_impl=auto \
         --weight_type=q4_k --decode_steps=16 --out="$OUT/decode_q4k" ;;
    6) step planar_gpu_tests env KVJAX_TEST_GPU=1 JAX_PLATFORMS=cuda,cpu python3 -m pytest -q -p no:cacheprovider \
         tests/test_planar_q8.py tests/test_planar.py -k gpu ;;
    7) step gemv_q8 python3 -m experiments.bench_gemv --implementations=planar_q8 --rows=1,4 --formats=q4_k \
         --shapes=ffn_gate.weight,ffn_down.weight,attn_qkv.weight --iters=32 --rounds=3 \
         --planar_tiles=32:8:0:512:1:1:4:3:0:1:1,16:8:0:512:1:1:4:3:0:0:1,32:8:0:512:1:1:4:3:0:0:1,16:16:0:512:1:1:4:3:0:1:1 \
         --out="$OUT/gemv_q8.json" ;;
    8) for p in pallas_q8 pallas_dot pallas; do
         step "spec32_$p" env KVJAX_PLANAR_PRODUCT=$p python3 -m experiments.bench_spec --model=qwen38_27b \
           --arena_mib=2240 --attn_impl=auto --weight_type=q4_k --contexts=32768 --decode_tokens=48 --n_max=3 \
           --acceptance=0.75 --allow_divergence --oracle_mtp --width_context=0 --rollback=replay --out="$OUT/spec32_$p"
       done ;;
    9) i=0
       for xf in "" "--xla_gpu_graph_min_graph_size=1" "--xla_gpu_enable_command_buffer="; do
         i=$((i + 1))
         step "decode_graphs_$i" env XLA_FLAGS="$xf" KVJAX_PLANAR_PRODUCT=pallas_q8 python3 -m experiments.bench_decode \
           --model=qwen38_27b --contexts=32768 --arena_mib=2240 --attn_impl=auto --weight_type=q4_k --decode_steps=16 \
           --check_steps=0 --host_profile --out="$OUT/decode_graphs_$i"
       done ;;
    10) for d in 0 1; do
          for xf in "" "--xla_gpu_graph_min_graph_size=1"; do
            step "decode_donate${d}_graphs${xf:+1}" env KVJAX_DONATE_STATES=$d XLA_FLAGS="$xf" KVJAX_PLANAR_PRODUCT=pallas_q8 \
              python3 -m experiments.bench_decode --model=qwen38_27b --contexts=32768 --arena_mib=2240 --attn_impl=auto \
              --weight_type=q4_k --decode_steps=16 --check_steps=0 --out="$OUT/decode_donate${d}_graphs${xf:+1}"
          done
        done ;;
    11) step rows_gpu_tests env KVJAX_TEST_GPU=1 JAX_PLATFORMS=cuda,cpu python3 -m pytest -q -p no:cacheprovider \
          tests/test_delta_rule.py -k "rows"
        step rows_probe python3 -m experiments.kernel_lab.probe_gdn_rows
        for rows in triton xla; do
          step "spec32_rows_$rows" env KVJAX_GDN_ROWS=$rows KVJAX_PLANAR_PRODUCT=pallas_q8 python3 -m experiments.bench_spec \
            --model=qwen38_27b --arena_mib=2240 --attn_impl=auto --weight_type=q4_k --contexts=32768 --decode_tokens=48 \
            --n_max=3 --acceptance=0.75 --allow_divergence --oracle_mtp --width_context=0 --rollback=replay \
            --out="$OUT/spec32_rows_$rows"
        done
        for rows in triton xla; do
          step "decode_rows_$rows" env KVJAX_GDN_ROWS=$rows KVJAX_PLANAR_PRODUCT=pallas_q8 python3 -m experiments.bench_decode \
            --model=qwen38_27b --contexts=32768 --arena_mib=2240 --attn_impl=auto --weight_type=q4_k --decode_steps=16 \
            --check_steps=0 --out="$OUT/decode_rows_$rows"
        done ;;
    12) step kernels_gpu_tests env KVJAX_TEST_GPU=1 JAX_PLATFORMS=cuda,cpu python3 -m pytest -q -p no:cacheprovider \
          tests/test_prologue.py tests/test_gdn_rows.py -k gpu
        for run in "default" "KVJAX_Q8_PROLOGUE=0" "KVJAX_GDN_ROWS=triton"; do
          name=$(echo "$run" | tr '=A-Z' '_a-z')
          prof=""; [ "$run" = default ] && prof="--profile"   # the resident and streamed kernels, apart
          step "decode_$name" env ${run/default/KVJAX_Q8_PROLOGUE=1} KVJAX_PLANAR_PRODUCT=pallas_q8 python3 -m \
            experiments.bench_decode --model=qwen38_27b --contexts=32768 --arena_mib=2240 --attn_impl=auto \
            --weight_type=q4_k --decode_steps=16 --check_steps=0 --host_profile $prof --out="$OUT/decode_$name"
        done
        for run in "default" "KVJAX_GDN_ROWS=triton"; do
          name=$(echo "$run" | tr '=A-Z' '_a-z')
          step "spec32_$name" env ${run/default/KVJAX_Q8_PROLOGUE=1} KVJAX_PLANAR_PRODUCT=pallas_q8 python3 -m \
            experiments.bench_spec --model=qwen38_27b --arena_mib=2240 --attn_impl=auto --weight_type=q4_k \
            --contexts=32768 --decode_tokens=48 --n_max=3 --acceptance=0.75 --allow_divergence --oracle_mtp \
            --width_context=0 --rollback=replay --out="$OUT/spec32_$name"
        done ;;
    13) step kernels_gpu_tests env KVJAX_TEST_GPU=1 JAX_PLATFORMS=cuda,cpu python3 -m pytest -q -p no:cacheprovider \
          tests/test_prologue.py tests/test_gdn_rows.py -k gpu
        step spec32_q4k env KVJAX_PLANAR_PRODUCT=pallas_q8 python3 -m experiments.bench_spec --model=qwen38_27b --arena_mib=2240 \
          --attn_impl=auto --weight_type=q4_k --contexts=32768 --decode_tokens=48 --n_max=3 --acceptance=0.75 \
          --allow_divergence --oracle_mtp --width_context=0 --rollback=replay --out="$OUT/spec32_q4k"
        step decode32_q4k env KVJAX_PLANAR_PRODUCT=pallas_q8 python3 -m experiments.bench_decode --model=qwen38_27b --contexts=32768 \
          --arena_mib=2240 --attn_impl=auto --weight_type=q4_k --decode_steps=16 --check_steps=16 --profile \
          --host_profile --out="$OUT/decode32_q4k"
        step decode_long_q4k env KVJAX_PLANAR_PRODUCT=pallas_q8 python3 -m experiments.bench_decode --model=qwen38_27b \
          --contexts=131072,262144 --arena_mib=2240 --attn_impl=auto --weight_type=q4_k --decode_steps=16 \
          --check_steps=16 --out="$OUT/decode_long_q4k"
        step gemv env KVJAX_PLANAR_PRODUCT=pallas_q8 python3 -m experiments.bench_gemv --implementations=planar_q8,bf16 --rows=1,4 \
          --formats=q4_k,q8_0 --shapes=ffn_gate.weight,ffn_down.weight,attn_qkv.weight --iters=32 --rounds=3 \
          --out="$OUT/gemv.json" ;;
    14) step probe_bf16_cast python3 -m experiments.kernel_lab.probe_bf16_cast
        step prologue_gpu_tests env KVJAX_TEST_GPU=1 JAX_PLATFORMS=cuda,cpu python3 -m pytest -q -p no:cacheprovider \
          tests/test_prologue.py -k gpu
        step spec32_q4k_again env KVJAX_PLANAR_PRODUCT=pallas_q8 python3 -m experiments.bench_spec --model=qwen38_27b --arena_mib=2240 \
          --attn_impl=auto --weight_type=q4_k --contexts=32768 --decode_tokens=48 --n_max=3 --acceptance=0.75 \
          --allow_divergence --oracle_mtp --width_context=0 --rollback=replay --out="$OUT/spec32_q4k_again"
        step decode32_q4k_profile env KVJAX_PLANAR_PRODUCT=pallas_q8 python3 -m experiments.bench_decode --model=qwen38_27b --contexts=32768 \
          --arena_mib=2240 --attn_impl=auto --weight_type=q4_k --decode_steps=16 --check_steps=0 --profile \
          --out="$OUT/decode32_q4k_profile"
        step decode32_q8_0 env KVJAX_PLANAR_PRODUCT=pallas_q8 python3 -m experiments.bench_decode --model=qwen38_27b --contexts=32768 \
          --arena_mib=2240 --attn_impl=auto --weight_type=q8_0 --decode_steps=16 --check_steps=0 \
          --out="$OUT/decode32_q8_0"
        # the bf16 model's joins do not fit an 80 GB card (2026-12-07): there it runs unjoined
        mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n 1)
        nofuse=""; [ "${mib:-0}" -lt 100000 ] && nofuse="--nofuse"
        step decode32_bf16 python3 -m experiments.bench_decode --model=qwen38_27b --contexts=32768 \
          --arena_mib=2240 --attn_impl=auto --decode_steps=16 --check_steps=0 $nofuse --out="$OUT/decode32_bf16"
        step gemv env KVJAX_PLANAR_PRODUCT=pallas_q8 python3 -m experiments.bench_gemv --implementations=planar_q8,bf16 --rows=1,4 \
          --formats=q4_k,q8_0 --shapes=ffn_gate.weight,ffn_down.weight,attn_qkv.weight --iters=32 --rounds=3 \
          --out="$OUT/gemv.json"
        step spec128_q4k env KVJAX_PLANAR_PRODUCT=pallas_q8 python3 -m experiments.bench_spec --model=qwen38_27b --arena_mib=2240 \
          --attn_impl=auto --weight_type=q4_k --contexts=131072 --decode_tokens=48 --n_max=3 --acceptance=0.75 \
          --allow_divergence --oracle_mtp --width_context=0 --rollback=replay --out="$OUT/spec128_q4k" ;;
    15) for ctx in ${GEN_CONTEXTS:-32768 131072}; do
          cmp=true; [ $ctx = 131072 ] && cmp=false
          step "generate_q4k_$ctx" env KVJAX_PLANAR_PRODUCT=pallas_q8 python3 -m experiments.bench_generate --model=qwen38_27b --weight_type=q4_k \
            --arena_mib=2240 --attn_impl=auto --contexts=$ctx --kinds=fixed --n_predict=256 --compare=$cmp \
            --compile_cache_dir="/tmp/generate_cache_$ctx" --out="$OUT/generate_q4k_$ctx"
        done ;;
  esac
done

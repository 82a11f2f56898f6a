"""The experiments as real processes (`python -m experiments.NAME` from the repository root) on the
tiny model (CPU): run.py's config overrides reach the run, results land in out_dir, streamed ==
plain, API errors name the config field; the sweep's columns and numbers are consistent with the
page/pool arithmetic, budget errors become rows, its plot has one line per budget given, and it
shows progress; no experiment prints jax's TPU backend probe."""

import csv
import json
import math
import os
import re
import subprocess
import sys

import pytest

from kvjax import config as config_lib
from kvjax.streaming import fit_split
from kvjax_pallas.page_layout import PageLayout
from kvjax_pallas.span_attention import magic_ptx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args, cwd, timeout=240):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  p = subprocess.run([sys.executable] + args, capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)
  assert p.returncode == 0, p.stderr[-3000:]
  return p


def test_run_config_with_overrides(tmp_path):
  out = str(tmp_path / "runs")
  run = ["-m", "experiments.run", "--config=configs/tiny_stream.py"]
  _run(run + ["--config.n_predict=20", f"--config.out_dir={out}"], cwd=REPO)
  _run(run + ["--config.n_predict=8", "--config.kv=plain", f"--config.out_dir={out}"], cwd=REPO)
  rows = [json.loads(l) for l in open(os.path.join(out, "tiny_stream.jsonl"))]
  assert len(rows) == 2
  s, p = rows
  assert s["kv"] == "streamed" and s["decode_tokens"] == 20 and s["tokens_match"] is True
  assert len(s["tokens"].split()) == 20 and s["pool_pages"] == 6 and s["ring_slots"] == 3
  assert s["h2d_bytes"] > 0 and s["prefill_tps"] > 0 and s["decode_tps"] > 0
  assert s["ctx_size"] == s["prompt_tokens"] + 20
  assert p["kv"] == "plain" and p["decode_tokens"] == 8 and "tokens_match" not in p
  # greedy, same prompt: the plain run's 8 tokens are the start of the streamed run's 20
  assert s["tokens"].split()[:8] == p["tokens"].split()
  with open(os.path.join(out, "tiny_stream.csv"), newline="") as f:
    table = list(csv.DictReader(f))
  assert len(table) == 2 and table[0]["tokens_match"] == "True" and table[1]["tokens_match"] == ""
  assert table[1]["decode_tokens"] == "8"
  assert s["all_pages_resident"] is False and s["compile_ms"] > 0 and s["spec_type"] == "none"


def test_run_config_speculative_from_a_corpus_prompt(tmp_path):
  """spec_* fields reach the run (MTP drafts, host rollback on the streamed cache: the tokens equal
  plain greedy on the plain cache); prompt_tokens come from the corpus; the metrics are in the row."""
  out = str(tmp_path / "runs")
  _run(["-m", "experiments.run", "--config=configs/tiny_stream.py", "--config.spec_type=mtp",
        "--config.spec_rollback=host", "--config.prompt_tokens=70", "--config.n_predict=10",
        f"--config.out_dir={out}"], cwd=REPO)
  (r,) = [json.loads(l) for l in open(os.path.join(out, "tiny_stream.jsonl"))]
  from kvjax import api, corpus
  assert r["tokens_match"] is True and r["spec_type"] == "mtp" and r["spec_rollback"] == "host"
  assert r["prompt_tokens"] == 70 and r["text"]
  assert corpus.prompt_tokens(api.load_model("tiny").tokenizer, 70)[:5] == corpus.prompt_tokens(
      api.load_model("tiny").tokenizer, 5)
  assert r["mtp_lease_bytes_per_round"] == r["mtp_h2d_bytes_per_round"] > 0
  assert r["mtp_leases"] == r["verify_forwards"] and r["rollback_d2h_bytes"] > 0
  assert len(r["acceptance_by_position"]) == 3 and r["verify_ms_by_width"] and r["verify_rows_mean"] > 1
  assert 1 <= r["realized_verify_width"] <= r["verify_rows_mean"]
  with open(os.path.join(out, "tiny_stream.csv"), newline="") as f:
    (row,) = list(csv.DictReader(f))
  assert json.loads(row["acceptance_by_position"]) == r["acceptance_by_position"]


def test_bench_spec_verify_rows_cpu(tmp_path):
  """The verify-rows check runs one command on the CPU: per row the verify and padded forwards'
  logits are within float rounding of one-row forwards, argmaxes agree, and the plain and streamed
  caches give the same bits."""
  p = _run(["-m", "experiments.bench_spec", "--model=tiny", "--dtype=float32", "--contexts=128",
            "--arena_mib=1", "--page_tokens=64", "--verify_rows=2", f"--out={tmp_path}"], cwd=REPO)
  assert "verify=plain" in p.stdout.splitlines()[-5]
  rows = json.load(open(os.path.join(tmp_path, "verify_rows.json")))["verify_rows"]
  assert [(r["cache"], r["row"]) for r in rows] == [("plain", 0), ("plain", 1), ("streamed", 0), ("streamed", 1)]
  for r in rows:
    assert r["verify_argmax_same"] and r["padded_argmax_same"] and r["margin"] > 0
    assert r["verify_max_rel"] < 1e-4 and r["padded_max_abs"] < 1e-3
    assert r["one_row_same_bits_as_plain"] and r["verify_same_bits_as_plain"]


def test_bench_spec_profile_counts_dispatches_by_phase(tmp_path):
  """bench_spec --profile on the CPU (tiny model, a 1,024-token history in a 2 MiB arena, oracle +
  MTP): the dispatches of each round phase, a round: the verify's group steps (2 groups), the
  catch-up's MTP step and the next round's drafting program behind it (the first round drafts in
  its draft phase), the rollback's one replay, the round's one read."""
  p = _run(["-m", "experiments.bench_spec", "--model=tiny", "--dtype=float32", "--contexts=1024",
            "--arena_mib=2", "--page_tokens=16", "--decode_tokens=10", "--n_max=3", "--oracle_mtp",
            "--allow_divergence", "--width_context=0", "--profile", f"--out={tmp_path}"], cwd=REPO, timeout=600)
  lines = {l.split()[2].rstrip(":"): l for l in p.stdout.splitlines() if l.startswith("dispatches 1024 ")}
  assert {"draft", "verify", "rollback", "mtp_catch_up", "read"} <= set(lines), p.stdout[-2000:]
  assert "group_step 2.0" in lines["verify"] and "head_step 1.0" in lines["verify"]
  assert "mtp_draft_steps 0." in lines["draft"] and "device_get 0." in lines["draft"]   # the first round's
  assert "mtp_step " in lines["mtp_catch_up"] and "mtp_draft_steps " in lines["mtp_catch_up"]
  assert "replay 1.0" in lines["rollback"] and "device_get 1.0" in lines["read"]


def test_run_config_errors_name_the_config_field(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  p = subprocess.run([sys.executable, "-m", "experiments.run", "--config=configs/tiny_stream.py",
                      "--config.ctx_size=10", f"--config.out_dir={tmp_path}"],
                     capture_output=True, text=True, cwd=REPO, env=env, timeout=240)
  assert p.returncode == 2 and "Traceback" not in p.stderr     # a usage error (1: a bad model file or budget)
  assert "config.ctx_size 10 is too small" in p.stderr and "config.n_predict 32" in p.stderr


def test_sweep_fixed_span(tmp_path):
  out = str(tmp_path / "sweep")
  p = _run(["-m", "experiments.sweep_fixed_span", "--contexts=128,256", "--arena_mib=0.5", "--pool_pages=1,6",
            "--decode_tokens=4", "--page_tokens=64", "--ubatch=64", "--nowarmup", f"--out={out}"], cwd=REPO)
  assert "sweep:" not in p.stderr   # tqdm progress only on a terminal (stderr is a pipe here)
  with open(os.path.join(out, "results.csv"), newline="") as f:
    rows = list(csv.DictReader(f))
  jsonl = [json.loads(l) for l in open(os.path.join(out, "results.jsonl"))]
  assert len(rows) == len(jsonl) == 6  # 2 contexts x 3 budgets
  for col in ("context_capacity", "prompt_tokens", "decode_tokens", "arena_mib", "prefill_tps", "decode_tps",
              "prompt_ms", "predicted_ms", "wall_seconds", "decode_kv_pool_mib", "resident_pages", "ring_slots",
              "active_pages", "h2d_mib_per_token", "h2d_calls_per_token"):
    assert col in rows[0]
  assert [int(r["context_capacity"]) for r in rows] == [128, 128, 128, 256, 256, 256]
  cfg = config_lib.tiny()
  layout = PageLayout(cfg.num_kv_heads, cfg.head_dim, "q8_0", "q4_0", 64)
  page = layout.page_bytes
  by = {(r["context_capacity"], r["arena_mib"], r["pool_pages"] if r["arena_mib"] == "" else ""): r
        for r in jsonl}
  for ctx in (128, 256):
    # a 1-page pool cannot stream 3 cache layers: an error row, and the sweep goes on
    e = by[(ctx, "", 1)]
    assert "too small" in e["error"] and e["decode_tps"] == ""
    r = by[(ctx, "", 6)]
    assert r["error"] == "" and r["prompt_tokens"] == ctx - 4 and r["decode_tokens"] == 4
    assert r["active_pages"] == ctx // 64
    # fixed split of 6 pages over 3 cache layers: 1 resident page each, a 3-slot ring
    assert (r["resident_pages"], r["ring_slots"]) == (3, 3)
    assert abs(r["decode_kv_pool_mib"] - 6 * page / 2**20) < 1e-12
    assert r["decode_tps"] > 0 and r["prefill_tps"] > 0
    # every decode forward uploads at least the non-resident pages holding committed tokens of both
    # target attention layers (copy units may round up), in at least one call per layer
    streamed = r["active_pages"] - 1
    assert r["h2d_mib_per_token"] >= 2 * streamed * page / 2**20
    assert r["h2d_calls_per_token"] >= 2
    a = by[(ctx, 0.5, "")]
    assert a["error"] == "" and 0 < a["decode_workspace_mib"] < 0.5
    available = int((0.5 * 2**20 - round(a["decode_workspace_mib"] * 2**20)) // page)
    # the pool leaves room in the arena for the staging of its in-flight uploads
    assert a["pool_pages"] == fit_split(available, 3, ctx, layout, 32, pinned=False).pool_pages
    assert 0 < a["pool_pages"] < available
    assert a["resident_pages"] + a["ring_slots"] == a["pool_pages"]
    assert a["all_pages_resident"] == (a["resident_pages"] // 3 >= a["active_pages"])
    if a["all_pages_resident"]:  # everything resident: nothing streams in decode
      assert a["h2d_mib_per_token"] == 0 and a["h2d_calls_per_token"] == 0
    assert r["all_pages_resident"] is False
  try:
    import matplotlib  # noqa: F401  pylint: disable=unused-import,import-outside-toplevel
    assert os.path.getsize(os.path.join(out, "results.png")) > 1000
  except ImportError:
    assert not os.path.exists(os.path.join(out, "results.png"))


def test_sweep_fixed_span_speculative(tmp_path):
  """The sweep over draft lengths: length 0 is plain decoding, MTP lengths run speculative decoding
  on the same corpus prompt (tokens equal plain's), with the reference's MTP columns and the lease."""
  out = str(tmp_path / "sweep")
  _run(["-m", "experiments.sweep_fixed_span", "--contexts=160", "--arena_mib=", "--pool_pages=6",
        "--decode_tokens=8", "--page_tokens=64", "--ubatch=64", "--nowarmup", "--spec_type=mtp",
        "--mtp_lengths=0,2", f"--out={out}"], cwd=REPO)
  rows = [json.loads(l) for l in open(os.path.join(out, "results.jsonl"))]
  assert [r["mtp_length"] for r in rows] == [0, 2] and not any(r["error"] for r in rows)
  plain, spec = rows
  assert plain["prompt_tokens"] == spec["prompt_tokens"] == 160 - 8 - 3
  assert plain["spec_type"] == "" and spec["spec_type"] == "mtp" and spec["tokens_match"] is True
  assert spec["mtp_draft_generated"] > 0 and 0 <= spec["mtp_acceptance_pct"] <= 100
  assert len(json.loads(spec["acceptance_by_position"])) == 2 and spec["verify_rows_mean"] > 1
  assert 1 <= spec["realized_verify_width"] <= spec["verify_rows_mean"]
  assert spec["mtp_lease_bytes_per_round"] > 0 and json.loads(spec["verify_ms_by_width"])


def test_bench_decode_smoke(tmp_path):
  """The GPU decode benchmark runs end to end at tiny scale and its table is self-consistent."""
  out = str(tmp_path / "bd")
  p = _run(["-m", "experiments.bench_decode", "--model=tiny", "--dtype=float32",
            "--contexts=4096", "--arena_mib=1.5", "--page_tokens=64", "--copy_pages=4", "--prompt=64",
            "--decode_steps=2", "--check_steps=3", "--block_pages=4", "--pool_pages=8", "--profile",
            "--host_profile", f"--out={out}"], cwd=REPO)
  log = json.load(open(os.path.join(out, "bench_decode.json")))
  row, small = log["rows"]
  # the plan's ring fills, counted before the cache was built, are what the decode forwards did
  for r in (row, small):
    assert r["waves_per_forward"] == r["plan_ring_fills_per_forward"] > 0, r
  assert small["pool_pages"] == 8 and small["bit_exact_steps"] == 3
  assert small["waves_per_forward"] > 2 * row["waves_per_forward"]    # a 5-slot ring: copy waves
  assert row["context"] == 4096 and row["resident_ms"] > 0 and row["streamed_ms"] > 0
  assert row["streamed_mib_per_forward"] > 0 and row["h2d_calls_per_forward"] > 0
  layout = PageLayout(2, 64, "q8_0", "q4_0", 64)
  # the pool make_kv plans in that arena: pool + staging reserve within what the workspace leaves
  available = int((1.5 * 2**20 - log["decode_workspace_mib"] * 2**20) // layout.page_bytes)
  split = fit_split(available, 3, 4096 + 2 + 8, layout, 4, wave_pages=4)
  assert row["pool_pages"] == split.pool_pages and row["ring_slots"] == split.ring_slots
  assert 0 < row["pool_pages"] + row["staging_reserve_pages"] <= available
  assert row["resident_pages_per_layer"] * 3 + row["ring_slots"] == row["pool_pages"]
  assert row["bit_exact_steps"] == 3 and row["copy_ms"] > 0 and row["host_ms_per_forward"] > 0
  for tag in ("4096", "4096_resident"):     # --profile: the streamed and the plain cache's kernels, apart
    assert os.path.getsize(os.path.join(out, f"kernels_{tag}.txt")) > 0, tag
  assert "resident_timeline_host_call_ms" in row and "timeline_host_call_ms" in row, sorted(row)
  # the host's time to enqueue a forward is part of the forward's time
  for mode, name in (("resident", "resident"), ("streamed", f"streamed_{row['pool_pages']}p")):
    assert 0 < row[f"{mode}_dispatch_ms"] < row[f"{mode}_ms"], (mode, row)
    text = open(os.path.join(out, f"host_4096_{name}.txt")).read()    # the host's time, by function
    assert text.startswith(f"2 timed forwards, {name},") and "generate.py" in text and "(forward)" in text, text[:400]
  assert row["timeline_device_events"] == 0          # a CPU has no device stream lines
  assert os.path.exists(os.path.join(out, "timeline_4096.txt")) and "context" in p.stdout


def test_sweep_plot_has_one_line_per_budget_given():
  """An arena whose pool changes with the context stays one line (one legend entry)."""
  code = """
from experiments.sweep_fixed_span import COLUMNS, series_of
def row(ctx, arena, pool, error=""):
  r = {k: "" for k in COLUMNS}
  r.update(context_capacity=ctx, arena_mib=arena, pool_pages=pool, error=error)
  return r
rows = [row(512, 0.5, 30), row(256, 0.5, 33), row(256, "", 6), row(512, "", 6), row(256, "", 1, "too small")]
s = series_of(rows)
print(sorted(s), [[r["context_capacity"] for r in v] for k, v in sorted(s.items())])
"""
  p = _run(["-c", code], cwd=REPO)
  assert p.stdout.strip() == "['arena 0.5 MiB', 'pool 6 pages'] [[256, 512], [256, 512]]"


def test_bench_h2d_smoke(tmp_path):
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}   # let jax probe its backends
  p = subprocess.run([sys.executable, "-m", "experiments.bench_h2d", "--sizes_mib=1", "--reps=1"],
                     capture_output=True, text=True, cwd=REPO, env=env, timeout=240)
  assert p.returncode == 0, p.stderr[-3000:]
  assert "Unable to initialize backend" not in p.stderr, p.stderr
  lines = [l for l in p.stdout.splitlines() if l.strip().startswith("1 ")]
  assert len(lines) == 5  # five copy variants measured


def test_bench_span_attention_smoke(tmp_path):
  """The span-kernel benchmark runs end to end in interpret mode: copy probe, correctness check
  (kernel vs the jnp reference), a sweep row and a main-table row with every baseline column."""
  out = str(tmp_path / "bs")
  p = _run(["-m", "experiments.bench_span_attention", "--interpret",
            "--contexts=256", "--rows=1", "--sweep_contexts=256",
            "--sweep_configs=block_tokens=16;decode=jnp;block_pages=auto",
            "--check_rows=1", "--check_precisions=f16x3", "--head_dim=64", "--page_tokens=64",
            "--q_heads=4", "--kv_heads=2", "--iters=1", "--rounds=1", "--copy_probe_mib=8",
            "--timing=dispatch", "--dispatch_iters=2",
            f"--out_dir={out}"], cwd=REPO, timeout=600)
  with open(os.path.join(out, "bench_span_attention.csv"), newline="") as f:
    rows = list(csv.DictReader(f))
  kinds = [r["kind"] for r in rows]
  assert kinds == ["copy_probe", "check", "sweep", "main"], kinds
  probe, check, sweep, main = rows
  assert float(probe["copy_gbps"]) > 0 and float(probe["read_gbps"]) > 0
  assert check["precision"] == "f16x3" and float(check["rel_err_vs_reference"]) < 1e-5
  assert float(sweep["us"]) > 0 and "block_tokens" in sweep["config"] and int(sweep["bp"]) >= 1
  assert "'decode': 'jnp'" in sweep["config"]
  assert int(main["bp"]) >= 1   # the "auto" partition size each row ran with
  assert float(sweep["rel_err"]) < 2e-3   # f16 operands against the float32 reference
  for col in ("kernel_contiguous_us", "kernel_ring_us", "xla_bf16_us", "reference_us"):
    assert float(main[col]) > 0, col
  assert "%copy" in p.stdout and "device copy" in p.stdout
  # S/1 (the verify ratio column): the one-row row over itself
  assert p.stdout.rstrip().splitlines()[-1].split("|")[-1].strip() == "1.00"


def test_bench_hoists_closed_over_arrays_into_arguments(tmp_path):
  """The bench times `fn(q)` closures over the pool / K / V; `hoist_closure` turns what they
  close over into arguments of the jitted step (closed over, jit embeds them in the program as
  constants), with the same result."""
  code = """
import jax, jax.numpy as jnp, numpy as np
import experiments.bench_span_attention as b
pool = jax.random.normal(jax.random.PRNGKey(0), (64, 96))
inner = jax.jit(lambda q, p: q @ p.T)
fn = lambda q: inner(q, pool) * 2.0
q = jnp.ones((3, 96))
fn_args, consts = b.hoist_closure(fn, q)
assert len(consts) == 1 and consts[0].shape == (64, 96), [c.shape for c in consts]
step = jax.jit(fn_args)
np.testing.assert_array_equal(np.asarray(step(q, consts)), np.asarray(fn(q)))
text = step.lower(q, consts).as_text()
assert "tensor<64x96xf32>" in text.split("public @main")[1].split(")")[0], text[:400]
closed_text = jax.jit(fn).lower(q).as_text()
assert "stablehlo.constant dense<" in closed_text and "tensor<64x96xf32>" not in closed_text.split(
    "public @main")[1].split(")")[0]
print("hoisted")
"""
  p = _run(["-c", code], cwd=REPO)
  assert "hoisted" in p.stdout


def test_bench_span_attention_mosaic_smoke(tmp_path):
  """--mosaic: the Mosaic GPU decode kernel (interpreted, head_dim 256) is checked against the
  reference and timed on the contiguous and the ring placement in the main table, with its own
  summary."""
  out = str(tmp_path / "bs2")
  p = _run(["-m", "experiments.bench_span_attention", "--interpret",
            "--contexts=192", "--rows=1", "--sweep=false", "--mosaic", "--check_rows=1",
            "--check_precisions=f16", "--head_dim=256", "--page_tokens=64", "--q_heads=6",
            "--kv_heads=2", "--iters=1", "--rounds=1", "--copy_probe_mib=0",
            "--reference_max_rows=0", "--timing=dispatch", "--dispatch_iters=1",
            f"--out_dir={out}"], cwd=REPO, timeout=600)
  with open(os.path.join(out, "bench_span_attention.csv"), newline="") as f:
    rows = list(csv.DictReader(f))
  checks = {r["precision"]: r for r in rows if r["kind"] == "check"}
  assert float(checks["mosaic_f16"]["rel_err_vs_reference"]) < 2e-3, checks
  main = [r for r in rows if r["kind"] == "main"][0]
  for col in ("mosaic_contiguous_us", "mosaic_ring_us", "kernel_contiguous_us"):
    assert float(main[col]) > 0, col
  assert any(l.startswith("mosaic ") and "mosaic us" in l for l in p.stdout.splitlines())


def test_probe_page_reads_smoke(tmp_path):
  """The read-ceiling probe (the span kernel's page reads alone, then with its decode) runs in
  interpret mode, and its raw-halfword sums equal numpy's over the same page bytes."""
  p = _run(["-m", "experiments.kernel_lab.probe_page_reads", "--interpret",
            "--contexts=192", "--block_pages=2", "--block_tokens=16", "--page_tokens=64",
            "--head_dim=64", "--kv_heads=2"], cwd=REPO, timeout=300)
  assert "check context=192: sums equal numpy's" in p.stdout
  probes = [l for l in p.stdout.splitlines() if l.startswith("probe ")]
  assert [l.split()[2] for l in probes] == ["mode=load", "mode=decode"], probes


def test_probe_bf16_cast_smoke():
  """kernel_lab/probe_bf16_cast interpreted on the CPU: its three conversions are XLA's on every value."""
  p = _run(["-m", "experiments.kernel_lab.probe_bf16_cast", "--interpret", "--n=8192"], cwd=REPO, timeout=300)
  rows = [line for line in p.stdout.splitlines() if line.startswith(("astype", "integer"))]
  assert len(rows) == 3 and all(line.split()[-3:] == ["0.0000%"] * 3 for line in rows), p.stdout[-2000:]


def test_probe_triton_loads_smoke():
  """kernel_lab/probe_triton_loads on the CPU: every load pattern interpreted, its byte sums right."""
  p = _run(["-m", "experiments.kernel_lab.probe_triton_loads"], cwd=REPO, timeout=300)
  rows = [line for line in p.stdout.splitlines() if line.startswith("small ")]
  assert len(rows) >= 8 and all(line.endswith("ok=True") for line in rows), p.stdout[-2000:]


def test_probe_planar_gemv_smoke(tmp_path):
  """The quantized-GEMV-as-XLA-fusion probe runs every variant on small shapes (CPU) and each
  variant's product is the dense product of the weights it packs (bf16 variants: bf16 rounding)."""
  out = str(tmp_path / "ppg")
  _run(["-m", "experiments.kernel_lab.probe_planar_gemv", "--small", f"--out={out}"], cwd=REPO, timeout=300)
  rows = json.load(open(os.path.join(out, "probe_planar_gemv.json")))["rows"]
  assert {r["variant"] for r in rows} == {"bf16", "q4k_u8", "q4k_u32", "q4k_row", "q4k_ggml", "q4k_dot", "q8_ggml",
                                          "q8_u8", "q8_dot"}
  for r in rows:   # f32 planes: float32 rounding; the dot variants round the weights to bf16
    assert r["rel_err"] < (1e-2 if r["variant"] in ("bf16", "q4k_dot", "q8_dot") else 1e-5), r


def test_probe_gdn_chunked_smoke(tmp_path):
  """The chunked-GDN probe runs each form and chunk size on small heads (CPU); the hoisted form, the
  scan and the Pallas kernel (interpreted) give the model's chunked result within float32 rounding."""
  out = str(tmp_path / "pgc")
  _run(["-m", "experiments.kernel_lab.probe_gdn_chunked", "--small", f"--out={out}"], cwd=REPO, timeout=300)
  rows = json.load(open(os.path.join(out, "gdn_chunked.json")))
  assert {(r["form"], r["chunk"]) for r in rows} == {("model", 16), ("model", 64), ("hoisted", 16), ("hoisted", 64),
                                                     ("scan", 1)} | {
      (f"triton default bv16{split}", c) for c in (16, 64) for split in ("", " split")}
  assert all(0 <= r["rel_diff"] < 1e-5 and r["ms"] > 0 for r in rows), rows


def test_probe_gdn_rows_smoke():
  """The rows-kernel probe runs on small heads (CPU, interpreted): each row count's errors within float32
  rounding of the float64 loop, capture and the by-count state bit for bit, a time for both forms."""
  p = _run(["-m", "experiments.kernel_lab.probe_gdn_rows", "--small", "--rows=1,3", "--calls=3"], cwd=REPO,
           timeout=300)
  rows = [line.split() for line in p.stdout.splitlines() if line.split() and line.split()[0].isdigit()]
  assert [r[0] for r in rows] == ["1", "3"], p.stdout
  for r in rows:
    assert max(float(x) for x in r[1:4]) < 1e-5 and r[5:7] == ["True", "True"], r
    assert float(r[7]) > 0 and float(r[8]) > 0, r


def test_probe_launch_cost_smoke():
  """The launch-cost probe runs on the CPU: a host time for each count of kernels and of argument buffers, and a
  slope for every count past the first."""
  p = _run(["-m", "experiments.kernel_lab.probe_launch_cost", "--small", "--calls=5"], cwd=REPO, timeout=300)
  rows = [line.split() for line in p.stdout.splitlines()[1:] if line.strip()]
  assert [(r[0], r[-3]) for r in rows if r[0] in ("xla", "args")] == [
      (w, n) for w in ("xla", "args") for n in ("1", "10", "40")], p.stdout
  assert all(float(r[-2]) > 0 for r in rows) and all(r[-1] != "-" for r in rows if r[-3] != "1"), p.stdout


def test_probe_tma_reads_smoke(tmp_path):
  """The TMA read-ceiling probe (Mosaic GPU) runs in the Mosaic GPU interpreter: every CTA's last
  tile lands in SMEM from the right page and offset (its first bytes, copied back, equal the page
  bytes), for two line widths (the TMA box's inner dimension), tile sizes and pipeline depths,
  with a partial last partition."""
  p = _run(["-m", "experiments.kernel_lab.probe_tma_reads", "--interpret",
            "--contexts=512", "--page_tokens=64", "--head_dim=64", "--kv_heads=4",
            "--block_pages=3", "--block_tokens=16,32", "--stages=2,3", "--line_bytes=16,256"],
           cwd=REPO, timeout=300)
  checked = [l for l in p.stdout.splitlines() if l.startswith("tma ") and " checked " in l]
  assert len(checked) == 8, p.stdout
  assert sorted({l.split()[3] for l in checked}) == ["line=16", "line=256"], checked


def _import_lab(name):
  """experiments/kernel_lab/NAME.py as a module (the repository root is on the tests' path)."""
  import importlib  # pylint: disable=import-outside-toplevel
  return importlib.import_module("experiments.kernel_lab." + name)


def test_probe_wg_reductions():
  """kernel_lab/probe_wg_reductions.py (GPU only: it found that concurrent axis-0 reductions of
  several Pallas warpgroups race): its numpy sums equal the loop they stand
  for, along either axis, and the kernel lowers for "cuda" with 1, 2 and 4 warpgroups."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  probe = _import_lab("probe_wg_reductions")
  x = np.random.default_rng(0).integers(-5, 5, (2, 3, 64, 16)).astype(np.float64)
  for axis in (0, 1):
    want = probe.expected(x, 3, axis)
    for k, op in enumerate((np.max, np.sum)):
      loop = sum(np.broadcast_to(np.expand_dims(op(x + i, axis=2 + axis), 2 + axis), x.shape)
                 for i in range(3))
      np.testing.assert_array_equal(want[:, :, k], loop)
  for wgs in (1, 2, 4):
    for axis in (0, 1):
      jax.jit(lambda a, ax=axis: probe.reductions(a, iters=4, axis=ax)).trace(
          jax.ShapeDtypeStruct((4, wgs, 64, 16), jnp.float32)).lower(lowering_platforms=("cuda",))


def _exact_pool(layout, pages: int, seed: int):
  """A pool of `kernel_lab.common.exact_pages` pages (numpy uint8 [pages, page_bytes])."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(seed)
  return _import_lab("common").exact_pages(
      rng.integers(0, 256, (pages, layout.page_bytes), np.uint8), layout, rng)


def test_probe_tma_magic_and_step():
  """The TMA probe's magic and step modes (GPU only: inline PTX) lower for "cuda" at the 27B page
  geometry with 256-byte lines (1, 2, 4 warpgroups, 1 and 2 stages), and their numpy checks
  agree with ggml_codec's dequant computed another way: on exact pages (every scale 2^-6) the
  magic mode's unscaled sums are 64 x the dequantized K . W_K + V . W_V, and the step mode's
  S^T / O^T sums equal a tile-by-tile loop; O^T's rows follow `magic_ptx.vt_dims`."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from kvjax_pallas import ggml_codec  # pylint: disable=import-outside-toplevel
  probe = _import_lab("probe_tma_reads")
  big = PageLayout(4, 256, "q8_0", "q4_0", 256)
  pool = _exact_pool(big, 5, seed=8)
  table = np.array([3, 0, 4, 1], np.int32)
  pages = jnp.asarray(pool[table])
  k = np.asarray(ggml_codec.decode_rows(pages[:, :big.k_plane_bytes].reshape(-1, big.k_row_bytes),
                                        "q8_0", 4), np.float64).reshape(2, 2 * 256, 4, 256)
  v = np.asarray(ggml_codec.decode_rows(
      pages[:, big.v_offset:big.v_offset + big.v_plane_bytes].reshape(-1, big.v_row_bytes),
      "q4_0", 4), np.float64).reshape(2, 2 * 256, 4, 256)
  w, _ = magic_ptx.check_operands("ggml", 256, 16)
  got = probe.expected_magic_sums(pool, table, big, 2, w)            # [parts, G, 64, N]
  want = np.zeros((2, 4, 64, 16))
  for t in range(2 * 256):
    want[:, :, t % 64] += 64 * (k[:, t] @ w[0] + v[:, t] @ w[1])
  np.testing.assert_array_equal(got, want)
  wk, p, qt, pt = probe.step_inputs(256, 16)
  np.testing.assert_array_equal(qt.astype(np.int64), wk[magic_ptx.ggml_dims("q8_0")])
  s_got, o_got = probe.expected_step_sums(pool, table, big, 2, wk, p)
  s_want, o_want = np.zeros((2, 4, 64, 16)), np.zeros((2, 4, 256, 16))
  for t in range(2 * 256):
    s_want[:, :, t % 64] += k[:, t] @ wk
    o_want += v[:, t][..., magic_ptx.vt_dims()][..., None] * p[t % 64]
  np.testing.assert_array_equal(s_got, s_want)
  np.testing.assert_array_equal(o_got, o_want)
  assert np.abs(s_want).max() > 0.1 and np.abs(o_want).max() > 0.1
  sds = jax.ShapeDtypeStruct
  lines = sds((520, big.page_bytes // 256, 256), jnp.uint8)
  tab = sds((512,), jnp.int32)
  for consumers, stages in ((4, 2), (2, 1), (1, 1)):
    jax.jit(lambda a, b, r, c=consumers, st=stages: probe.magic_probe(
        a, b, r, layout=big, block_pages=4, stages=st, consumers=c)).trace(
            lines, tab, sds((2, 256, 16), jnp.float16)).lower(lowering_platforms=("cuda",))
  jax.jit(lambda a, b, q, r: probe.step_probe(a, b, q, r, layout=big, block_pages=4, stages=2,
                                              consumers=4)).trace(
      lines, tab, sds((256, 16), jnp.float16), sds((64, 16), jnp.float16)).lower(
          lowering_platforms=("cuda",))
  with pytest.raises(ValueError, match="head dim 256"):
    probe.magic_probe(jnp.zeros((4, 26624 // 256, 256), jnp.uint8), jnp.zeros((4,), jnp.int32),
                      jnp.zeros((2, 64, 16), jnp.float16),
                      layout=PageLayout(2, 64, "q8_0", "q4_0", 128), block_pages=2, stages=1)


def test_probe_packed_decode(tmp_path):
  """The packed-format decode probe: `repack` keeps every value (the packed planes, dequantized,
  equal ggml_codec's decode of real Q8_0 / Q4_0 pages, scales included); the probe runs in the
  Mosaic GPU interpreter with its sums equal to numpy's for 1 and 2 stages; it lowers for "cuda"
  at the 27B page geometry (Warpgroup semantics, swizzled int8 tiles)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from kvjax_pallas import ggml_codec  # pylint: disable=import-outside-toplevel
  probe = _import_lab("probe_packed_decode")
  layout = PageLayout(2, 64, "q8_0", "q4_0", 128)
  x = np.random.default_rng(3).normal(size=(3, 2, 128, 2, 64)).astype(np.float32)
  k_rows = np.asarray(ggml_codec.encode_rows(jnp.asarray(x[:, 0]), "q8_0"))   # [P, T, G*68]
  v_rows = np.asarray(ggml_codec.encode_rows(jnp.asarray(x[:, 1]), "q4_0"))
  pool = np.zeros((3, layout.page_bytes), np.uint8)
  pool[:, :layout.k_plane_bytes] = k_rows.reshape(3, -1)
  pool[:, layout.v_offset:layout.v_offset + layout.v_plane_bytes] = v_rows.reshape(3, -1)
  kq, vq, ks, vs = probe.repack(pool, layout)
  assert kq.shape == (3, 2, 128, 64) and vq.shape == (3, 2, 128, 32) and ks.shape == (3, 2, 128, 2)
  k_want = np.asarray(ggml_codec.decode_rows(jnp.asarray(k_rows), "q8_0", 2)).transpose(0, 2, 1, 3)
  v_want = np.asarray(ggml_codec.decode_rows(jnp.asarray(v_rows), "q4_0", 2)).transpose(0, 2, 1, 3)
  k_got = (kq.astype(np.float32).reshape(3, 2, 128, 2, 32)
           * ks.astype(np.float32)[..., None]).reshape(3, 2, 128, 64)
  lo, hi = (vq & 15).astype(np.float32) - 8, (vq >> 4).astype(np.float32) - 8
  v_vals = np.concatenate([lo.reshape(3, 2, 128, 2, 16), hi.reshape(3, 2, 128, 2, 16)], -1)
  v_got = (v_vals * vs.astype(np.float32)[..., None]).reshape(3, 2, 128, 64)
  np.testing.assert_array_equal(k_got, k_want)
  np.testing.assert_array_equal(v_got, v_want)
  p = _run(["-m", "experiments.kernel_lab.probe_packed_decode", "--interpret",
            "--contexts=512", "--page_tokens=128", "--head_dim=64", "--kv_heads=2",
            "--block_pages=2", "--stages=1,2", "--consumers=1,2"], cwd=REPO, timeout=600)
  checked = [[l.split()[i] for i in (1, 3, 4)] for l in p.stdout.splitlines()
             if l.startswith("packed ") and " checked " in l]
  assert checked == [["sum", "stages=1", "WGs=1"], ["sum", "stages=2", "WGs=1"],
                     ["wgmma", "stages=1", "WGs=1"], ["wgmma", "stages=1", "WGs=2"],
                     ["wgmma", "stages=2", "WGs=1"], ["wgmma", "stages=2", "WGs=2"]], p.stdout
  assert "skip magic: GPU only" in p.stdout and "FAILED" not in p.stdout
  assert probe.smem_bytes(4, 256, 2) <= 227 * 1024
  assert probe.wgmma_smem_bytes(4, 256, 2, 16) <= 227 * 1024
  sds = jax.ShapeDtypeStruct
  args = (sds((520, 4, 256, 256), jnp.int8), sds((520, 4, 256, 128), jnp.uint8),
          sds((520, 4, 256, 8), jnp.float16), sds((520, 4, 256, 8), jnp.float16),
          sds((512,), jnp.int32))
  jax.jit(lambda *a: probe.packed_probe(*a, block_pages=4, stages=2, interpret=False)).trace(
      *args).lower(lowering_platforms=("cuda",))
  wargs = (args[0], sds((520, 4, 256, 128), jnp.int8)) + args[2:]
  for convert, dtype in (("mosaic", jnp.bfloat16), ("magic", jnp.float16)):
    jax.jit(lambda *a, cv=convert: probe.packed_wgmma_probe(
        *a, block_pages=4, stages=2, consumers=4, interpret=False, convert=cv)).trace(
            *wargs, sds((2, 256, 16), dtype)).lower(lowering_platforms=("cuda",))
  # the magic check: a wrong permutation of the rhs rows changes the expected sums
  kq = np.random.default_rng(6).integers(-128, 128, (4, 2, 128, 256), dtype=np.int8)
  vq = np.random.default_rng(7).integers(-128, 128, (4, 2, 128, 128), dtype=np.int8)
  sc = np.ones((4, 2, 128, 8), np.float16)
  w, rhs = magic_ptx.check_operands("packed", 256, 16)
  want = probe.expected_magic_sums(kq, vq, sc, sc, np.arange(4, dtype=np.int32), 2, w)[0]
  lhs_k = kq.astype(np.float64)[..., magic_ptx_dims("q8_0")]
  v = vq.astype(np.int64) & 0xFF
  blocks = v.reshape(4, 2, 128, 8, 16)
  v_vals = np.concatenate([blocks & 15, blocks >> 4], -1).reshape(4, 2, 128, 256) - 8
  lhs_v = v_vals.astype(np.float64)[..., magic_ptx_dims("q4_0")]
  got = (lhs_k @ rhs[0].astype(np.float64) + lhs_v @ rhs[1].astype(np.float64))
  got = got.reshape(2, 2, 2, 2, 64, 16).sum(axis=(1, 3))   # [parts, pages, G, tiles, 64, N]
  np.testing.assert_array_equal(got, want)


def magic_ptx_dims(kind):
  return magic_ptx.packed_dims(kind, 256)


def test_ncu_report_summaries(tmp_path):
  """experiments/kernel_lab/ncu_report.py (used by opcode_mix.sh / stall_profile.sh on the GPU
  machine)
  reads ncu's CSV: opcode counts by name, largest first; stall reasons by size with their total;
  the kept section metrics; the longest kernel's name (regex-escaped), the program's own output
  lines skipped."""
  head = ["ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream",
          "Block Size", "Grid Size", "Device", "CC", "Section Name", "Metric Name", "Metric Unit",
          "Metric Value"]

  def row(kernel, metric, unit, value):
    return ["0", "1", "python3", "host", kernel, "1", "7", "(128, 1, 1)", "(4, 1, 1)", "0", "9.0",
            "sec", metric, unit, value]

  path = tmp_path / "ncu.csv"
  with open(path, "w", newline="") as f:
    f.write("==PROF== Connected to process 1\n")
    w = csv.writer(f)
    w.writerow(head)
    w.writerow(row("k", "sass__inst_executed_per_opcode", "",
                   "4,500 (LDG: 1,000; IMAD: 3,000; HMMA: 500)"))
    w.writerow(row("k", "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio", "", "1.5"))
    w.writerow(row("k", "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",
                   "", "2.25"))
    w.writerow(row("k", "Registers Per Thread", "register/thread", "128"))
    w.writerow(row("k", "Not Kept", "", "7"))
  script = ["-m", "experiments.kernel_lab.ncu_report"]
  p = _run(script + ["stalls", str(path), "cfg=1", "k"], cwd=REPO)
  assert "opcodes (0.00 M): IMAD 0.00M, LDG 0.00M, HMMA 0.00M" in p.stdout
  assert "stalls (warps a issued instruction, total 3.75): long_scoreboard 2.25, wait 1.50" in p.stdout
  assert "Registers Per Thread = 128 register/thread" in p.stdout and "Not Kept" not in p.stdout
  p = _run(script + ["opcodes", str(path), "cfg=1"], cwd=REPO)
  assert "cfg=1: 0.00 M warp instructions by opcode" in p.stdout
  assert "IMAD 0.00M, LDG 0.00M, HMMA 0.00M" in p.stdout
  def write(name, *rows):
    with open(tmp_path / name, "w", newline="") as f:
      csv.writer(f).writerows([head, *rows])
    return str(tmp_path / name)

  times = write("times.csv", row("short_kernel", "gpu__time_duration.sum", "ns", "1,000"),
                row("long.kernel(int)", "gpu__time_duration.sum", "ns", "2,000,000"))
  p = _run(script + ["longest", times], cwd=REPO)
  assert p.stdout.strip() == r"long\.kernel"
  shared = write("shared.csv",
                 row("k", "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum", "", "3,000"),
                 row("k", "smsp__inst_executed_op_shared_ld.sum", "inst", "1,200"))
  p = _run(script + ["metrics", shared], cwd=REPO)
  assert "smsp__inst_executed_op_shared_ld.sum = 1,200 inst" in p.stdout
  assert "wavefronts per shared load instruction = 2.50" in p.stdout


def test_ncu_durations_lists_a_calls_kernels(tmp_path):
  """experiments/kernel_lab/ncu_durations.py: the last `tail` kernels of an ncu duration log in launch
  order, each in microseconds (ns / us / ms units), and their total; the program's own lines and
  ncu's banner skipped."""
  head = ["ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream",
          "Block Size", "Grid Size", "Device", "CC", "Section Name", "Metric Name", "Metric Unit",
          "Metric Value"]

  def row(kernel, unit, value):
    return ["0", "1", "python3", "host", kernel, "1", "7", "(128, 1, 1)", "(4, 1, 1)", "0", "9.0",
            "", "gpu__time_duration.sum", unit, value]

  path = tmp_path / "d.csv"
  with open(path, "w", newline="") as f:
    f.write("==PROF== Connected to process 1\n=== rows 6 N 8: sum |o| 1\n")
    w = csv.writer(f)
    w.writerow(head)
    w.writerow(row("random_bits", "usecond", "50"))
    w.writerow(row("loop_gather_fusion", "nsecond", "2,940"))
    w.writerow(row("anonymous_mosaic_gpu_kernel", "usecond", "91.46"))
    w.writerow(row("kvjax_span_combine", "msecond", "0.021"))
  p = _run(["-m", "experiments.kernel_lab.ncu_durations", str(path), "3"], cwd=REPO)
  lines = p.stdout.strip().splitlines()
  assert [ln.split()[-1] for ln in lines[:3]] == [
      "loop_gather_fusion", "anonymous_mosaic_gpu_kernel", "kvjax_span_combine"]
  assert [float(ln.split()[0]) for ln in lines[:3]] == [2.94, 91.46, 21.0]
  assert lines[3].split()[0] == "115.40" and "3 kernels" in lines[3]


def test_mosaic_round_runs_the_named_steps_and_prints_a_summary(tmp_path):
  """experiments/kernel_lab/mosaic_round.sh (one device call of the decode kernel's round): only
  the steps
  named in STEPS run; the EXTRA command's output tail goes into $OUT/summary.txt, which is
  printed last."""
  script = os.path.join(REPO, "experiments", "kernel_lab", "mosaic_round.sh")
  env = dict(os.environ, OUT=str(tmp_path), STEPS="none", EXTRA="echo measured 42 us",
             JAX_PLATFORMS="cpu")
  p = subprocess.run(["bash", script], capture_output=True, text=True, cwd=REPO, env=env,
                     timeout=60)
  assert p.returncode == 0, p.stderr
  summary = (tmp_path / "summary.txt").read_text()
  assert "== extra: echo measured 42 us" in summary and "measured 42 us" in summary
  assert "== tests" not in summary and "== bench" not in summary
  assert p.stdout.rstrip().endswith("measured 42 us")


def test_time_combine_smoke(tmp_path):
  """experiments/kernel_lab/time_combine.py on the CPU (the Triton combine interpreted): every
  tiling of the decode kernel's combine folds to the default's bits, a tiling the shape refuses
  is reported by name and the run goes on."""
  env = dict(os.environ, TIME_COMBINE_REPS="1")
  p = subprocess.run([sys.executable, "-m", "experiments.kernel_lab.time_combine",
                      "8", "1", "default,cols=32,rows=16,cols=4+unroll=8"],
                     capture_output=True, text=True, cwd=REPO, timeout=300,
                     env=dict(env, JAX_PLATFORMS="cpu"))
  assert p.returncode == 0, p.stderr[-3000:]
  rows = [l for l in p.stdout.splitlines() if l.strip().startswith("8 ")]
  assert len(rows) == 4, p.stdout
  timed = [l for l in rows if "failed" not in l]
  assert len(timed) == 3 and all(l.split("|")[-1].strip() == "0" for l in timed), p.stdout
  assert "combine rows must be a power of two dividing the 8 padded rows, got 16" in p.stdout


def test_bench_cases_that_differ_in_closed_over_arrays_share_a_step(tmp_path):
  """The bench's timing step is cached by jaxpr: a kernel over the contiguous and over the ring
  table (closed-over arrays of one shape) is one jitted step, compiled once; another shape is
  another step. (In a subprocess: the bench's absl flags would clash with the probes'.)"""
  code = """
import jax.numpy as jnp
import experiments.bench_span_attention as bench
q = jnp.ones((2, 3))
t1, t2, t3 = jnp.arange(4), jnp.arange(4)[::-1], jnp.arange(5)
step1, c1 = bench._dispatch_step(lambda x: x * t1.sum(), q)
step2, c2 = bench._dispatch_step(lambda x: x * t2.sum(), q)
step3, _ = bench._dispatch_step(lambda x: x * t3.sum(), q)
assert step1 is step2 and step3 is not step1
assert float(step1(q, c1)[0, 0]) == float(step2(q, c2)[0, 0]) == 1.0   # q + 1e-30 * 6 q
print("shared")
"""
  p = _run(["-c", code], cwd=REPO, timeout=120)
  assert "shared" in p.stdout


def test_compile_time_smoke(tmp_path):
  """experiments/kernel_lab/compile_time.py on the CPU (the jnp reference): one row a (rows,
  implementation), the first forward (compiling) slower than the second."""
  p = _run(["-m", "experiments.kernel_lab.compile_time", "1", "reference", "300"], cwd=REPO,
           timeout=300)
  rows = [l.split() for l in p.stdout.splitlines() if l.split()[:2] == ["1", "reference"]]
  assert len(rows) == 1, p.stdout
  first, second = float(rows[0][3]), float(rows[0][4])
  assert first > second > 0


def test_ncu_report_sources(tmp_path):
  """`ncu_report.py sources` (stall_sources.sh): the SASS source page's stall samples summed by
  opcode (predicates and modifiers dropped) and listed by instruction, largest first, with their
  largest reasons; a page without the sampling column is refused by name."""
  path = tmp_path / "sass.csv"
  with open(path, "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(["# Address", "Source", "Warp Stall Sampling (All Samples)",
                "Warp Stall Sampling (Not-issued Samples)", "stall_long_sb", "stall_barrier"])
    w.writerow(["0x10", "@!P0 LDL.64 R2, [R1+0x8]", "600", "590", "550", "0"])
    w.writerow(["0x20", "LDL R4, [R1]", "200", "190", "180", "0"])
    w.writerow(["0x30", "BAR.SYNC.DEFER_BLOCKING 0x1, 0x80", "300", "300", "0", "290"])
    w.writerow(["0x40", "HMUL2 R5, R6, R7", "1,000", "100", "0", "0"])
  script = ["-m", "experiments.kernel_lab.ncu_report"]
  out = _run(script + ["sources", str(path), "2"], cwd=REPO).stdout
  assert "4 SASS instructions, 2100 warp samples" in out
  lines = out.splitlines()
  ops = [l.split()[0] for l in lines[lines.index("  by opcode (share of samples; largest reasons):")
                                     + 1:][:3]]
  assert ops == ["HMUL2", "LDL", "BAR"]
  assert "LDL         38.1 %  stall_long_sb 730" in out
  top = lines[lines.index("  top 2 instructions:") + 1:]
  assert len(top) == 2 and "HMUL2" in top[0] and "@!P0 LDL.64" in top[1]
  bad = tmp_path / "bad.csv"
  bad.write_text("Source,Other\nLDL,1\n")
  p = subprocess.run([sys.executable] + script + ["sources", str(bad)], capture_output=True,
                     text=True, cwd=REPO)
  assert p.returncode != 0 and "no 'Warp Stall Sampling (All Samples)' column" in p.stderr


def test_bench_overlap_smoke(tmp_path):
  """The overlap microbenchmark runs every issuing method at tiny scale (CPU: no pinned memory)."""
  out = str(tmp_path / "bo")
  p = _run(["-m", "experiments.bench_overlap", "--layers=2", "--copy_mib=1", "--dim=64", "--reps=1",
            f"--out={out}"], cwd=REPO)
  log = json.load(open(os.path.join(out, "bench_overlap.json")))
  assert [r["method"] for r in log["rows"]] == ["ahead", "after", "ahead_small", "small_first",
                                                "all_first", "in_step", "one_program"]
  assert log["copy_ms"] > 0 and log["compute_ms"] > 0 and "hidden" in p.stdout


def test_timeline_overlap_arithmetic():
  """Union and intersection of copy and kernel intervals, on hand-made events."""
  from experiments.lib import timeline
  ev = [timeline.Event("Stream #1", "h2d", "MemcpyH2D", 0.0, 4e6),        # 0-4 ms
        timeline.Event("Stream #2", "h2d", "MemcpyH2D", 2e6, 4e6),        # 2-6 ms (overlaps the first)
        timeline.Event("Stream #9", "kernel", "fusion", 5e6, 3e6),        # 5-8 ms
        timeline.Event("Stream #9", "kernel", "fusion", 8e6, 2e6)]        # 8-10 ms
  s = timeline.summarize(ev)
  assert s["h2d_ms"] == pytest.approx(6.0) and s["kernel_ms"] == pytest.approx(5.0)
  assert s["overlap_ms"] == pytest.approx(1.0) and s["hidden_share"] == pytest.approx(1 / 6)
  assert s["window_ms"] == pytest.approx(10.0) and s["kernel_idle_ms"] == pytest.approx(5.0)
  segs = timeline.segments(ev, gap_ns=1e3)
  assert [(g["kind"], g["n"]) for g in segs] == [("h2d", 1), ("h2d", 1), ("kernel", 2)]
  assert timeline.classify("MemcpyDtoH") == "d2h" and timeline.classify("Memcpy HtoD") == "h2d"


def test_timeline_kernel_table_families():
  """Kernel time by family and the top kernels, on hand-made events (copies are not kernels)."""
  from experiments.lib import timeline
  ev = [timeline.Event("Stream #9", "kernel", "sm90_xmma_gemm_bf16bf16_bf16f32", 0.0, 6e6),
        timeline.Event("Stream #9", "kernel", "nvjet_hsh_128x256", 6e6, 2e6),
        timeline.Event("Stream #9", "kernel", "mosaic_gpu_span_kernel", 8e6, 1e6),
        timeline.Event("Stream #9", "kernel", "loop_multiply_fusion", 9e6, 1e6),
        timeline.Event("Stream #9", "kernel", "sm90_xmma_gemm_f32f32_f32f32_f32_tn", 10e6, 0.5e6),
        timeline.Event("Stream #9", "kernel", "trsm_left_lower_kernel", 10.5e6, 0.25e6),
        timeline.Event("Stream #2", "h2d", "MemcpyH2D", 0.0, 5e6)]
  t = timeline.kernel_table(ev, top=2)
  assert t["total_ms"] == pytest.approx(10.75)
  assert list(t["families"]) == ["gemm", "attention", "fusion", "gemm_f32", "solve"]
  assert t["families"]["gemm"]["n"] == 2 and t["families"]["gemm"]["share"] == pytest.approx(8 / 10.75)
  assert [k["name"] for k in t["top"]] == ["sm90_xmma_gemm_bf16bf16_bf16f32", "nvjet_hsh_128x256"]
  assert "gemm" in timeline.format_kernel_table(t)


def test_timeline_phase_device_arithmetic():
  """What the device did inside each named host phase, on hand-made windows and events."""
  from experiments.lib import timeline
  ev = [timeline.Event("Stream #9", "kernel", "fusion", 1e6, 2e6),        # 1-3 ms
        timeline.Event("Stream #2", "h2d", "MemcpyH2D", 2e6, 4e6),        # 2-6 ms
        timeline.Event("Stream #9", "kernel", "fusion", 9e6, 1e6)]        # 9-10 ms
  d = timeline.phase_device(ev, [("verify", 0.0, 4e6), ("draft", 4e6, 8e6), ("verify", 8e6, 10e6)])
  assert d["verify"]["n"] == 2 and d["verify"]["wall_ms"] == pytest.approx(6.0)
  assert d["verify"]["kernel_ms"] == pytest.approx(3.0) and d["verify"]["h2d_ms"] == pytest.approx(2.0)
  assert d["draft"]["kernel_idle_ms"] == pytest.approx(4.0) and d["draft"]["h2d_ms"] == pytest.approx(2.0)


def test_speculative_round_phases_are_trace_annotations():
  """A speculative generation under the profiler leaves each round's phases as host annotations
  (`PhaseClock`: spec:draft, spec:verify, ...), one window a round each, in the round's order."""
  import jax
  from experiments.lib import timeline
  from kvjax import engine, speculative
  from tiny_setup import build_tiny_runner
  cfg, runner, layout = build_tiny_runner(0, 16)
  prompt = [int(t) for t in range(5, 25)]
  spec = speculative.SpecConfig("ngram", n_max=3, ngram_n=1)
  run = lambda: speculative.generate_speculative(runner, engine.PlainKV(cfg, layout, 64), prompt, 10, spec,
                                                 ubatch=16)
  run()      # compiled outside the trace
  out = []
  _, trace = timeline.profile(lambda: out.append(jax.block_until_ready(run().tokens)))
  windows = timeline.phase_windows(trace, speculative.PhaseClock.PREFIX)
  rounds = speculative.generate_speculative(runner, engine.PlainKV(cfg, layout, 64), prompt, 10, spec,
                                            ubatch=16).metrics["verify_forwards"]
  names = [w[0] for w in windows]
  assert names.count("verify") == names.count("draft") == rounds > 0
  assert names[:5] == ["draft", "verify", "rollback", "read", "truncate"]
  assert all(s <= e for _, s, e in windows) and all(a[2] <= b[1] for a, b in zip(windows, windows[1:]))


def test_hlo_schedule_reads_async_copies():
  from experiments.kernel_lab import hlo_schedule
  text = """HloModule m

ENTRY %main (p: u8[4]) -> u8[4] {
  %p = u8[4] parameter(0)
  %copy-start = (u8[4], u8[4], u32[]) copy-start(%p)
  %fusion.1 = f32[2] fusion(%x), kind=kLoop, calls=%f1
  %fusion.2 = f32[2] fusion(%fusion.1), kind=kLoop, calls=%f2
  %copy-done = u8[4] copy-done(%copy-start)
  ROOT %custom-call.3 = u8[4] custom-call(%copy-done), custom_call_target="x"
}
"""
  events, kernels = hlo_schedule.schedule(text)
  assert kernels == 3 and [(k, op) for k, op, _ in events] == [(0, "copy-start"), (2, "copy-done")]


def test_acceptance_by_position_from_rounds():
  from experiments import acceptance
  # rounds [drafts, accepted]: position 1 drafted 4x accepted 3x; position 2 drafted 3x, accepted 1x
  # (of the 2 rounds whose first draft was accepted); position 3 drafted 2x, accepted 0x
  acc, cond = acceptance.position_acceptance([[3, 1], [3, 2], [2, 0], [1, 1]], 3)
  assert acc[:2] == [3 / 4, 1 / 3] and acc[2] == 0.0
  assert cond[:2] == [3 / 4, 1 / 2] and cond[2] == 0.0
  assert math.isnan(acceptance.position_acceptance([[1, 0]], 2)[1][1])
  assert acceptance.default_contexts(2048, 69) == [256, 512, 1024, 1979]


def test_every_experiment_imports_into_one_process():
  """Importing every experiment (and its lib helpers) into one process defines no absl flag: the
  programs define theirs in `define_flags()` when run (two modules defining `--out` at import
  collide). Each program's `define_flags()` runs on its own (its flags removed after)."""
  code = """
import importlib, pathlib, re
from absl import app, flags, logging  # absl's own flags (--v, --log_dir, ...) come with these
names = sorted("experiments." + p.stem for p in pathlib.Path("experiments").glob("*.py") if p.stem != "__init__")
names += sorted("experiments.lib." + p.stem for p in pathlib.Path("experiments/lib").glob("*.py")
                if p.stem != "__init__")
before = set(flags.FLAGS)
mods = [importlib.import_module(n) for n in names]
assert set(flags.FLAGS) == before, sorted(set(flags.FLAGS) - before)
programs = 0
for name, mod in zip(names, mods):
  src = pathlib.Path(mod.__file__).read_text()
  if "app.run(" not in src:
    continue
  assert hasattr(mod, "define_flags"), name
  mod.define_flags()
  added = set(flags.FLAGS) - before
  assert added, name
  for f in added:
    delattr(flags.FLAGS, f)
  programs += 1
print("imported", len(mods), "programs", programs)
"""
  p = _run(["-c", code], cwd=REPO, timeout=120)
  n_mods, n_programs = map(int, re.findall(r"imported (\d+) programs (\d+)", p.stdout)[0])
  assert n_programs >= 11 and n_mods > n_programs, p.stdout


def test_acceptance_both_drafter_is_ngram_and_mtp():
  """'both' maps to the API's ngram + MTP drafter, with ngram's wide round (ngram_m)."""
  from experiments import acceptance
  from kvjax import api
  s = acceptance.spec_for(api, "both", 3, 0.0, 2, 6)
  assert (s.draft, s.n_max, s.ngram_n, s.ngram_m) == ("ngram+mtp", 3, 2, 6)
  assert acceptance.spec_for(api, "mtp", 3, 0.0, 2, 6).ngram_m == 0
  rows = [{"drafter": "both", "n_max": 3, "context": 256, "draft_generated": 4, "draft_accepted": 2,
           "accepted_len": 1.5, "verify_rows": 4.0, "matches_greedy": True, "ngram_share": 0.5,
           **{f"acc_pos_{i}": 0.5 for i in range(1, 7)}, **{f"cond_pos_{i}": 0.5 for i in range(1, 7)}}]
  (s,) = acceptance.summarize(rows)
  assert s["acc_pos_6"] == 0.5 and s["ngram_share"] == 0.5 and "ngram" in acceptance.table([s])


def test_compare_llama_cpp_prepares_its_files_and_scores_agreement(tmp_path):
  """experiments.compare_llama_cpp without llama.cpp (it is not installed here): the files it hands
  both sides (code-tiny re-quantized to Q4_0 with its tokenizer; random Q4_K matrices and the same
  matrices dequantized to f32, in a geometry of 256-value rows) load in kvjax as they should, the
  scores count agreement and near ties, and without a llama.cpp tree it refuses in one line."""
  import numpy as np
  from kvjax import api, gguf_io
  import experiments.compare_llama_cpp as cmp
  q4 = gguf_io.read_gguf(cmp.model_file("code-tiny:q4_0", str(tmp_path)))
  assert q4.tensor_info("blk.0.ffn_up.weight").ggml_type.name == "Q4_0" and q4.tokenizer_spec
  quant = api.load_model(cmp.model_file("wide:q4_k", str(tmp_path)), weights="quantized")
  f32 = gguf_io.read_gguf(cmp.model_file("wide:q4_k:f32", str(tmp_path)))
  assert quant.weights == "quantized" and f32.tensor_info("blk.0.ffn_up.weight").ggml_type.name == "F32"
  plain = api.load_model(str(tmp_path / "wide-q4_k.gguf"), weights="dequantized")
  toks = cmp.tokens_for(quant, 8) if quant.tokenizer is not None else list(range(3, 11))
  assert np.array_equal(api.teacher_forced_logits(plain, toks),
                        api.teacher_forced_logits(api.load_model(str(tmp_path / "wide-q4_k-f32.gguf")), toks))
  theirs = np.array([[0.0, 1.0, 0.98], [2.0, 0.0, 1.0], [0.0, 0.0, 3.0]], np.float32)
  ours = np.array([[0.0, 0.9, 1.0], [2.0, 0.0, 1.0], [3.5, 0.0, 3.0]], np.float32)
  score = cmp.compare(ours, theirs, tie=0.05)
  assert score["top1_agree"] == pytest.approx(1 / 3) and score["disagree"] == 2
  assert score["disagree_near_ties"] == 1 and score["max_rel_diff"] == pytest.approx(3.5 / 3.0)
  p = subprocess.run([sys.executable, "-m", "experiments.compare_llama_cpp", f"--out={tmp_path}"],
                     capture_output=True, text=True, cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=240)
  assert p.returncode != 0 and "--llama_cpp and --llama_build are needed" in p.stderr


def test_bench_generate_prefill_only_profile(tmp_path):
  """bench_generate --prefill_only with a traced, warmed prefill (tiny model, CPU): the row's
  prefill numbers and the profile's row are written; a CPU has no device lines to classify."""
  out = str(tmp_path / "bg")
  p = _run(["-m", "experiments.bench_generate", "--model=tiny", "--contexts=96", "--arena_mib=2",
            "--page_tokens=16", "--prefill_only", "--ubatch=32", "--profile_tokens=64", "--compile_cache_dir=off",
            f"--out={out}"], cwd=REPO)
  log = json.load(open(os.path.join(out, "bench_generate.json")))
  row, prof = log["rows"][0], log["prefill_profile"]
  assert row["context"] == 96 and row["prefill_tps_without_compile"] > 0 and row["prefill_mfu"] > 0
  assert prof["profile_tokens"] == 64 and prof["kind"] == "fixed" and prof["device_events"] == 0
  assert prof["window_mfu"] is None and "no device events" in p.stdout
  assert os.path.isdir(prof["trace_dir"]) and "prefill of 64 tokens" in p.stdout


def test_bench_generate_quantized_with_its_bench_forward(tmp_path):
  """bench_generate with --weight_type (tiny's geometry, Q8_0 blocks, CPU) and its default --compare: the weights
  stay quantized, the prefill's MFU counts the matrices' values, bench_decode's forward is timed beside it; a
  model with its own block types refuses --weight_type in one line."""
  out = str(tmp_path / "bg")
  _run(["-m", "experiments.bench_generate", "--model=tiny", "--weight_type=q8_0", "--contexts=96", "--arena_mib=2",
        "--page_tokens=16", "--ubatch=32", "--n_predict=4", "--compile_cache_dir=off", f"--out={out}"], cwd=REPO)
  log = json.load(open(os.path.join(out, "bench_generate.json")))
  row = log["rows"][0]
  assert log["weights"] == "quantized" and row["bench_forward_ms"] > 0 and 0 < row["prefill_mfu"] < 1
  p = subprocess.run([sys.executable, "-m", "experiments.bench_generate", "--model=code-tiny", "--weight_type=q8_0",
                      f"--out={out}"], capture_output=True, text=True, cwd=REPO, timeout=240,
                     env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert p.returncode == 2 and p.stderr.strip().splitlines()[-1].startswith("bench_generate: error: --weight_type")


@pytest.mark.parametrize("bench", ["bench_decode", "bench_spec", "bench_generate"])
def test_bench_bad_flags_are_one_line(bench):
  """A bench given a bad flag, or a bad value its model load refuses, prints one line `NAME: error:`
  naming it (exit status 2), not absl's usage text."""
  for flag, needle in (("--nosuchflag", "nosuchflag"), ("--dtype=float8", "dtype")):
    p = subprocess.run([sys.executable, "-m", f"experiments.{bench}", "--model=tiny_deep", flag, "--out=/tmp/unused"],
                       capture_output=True, text=True, cwd=REPO, timeout=240, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    lines = [l for l in p.stderr.splitlines() if l.strip() and not l.startswith(("I1", "W1"))]
    assert p.returncode == 2 and lines[-1].startswith(f"{bench}: error: ") and needle in lines[-1], p.stderr[-1500:]
    assert "USAGE" not in p.stderr and "flags:" not in p.stdout + p.stderr

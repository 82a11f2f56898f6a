"""kvjax.cli: the `kvjax` console script, run in-process through `cli.main(argv)` (and once as a
subprocess). Tiny model, CPU, 64-token KV pages.

What is checked: JSON output fields and values (text = tokenizer decode of the tokens), the text
output (unprintable characters escaped; timings, the compilation share of a cold run and the
"all pages resident" note on stderr), llama.cpp's short flags, streamed tokens == plain tokens with
a pool much smaller than the context (and the copy counters show that pages really streamed), the
arena budget arithmetic, logits / MTP logits files against `engine.Runner` run directly, the memory
report against `kvjax.memory_report` (and that it imports no JAX), a GGUF file giving the same
tokens as the built-in tiny model, and errors as one `kvjax: error:` line naming the flag, with no
traceback and a non-zero exit status. A new user's path: budgets, pages and weights beyond memory or
the context refused before allocation, unknown config fields named with the closest one (`kvjax
memory`, `experiments.run`), API type errors, the sweep's refusals and tokens_match, `-f` /
`--top-p` / `--version`, streamed output with the prompt echoed, the prefill progress, where the
experiments wrote, tok/s without compilation.
"""

import csv
import json
import os
import re
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import api, cli, compile_cache, engine, memory_report, tiny
from kvjax.streaming import fit_adaptive_pool, fit_split
from kvjax.tokenizer import tiny_tokenizer
from kvjax_pallas.page_layout import PageLayout

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT_IDS = [int(t) for t in np.random.default_rng(7).integers(0, 381, 100)]  # 100 ids, no specials
PROMPT_FLAG = "--prompt-tokens=" + ",".join(map(str, PROMPT_IDS))
# 100 prompt + 40 generated = 140 tokens = 3 pages of 64 per cache layer; 3 cache layers
# (2 target attention + MTP). A 6-page pool: 1 resident page per layer + a 3-slot ring.
COMMON = ["--model=tiny", "--kv-page-tokens=64", "--ubatch-size=64", "--n-predict=40", "--ignore-eos",
          "--json"]


def run_main(capsys, *argv):
  rc = cli.main(list(argv))
  cap = capsys.readouterr()
  return rc, cap.out, cap.err


def json_line(out):
  lines = [l for l in out.splitlines() if l.strip()]
  assert len(lines) == 1, out
  return json.loads(lines[0])


@pytest.fixture(scope="module")
def plain_run():
  import io
  import contextlib
  buf = io.StringIO()
  with contextlib.redirect_stdout(buf):
    rc = cli.main(["generate", PROMPT_FLAG] + COMMON)
  assert rc == 0
  return json_line(buf.getvalue())


def assert_one_line_error(rc, err, status, *needles):
  """One `kvjax: error:` line naming `needles`, exit `status` (2 usage errors, 1 the rest)."""
  assert rc == status, (rc, err)
  lines = [l for l in err.splitlines() if l.strip()]
  assert lines, "no error message"
  assert lines[-1].startswith("kvjax: error: "), err
  assert "Traceback" not in err
  for n in needles:
    assert n in lines[-1], (n, lines[-1])


# ---------------------------------------------------------------------------
# generate
# ---------------------------------------------------------------------------

def test_generate_json_fields(plain_run):
  r = plain_run
  assert set(r) == {"tokens", "text", "metrics"}
  assert len(r["tokens"]) == 40 and all(0 <= t < 384 for t in r["tokens"])
  assert r["text"] == tiny_tokenizer().decode(r["tokens"])
  m = r["metrics"]
  assert m["prompt_tokens"] == 100 and m["decode_tokens"] == 40
  assert m["prefill_tps"] > 0 and m["decode_tps"] > 0
  assert m["kv"] == "plain" and m["ctx_size"] == 140 and m["page_tokens"] == 64
  assert m["h2d_bytes"] == 0
  assert len(set(r["tokens"])) > 3  # not a degenerate sequence


def test_generate_text_output_is_the_decoded_tokens(capsys, plain_run):
  argv = ["generate", PROMPT_FLAG] + [a for a in COMMON if a != "--json"]
  rc, out, err = run_main(capsys, *argv)
  assert rc == 0, err
  # the prompt echoed (as llama.cpp does), then the generated text, streamed a token at a time
  tok = tiny_tokenizer()
  assert out == api.printable(tok.decode(PROMPT_IDS)) + api.printable(tok.decode(plain_run["tokens"])) + "\n"
  rc, out, err = run_main(capsys, *argv, "--no-display-prompt")
  assert rc == 0, err
  assert out == api.printable(tok.decode(plain_run["tokens"])) + "\n"
  # timings on stderr; the module's earlier runs compiled these steps already
  assert "kvjax: prefill 100 tokens in " in err and "decode 40 tokens in " in err
  assert "nothing streams" not in err


def test_text_output_escapes_control_characters(capsys):
  """'Hello' -> tokens whose text holds DEL (0x7f) and DC3 (0x13): escaped on the terminal, raw in
  the JSON text."""
  argv = ["generate", "--prompt=Hello", "--n-predict=12", "--kv-page-tokens=64"]
  rc, out, err = run_main(capsys, *argv, "--json")
  assert rc == 0, err
  raw = json_line(out)["text"]
  assert "\x7f" in raw and "\x13" in raw
  rc, out, err = run_main(capsys, *argv)
  assert rc == 0, err
  assert out == "Hello" + api.printable(raw) + "\n" and "\\x7f" in out and "\\x13" in out
  assert not any(ord(c) < 32 and c not in "\n\t" or 0x7f <= ord(c) < 0xa0 for c in out)


def test_cold_run_says_how_much_was_compilation(capsys):
  """A layout no earlier test compiled (48-token pages): the timings are mostly compilation, and
  the text output says so; with --warmup the measured run compiles nothing and no note is printed."""
  argv = ["generate", "--prompt=Hello", "--n-predict=4", "--kv-page-tokens=48"]
  rc, out, err = run_main(capsys, *argv, "--json")
  assert rc == 0, err
  m = json_line(out)["metrics"]
  assert m["warmup"] is False
  # the decode's programs compile (and run once, inert) before the first token, none after it
  assert 0 < m["prompt_compile_ms"] <= m["prompt_ms"] and m["predicted_compile_ms"] == 0
  assert m["compile_ms"] == pytest.approx(m["prompt_compile_ms"] + m["predicted_compile_ms"])
  assert m["compile_ms"] > 0.5 * (m["prompt_ms"] + m["predicted_ms"])   # a cold run is mostly compiling
  rc, out, err = run_main(capsys, *argv[:-1], "--kv-page-tokens=40")
  assert rc == 0, err
  assert "kvjax: cold run: " in err and "--warmup" in err
  argv = argv[:-1] + ["--kv-page-tokens=56"]
  rc, out, err = run_main(capsys, *argv, "--warmup", "--json")
  assert rc == 0, err
  m = json_line(out)["metrics"]
  assert m["warmup"] is True and m["compile_ms"] == 0.0
  rc, out, err = run_main(capsys, *argv, "--warmup")
  assert rc == 0 and "cold run" not in err and "kvjax: prefill 5 tokens" in err


def test_warmup_leaves_a_generation_with_its_flags_nothing_to_compile(capsys):
  """`kvjax warmup` with a generation's flags (a layout no other test uses: 24-token pages, a
  phased arena): the generation after it compiles nothing; without a prompt --ctx-size is needed."""
  kv = ["--kv-page-tokens=24", "--ctx-size=160", "--kv-stream-arena-mib=4", "--kv-stream-phased",
        "--kv-stream-policy=adaptive", "--ubatch-size=16", "--n-predict=6"]
  rc, out, err = run_main(capsys, "warmup", *kv, "--json")
  assert rc == 0, err
  w = json_line(out)
  assert w["compiles"] + w["executables_loaded"] > 0 and w["ctx_size"] == 160 and "phased" in w["kv"], w
  rc, out, err = run_main(capsys, "generate", "--prompt=Hello there", "--ignore-eos", *kv, "--json")
  assert rc == 0, err
  m = json_line(out)["metrics"]
  assert m["compiles"] == 0 and m["compile_ms"] == 0.0, m["compile_by_program"]
  rc, out, err = run_main(capsys, "warmup", "--kv-page-tokens=24")
  assert rc == 2 and "--ctx-size is required" in err and len(err.strip().splitlines()) == 1, err
  rc, out, err = run_main(capsys, "warmup", *kv)
  assert rc == 0 and out.startswith("kvjax: warm for 160 tokens") and "compilation cache" in out, out


def test_llama_cpp_short_flags(capsys):
  rc, out, err = run_main(capsys, "generate", "-m", "tiny", "-p", "Hello", "-n", "3", "-c", "96", "-s", "4",
                          "-ub", "16", "-ctk", "f16", "-ctv", "q8_0", "--temp", "0.5", "--json")
  assert rc == 0, err
  m = json_line(out)["metrics"]
  assert m["decode_tokens"] == 3 and m["ctx_size"] == 96 and m["prompt_tokens"] == 5
  assert m["kv_layout"].startswith("F16 K / Q8_0 V")
  rc, out, err = run_main(capsys, "logits", "-m", "tiny", "-p", "Hi", "--out=/nonexistent-dir/x.npy")
  assert_one_line_error(rc, err, 1, "--out", "/nonexistent-dir")   # -p reached the logits flags too


def test_all_pages_resident_is_reported(capsys, plain_run):
  """A 6-page pool for 'Hello' + 8 tokens (one 64-token page per cache layer): every page is
  resident, nothing streams, and the output says so; the 140-token run of the same pool streams."""
  argv = ["generate", "--prompt=Hello", "--n-predict=8", "--kv-page-tokens=64", "--kv-stream-pool-pages=6"]
  rc, out, err = run_main(capsys, *argv, "--json")
  assert rc == 0, err
  m = json_line(out)["metrics"]
  assert m["all_pages_resident"] is True and m["streamed_pages"] == 0 and m["h2d_bytes"] == 0
  assert m["kv"] == "all pages resident"
  rc, out, err = run_main(capsys, *argv)
  assert rc == 0 and "kvjax: all pages resident: nothing streams" in err
  rc, out, err = run_main(capsys, "generate", PROMPT_FLAG, *COMMON, "--kv-stream-pool-pages=6")
  m = json_line(out)["metrics"]
  assert m["all_pages_resident"] is False and m["streamed_pages"] > 0 and m["kv"] == "streamed"
  assert "all_pages_resident" not in plain_run["metrics"]    # a plain cache has nothing to stream


def test_streamed_pool_pages_matches_plain(capsys, plain_run):
  rc, out, err = run_main(capsys, "generate", PROMPT_FLAG, *COMMON, "--kv-stream-pool-pages=6")
  assert rc == 0, err
  r = json_line(out)
  assert r["tokens"] == plain_run["tokens"]
  m = r["metrics"]
  assert m["kv"] == "streamed" and m["pool_pages"] == 6
  assert m["resident_pages"] == 3 and m["ring_slots"] == 3
  assert m["resident_pages_per_layer"] == [1, 1, 1]
  # pages 1..2 of each layer streamed through the ring every forward after the prompt
  assert m["h2d_bytes"] > 0 and m["streamed_pages"] > 0 and m["ring_wraps"] > 0
  assert m["d2h_bytes"] > 0 and 0 < m["deadline_samples"] and m["readiness_misses"] <= m["deadline_samples"]
  for k in ("h2d_bytes", "d2h_bytes", "ring_wraps", "resident_pages", "ring_slots", "readiness_misses"):
    assert k in m


def test_adaptive_arena_budget(capsys, plain_run):
  """--kv-stream-policy=adaptive under an arena: the pool leaves room for the staging of every split
  the policy may pick (`fit_adaptive_pool`), the tokens match plain, the staging stays inside."""
  arena = 0.4
  rc, out, err = run_main(capsys, "generate", PROMPT_FLAG, *COMMON, f"--kv-stream-arena-mib={arena}",
                          "--kv-stream-copy-pages=2", "--kv-stream-policy=adaptive")
  assert rc == 0, err
  r = json_line(out)
  m = r["metrics"]
  assert r["tokens"] == plain_run["tokens"] and m["kv_policy"] == "adaptive"
  layout = PageLayout(2, 64, "q8_0", "q4_0", 64)
  available = int((arena * 2**20 - round(m["decode_workspace_mib"] * 2**20)) // layout.page_bytes)
  staging = round(m["staging_reserve_mib"] * 2**20 / layout.page_bytes)
  # 3 cache layers (2 attention + MTP), each staging at most the cap (`adaptive_staging_cap`)
  assert m["pool_pages"] == fit_adaptive_pool(available, m["ctx_size"], layout, 2, pinned=False, n_layers=3,
                                              wave_pages=m["wave_pages"])
  assert m["pool_pages"] >= fit_adaptive_pool(available, m["ctx_size"], layout, 2, pinned=False)
  assert staging > 0 and m["pool_pages"] + staging <= available
  assert 0 < m["staging_peak_bytes"] <= staging * layout.page_bytes


def test_streamed_arena_budget(capsys, plain_run):
  arena = 0.4
  rc, out, err = run_main(capsys, "generate", PROMPT_FLAG, *COMMON, f"--kv-stream-arena-mib={arena}",
                          "--kv-stream-copy-pages=2")
  assert rc == 0, err
  r = json_line(out)
  m = r["metrics"]
  assert r["tokens"] == plain_run["tokens"]
  assert 0 < m["decode_workspace_mib"] < arena
  layout = PageLayout(2, 64, "q8_0", "q4_0", 64)
  ws = m["decode_workspace_mib"] * 2**20
  available = int((arena * 2**20 - round(ws)) // layout.page_bytes)
  # the arena holds the workspace, the pool and the staging of the pool's in-flight uploads
  staging = round(m["staging_reserve_mib"] * 2**20 / layout.page_bytes)
  assert staging > 0 and m["pool_pages"] + staging <= available
  assert m["pool_pages"] == fit_split(available, 3, m["ctx_size"], layout, 2, pinned=False).pool_pages
  assert 0 <= m["staging_peak_bytes"] <= staging * layout.page_bytes
  assert m["copy_pages"] == 2


def test_sampling_is_seeded(capsys):
  def once(seed):
    rc, out, err = run_main(capsys, "generate", "--prompt=Hello", "--n-predict=12", "--ignore-eos",
                            "--temperature=1.0", "--top-k=20", f"--seed={seed}", "--kv-page-tokens=64",
                            "--json")
    assert rc == 0, err
    return json_line(out)["tokens"]
  a, b, c = once(1), once(1), once(2)
  assert a == b and a != c


# ---------------------------------------------------------------------------
# logits
# ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def direct():
  """Target and MTP logits of 40 tokens from engine.Runner directly, in ONE forward."""
  cfg, tensors, _ = tiny.load_model_source("tiny")
  runner = engine.Runner(engine.build_model(cfg, tensors), PageLayout(2, 64, "q8_0", "q4_0", 64))
  toks = np.asarray(PROMPT_IDS[:40], np.int32)
  kv = engine.PlainKV(cfg, runner.layout, 40)
  out = runner.forward(toks, 0, 40, runner.zero_states(), kv)
  mtp, _ = runner.mtp_forward(out.hn_se[:-1], toks[1:], 0, 39, kv)
  return np.asarray(out.logits_rv), np.asarray(mtp)


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize("mtp", [False, True])
def test_logits_file_matches_runner(capsys, tmp_path, direct, mtp):
  path = str(tmp_path / "logits.npy")
  # micro-batches of 16 rows (3 forwards) against the direct single forward
  argv = ["logits", "--model=tiny", "--tokens=" + ",".join(map(str, PROMPT_IDS[:40])), f"--out={path}",
          "--kv-page-tokens=64", "--ubatch-size=16"] + (["--mtp"] if mtp else [])
  rc, out, err = run_main(capsys, *argv)
  assert rc == 0, err
  got = np.load(path)
  want = direct[1] if mtp else direct[0]
  assert got.dtype == np.float32
  assert got.shape == ((39, 384) if mtp else (40, 384))
  assert rel(got, want) < 1e-4  # float32 rounding of chunked vs one-shot Gated DeltaNet
  assert np.mean(np.argmax(got, -1) == np.argmax(want, -1)) == 1.0
  assert str(list(got.shape)) in out


def test_logits_out_must_name_an_npy_file(capsys, tmp_path):
  """numpy.save adds ".npy" to any other name, so the file written would not be the one named."""
  rc, _, err = run_main(capsys, "logits", "--tokens=1,2,3", f"--out={tmp_path}/l.txt")
  one_error_line(rc, err, 2, f"--out '{tmp_path}/l.txt': the file name must end in .npy")
  assert os.listdir(tmp_path) == []


def test_unwritable_compile_cache_is_one_line(capsys, tmp_path, monkeypatch):
  """A compile cache folder that is a file, or one that cannot be made: one line naming the folder
  (and the variable, where it came from $KVJAX_COMPILE_CACHE_DIR), exit 1."""
  (tmp_path / "f").write_text("x")
  rc, _, err = run_main(capsys, "generate", "-p", "hi", "-n", "2", f"--compile-cache-dir={tmp_path}/f")
  one_error_line(rc, err, 1, f"compile cache folder '{tmp_path}/f': not a writable folder", "'off'")
  monkeypatch.setenv("KVJAX_COMPILE_CACHE_DIR", f"{tmp_path}/f/sub")
  with pytest.raises(ValueError, match=r"\(\$KVJAX_COMPILE_CACHE_DIR\): not a writable folder"):
    compile_cache.enable()


def test_logits_cache_type_changes_logits(capsys, tmp_path, direct):
  path = str(tmp_path / "f32.npy")
  rc, _, err = run_main(capsys, "logits", "--tokens=" + ",".join(map(str, PROMPT_IDS[:40])), f"--out={path}",
                        "--kv-page-tokens=64", "--ubatch-size=16", "--cache-type-k=f32", "--cache-type-v=f32")
  assert rc == 0, err
  got = np.load(path)
  # an f32 cache is not the quantized one, but the same model: close, not equal
  assert 0 < rel(got, direct[0]) < 0.2


# ---------------------------------------------------------------------------
# memory
# ---------------------------------------------------------------------------

def test_memory_imports_no_jax():
  """`kvjax memory` is arithmetic: its whole code path (flags, report, printing) imports no JAX."""
  code = ("import sys; from kvjax import cli; "
          "rc = cli.main(['memory', '--config=configs/memory_27b.py', '--json']); "
          "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax')); "
          "print(rc, heavy)")
  p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
  assert p.returncode == 0, p.stderr
  assert p.stdout.strip().splitlines()[-1] == "0 []", p.stdout
  assert '"decode_kv_pool_pages"' in p.stdout


def test_memory_report(capsys):
  cfg_path = os.path.join(REPO, "configs", "memory_27b.py")
  rc, out, err = run_main(capsys, "memory", f"--config={cfg_path}", "--config.mtp_depth=5", "--json")
  assert rc == 0, err
  got = json.loads(out)
  from configs import memory_27b  # pylint: disable=import-outside-toplevel
  c = memory_27b.get_config()
  c.mtp_depth = 5
  want = memory_report.report_from_config(c)
  assert got == json.loads(json.dumps(want))
  assert got["rollback_host_bytes"] == 5 * got["recurrent_checkpoint_bytes"]
  rc, out, err = run_main(capsys, "memory", f"--config={cfg_path}")
  assert rc == 0 and memory_report.format_table(memory_report.report_from_config(memory_27b.get_config())) in out


# ---------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------

def test_error_missing_model_file(capsys, tmp_path):
  missing = str(tmp_path / "nope.gguf")
  rc, _, err = run_main(capsys, "generate", f"--model={missing}", "--prompt=hi")
  assert_one_line_error(rc, err, 1, "nope.gguf", "no such file")


def test_error_truncated_gguf(capsys, tmp_path):
  path = tmp_path / "tiny.gguf"
  tiny.write_tiny_gguf(str(path))
  data = path.read_bytes()
  cut = tmp_path / "cut.gguf"
  cut.write_bytes(data[:len(data) // 2])
  rc, _, err = run_main(capsys, "generate", f"--model={cut}", "--prompt=hi")
  assert_one_line_error(rc, err, 1, "cut.gguf", "truncated file")


def test_error_pool_too_small(capsys):
  rc, _, err = run_main(capsys, "generate", "--prompt=hi", "--kv-stream-pool-pages=2", "--ctx-size=1024",
                        "--kv-page-tokens=64")
  assert_one_line_error(rc, err, 2, "--kv-stream-pool-pages 2:", "too small", "the minimum is 4 pages", "2 more pages")


@pytest.mark.parametrize("argv,needle", [
    (["generate", "--prompt=hi", "--kv-stream-copy-pages=3"], "--kv-stream-copy-pages must be a power of two"),
    (["generate", "--prompt=hi", "--n-predict=x"], "n-predict"),
    (["generate", "--prompt=hi", "--n-predict=0"], "--n-predict must be >= 1, got 0"),
    (["generate", "--prompt=hi", "--no-such-flag=1"], "no-such-flag"),
    (["generate", "--prompt=hi", "--prompt-tokens=1,2"], "give exactly one of --prompt, --file and --prompt-tokens"),
    (["generate", "--prompt-tokens=1,999"], "--prompt-tokens: token id 999 is outside the vocabulary"),
    (["generate", "--prompt=hi", "--n-predict=8", "--ctx-size=4"], "--ctx-size 4 is too small"),
    (["generate", "--prompt=hi", "--kv-stream-pool-pages=4", "--kv-stream-arena-mib=1"],
     "give only one of --kv-stream-arena-mib and --kv-stream-pool-pages"),
    (["generate", "--prompt=hi", "--kv-stream-pool-pages=0"], "--kv-stream-pool-pages must be >= 1"),
    (["generate", "--prompt=hi", "--kv-stream-arena-mib=-1"], "--kv-stream-arena-mib must be > 0"),
    (["generate", "--prompt=hi", "--spec-type=ngram-simple", "--spec-draft-n-max=0"],
     "--spec-draft-n-max must be >= 1"),
    (["generate", "--prompt=hi", "--top-k=-2"], "--top-k must be >= 0"),
    (["generate", "--prompt=hi", "--cache-type-k=q5_1"], "--cache-type-k 'q5_1'"),
    (["generate", "--prompt=hi", "--attn-impl=cuda"], "--attn-impl 'cuda'"),
    (["generate", "--prompt=hi", "--model=tiny:x"], "--model 'tiny:x'"),
    (["generate", "--prompt=hi", "--attn-block-pages=0"], "--attn-block-pages must be auto or an int >= 1, got '0'"),
    (["generate", "--prompt=hi", "--attn-block-pages=big"], "got 'big'"),
    (["generate", "--prompt=hi", "--attn-impl=mosaic2"],
     "--attn-impl 'mosaic2': expected auto or one of reference, triton, mosaic"),
    (["logits", "--tokens=1,2,3"], "--out"),
    (["memory"], "--config"),
    (["memory", "--config=configs/does_not_exist.py"], "does_not_exist.py"),
    (["generate", "--prompt-tokens=1,,2"], "--prompt-tokens '1,,2': expected comma-separated integer token ids (entry 2"),
    (["generate", "-n", "4"], "give one of --prompt, --file and --prompt-tokens"),
    (["generate", "--prompt-tokens=" + ",".join(["5"] * 8190), "-n", "4"],
     "a prompt of 8190 tokens + --n-predict 4 needs 8194 positions, beyond the model's context length of 8192"),
])
def test_error_bad_flags(capsys, argv, needle):
  rc, _, err = run_main(capsys, *argv)
  assert_one_line_error(rc, err, 2, needle)


def test_model_name_near_a_builtin_or_preset_is_suggested(capsys):
  for name, hint in (("qwen38_27B", "did you mean the preset 'qwen38_27b'?"), ("code_tiny", "did you mean 'code-tiny'?")):
    rc, _, err = run_main(capsys, "generate", f"--model={name}", "-p", "hi")
    assert_one_line_error(rc, err, 1, f"--model {name!r}: no such file", hint)


def test_stdout_closed_by_its_reader_ends_quietly(tmp_path):
  """`kvjax generate ... | head -c 1`: the generation stops at its next write, exit 141, no error."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", KVJAX_COMPILE_CACHE_DIR="off")
  p = subprocess.Popen([sys.executable, "-m", "kvjax.cli", "generate", "--model=tiny", "-p", "hello there",
                        "-n", "64", "--ignore-eos", "--kv-page-tokens=64"], stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, cwd=str(tmp_path), env=env)
  assert p.stdout.read(1)
  p.stdout.close()
  _, err = p.communicate(timeout=300)
  assert p.returncode == 141 and b"error" not in err and b"Traceback" not in err, err[-2000:]


def test_block_pages_flag_values():
  assert cli.parse_block_pages("auto") == "auto"
  assert cli.parse_block_pages("4") == 4 and cli.parse_block_pages(2) == 2
  with pytest.raises(cli.UsageError, match="--attn-block-pages must be"):
    cli.parse_block_pages("0")


def test_every_api_parameter_maps_to_a_flag():
  """`FLAG_OF` names flags that exist: an API error renamed for the command line names a real flag."""
  from absl import flags  # pylint: disable=import-outside-toplevel
  defined = set()
  for sub in ("generate", "logits"):
    fv = flags.FlagValues()
    cli._FLAG_SETS[sub](fv)  # pylint: disable=protected-access
    defined |= {"--" + name for name in fv}
  assert set(cli.FLAG_OF.values()) <= defined, set(cli.FLAG_OF.values()) - defined
  e = api.ParameterError("give only one of arena_mib and pool_pages (prompt_tokens, not prompt)",
                         "arena_mib", "pool_pages", "prompt_tokens", "prompt")
  assert e.renamed(cli.FLAG_OF) == ("give only one of --kv-stream-arena-mib and --kv-stream-pool-pages "
                                    "(--prompt-tokens, not --prompt)")
  e = api.ParameterError("spec.n_max must be >= 1 for spec", "spec.n_max", "spec")
  assert e.renamed(cli.FLAG_OF) == "--spec-draft-n-max must be >= 1 for --spec-type"


def test_unknown_subcommand_prints_usage(capsys):
  rc, out, err = run_main(capsys, "frobnicate")
  assert rc == 2
  assert "usage: kvjax" in err and "generate" in err
  assert err.strip().splitlines()[-1].startswith("kvjax: error: unknown subcommand 'frobnicate'")
  rc, _, err = run_main(capsys)
  assert rc == 2 and "usage: kvjax" in err


def test_subcommand_help_lists_flags(capsys):
  rc, out, _ = run_main(capsys, "generate", "--help")
  assert rc == 0
  for name in ("--n-predict", "--ctx-size", "--kv-stream-arena-mib", "--kv-stream-pool-pages"):
    assert name in out


# ---------------------------------------------------------------------------
# as a real process, on a GGUF file
# ---------------------------------------------------------------------------

def test_subprocess_gguf_equals_builtin_tiny(tmp_path, plain_run):
  path = str(tmp_path / "tiny.gguf")
  tiny.write_tiny_gguf(path)  # the same seed-0 weights as --model=tiny
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  p = subprocess.run([sys.executable, "-m", "kvjax.cli", "generate", f"--model={path}", PROMPT_FLAG] + COMMON[1:],
                     capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=300)
  assert p.returncode == 0, p.stderr
  r = json_line(p.stdout)
  assert r["tokens"] == plain_run["tokens"]
  p = subprocess.run([sys.executable, "-m", "kvjax.cli", "generate", "--model=missing.gguf", "--prompt=hi"],
                     capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=300)
  assert p.returncode == 1
  assert p.stderr.strip() == ("kvjax: error: --model 'missing.gguf': no such file (expected a .gguf path, 'tiny', "
                              "'tiny:SEED', 'code-tiny' or a preset: qwen38_27b, tiny_deep)")
  p = subprocess.run([sys.executable, "-m", "kvjax.cli", "generate", "-p", "hi", "--kv-stream-copy-pages=3"],
                     capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=300)
  assert p.returncode == 2
  assert p.stderr.strip() == "kvjax: error: --kv-stream-copy-pages must be a power of two >= 1, got 3"


def test_adaptive_policy_streams_identically(capsys, plain_run):
  rc, out, _ = run_main(capsys, "generate", PROMPT_FLAG, *COMMON, "--kv-stream-pool-pages=9",
                        "--kv-stream-policy=adaptive")
  assert rc == 0
  d = json_line(out)
  assert d["tokens"] == plain_run["tokens"]
  m = d["metrics"]
  assert m["kv_policy"] == "adaptive" and m["pool_pages"] == 9 and m["streamed_pages"] > 0
  # the policy's decisions (one a forward), copy waves and the placed capacities are reported
  assert m["policy_decisions"] == m["forwards"] > 0 and m["waves"] > 0 and m["waves_per_forward"] > 0
  assert sum(int(n) for n, _ in (run.split("x") for run in m["capacities"].split(","))) == 3
  assert m["policy_repartitions"] >= 0 and "admission_refusals" in m


def test_phased_adaptive_arena_streams_identically(capsys, plain_run):
  """--kv-stream-phased with the adaptive policy: the policy rebinds on each phase's pool."""
  rc, out, err = run_main(capsys, "generate", PROMPT_FLAG, *COMMON, "--kv-stream-arena-mib=2.5",
                          "--kv-stream-phased", "--kv-stream-policy=adaptive")
  assert rc == 0, err
  d = json_line(out)
  assert d["tokens"] == plain_run["tokens"]
  m = d["metrics"]
  assert m["kv"] == "all pages resident+phased" and m["kv_policy"] == "adaptive"   # 2.5 MiB holds 140 tokens
  assert m["policy_rebinds"] == 2 and m["policy_decisions"] == m["forwards"] + 2
  assert m["pool_pages"] == m["decode_pool_pages"] > m["prefill_pool_pages"]


def test_phased_arena_streams_identically(capsys, plain_run):
  rc, out, _ = run_main(capsys, "generate", PROMPT_FLAG, *COMMON, "--kv-stream-arena-mib=2.5",
                        "--kv-stream-phased")
  assert rc == 0
  d = json_line(out)
  assert d["tokens"] == plain_run["tokens"]
  m = d["metrics"]
  assert m["kv"] == "all pages resident+phased"     # the arena holds every page of the 140 tokens
  # the decode layout's pool is larger than the prefill layout's by the workspace difference
  assert m["decode_pool_pages"] > m["prefill_pool_pages"]
  page_mib = m["pool_mib"] / m["pool_pages"]
  diff = (m["prefill_workspace_mib"] - m["decode_workspace_mib"]) / page_mib
  assert abs((m["decode_pool_pages"] - m["prefill_pool_pages"]) - diff) <= 1.0
  assert m["pool_pages"] == m["decode_pool_pages"]  # generation ended in the decode phase
  assert m["rebinds"] == 2                          # prefill layout, then decode layout


def test_phased_needs_an_arena(capsys):
  rc, _, err = run_main(capsys, "generate", PROMPT_FLAG, *COMMON, "--kv-stream-pool-pages=9",
                        "--kv-stream-phased")
  assert_one_line_error(rc, err, 2, "--kv-stream-phased needs --kv-stream-arena-mib")


@pytest.mark.parametrize("spec", ["draft-mtp", "ngram-simple"])
def test_speculative_generation_equals_plain(capsys, plain_run, spec):
  rc, out, err = run_main(capsys, "generate", PROMPT_FLAG, *COMMON, f"--spec-type={spec}",
                          "--spec-draft-n-max=3", "--spec-ngram-size-n=2")
  assert rc == 0, err
  d = json_line(out)
  assert d["tokens"] == plain_run["tokens"]
  m = d["metrics"]
  assert m["spec_type"] == {"draft-mtp": "mtp", "ngram-simple": "ngram"}[spec]
  assert m["verify_forwards"] >= 1 and 0 <= m["draft_accepted"] <= m["draft_generated"]
  assert m["draft_acceptance"] == pytest.approx(m["draft_accepted"] / max(m["draft_generated"], 1))
  # the plain cache uploads nothing: no MTP upload or lease bytes, and no MTP metric without the MTP drafter
  mtp_keys = {"mtp_h2d_bytes_per_round", "mtp_leases", "mtp_lease_bytes", "mtp_lease_bytes_per_round"}
  assert {k for k in m if k.startswith("mtp_")} == (mtp_keys if spec == "draft-mtp" else set())
  assert all(m.get(k, 0) == 0 for k in mtp_keys - {"mtp_leases"})
  assert m.get("mtp_leases", 0) == (m["verify_forwards"] if spec == "draft-mtp" else 0)


def test_attn_impl_auto_resolves_on_cpu(plain_run):
  assert plain_run["metrics"]["attn_impl"] == "reference"  # 'auto' on a CPU backend
  assert plain_run["metrics"]["attn_interpret"] is False


def test_speculative_needs_greedy(capsys):
  rc, _, err = run_main(capsys, "generate", PROMPT_FLAG, *COMMON, "--spec-type=draft-mtp", "--temperature=0.7")
  assert_one_line_error(rc, err, 2, "--temperature 0")


# ---- sizes and flags refused before anything is allocated, with their exit status ----------

@pytest.mark.parametrize("flags_,status,needles", [
    (["--kv-stream-arena-mib", "inf"], 2, ["--kv-stream-arena-mib must be > 0 and finite, got inf"]),
    (["--ctx-size", "-5"], 2, ["--ctx-size must be >= 0", "got -5"]),
    (["--ctx-size", "1000000000000"], 2, ["--ctx-size 1000000000000 is beyond the 2147483647 token positions"]),
    (["--n-predict", "1000000000000"], 2, ["prompt 3 + --n-predict 1000000000000 needs 1000000000003 token "
                                            "positions, beyond the 2147483647"]),
    (["--ctx-size", "9000"], 2, ["--ctx-size 9000 is beyond the model's context length of 8192 positions",
                                 "808 more", "--exceed-context-length"]),
    (["--kv-page-tokens", "48", "--attn-impl", "mosaic"], 2, ["--kv-page-tokens 48", "multiple of 64"]),
    (["--kv-page-tokens", "3", "--attn-impl", "triton"], 2, ["--kv-page-tokens 3", "multiple of 16"]),
    (["--kv-page-tokens", "2147483648", "--exceed-context-length"], 2,
     ["--kv-page-tokens 2147483648 is beyond the model's context length of 8192 positions"]),
    (["--ctx-size", "2000000000", "--exceed-context-length", "--kv-page-tokens", "8192"], 2,
     ["--ctx-size 2000000000: the KV cache needs", "MiB of", "available"]),
    (["--top-k", "100000"], 2, ["--top-k 100000 is larger than the vocabulary of 384 tokens"]),
    (["--model", "tiny:abc"], 2, ["--model 'tiny:abc'"]),
    (["--temperature", "nan"], 2, ["--temperature must be >= 0, got nan"]),
    (["--spec-type", "ngram-simple", "--spec-draft-n-max", "0"], 2, ["--spec-draft-n-max must be >= 1"]),
    (["--model", "/nonexistent/m.gguf"], 1, ["--model '/nonexistent/m.gguf': no such file"]),
    (["--tensor-parallel", "3"], 2, ["--tensor-parallel 3 must divide the model's 2 KV heads"]),
    (["--tensor-parallel", "2"], 2, ["--tensor-parallel 2 needs 2 devices, 1 available"]),
    (["--tensor-parallel", "0"], 2, ["--tensor-parallel must be an int >= 1, got 0"]),
    (["--model", "/"], 1, ["/: cannot open", "Is a directory"]),
])
def test_generate_refusals_exit_status(capsys, flags_, status, needles):
  argv = ["generate", "--prompt-tokens", "1,2,3"] + flags_
  if "--n-predict" not in flags_:
    argv += ["--n-predict", "2"]
  rc, out, err = run_main(capsys, *argv)
  assert rc == status, err
  lines = err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("kvjax: error: "), err
  for n in needles:
    assert n in lines[0], lines[0]


def test_bad_gguf_exits_1_with_one_escaped_line(capsys, tmp_path):
  from experiments.lib import gguf_fuzz as gf
  from kvjax import tiny
  g = gf.Gguf.parse(open(tiny.write_tiny_gguf(tmp_path / "t.gguf"), "rb").read())
  p = tmp_path / "bad.gguf"
  p.write_bytes(gf._set(g, b"general.architecture", gf.VT_STRING, "x\x1b]0;t\x07").to_bytes())
  rc, out, err = run_main(capsys, "generate", "--model", str(p), "--prompt-tokens", "1,2,3", "--n-predict", "2")
  assert rc == 1 and len(err.strip().splitlines()) == 1, err
  assert "\x1b" not in err and "\\x1b]0;t\\x07" in err and str(p) in err


def test_ctrl_c_one_line_status_130(capsys, monkeypatch):
  from kvjax import api

  def interrupted(*a, **k):
    raise KeyboardInterrupt()
  monkeypatch.setattr(api, "load_model", interrupted)
  rc, out, err = run_main(capsys, "generate", "--prompt-tokens", "1,2,3", "--n-predict", "2")
  assert rc == 130 and err == "kvjax: error: interrupted\n"


# ---- a new user's path: one-line refusals before anything big is allocated ---------------------

SMALL_HOST = {"host": 16 * 2**30, "device": None}   # a 16 GiB machine without a GPU


@pytest.fixture(scope="module")
def tiny64():
  return api.load_model("tiny", page_tokens=64)


@pytest.fixture
def small_host(monkeypatch):
  """Memory checks see a 16 GiB CPU host, whatever this machine has."""
  monkeypatch.setattr(memory_report, "available_memory", lambda: dict(SMALL_HOST))


def one_error_line(rc, err, status, *needles):
  """Exactly one line on stderr, `kvjax: error: ...` naming `needles`, exit `status`."""
  lines = err.splitlines()
  assert rc == status and len(lines) == 1 and lines[0].startswith("kvjax: error: "), (rc, err)
  for n in needles:
    assert n in lines[0], (n, lines[0])


def test_kv_budget_beyond_memory_refused(capsys, small_host, tiny64):
  """A pool or an arena larger than the memory it would take: one line, exit 2, before allocation;
  the API raises ParameterError naming the parameter, the value and the MiB needed / available."""
  base = ["generate", "--prompt-tokens", "1,2,3", "-n", "2", "--kv-page-tokens", "64"]
  rc, _, err = run_main(capsys, *base, "--kv-stream-pool-pages", "1000000000")
  one_error_line(rc, err, 2, "--kv-stream-pool-pages 1000000000: the device pool (1000000000 pages of 13328 B)",
                 "12,710,571.3 MiB of host memory needed, 16,384.0 MiB available")
  rc, _, err = run_main(capsys, *base, "--kv-stream-arena-mib", "1e12")
  one_error_line(rc, err, 2, "--kv-stream-arena-mib 1e+12: the arena", "MiB of host memory needed, 16,384.0 MiB")
  for kw, name in ((dict(pool_pages=10**9), "pool_pages 1000000000"), (dict(arena_mib=1e12), "arena_mib 1e+12")):
    with pytest.raises(api.ParameterError, match=re.escape(name) + ".* MiB of host memory needed") as e:
      api.make_kv(tiny64, 160, **kw)
    assert e.value.params == (name.split()[0],)
  from kvjax import checks
  gpu = {"host": 2**40, "device": 80 * 2**30}   # where the backend reports it, the device's memory counts
  with pytest.raises(api.ParameterError, match="device memory needed, 81,920.0 MiB available"):
    checks.check_pool_memory(10**7, 13328, available=gpu)
  checks.check_pool_memory(6, 13328, available=gpu)


def test_page_tokens_beyond_the_context_refused(capsys):
  """--kv-page-tokens beyond the model's context length, or one the chosen kernel does not take:
  refused at once (not a 60 s prefill of one huge page)."""
  rc, _, err = run_main(capsys, "generate", "--prompt-tokens", "1,2", "-n", "2", "--kv-page-tokens", "1048576")
  one_error_line(rc, err, 2, "--kv-page-tokens 1048576 is beyond the model's context length of 8192 positions",
                 "at most 8192 tokens")
  rc, _, err = run_main(capsys, "generate", "--prompt-tokens", "1,2", "-n", "2", "--kv-page-tokens", "40",
                        "--attn-impl", "triton")
  one_error_line(rc, err, 2, "--kv-page-tokens 40", "multiple of 16")
  with pytest.raises(api.ParameterError, match="page_tokens 16384 is beyond the model's context length of 8192"):
    api.load_model("tiny", page_tokens=16384)


def test_weights_beyond_memory_refused(capsys, small_host):
  """The 27B preset on a 16 GiB CPU host: refused from parameter count x dtype bytes, before a
  weight is drawn (`--model qwen38_27b` loads the preset)."""
  rc, _, err = run_main(capsys, "generate", "-m", "qwen38_27b", "--prompt-tokens", "1,2", "-n", "2")
  one_error_line(rc, err, 2, "--model qwen38_27b: the weights (28,592,096,256 parameters x 4 B float32)",
                 "109,070.2 MiB of host memory needed, 16,384.0 MiB available")
  with pytest.raises(api.ParameterError, match=r"preset qwen38_27b: the weights .* x 2 B bfloat16\): 54,535.1 MiB"):
    api.load_model(preset="qwen38_27b", dtype="bfloat16")


def _experiment(args, timeout=240):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m"] + args, capture_output=True, text=True, cwd=REPO, env=env,
                        timeout=timeout)


def test_unknown_config_field_or_file_is_one_line(capsys):
  """`kvjax memory` and `python -m experiments.run`: an unknown --config.FIELD names the closest
  field; a missing config file names the path; a file that is not Python, another command's
  config, the flag given twice or a size out of range: one line, exit 2, no traceback."""
  cfg = os.path.join(REPO, "configs", "memory_27b.py")
  rc, _, err = run_main(capsys, "memory", f"--config={cfg}", "--config.mtp_dept=1")
  one_error_line(rc, err, 2, "--config.mtp_dept:", "no field 'mtp_dept'", "did you mean --config.mtp_depth?")
  rc, _, err = run_main(capsys, "memory", "--config", "configs/nope.py")
  one_error_line(rc, err, 2, "--config 'configs/nope.py': no such file")
  readme, stream = os.path.join(REPO, "README.md"), os.path.join(REPO, "configs", "tiny_stream.py")
  rc, _, err = run_main(capsys, "memory", f"--config={readme}")
  one_error_line(rc, err, 2, f"--config {readme!r}: cannot load it: SyntaxError")
  rc, _, err = run_main(capsys, "memory", f"--config={stream}")
  one_error_line(rc, err, 2, "has no field 'context_tokens'", "not a config of this command")
  rc, _, err = run_main(capsys, "memory", f"--config={cfg}", f"--config={stream}")
  one_error_line(rc, err, 2, "--config given 2 times")
  for override, needle in (("--config.context_tokens=999999999999", "context_tokens must be in 1..2147483647"),
                           ("--config.mtp_depth=-1", "mtp_depth must be >= 0, got -1")):
    rc, _, err = run_main(capsys, "memory", f"--config={cfg}", override)   # refused before any plan is built
    one_error_line(rc, err, 2, needle)
  for args, needles in (
      (["--config=configs/tiny_stream.py", "--config.n_predcit=8"],
       ["run: error: --config.n_predcit:", "did you mean --config.n_predict?"]),
      (["--config=configs/nope.py"], ["run: error: --config 'configs/nope.py': no such file"]),
      (["--config=configs/train_code_tiny.py"], ["run: error: ", "has no field 'kv'", "configs/tiny_stream.py"]),
      (["--config=configs/tiny_stream.py", "--config.n_predict=abc"], ["run: error: ", "--config.n_predict=abc"])):
    p = _experiment(["experiments.run"] + args)
    assert p.returncode == 2 and len(p.stderr.splitlines()) == 1, p.stderr
    for n in needles:
      assert n in p.stderr, p.stderr


def test_api_budget_and_type_errors_name_the_parameter(capsys, tiny64):
  """A phased arena too small: ParameterError naming arena_mib and the least it needs (the CLI: one
  line, exit 2); arguments of the wrong type: the parameter and the type expected."""
  with pytest.raises(api.ParameterError, match=r"^arena_mib 0.5: too small: at least \d+\.\d+ MiB needed") as e:
    api.make_kv(tiny64, 160, arena_mib=0.5, phased=True)
  assert e.value.params == ("arena_mib",)
  rc, _, err = run_main(capsys, "generate", "--prompt-tokens", "1,2,3", "-n", "2", "-c", "160", "--kv-page-tokens",
                        "64", "--kv-stream-arena-mib", "0.5", "--kv-stream-phased")   # the same workspaces
  one_error_line(rc, err, 2, "--kv-stream-arena-mib 0.5: too small: at least")
  for kw, msg in ((dict(prompt="hi", n_predict=2.5), "n_predict must be an int, got 2.5 (float)"),
                  (dict(prompt_tokens="1,2"), "prompt_tokens must be a sequence of int token ids, got '1,2' (str)"),
                  (dict(prompt_tokens=[1, 2.0]), "prompt_tokens must be a sequence of int token ids, got the "
                                                 "element 2.0 (float)"),
                  (dict(prompt="hi", temperature="0.5"), "temperature must be a number, got '0.5' (str)"),
                  (dict(prompt=7), "prompt must be a str or None, got 7 (int)")):
    with pytest.raises(api.ParameterError) as e:
      api.generate(tiny64, **kw)
    assert str(e.value).startswith(msg) and "\n" not in str(e.value), str(e.value)
  with pytest.raises(api.ParameterError, match=r"max_tokens must be an int, got 160.0 \(float\)"):
    api.make_kv(tiny64, 160.0)
  with pytest.raises(api.ParameterError, match=r"^prompt must be a str, got 123 \(int\)"):
    api.encode(tiny64, 123)
  with pytest.raises(api.ParameterError, match=r"^tokens must be a sequence of int token ids, got 'hi' \(str\)"):
    api.teacher_forced_logits(tiny64, "hi")
  ids = list(range(5, 20))   # token ids as a jax or numpy integer array: the list's logits
  want = np.asarray(api.teacher_forced_logits(tiny64, ids))
  for arr in (jnp.asarray(ids, jnp.int32), np.asarray(ids, np.int64)):
    assert np.array_equal(np.asarray(api.teacher_forced_logits(tiny64, arr)), want)
  with pytest.raises(api.ParameterError, match=r"^tokens must be a sequence of int token ids, got the element"):
    api.teacher_forced_logits(tiny64, jnp.ones((2, 3), jnp.int32))
  with pytest.raises(api.ParameterError, match=r"^model must be a LoadedModel .*, got str"):
    api.weight_bytes("tiny")


def test_sweep_refuses_bad_contexts_and_reports_tokens_match(tmp_path):
  """sweep_fixed_span: a non-positive context is one line, exit 2; `--compare_plain` fills
  tokens_match (the plain cache's greedy tokens); a sweep that compares nothing has no such column;
  it says where it wrote its files."""
  p = _experiment(["experiments.sweep_fixed_span", "--contexts=-128", f"--out={tmp_path}"])
  assert p.returncode == 2 and p.stderr.splitlines() == ["sweep_fixed_span: error: --contexts -128: must be a "
                                                         "positive count"], p.stderr
  common = ["experiments.sweep_fixed_span", "--pool_pages=6", "--decode_tokens=4",   # no arena row with a pool
            "--page_tokens=64", "--ubatch=64", "--nowarmup"]
  p = _experiment(common + ["--contexts=128", "--compare_plain", f"--out={tmp_path}/a"])
  assert p.returncode == 0, p.stderr[-2000:]
  with open(tmp_path / "a" / "results.csv", newline="") as f:
    (row,) = list(csv.DictReader(f))
  assert row["error"] == "" and row["tokens_match"] == "True"
  assert f"sweep_fixed_span: wrote {tmp_path}/a/results.csv, {tmp_path}/a/results.jsonl" in p.stdout
  p = _experiment(common + ["--contexts=4", f"--out={tmp_path}/b"])   # leaves no prompt: an error row
  assert p.returncode == 0, p.stderr[-2000:]
  with open(tmp_path / "b" / "results.csv", newline="") as f:
    (row,) = list(csv.DictReader(f))
  assert "tokens_match" not in row and "leaves no prompt" in row["error"]


# ---- llama.cpp habits ----------------------------------------------------------------------------

def test_file_flag_top_p_and_version(capsys, tmp_path):
  """-f FILE (one trailing newline dropped) gives the tokens of -p; --top-p keeps the most probable
  tokens (a tiny top-p sampled run is greedy); kvjax --version prints the package version."""
  path = tmp_path / "prompt.txt"
  path.write_text("Hello\n")
  rc, out, err = run_main(capsys, "generate", "-f", str(path), "-n", "6", "--ignore-eos", "--kv-page-tokens", "64",
                          "--json")
  assert rc == 0, err
  r = json_line(out)
  assert r["metrics"]["prompt_tokens"] == 5
  rc, out, _ = run_main(capsys, "generate", "--file", str(path), "-n", "6", "--ignore-eos", "--kv-page-tokens", "64",
                        "--temperature", "1.0", "--top-p", "1e-6", "--seed", "3", "--json")
  assert rc == 0 and json_line(out)["tokens"] == r["tokens"]   # only the top token survives top-p
  rc, _, err = run_main(capsys, "generate", "-f", str(path), "-p", "hi")
  one_error_line(rc, err, 2, "give exactly one of --prompt, --file and --prompt-tokens")
  rc, _, err = run_main(capsys, "generate", "-f", str(tmp_path / "none.txt"))
  one_error_line(rc, err, 1, "--file", "none.txt", "no such file")
  rc, _, err = run_main(capsys, "generate", "-p", "hi", "--top-p", "0")
  one_error_line(rc, err, 2, "--top-p must be in (0, 1] (1: off), got 0.0")
  rc, out, _ = run_main(capsys, "--version")
  assert rc == 0 and out.strip() == "kvjax 0.1.0"
  from kvjax import generate as gen_lib
  logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))   # top-p 0.7: the first two tokens
  picks = {gen_lib.sample_token(logits, gen_lib.SamplingParams(1.0, 0, s, top_p=0.7), 0) for s in range(40)}
  assert picks == {0, 1}


def test_tokens_stream_as_generated(capsys, monkeypatch):
  """The text output writes the prompt echo, then the tokens as they come (a write per token, not
  one at the end); --json prints its one line only."""
  writes = []

  class Recorder:
    def write(self, s):
      writes.append(s)

    def flush(self):
      pass
  monkeypatch.setattr(sys, "stdout", Recorder())
  argv = ["generate", "-p", "Hello", "-n", "12", "--ignore-eos", "--kv-page-tokens", "64"]
  assert cli.main(argv) == 0
  text = "".join(writes)
  assert text.startswith("Hello") and text.endswith("\n") and len(writes) >= 8, writes
  writes.clear()
  assert cli.main(argv + ["--no-display-prompt", "--json"]) == 0
  assert len("".join(writes).splitlines()) == 1 and api.printable(json.loads("".join(writes))["text"]) in text


def test_prefill_progress(capsys, monkeypatch, tiny64):
  """api.generate(on_prefill=) is called at the start and after each prefill block (done, total);
  the CLI draws a bar on a terminal's stderr (tokens, tok/s), none with --no-progress."""
  calls = []
  api.generate(tiny64, prompt_tokens=PROMPT_IDS, n_predict=2, ubatch=16, on_prefill=lambda d, t: calls.append((d, t)))
  assert calls == [(0, 100)] + [(min(d, 100), 100) for d in range(16, 113, 16)]

  class Terminal:
    def __init__(self):
      self.text = ""

    def write(self, s):
      self.text += s

    def flush(self):
      pass

    def isatty(self):
      return True
  monkeypatch.setattr(cli, "PROGRESS_DELAY_S", 0)
  for extra, shown in (([], True), (["--no-progress"], False)):
    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    assert cli.main(["generate", PROMPT_FLAG, "-n", "2", "--ubatch-size", "16", "--kv-page-tokens", "64",
                     "--json"] + extra) == 0
    assert ("prefill: " in term.text and "/100 [" in term.text and "tok/s]" in term.text) == shown, term.text


def test_run_says_where_it_wrote(tmp_path):
  p = _experiment(["experiments.run", "--config=configs/tiny_stream.py", "--config.kv=plain",
                   "--config.n_predict=2", f"--config.out_dir={tmp_path}"])
  assert p.returncode == 0, p.stderr[-2000:]
  assert f"run: wrote {tmp_path}/tiny_stream.jsonl and {tmp_path}/tiny_stream.csv" in p.stderr
  assert os.path.exists(tmp_path / "tiny_stream.csv")


def test_summary_excludes_compilation():
  """tok/s without the compile time inside the timings; a cold run adds one line of its compile time."""
  m = {"prompt_tokens": 100, "prompt_ms": 1000.0, "prompt_compile_ms": 900.0, "decode_tokens": 11,
       "predicted_ms": 600.0, "predicted_compile_ms": 500.0, "compile_ms": 1400.0, "warmup": False,
       "spec_type": "none", "compiles": 9, "compile_cache_hits": 2}
  lines = cli._summary(m)  # pylint: disable=protected-access
  assert lines[0] == "prefill 100 tokens in 100.0 ms (1000.0 tok/s), decode 11 tokens in 100.0 ms (100.0 tok/s)"
  assert lines[1].startswith("cold run: 1.4 s of jax tracing and compiling (prefill 0.9 s, decode 0.5 s), "
                             "not counted above") and "--warmup" in lines[1]
  assert len(cli._summary(dict(m, warmup=True, compile_ms=0.0, prompt_compile_ms=0.0,  # pylint: disable=protected-access
                               predicted_compile_ms=0.0))) == 1
  # a warm process: every program loaded from the persistent cache (its tracing still takes time)
  assert len(cli._summary(dict(m, compile_cache_hits=9))) == 1  # pylint: disable=protected-access


def test_weights_impl_and_fuse_flags_keep_the_tokens(capsys):
  """--weights-impl fused --nofuse (the Q8_0 code-tiny's products as one multiply-and-sum, the
  block's matrices apart) gives the default run's tokens; a bad implementation is a usage error."""
  argv = ["generate", "--model=code-tiny", "--prompt=def main(", "--n-predict=16", "--kv-page-tokens=64", "--json"]
  rc, out, err = run_main(capsys, *argv)
  assert rc == 0, err
  want = json_line(out)["tokens"]
  rc, out, err = run_main(capsys, *argv, "--weights-impl=fused", "--nofuse")
  assert rc == 0, err
  assert json_line(out)["tokens"] == want
  rc, out, err = run_main(capsys, *argv, "--weights-impl=cuda")
  assert_one_line_error(rc, err, 2, "--weights-impl", "fused")


def test_a_preset_without_tokenizer_prints_the_generated_ids(capsys):
  """A preset has no tokenizer: the text output is the generated ids, comma-separated as
  --prompt-tokens takes them, equal to the JSON's tokens."""
  argv = ["generate", "--model=tiny_deep", "--prompt-tokens=1,2,3", "--n-predict=6", "--kv-page-tokens=16"]
  rc, out, err = run_main(capsys, *argv, "--json")
  assert rc == 0, err
  want = json_line(out)["tokens"]
  m = json_line(out)["metrics"]
  assert m["joined_products"] > 0 and m["weights_impl"] == "none"   # bf16 random weights: nothing quantized
  rc, out, err = run_main(capsys, *argv)
  assert rc == 0, err
  assert out.strip() == ",".join(map(str, want))

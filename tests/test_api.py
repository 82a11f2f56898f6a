"""kvjax.api, the Python API: the same results as the `kvjax` command for the same inputs, plain ==
streamed tokens, speculative == plain greedy, teacher-forced logits, a reused cache, kernels
interpreted on a CPU, text made safe for a terminal, and errors as `ValueError`s naming the API's
parameters (never a command-line flag). Tiny model, CPU, 64-token KV pages."""

import contextlib
import io
import json

import jax
import numpy as np
import pytest

from kvjax import api, cli
from tiny_setup import assert_same_logits

PROMPT = [int(t) for t in np.random.default_rng(11).integers(0, 381, 90)]   # 90 ids, no specials
N = 30   # 90 + 30 = 120 tokens: 2 pages of 64 per cache layer


@pytest.fixture(scope="module")
def model():
  return api.load_model("tiny", page_tokens=64)


def generate_logged(model, kv=None, **kwargs):
  """api.generate -> (result, logits [n, V] of every generated token's step)."""
  rows = []
  res = api.generate(model, kv, prompt_tokens=PROMPT, n_predict=N, ignore_eos=True, ubatch=32,
                     on_logits=lambda _, l: rows.append(np.asarray(l)), **kwargs)
  return res, np.stack(rows)


@pytest.fixture(scope="module")
def plain_run(model):
  return generate_logged(model)


@pytest.fixture(scope="module")
def plain(plain_run):
  return plain_run[0]


def cli_json(*argv):
  buf = io.StringIO()
  with contextlib.redirect_stdout(buf):
    rc = cli.main(list(argv))
  assert rc == 0
  return json.loads(buf.getvalue())


CLI_COMMON = ["--model=tiny", "--kv-page-tokens=64", "--ubatch-size=32", f"--n-predict={N}", "--ignore-eos",
              "--json", "--prompt-tokens=" + ",".join(map(str, PROMPT))]


def test_plain_generation_equals_the_cli(model, plain):
  assert len(plain.tokens) == N and len(set(plain.tokens)) > 3
  assert plain.text == model.tokenizer.decode(plain.tokens)
  m = plain.metrics
  assert m["kv"] == "plain" and m["ctx_size"] == 90 + N and m["spec_type"] == "none" and m["warmup"] is False
  got = cli_json("generate", *CLI_COMMON)
  assert got["tokens"] == plain.tokens and got["text"] == plain.text
  assert set(got["metrics"]) == set(m)


@pytest.mark.parametrize("budget", [dict(pool_pages=5), dict(pool_pages=4, copy_pages=2),
                                    dict(pool_pages=9, policy="adaptive")])
def test_streamed_equals_plain_and_the_cli(model, plain_run, budget):
  """Streamed caches smaller than the context (something streams) give the plain logits, bit for
  bit at every step, and the command line with the same budget gives the same tokens and budget."""
  plain, plain_logits = plain_run
  kv = api.make_kv(model, 90 + N, ubatch=32, **budget)
  assert kv.info["kv"] == "streamed" and kv.info["all_pages_resident"] is False
  res, logits = generate_logged(model, kv)
  assert res.tokens == plain.tokens
  assert_same_logits(logits, plain_logits)
  assert res.metrics["streamed_pages"] > 0 and res.metrics["h2d_bytes"] > 0
  # the fixed split times no copy alone (no forced wait); the adaptive policy samples its copy rate
  assert (res.metrics["timed_bytes"] > 0) == (budget.get("policy") == "adaptive"), res.metrics["timed_bytes"]
  flag = {"pool_pages": "--kv-stream-pool-pages", "arena_mib": "--kv-stream-arena-mib",
          "copy_pages": "--kv-stream-copy-pages", "policy": "--kv-stream-policy"}
  got = cli_json("generate", *CLI_COMMON, *[f"{flag[k]}={v}" for k, v in budget.items()])
  assert got["tokens"] == res.tokens
  for k in ("pool_pages", "resident_pages", "ring_slots", "resident_pages_per_layer", "staging_reserve_mib"):
    assert got["metrics"][k] == res.metrics[k], k


def test_a_used_cache_is_reset_and_warmup_reuses_it(model, plain_run):
  plain, plain_logits = plain_run
  kv = api.make_kv(model, 90 + N, pool_pages=5)
  first, first_logits = generate_logged(model, kv)
  provider = kv.provider
  again, again_logits = generate_logged(model, kv, warmup=True)
  assert first.tokens == again.tokens == plain.tokens
  assert_same_logits(first_logits, plain_logits, "first run")
  assert_same_logits(again_logits, plain_logits, "reused cache")
  assert kv.provider is not provider and kv.used
  # the measured run starts from a fresh cache: its counters are one run's, equal to the first run's
  for k in ("h2d_bytes", "d2h_bytes", "streamed_pages", "forwards"):
    assert again.metrics[k] == first.metrics[k], k
  assert again.metrics["warmup"] is True and again.metrics["compile_ms"] == 0.0


def test_budget_holding_the_whole_context_streams_nothing(model):
  kv = api.make_kv(model, 100, pool_pages=9)   # 2 pages per cache layer, 3 layers: all resident
  assert kv.info["all_pages_resident"] is True and kv.info["resident_pages_per_layer"] == [2, 2, 2]
  assert kv.info["kv"] == "all pages resident"
  res = api.generate(model, kv, prompt_tokens=PROMPT[:60], n_predict=40, ignore_eos=True, ubatch=32)
  assert res.metrics["streamed_pages"] == 0 and res.metrics["h2d_bytes"] == 0


@pytest.mark.parametrize("draft", ["mtp", "ngram"])
def test_speculative_equals_plain_greedy(model, plain, draft):
  spec = api.SpecConfig(draft, n_max=3, ngram_n=2)
  res = api.generate(model, api.make_kv(model, api.context_tokens(90, N, spec), pool_pages=8),
                     prompt_tokens=PROMPT, n_predict=N, ignore_eos=True, ubatch=32, spec=spec)
  assert res.tokens == plain.tokens
  m = res.metrics
  assert m["spec_type"] == draft and m["verify_forwards"] >= 1
  assert 0 <= m["draft_accepted"] <= m["draft_generated"]
  if draft == "ngram":   # (the MTP drafter's CLI run is in tests/test_cli.py)
    got = cli_json("generate", *CLI_COMMON, "--spec-type=ngram-simple", "--spec-draft-n-max=3",
                   "--spec-ngram-size-n=2")
    assert got["tokens"] == res.tokens and got["metrics"]["draft_generated"] == m["draft_generated"]


def test_the_arena_holds_a_verify_forward_and_its_captured_states(model, plain):
  """make_kv(spec=): the arena's decode workspace is the verify forward's scratch plus the
  recurrent states its rows capture (device rollback: every group's states of the W - 1 extra
  rows; host: two groups' in the stage), so the pool shrinks; generate refuses a spec whose verify
  the arena was not measured for, and runs equal to plain greedy with one that was."""
  from kvjax import engine, speculative
  every, largest = engine.recurrent_state_bytes(model.runner)
  states = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree_util.tree_leaves(model.runner.zero_states()))
  assert every == states and 0 < largest < every
  ctx = api.context_tokens(len(PROMPT), N, api.SpecConfig("mtp", n_max=5))
  base = api.make_kv(model, ctx, arena_mib=2)
  dev = api.make_kv(model, ctx, arena_mib=2, spec=api.SpecConfig("mtp", n_max=5, rollback="device"))
  host = api.make_kv(model, ctx, arena_mib=2, spec=api.SpecConfig("mtp", n_max=5, rollback="host"))
  replay = api.make_kv(model, ctx, arena_mib=2, spec=api.SpecConfig("mtp", n_max=5))   # the default
  assert base.info["decode_rows"] == 1 and base.info["verify_states_bytes"] == 0
  assert dev.info["decode_rows"] == host.info["decode_rows"] == replay.info["decode_rows"] == 6
  assert dev.info["verify_states_bytes"] == 5 * every
  assert host.info["verify_states_bytes"] == 5 * speculative.HostRollback.SLOTS * largest
  assert replay.info["verify_states_bytes"] == 6 * speculative.replay_row_bytes(model.cfg) < every
  assert sum(replay.info["resident_pages_per_layer"]) >= sum(dev.info["resident_pages_per_layer"])
  assert dev.info["decode_workspace_mib"] >= base.info["decode_workspace_mib"] + 5 * every / 2**20
  assert sum(dev.info["resident_pages_per_layer"]) <= sum(base.info["resident_pages_per_layer"])
  spec = api.SpecConfig("mtp", n_max=5)
  for kv in (base, api.make_kv(model, ctx, arena_mib=2, spec=api.SpecConfig("mtp", n_max=3))):
    with pytest.raises(api.ParameterError, match=r"spec verifies 6 rows a forward and captures .* was measured for"):
      api.generate(model, kv, prompt_tokens=PROMPT, n_predict=N, ignore_eos=True, ubatch=32, spec=spec)
  res = api.generate(model, dev, prompt_tokens=PROMPT, n_predict=N, ignore_eos=True, ubatch=32, spec=spec)
  assert res.tokens == plain.tokens


def test_sampling_equals_the_cli(model):
  res = api.generate(model, prompt="Hello", n_predict=10, temperature=0.8, top_k=40, seed=3, ignore_eos=True)
  got = cli_json("generate", "--kv-page-tokens=64", "--prompt=Hello", "--n-predict=10", "--temperature=0.8",
                 "--top-k=40", "--seed=3", "--ignore-eos", "--json")
  assert got["tokens"] == res.tokens


@pytest.mark.parametrize("mtp", [False, True])
def test_teacher_forced_logits_equal_the_cli(model, tmp_path, mtp):
  toks = PROMPT[:40]
  arr = api.teacher_forced_logits(model, toks, mtp=mtp, ubatch=16)
  assert arr.dtype == np.float32 and arr.shape == ((39 if mtp else 40), model.cfg.vocab_size)
  path = str(tmp_path / "l.npy")
  with contextlib.redirect_stdout(io.StringIO()):
    rc = cli.main(["logits", "--model=tiny", "--kv-page-tokens=64", "--ubatch-size=16", f"--out={path}",
                   "--tokens=" + ",".join(map(str, toks))] + (["--mtp"] if mtp else []))
  assert rc == 0
  np.testing.assert_array_equal(np.load(path), arr)
  if not mtp:   # rows predict the next token: the greedy continuation's first token is row 39's argmax
    res = api.generate(model, prompt_tokens=toks, n_predict=1)
    assert res.tokens == [int(np.argmax(arr[-1]))]


@pytest.mark.slow
def test_kernel_runs_interpreted_on_a_cpu():
  """attn_impl="triton" without a GPU: Pallas interpret mode, close to the reference."""
  tri = api.load_model("tiny", page_tokens=64, attn_impl="triton", block_pages=1)
  ref = api.load_model("tiny", page_tokens=64, attn_impl="reference", block_pages=1)
  assert tri.runner.opts.interpret and tri.runner.opts.implementation == "triton"
  assert not ref.runner.opts.interpret
  toks = PROMPT[:70]
  a = api.teacher_forced_logits(tri, toks, ubatch=32)
  b = api.teacher_forced_logits(ref, toks, ubatch=32)
  assert 0 < np.max(np.abs(a - b)) / np.max(np.abs(b)) < 1e-2   # f16 operand rounding in the kernel
  res = api.generate(tri, prompt_tokens=toks, n_predict=3, ubatch=32)
  assert res.metrics["attn_impl"] == "triton" and res.metrics["attn_interpret"] is True


def test_printable_escapes_control_characters():
  text = "red\x1b[31m\x07bell\x00nul\x7fdel\x9bcsi\ud800 \ue000pua\n\tkept é ☃ \u200d\ufffd"
  got = api.printable(text)
  assert got == ("red\\x1b[31m\\x07bell\\x00nul\\x7fdel\\x9bcsi\\ud800 \\ue000pua\n\tkept é ☃ \u200d\ufffd")
  assert api.printable("plain text\n") == "plain text\n"


def _error(fn, *a, **kw):
  with pytest.raises(ValueError) as e:
    fn(*a, **kw)
  return e.value


@pytest.mark.parametrize("call,params,needle", [
    (lambda m: api.make_kv(m, 100, copy_pages=3), ("copy_pages",), "copy_pages must be a power of two"),
    (lambda m: api.make_kv(m, 100, pool_pages=0), ("pool_pages",), "pool_pages must be >= 1"),
    (lambda m: api.make_kv(m, 100, arena_mib=-1.0), ("arena_mib",), "arena_mib must be > 0"),
    (lambda m: api.make_kv(m, 100, arena_mib=1.0, pool_pages=4), ("arena_mib", "pool_pages"), "only one of"),
    (lambda m: api.make_kv(m, 100, pool_pages=4, phased=True), ("phased", "arena_mib"), "phased needs arena_mib"),
    (lambda m: api.make_kv(m, 100, policy="lru"), ("policy",), "policy must be"),
    (lambda m: api.make_kv(m, 0), ("max_tokens",), "max_tokens must be >= 1"),
    (lambda m: api.generate(m, prompt="hi", prompt_tokens=[1]), ("prompt", "prompt_tokens"), "exactly one"),
    (lambda m: api.generate(m, prompt=""), ("prompt",), "prompt is empty"),
    (lambda m: api.generate(m, prompt_tokens=[1, 999]), ("prompt_tokens",), "token id 999"),
    (lambda m: api.generate(m, prompt="hi", n_predict=0), ("n_predict",), "n_predict must be >= 1"),
    (lambda m: api.generate(m, prompt="hi", temperature=-1.0), ("temperature",), "temperature must be >= 0"),
    (lambda m: api.generate(m, prompt="hi", spec=api.SpecConfig(), temperature=0.5), ("spec", "temperature"),
     "spec verifies greedily"),
    (lambda m: api.generate(m, prompt="hi", spec=api.SpecConfig("eagle")), ("spec.draft",), "spec.draft must be"),
    (lambda m: api.generate(m, prompt="hi", spec=api.SpecConfig(), on_logits=print), ("on_logits", "spec"),
     "on_logits is called by plain generation only"),
    (lambda m: api.generate(m, api.make_kv(m, 8), prompt="hi", n_predict=8), ("kv",), "kv holds 8 tokens"),
    (lambda m: api.context_tokens(10, 8, max_tokens=12), ("max_tokens",), "max_tokens 12 is too small"),
    (lambda m: api.teacher_forced_logits(m, [3], mtp=True), ("mtp",), "mtp needs at least 2 tokens"),
    (lambda m: api.load_model(dtype="float8"), ("dtype",), "dtype 'float8'"),
    (lambda m: api.load_model(attn_impl="cuda"), ("attn_impl",), "attn_impl 'cuda'"),
    (lambda m: api.load_model(k_type="q5_1"), ("k_type",), "k_type 'q5_1'"),
    (lambda m: api.load_model(block_pages=0), ("block_pages",), "block_pages must be auto or an int >= 1"),
    (lambda m: api.load_model("tiny:x"), ("source",), "source 'tiny:x'"),
    (lambda m: api.load_model("missing.gguf"), ("source",), "source 'missing.gguf': no such file"),
    (lambda m: api.load_model(preset="gpt5"), ("preset",), "unknown model preset 'gpt5'"),
])
def test_errors_are_value_errors_naming_the_parameter(model, call, params, needle):
  e = _error(call, model)
  assert isinstance(e, api.ParameterError) and isinstance(e, ValueError)
  assert needle in str(e), str(e)
  assert "--" not in str(e)          # the API's words, not the command line's
  assert set(params) <= set(e.params)
  for p in e.params:
    assert p in str(e)


def test_missing_model_file_is_its_own_error(model):
  e = _error(api.load_model, "missing.gguf")
  assert isinstance(e, api.ModelNotFoundError)
  assert e.renamed({"source": "--model"}) == ("--model 'missing.gguf': no such file (expected a .gguf path, "
                                              "'tiny', 'tiny:SEED', 'code-tiny' or a preset: qwen38_27b, tiny_deep)")
  assert "did you mean the preset 'qwen38_27b'?" in str(_error(api.load_model, "qwen38_27B"))
  # a preset's exact name as the source: the API takes presets as their own argument
  assert str(_error(api.load_model, "tiny_deep")).endswith("is a preset, not a file: load_model(preset='tiny_deep')")
  e = _error(api.load_model, "tiny", fuse="no")
  assert isinstance(e, api.ParameterError) and "fuse must be" in str(e)


def test_budget_too_small_says_how_many_pages_are_missing(model):
  from kvjax.streaming import StreamBudgetError  # pylint: disable=import-outside-toplevel
  e = _error(api.make_kv, model, 1024, pool_pages=2)
  assert isinstance(e, StreamBudgetError) and "the minimum is 4 pages" in str(e) and "2 more pages" in str(e)
  assert isinstance(e, api.KVBudgetError) and e.params == ("pool_pages",) and str(e).startswith("pool_pages 2: ")
  e = _error(api.make_kv, model, 1024, arena_mib=0.5)
  assert isinstance(e, api.KVBudgetError) and e.params == ("arena_mib",) and str(e).endswith(" MiB more")
  assert e.renamed({"arena_mib": "--kv-stream-arena-mib"}).startswith("--kv-stream-arena-mib 0.5: ")


def test_readme_api_example_runs_and_streams():
  """The README's Python example, as written: it runs, and its cache streams (in copy waves)."""
  import pathlib
  import re
  text = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
  blocks = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "api.make_kv" in b]
  assert len(blocks) == 1
  ns = {}
  with contextlib.redirect_stdout(io.StringIO()):
    exec(compile(blocks[0], "README.md", "exec"), ns)  # pylint: disable=exec-used
  m = ns["m"]
  assert m["streamed_pages"] > 0 and m["waves"] > 0 and m["h2d_bytes"] > 0
  assert ns["fast"].tokens and ns["logits"].shape[0] == len(ns["ids"]) > len(ns["res"].tokens)   # prompt + generated
  assert ns["same"].tokens == ns["res"].tokens and ns["same"].metrics["streamed_pages"] > 0   # speculative, streamed

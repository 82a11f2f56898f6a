"""kvjax.train: the training form equals the inference path, gradients reach every parameter, runs
are deterministic and resume exactly, checkpoints refuse a wrong structure, bad config fields are
refused in one line before anything is read or written; and the shipped `code-tiny` model: its
export round trip, its tokenizer on held-out files, its held-out loss."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kvjax import api, corpus, engine, gguf_io, tiny, train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def toy_corpus(tmp_path_factory):
  """A small corpus: the first 40 stdlib files under 8 kB, copied (a third held out)."""
  root = corpus.stdlib_root()
  out = tmp_path_factory.mktemp("corpus")
  small = [f for f in corpus.stdlib_files(root) if "/" not in f and os.path.getsize(os.path.join(root, f)) < 8000]
  for f in small[:40]:
    with open(os.path.join(root, f), "rb") as src, open(out / f, "wb") as dst:
      dst.write(src.read())
  return str(out)


def toy_config(root=""):
  c = train.base_config()
  c.name = "toy"
  c.corpus_root, c.heldout_percent = root, 30.0
  c.max_train_bytes, c.max_heldout_bytes, c.bpe_bytes, c.vocab_size = 0, 0, 0, 288
  c.model.update(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_kv_heads=1, head_dim=32,
                 rope_dim=16, linear_num_key_heads=1, linear_num_value_heads=2, linear_head_dim=32)
  c.seq_len, c.batch_size, c.steps, c.warmup_steps = 32, 4, 4, 2
  c.eval_every, c.eval_windows, c.ckpt_every, c.export_weight_type = 2, 6, 2, "f32"
  return c


def assert_training_form_matches(model, loaded, toks):
  """Target and MTP logits of the training form within 1e-4 relative of the loaded model's
  teacher-forced logits (f32 K/V pages)."""
  graphdef, state = nnx.split(model)

  @jax.jit
  def forms(state, toks):
    m = nnx.merge(graphdef, state)
    logits, hn = m.causal(toks)
    return logits, m.mtp_causal(hn[:-1], toks[1:])

  logits, mtp = forms(state, jnp.asarray(toks))
  ref = api.teacher_forced_logits(loaded, toks)
  assert np.abs(np.asarray(logits) - ref).max() <= 1e-4 * np.abs(ref).max()
  ref = api.teacher_forced_logits(loaded, toks, mtp=True)
  assert np.abs(np.asarray(mtp) - ref).max() <= 1e-4 * np.abs(ref).max()


def test_gradients_reach_every_parameter():
  c = toy_config()
  model = train.init_model(train.model_config(c), 0)
  graphdef, params = nnx.split(model)
  w = np.random.default_rng(1).integers(0, c.vocab_size, (2, 40)).astype(np.int32)
  loss = lambda p: sum(x.mean() for x in train.window_losses_batch(p, graphdef, w, jnp.float32))
  grads = jax.jit(jax.grad(loss))(params)
  norms = {jax.tree_util.keystr(k): float(jnp.abs(g).max())
           for k, g in jax.tree_util.tree_leaves_with_path(grads)}
  assert all(np.isfinite(v) for v in norms.values())
  dead = [k for k, v in norms.items() if v == 0.0]
  assert not dead, dead        # GDN (chunked form), attention, MTP and embeddings all get gradients


def test_bfloat16_compute_casts_matrices_only():
  c = toy_config()
  graphdef, params = nnx.split(train.init_model(train.model_config(c), 0))
  cast = train.cast_for_compute(params, graphdef, jnp.bfloat16)
  leaves = {jax.tree_util.keystr(k): a.dtype for k, a in jax.tree_util.tree_leaves_with_path(cast)}
  assert leaves["['token_embd'].value"] == jnp.bfloat16
  assert leaves["['groups'][0]['recurrent'][0]['mixer']['ssm_alpha'].value"] == jnp.bfloat16
  assert leaves["['groups'][0]['recurrent'][0]['mixer']['ssm_a'].value"] == jnp.float32
  assert all(v == jnp.float32 for k, v in leaves.items() if "norm" in k or "conv1d" in k or "['ssm_a']" in k)
  t, m = train.window_losses_batch(params, graphdef, np.zeros((1, 33), np.int32), jnp.bfloat16)
  assert np.isfinite(float(t[0])) and np.isfinite(float(m[0]))


def _losses(out):
  return {r["step"]: r["loss"] for r in train.read_log(os.path.join(out, train.LOG_NAME))}


def test_run_is_deterministic_and_resumes_exactly(tmp_path, toy_corpus):
  """A second run from scratch, stopped at step 2 (the schedule still over 4 steps) and resumed
  from its checkpoint: every step's loss and the held-out loss are the first run's bits (steps 1-2:
  the run is deterministic; 3-4: the resume is exact)."""
  c = toy_config(toy_corpus)
  a = train.run(c, str(tmp_path / "a"), progress=False, log=lambda s: None)
  la = _losses(tmp_path / "a")
  assert la[4] != la[1]                                        # it trained
  c.stop_step = 2
  train.run(c, str(tmp_path / "c"), progress=False, log=lambda s: None)
  assert sorted(_losses(tmp_path / "c")) == [1, 2]
  c.stop_step = 0
  resumed = train.run(c, str(tmp_path / "c"), resume=True, progress=False, log=lambda s: None)
  lc = _losses(tmp_path / "c")
  assert lc == la
  assert resumed["heldout_loss"] == a["heldout_loss"]
  # the export loads and runs in kvjax; its tokenizer is the one the run learned
  m = api.load_model(a["gguf"], k_type="f32", v_type="f32", page_tokens=16)
  spec = json.load(open(tmp_path / "a" / train.TOKENIZER_NAME))
  assert m.tokenizer.tokens == spec["tokens"] and m.cfg.has_mtp
  assert os.path.exists(tmp_path / "a" / train.PLOT_NAME)


def test_the_best_heldout_step_is_exported(tmp_path, toy_corpus):
  """An evaluation every step at a learning rate too high to keep improving: the export (and the
  summary's held-out loss) is the step with the lowest held-out loss in the log, not the last one;
  with export_best off, it is the last step."""
  c = toy_config(toy_corpus)
  c.steps, c.eval_every, c.lr, c.warmup_steps, c.min_lr_ratio = 5, 1, 0.5, 1, 1.0   # best: step 4
  s = train.run(c, str(tmp_path / "a"), progress=False, log=lambda m: None)
  held = {r["step"]: r["heldout_loss"] for r in train.read_log(str(tmp_path / "a" / train.LOG_NAME))}
  best = min(held, key=held.get)
  assert best != c.steps, held                    # the schedule really makes the last step worse
  assert s["export_step"] == best and s["heldout_loss"] == held[best] and s["final_heldout_loss"] == held[c.steps]
  assert train.checkpoint_heldout_loss(str(tmp_path / "a" / train.BEST_NAME)) == held[best]
  c.export_best = False
  s = train.run(c, str(tmp_path / "b"), progress=False, log=lambda m: None)
  assert s["export_step"] == c.steps and s["heldout_loss"] == held[c.steps]


def test_checkpoint_of_another_model_is_refused(tmp_path):
  c = toy_config()
  g, p = nnx.split(train.init_model(train.model_config(c), 0))
  opt = train.make_optimizer(c)
  path = str(tmp_path / "ck.npz")
  train.save_checkpoint(path, p, opt.init(p), 3)
  p2, s2, step = train.load_checkpoint(path, p, opt.init(p))
  assert step == 3
  c.model.intermediate_size = 96
  g3, p3 = nnx.split(train.init_model(train.model_config(c), 0))
  with pytest.raises(ValueError, match=r"ck\.npz: array \d+ has shape"):
    train.load_checkpoint(path, p3, opt.init(p3))


# ---- bad config fields: one line, before anything is read or written ---------------------------

@pytest.mark.parametrize("field, value, message", [
    ("steps", 0, "config.steps 0: must be at least 1"),
    ("steps", -3, "config.steps -3: must be at least 1"),
    ("batch_size", -1, "config.batch_size -1: must be at least 1"),
    ("eval_every", 0, "config.eval_every 0: must be at least 1"),
    ("warmup_steps", -1, "config.warmup_steps -1: must be at least 0"),
    ("lr", 0.0, "config.lr 0: must be above 0"),
    ("export_weight_type", "q5", "config.export_weight_type 'q5': expected one of"),
])
def test_bad_config_field_is_refused_before_out_is_touched(tmp_path, field, value, message):
  """A bad count, rate or type: `kvjax.api.ParameterError`, one line naming `config.FIELD`, its value
  and the least needed; the out folder is not created, and a resumed run's files stay as they were."""
  c = toy_config()
  c[field] = value
  out = tmp_path / "out"
  with pytest.raises(api.ParameterError) as e:
    train.run(c, str(out), progress=False, log=lambda s: None)
  assert str(e.value).startswith(message) and "\n" not in str(e.value) and e.value.params == (f"config.{field}",)
  assert not out.exists()
  out.mkdir()
  (out / train.LOG_NAME).write_text("{}\n")
  with pytest.raises(api.ParameterError, match=f"^config.{field} "):
    train.run(c, str(out), resume=True, progress=False, log=lambda s: None)
  assert sorted(os.listdir(out)) == [train.LOG_NAME] and (out / train.LOG_NAME).read_text() == "{}\n"


def test_resume_at_or_past_steps_is_refused(tmp_path):
  """A checkpoint already at config.steps: refused (naming the least steps that trains on) before
  the corpus is read; the run's files are untouched."""
  c = toy_config()
  ckpt = tmp_path / train.CKPT_NAME
  train.save_checkpoint(str(ckpt), {}, (), c.steps)
  before = ckpt.read_bytes()
  with pytest.raises(api.ParameterError, match=rf"^config.steps {c.steps}: .* is at step {c.steps}; at least "
                     rf"{c.steps + 1} needed to resume"):
    train.run(c, str(tmp_path), resume=True, progress=False, log=lambda s: None)
  assert os.listdir(tmp_path) == [train.CKPT_NAME] and ckpt.read_bytes() == before


def test_no_heldout_file_within_max_heldout_bytes_names_the_bytes_needed(tmp_path, toy_corpus):
  """max_heldout_bytes below the first held-out file: the error says how many bytes read one, and
  that many do."""
  c = toy_config(toy_corpus)
  c.max_heldout_bytes = 1
  first = corpus.split_files(corpus.stdlib_files(toy_corpus), c.heldout_percent).heldout[0]
  need = os.path.getsize(os.path.join(toy_corpus, first))
  with pytest.raises(api.ParameterError, match=rf"^config.max_heldout_bytes 1: no held-out file .* fits; at least "
                     rf"{need} needed \(the first, {first}, has {need} bytes; 0 = all\)$"):
    train.run(c, str(tmp_path / "out"), progress=False, log=lambda s: None)
  assert not (tmp_path / "out").exists()
  split = corpus.split_files(corpus.stdlib_files(toy_corpus), c.heldout_percent)
  assert list(corpus.read_texts(toy_corpus, split.heldout, need)) == [first]


@pytest.mark.parametrize("args, needles", [
    (["--config=configs/train_code_tiny.py", "--config.step=5"], ["did you mean", "steps"]),
    (["--config.step=5"], ["did you mean", "steps"]),
    (["--config.steps=0"], ["train: error: config.steps 0: must be at least 1"]),
])
def test_training_script_errors_are_one_line(tmp_path, args, needles):
  """`python -m experiments.train`: an unknown --config.FIELD (with the closest field; with or
  without --config) or a bad value is one line on stderr, exit status 2, no traceback, no --out."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  out = tmp_path / "out"
  p = subprocess.run([sys.executable, "-m", "experiments.train"] + args + [f"--out={out}"], capture_output=True,
                     text=True, cwd=REPO, env=env, timeout=120)
  assert p.returncode == 2 and len(p.stderr.splitlines()) == 1 and "Traceback" not in p.stderr, p.stderr
  assert p.stderr.startswith("train: error: ")
  for n in needles:
    assert n.lower() in p.stderr.lower(), p.stderr
  assert not out.exists()


# ---- the shipped code-tiny model ------------------------------------------------------------------

def _heldout_texts():
  """The held-out files of this machine's stdlib under code-tiny's split rule."""
  c = train.base_config()
  root = corpus.stdlib_root()
  split = corpus.split_files(corpus.stdlib_files(root), c.heldout_percent)
  return corpus.read_texts(root, split.heldout, c.max_heldout_bytes)


def test_code_tiny_tokenizer_round_trips_heldout_files_byte_for_byte():
  _, _, tok = tiny.load_model_source("code-tiny")
  texts = _heldout_texts()
  assert len(texts) >= 5
  for name, text in texts.items():
    assert tok.decode(tok.encode(text, allow_special=False)).encode("utf-8") == text.encode("utf-8"), name


def test_code_tiny_export_round_trip_logits(tmp_path):
  """The shipped weights as a training-form model, exported as f32 GGUF, loaded by kvjax: teacher-
  forced target and MTP logits within 1e-4 relative of the in-memory model on held-out code
  (150 tokens: more than one Gated DeltaNet chunk). This is also the check that the training
  forms (`Qwen38.causal` / `mtp_causal`) compute what the paged inference path computes."""
  cfg, tensors, tok = tiny.load_model_source("code-tiny")
  model = engine.build_model(cfg, tensors)
  with gguf_io.read_gguf(tiny.builtin_path("code-tiny")) as g:
    spec = g.tokenizer_spec
  path = train.export_gguf(str(tmp_path / "ct.gguf"), model, spec, "f32")
  loaded = api.load_model(path, k_type="f32", v_type="f32", page_tokens=32)
  text = next(iter(_heldout_texts().values()))
  toks = np.asarray(tok.encode(text)[:150])
  assert_training_form_matches(model, loaded, toks)


def test_code_tiny_beats_the_unigram_entropy_of_heldout_code():
  """Cross-entropy of the shipped model on held-out files below the entropy of those tokens' own
  unigram distribution (a stricter bar than a unigram fitted on the training split)."""
  m = api.load_model("code-tiny", page_tokens=64)
  ce, toks_all = [], []
  for text in list(_heldout_texts().values())[:3]:
    toks = np.asarray(m.tokenizer.encode(text)[:257])
    lg = api.teacher_forced_logits(m, toks[:-1])
    lp = jax.nn.log_softmax(jnp.asarray(lg), axis=-1)
    ce.append(-np.asarray(lp)[np.arange(len(toks) - 1), toks[1:]])
    toks_all.append(toks[1:])
  y = np.concatenate(toks_all)
  p = np.bincount(y) / len(y)
  unigram_entropy = float(-(p[p > 0] * np.log(p[p > 0])).sum())
  assert float(np.concatenate(ce).mean()) < unigram_entropy - 0.5

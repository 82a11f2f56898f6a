"""Training the hybrid target and its MTP head on the stdlib corpus (optax), and GGUF export.

    cfg = train.base_config()                  # or configs/train_code_tiny.py's get_config()
    summary = train.run(cfg, "runs/code-tiny")  # data, BPE, train, held-out eval, checkpoints, GGUF

The model is `kvjax.model.Qwen38` itself, run in its training form (`Qwen38.causal`: Gated
DeltaNet chunked, attention over the window's own rows, no cache; `Qwen38.mtp_causal` for the
head), so the trained parameters are the inference parameters and export is `engine.model_tensors`.

Loss per window of L + 1 tokens x_0..x_L: the target's cross-entropy of x_{t+1} at rows t < L,
plus `mtp_weight` x the MTP head's cross-entropy of x_{t+2} from (target post-norm hidden at t,
embedding of x_{t+1}), rows t < L - 1 (the published MTP recipes' joint objective).

Master weights and AdamW state are float32; `compute_dtype` bfloat16 casts the matrices (the
tensors a bf16 inference model stores in bf16) for the forward and backward. Batches are a pure
function of (seed, step) and the corpus file list, so a run, and a resumed run, are deterministic.
Checkpoints are plain `.npz` files of (params, optimizer state, step).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

from kvjax import config as config_lib, corpus, engine, gguf_io, tokenizer as tok_lib, weights
from kvjax.model import Qwen38

LOG_NAME, CKPT_NAME, TOKENIZER_NAME, PLOT_NAME = "log.jsonl", "checkpoint.npz", "tokenizer.json", "loss.png"
BEST_NAME = "best.npz"


def base_config() -> ml_collections.ConfigDict:
  """Every field of a training run (the presets in configs/train_*.py override some)."""
  c = ml_collections.ConfigDict()
  c.name = "code-tiny"
  c.seed = 0
  # corpus: the stdlib's .py files (root "" = this Python's stdlib), whole files held out
  c.corpus_root = ""
  c.heldout_percent = 2.0
  c.max_train_bytes = 6_000_000     # 0: every training file
  c.max_heldout_bytes = 400_000
  c.bpe_bytes = 2_000_000           # the first bytes of the training split the BPE learns from
  c.vocab_size = 1024
  # model (kvjax.config.ModelConfig fields); the MTP head uses the target's output head
  c.model = ml_collections.ConfigDict(dict(
      hidden_size=128, intermediate_size=256, num_layers=4, num_attention_heads=4, num_kv_heads=2,
      head_dim=32, rope_dim=16, rope_theta=10000.0, linear_num_key_heads=2, linear_num_value_heads=4,
      linear_head_dim=32, conv_kernel=4, full_attention_interval=4, context_length=2048))
  # optimisation
  c.seq_len = 128
  c.batch_size = 16
  c.steps = 500
  c.lr = 3e-3
  c.min_lr_ratio = 0.1
  c.warmup_steps = 50
  c.weight_decay = 0.1
  c.clip_norm = 1.0
  c.mtp_weight = 0.3
  c.compute_dtype = "auto"          # auto: bfloat16 on a GPU, float32 elsewhere
  # evaluation, checkpoints, export
  c.eval_every = 100
  c.eval_windows = 64
  c.ckpt_every = 250
  c.time_limit_s = 0.0              # > 0: stop (and still evaluate and export) after this long
  c.stop_step = 0                   # > 0: stop after this step (the schedule still spans `steps`)
  c.export_weight_type = "q8_0"
  c.export_best = True              # export the evaluated parameters with the lowest held-out loss
  return c


def model_config(c) -> config_lib.ModelConfig:
  return config_lib.ModelConfig(vocab_size=int(c.vocab_size), mtp_layers=1, **dict(c.model))


def compute_dtype(c):
  if c.compute_dtype == "auto":
    return jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
  return jnp.dtype(c.compute_dtype)


# ---------------------------------------------------------------------------
# config checks (before anything is read, allocated or written)
# ---------------------------------------------------------------------------

# the least value of each count and size (0: "not set" / "all" where base_config says so)
AT_LEAST = {"steps": 1, "seq_len": 2, "batch_size": 1, "eval_every": 1, "eval_windows": 1, "ckpt_every": 1,
            "warmup_steps": 0, "stop_step": 0, "max_train_bytes": 0, "max_heldout_bytes": 0, "bpe_bytes": 0,
            "vocab_size": 256 + len(corpus.SPECIALS)}
AT_LEAST_REAL = {"min_lr_ratio": 0.0, "weight_decay": 0.0, "mtp_weight": 0.0, "time_limit_s": 0.0}
ABOVE_REAL = {"lr": 0.0, "clip_norm": 0.0}
WHY = {"seq_len": " (the MTP head's target is 2 tokens ahead)",
       "vocab_size": f" (256 byte tokens + {len(corpus.SPECIALS)} special)"}
COMPUTE_DTYPES = ("auto", "float32", "bfloat16", "float16")


def _param_error(message: str, *params: str):
  from kvjax.api import ParameterError  # pylint: disable=import-outside-toplevel  (api imports this module)
  return ParameterError(message, *params)


def check_config(c, out: Optional[str] = None, resume: bool = False) -> None:
  """The checks of `run` that need no corpus, before anything is read, allocated or written: each
  count and size at least its least value (`AT_LEAST`; rates `AT_LEAST_REAL` / `ABOVE_REAL`),
  `heldout_percent` in (0, 100), the model geometry, `compute_dtype`, `export_weight_type` (a
  block type's rows whole blocks), `corpus_root` a folder, and with `resume` a checkpoint in `out`
  before `steps`. A bad field is a `kvjax.api.ParameterError`: one line naming `config.FIELD`, its
  value and what is needed (an unreadable checkpoint: a ValueError)."""
  from kvjax import checks  # pylint: disable=import-outside-toplevel
  checks.check_types(**{f"config.{k}": (c[k], "int") for k in AT_LEAST},
                     **{f"config.{k}": (c[k], "real") for k in (*AT_LEAST_REAL, *ABOVE_REAL, "heldout_percent")},
                     **{f"config.{k}": (c[k], "str") for k in ("name", "corpus_root", "compute_dtype",
                                                               "export_weight_type")})
  for k, least in AT_LEAST.items():
    if c[k] < least:
      raise _param_error(f"config.{k} {c[k]}: must be at least {least}{WHY.get(k, '')}", f"config.{k}")
  for k, least in AT_LEAST_REAL.items():
    if not least <= c[k] < math.inf:
      raise _param_error(f"config.{k} {c[k]:g}: must be at least {least:g} and finite", f"config.{k}")
  for k, bound in ABOVE_REAL.items():
    if not bound < c[k] < math.inf:
      raise _param_error(f"config.{k} {c[k]:g}: must be above {bound:g} and finite", f"config.{k}")
  if not 0 < c.heldout_percent < 100:
    raise _param_error(f"config.heldout_percent {c.heldout_percent:g}: must be above 0 and below 100",
                       "config.heldout_percent")
  if not c.name or os.sep in c.name or c.name in (".", ".."):
    raise _param_error(f"config.name {c.name!r}: must name a file ({c.name or 'NAME'}.gguf), not a path",
                       "config.name")
  if c.corpus_root and not os.path.isdir(c.corpus_root):
    raise _param_error(f"config.corpus_root {c.corpus_root!r}: no such folder ('' = this Python's stdlib)",
                       "config.corpus_root")
  if c.compute_dtype not in COMPUTE_DTYPES:
    raise _param_error(f"config.compute_dtype {c.compute_dtype!r}: expected one of {', '.join(COMPUTE_DTYPES)}",
                       "config.compute_dtype")
  try:
    mcfg = model_config(c)
  except (TypeError, ValueError) as e:
    raise _param_error(f"config.model: {e}", "config.model") from None
  _check_export_type(c.export_weight_type, mcfg)
  if out and os.path.exists(out) and not os.path.isdir(out):
    raise _param_error(f"out {out!r}: not a folder", "out")
  ckpt = os.path.join(out, CKPT_NAME) if out else ""
  if resume and os.path.isfile(ckpt):
    try:
      with np.load(ckpt) as z:
        done = int(z["step"])
    except Exception as e:  # pylint: disable=broad-except  (a damaged file: any error is reported in one line)
      raise ValueError(f"{ckpt}: cannot read its step: {type(e).__name__}: {e}") from None
    if done >= c.steps:
      raise _param_error(f"config.steps {c.steps}: {ckpt} is at step {done}; at least {done + 1} needed to "
                         f"resume (the schedule spans config.steps)", "config.steps")


def _check_export_type(weight_type: str, mcfg: config_lib.ModelConfig) -> None:
  """`weight_type` a `gguf_io.WEIGHT_TYPES` name whose blocks divide the rows of every matrix it stores."""
  import gguf  # pylint: disable=import-outside-toplevel
  if weight_type not in gguf_io.WEIGHT_TYPES:
    raise _param_error(f"config.export_weight_type {weight_type!r}: expected one of "
                       f"{', '.join(sorted(gguf_io.WEIGHT_TYPES))}", "config.export_weight_type")
  block = gguf.GGML_QUANT_SIZES[gguf_io.WEIGHT_TYPES[weight_type]][0]
  for name, shape in config_lib.gguf_tensor_shapes(mcfg, include_optional=False).items():
    if len(shape) >= 2 and not name.endswith("ssm_conv1d.weight") and shape[-1] % block:
      raise _param_error(f"config.export_weight_type {weight_type!r}: tensor {name}'s rows of {shape[-1]} "
                         f"values are not whole blocks of {block}; use f32, f16 or bf16, or model sizes "
                         f"that are multiples of {block}", "config.export_weight_type")


# ---------------------------------------------------------------------------
# model, loss, optimiser
# ---------------------------------------------------------------------------

def init_model(mcfg: config_lib.ModelConfig, seed: int) -> Qwen38:
  """Qwen38 (float32) with `weights.random_tensors` of `seed`; no MTP shared head (the MTP head
  uses the target's output norm and projection)."""
  return engine.build_model(mcfg, weights.random_tensors(mcfg, seed, include_optional=False).items())


def cast_for_compute(params, graphdef, dtype):
  """The float32 master params with the tensors a `dtype` inference model stores in `dtype`
  (matrices; norms, vectors and the conv stay float32) cast to it."""
  if dtype == jnp.float32:
    return params
  model = nnx.merge(graphdef, params)
  ref = nnx.state(nnx.eval_shape(lambda: Qwen38(model.cfg, dtype, mtp_shared_head_norm=False,
                                                mtp_shared_head_head=False)))
  return jax.tree_util.tree_map(lambda p, r: p.astype(r.dtype), params, ref)


def window_losses(model: Qwen38, window_s) -> Tuple[jax.Array, jax.Array]:
  """Mean target and MTP cross-entropy (nats) over one window of L + 1 tokens."""
  x = window_s[:-1]
  logits, hn = model.causal(x)
  target = optax.softmax_cross_entropy_with_integer_labels(logits, window_s[1:]).mean()
  mtp_logits = model.mtp_causal(hn[:-1], x[1:])
  mtp = optax.softmax_cross_entropy_with_integer_labels(mtp_logits, window_s[2:]).mean()
  return target, mtp


def window_losses_batch(params, graphdef, windows_bs, dtype):
  """Per-window (target, MTP) losses [B] each."""
  model = nnx.merge(graphdef, cast_for_compute(params, graphdef, dtype))
  return jax.vmap(lambda w: window_losses(model, w))(windows_bs)


def make_optimizer(c) -> optax.GradientTransformation:
  sched = optax.warmup_cosine_decay_schedule(0.0, c.lr, c.warmup_steps, max(c.steps, c.warmup_steps + 1),
                                             end_value=c.lr * c.min_lr_ratio)
  decay_mask = lambda p: jax.tree_util.tree_map(lambda a: a.ndim >= 2, p)  # no decay on norms, biases
  return optax.chain(optax.clip_by_global_norm(c.clip_norm),
                     optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=c.weight_decay, mask=decay_mask))


_STEPS: Dict[Any, Any] = {}


def make_steps(graphdef, c, dtype):
  """-> (optimizer, train_step(params, opt_state, windows) -> (params, opt_state, metrics),
         eval_step(params, windows) -> per-window (target, mtp) losses), both jitted; the same
  functions (and so compiled executables) for the same model structure and optimiser fields."""
  key = (graphdef, jnp.dtype(dtype).name, c.mtp_weight, c.lr, c.min_lr_ratio, c.warmup_steps, c.steps,
         c.weight_decay, c.clip_norm)
  if key not in _STEPS:
    if len(_STEPS) > 8:
      _STEPS.clear()
    opt = make_optimizer(c)
    _STEPS[key] = (opt,) + _build_steps(graphdef, opt, c.mtp_weight, dtype)
  return _STEPS[key]


def _build_steps(graphdef, opt, mtp_weight: float, dtype):

  def loss_fn(params, windows):
    t, m = window_losses_batch(params, graphdef, windows, dtype)
    t, m = t.mean(), m.mean()
    return t + mtp_weight * m, (t, m)

  @jax.jit
  def train_step(params, opt_state, windows):
    (loss, (t, m)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, windows)
    updates, opt_state = opt.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, {"loss": loss, "target_loss": t, "mtp_loss": m,
                               "grad_norm": jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree_util.tree_leaves(grads)))}

  @jax.jit
  def eval_step(params, windows):
    return window_losses_batch(params, graphdef, windows, dtype)

  return train_step, eval_step


def evaluate(eval_step, params, stream: np.ndarray, c) -> Dict[str, float]:
  """Mean held-out losses over `eval_windows` evenly spaced windows (the last batch padded with
  copies of its first window, which are not counted)."""
  starts = corpus.eval_windows(len(stream), c.seq_len + 1, c.eval_windows)
  tt, mm = [], []
  for i in range(0, len(starts), c.batch_size):
    s = starts[i:i + c.batch_size]
    n = len(s)
    s = np.concatenate([s, np.repeat(s[:1], c.batch_size - n)])
    t, m = eval_step(params, corpus.batch_windows(stream, s, c.seq_len + 1))
    tt.append(np.asarray(t)[:n])
    mm.append(np.asarray(m)[:n])
  return {"heldout_loss": float(np.concatenate(tt).mean()), "heldout_mtp_loss": float(np.concatenate(mm).mean())}


# ---------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------

@dataclasses.dataclass
class Data:
  tokenizer_spec: Dict[str, Any]
  train: np.ndarray             # int32 token stream (files separated by eos)
  heldout: np.ndarray
  train_files: List[str]
  heldout_files: List[str]
  heldout_texts: Dict[str, str]


def prepare_data(c, log: Callable[[str], None] = print) -> Data:
  """File list -> split -> texts -> BPE learned from the training split -> token streams."""
  root = c.corpus_root or corpus.stdlib_root()
  split = corpus.split_files(corpus.stdlib_files(root), c.heldout_percent)
  # a max_train_bytes subset spans the whole library: files in the order of their path's md5
  train_files = sorted(split.train, key=corpus.path_hash)
  train_texts = corpus.read_texts(root, train_files, c.max_train_bytes)
  held_texts = corpus.read_texts(root, split.heldout, c.max_heldout_bytes)
  for texts, files, key in ((train_texts, train_files, "max_train_bytes"), (held_texts, split.heldout,
                                                                            "max_heldout_bytes")):
    if not texts:
      raise _no_files_error(c, root, files, key)
  t0 = time.perf_counter()
  spec = corpus.learn_tokenizer(list(train_texts.values()), c.vocab_size, c.bpe_bytes)
  tok = tok_lib.from_spec(spec)
  train = corpus.token_stream(tok, list(train_texts.values()))
  held = corpus.token_stream(tok, list(held_texts.values()))
  log(f"corpus {root}: {len(train_texts)} training files ({sum(map(len, train_texts.values())):,} chars, "
      f"{len(train):,} tokens), {len(held_texts)} held-out ({len(held):,} tokens); BPE + tokenize "
      f"{time.perf_counter() - t0:.1f} s")
  if len(train) <= c.seq_len + 1 or len(held) <= c.seq_len + 1:
    raise _param_error(f"config.seq_len {c.seq_len}: the corpus has {len(train)} training / {len(held)} "
                       f"held-out tokens, at least seq_len + 2 = {c.seq_len + 2} of each are needed; at most "
                       f"{min(len(train), len(held)) - 2} fits", "config.seq_len")
  return Data(spec, train, held, list(train_texts), list(held_texts), held_texts)


def _no_files_error(c, root: str, files, key: str):
  """The error of a split with no file within `config.<key>` (`corpus.read_texts` stops at the first
  file that would pass it): the size of its first UTF-8 file is the least value that reads one."""
  kind = "training" if key == "max_train_bytes" else "held-out"
  for f in files:
    with open(os.path.join(root, f), "rb") as fh:
      raw = fh.read()
    try:
      raw.decode("utf-8")
    except UnicodeDecodeError:
      continue
    return _param_error(f"config.{key} {c[key]}: no {kind} file of corpus {root!r} fits; at least {len(raw)} "
                        f"needed (the first, {f}, has {len(raw)} bytes; 0 = all)", f"config.{key}")
  if key == "max_heldout_bytes" and any(corpus.stdlib_files(root)):
    return _param_error(f"config.heldout_percent {c.heldout_percent:g}: corpus {root!r} has no held-out UTF-8 "
                        f".py file; a larger percent is needed", "config.heldout_percent")
  return _param_error(f"config.corpus_root {root!r}: no {kind} UTF-8 .py file (at least 2 files are needed: "
                      f"one to train on, one held out)", "config.corpus_root")


def heldout_baselines(data: Data, c) -> Dict[str, float]:
  """Unigram / bigram losses on exactly the tokens `evaluate` scores."""
  starts = corpus.eval_windows(len(data.heldout), c.seq_len + 1, c.eval_windows)
  w = corpus.batch_windows(data.heldout, starts, c.seq_len + 1)
  return corpus.ngram_baselines(data.train, w[:, :-1].ravel(), w[:, 1:].ravel(), c.vocab_size)


# ---------------------------------------------------------------------------
# checkpoints and export
# ---------------------------------------------------------------------------

def save_checkpoint(path: str, params, opt_state, step: int, heldout_loss: float = math.nan) -> None:
  leaves = jax.tree_util.tree_leaves((params, opt_state))
  tmp = path + ".tmp.npz"
  np.savez(tmp, step=np.int64(step), heldout_loss=np.float64(heldout_loss),
           **{f"leaf_{i}": np.asarray(a) for i, a in enumerate(leaves)})
  os.replace(tmp, path)


def checkpoint_heldout_loss(path: str) -> float:
  """The held-out loss saved with a checkpoint (nan when none was)."""
  with np.load(path) as z:
    return float(z["heldout_loss"]) if "heldout_loss" in z.files else math.nan


def load_checkpoint(path: str, params, opt_state):
  """-> (params, opt_state, step) with the structure of the given ones (refused when it differs)."""
  leaves, treedef = jax.tree_util.tree_flatten((params, opt_state))
  with np.load(path) as z:
    n = sum(1 for k in z.files if k.startswith("leaf_"))
    if n != len(leaves):
      raise ValueError(f"{path}: checkpoint has {n} arrays, this config's model and optimizer need {len(leaves)}")
    new = []
    for i, ref in enumerate(leaves):
      a = z[f"leaf_{i}"]
      if a.shape != tuple(np.shape(ref)):
        raise ValueError(f"{path}: array {i} has shape {a.shape}, this config needs {tuple(np.shape(ref))}")
      new.append(jnp.asarray(a, dtype=jnp.asarray(ref).dtype))
    step = int(z["step"])
  params, opt_state = jax.tree_util.tree_unflatten(treedef, new)
  return params, opt_state, step


def export_gguf(path: str, model: Qwen38, tokenizer_spec, weight_type: str = "q8_0",
                name: str = "kvjax") -> str:
  """The model (its GGUF-named tensors) and tokenizer as a `qwen35` GGUF, nextn_predict_layers = 1."""
  return gguf_io.write_gguf(path, model.cfg, engine.model_tensors(model), tokenizer_spec,
                            weight_type=weight_type, name=name)


# ---------------------------------------------------------------------------
# a run
# ---------------------------------------------------------------------------

def _keep_best(best, rec, params, c, path):
  """-> the new (held-out loss, step, params) best; saved to `path` (for resume) when it improves."""
  if not c.export_best or rec["heldout_loss"] >= best[0]:
    return best
  save_checkpoint(path, params, (), rec["step"], rec["heldout_loss"])
  return rec["heldout_loss"], rec["step"], params


def count_params(params) -> int:
  return int(sum(np.prod(np.shape(a)) for a in jax.tree_util.tree_leaves(params)))


def run(c, out: str, *, resume: bool = False, progress: bool = True,
        log: Callable[[str], None] = print) -> Dict[str, Any]:
  """Train per config `c`, writing under `out`: `log.jsonl` (one line a step; held-out losses every
  `eval_every`), `checkpoint.npz` (resumed from with `resume`), `best.npz` (the parameters with
  the lowest held-out loss, exported when `export_best`), `tokenizer.json`, `files.json`
  (the training / held-out file lists), `<name>.gguf` (export_weight_type), `loss.png`,
  `summary.json`. -> the summary. A bad config field (`check_config`; a corpus without a file
  within the byte limits, `prepare_data`) is refused before `out` is created or touched."""
  from tqdm import tqdm
  check_config(c, out, resume)       # and nothing is written under `out` until a resumed checkpoint loads
  t_start = time.perf_counter()
  data = prepare_data(c, log)
  model = init_model(model_config(c), c.seed)
  graphdef, params = nnx.split(model)
  dtype = compute_dtype(c)
  opt, train_step, eval_step = make_steps(graphdef, c, dtype)
  opt_state = opt.init(params)
  step = 0
  ckpt, best_path = os.path.join(out, CKPT_NAME), os.path.join(out, BEST_NAME)
  log_path = os.path.join(out, LOG_NAME)
  best = (math.inf, 0, None)      # (held-out loss, step, params) of the best evaluation so far
  if resume and os.path.exists(ckpt):
    params, opt_state, step = load_checkpoint(ckpt, params, opt_state)
    log(f"resumed from {ckpt} at step {step}")
    if os.path.exists(best_path):
      bp, _, bstep = load_checkpoint(best_path, params, ())
      best = (checkpoint_heldout_loss(best_path), bstep, bp)
  else:
    for p in (log_path, best_path):
      if os.path.exists(p):
        os.remove(p)
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, TOKENIZER_NAME), "w") as f:
    json.dump(data.tokenizer_spec, f)
  with open(os.path.join(out, "files.json"), "w") as f:
    json.dump({"corpus_root": c.corpus_root or corpus.stdlib_root(), "train": data.train_files,
               "heldout": data.heldout_files}, f, indent=0)
  baselines = heldout_baselines(data, c)
  n_params = count_params(params)
  log(f"{n_params:,} parameters; compute {jnp.dtype(dtype).name}; baselines unigram "
      f"{baselines['unigram_loss']:.3f} bigram {baselines['bigram_loss']:.3f} nats/token")
  t_train, stopped_early = time.perf_counter(), False
  rec: Dict[str, Any] = {}
  with open(log_path, "a") as logf, tqdm(total=c.steps, initial=step, disable=not progress,
                                          desc=c.name) as bar:
    while step < c.steps:
      starts = corpus.window_starts(len(data.train), c.seq_len + 1, c.batch_size, step, c.seed)
      params, opt_state, m = train_step(params, opt_state,
                                        corpus.batch_windows(data.train, starts, c.seq_len + 1))
      step += 1
      rec = {"step": step, **{k: float(v) for k, v in m.items()},
             "elapsed_s": round(time.perf_counter() - t_train, 3)}
      over = ((c.time_limit_s > 0 and time.perf_counter() - t_start > c.time_limit_s)
              or 0 < c.stop_step <= step < c.steps)
      if step % c.eval_every == 0 or step == c.steps or over:
        rec.update(evaluate(eval_step, params, data.heldout, c))
        best = _keep_best(best, rec, params, c, best_path)
      logf.write(json.dumps(rec) + "\n")
      logf.flush()
      bar.update(1)
      bar.set_postfix(loss=f"{rec['target_loss']:.3f}", mtp=f"{rec['mtp_loss']:.3f}")
      if step % c.ckpt_every == 0:
        save_checkpoint(ckpt, params, opt_state, step)
      if over:
        stopped_early = True
        log(f"stopped at step {step} of {c.steps} (time_limit_s {c.time_limit_s:g}, stop_step {c.stop_step})")
        break
  save_checkpoint(ckpt, params, opt_state, step)
  if "heldout_loss" not in rec:
    rec.update(evaluate(eval_step, params, data.heldout, c))
    best = _keep_best(best, rec, params, c, best_path)
  final_loss, export_step = rec["heldout_loss"], step
  if c.export_best and best[2] is not None and best[0] < rec["heldout_loss"]:
    params, export_step = best[2], best[1]
    rec.update(evaluate(eval_step, params, data.heldout, c))
    log(f"exporting step {export_step} (held-out loss {rec['heldout_loss']:.3f}; the last step's "
        f"{final_loss:.3f})")
  model = nnx.merge(graphdef, params)
  gguf_path = export_gguf(os.path.join(out, f"{c.name}.gguf"), model, data.tokenizer_spec,
                          c.export_weight_type, name=f"kvjax-{c.name}")
  summary = {
      "name": c.name, "params": n_params, "steps": step, "stopped_early": stopped_early,
      "export_step": export_step, "final_heldout_loss": final_loss,
      "tokens_seen": step * c.batch_size * c.seq_len, "train_s": round(time.perf_counter() - t_train, 1),
      "total_s": round(time.perf_counter() - t_start, 1), "compute_dtype": jnp.dtype(dtype).name,
      "backend": jax.default_backend(), "train_tokens": int(len(data.train)),
      "heldout_tokens": int(len(data.heldout)), "train_loss": rec["target_loss"],
      "heldout_loss": rec["heldout_loss"], "heldout_ppl": math.exp(rec["heldout_loss"]),
      "heldout_mtp_loss": rec["heldout_mtp_loss"], **baselines,
      "unigram_ppl": math.exp(baselines["unigram_loss"]), "bigram_ppl": math.exp(baselines["bigram_loss"]),
      "gguf": gguf_path, "gguf_bytes": os.path.getsize(gguf_path),
  }
  with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1)
  summary["plot"] = plot_losses(log_path, os.path.join(out, PLOT_NAME), baselines, c.name)
  return summary


def read_log(path: str) -> List[Dict[str, Any]]:
  with open(path) as f:
    return [json.loads(l) for l in f if l.strip()]


def plot_losses(log_path: str, png: str, baselines: Dict[str, float], title: str) -> Optional[str]:
  """Train and held-out loss curves (target and MTP) against the baselines; None without matplotlib."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return None
  recs = read_log(log_path)
  ev = [r for r in recs if "heldout_loss" in r]
  fig, ax = plt.subplots(figsize=(7, 4.2))
  k = max(len(recs) // 100, 1)   # training losses: running means of k steps
  steps = [r["step"] for r in recs][k - 1:]
  smooth = lambda key: np.convolve([r[key] for r in recs], np.ones(k) / k, mode="valid")
  ax.plot(steps, smooth("target_loss"), lw=1, color="C0", alpha=0.6, label=f"train target ({k}-step mean)")
  ax.plot(steps, smooth("mtp_loss"), lw=1, color="C1", alpha=0.6, label=f"train MTP, t+2 ({k}-step mean)")
  ax.plot([r["step"] for r in ev], [r["heldout_loss"] for r in ev], "o-", color="C0", label="held-out target")
  ax.plot([r["step"] for r in ev], [r["heldout_mtp_loss"] for r in ev], "s-", color="C1",
          label="held-out MTP")
  ax.axhline(baselines["unigram_loss"], ls="--", color="gray", label="unigram (held-out)")
  ax.axhline(baselines["bigram_loss"], ls=":", color="gray", label="bigram (held-out)")
  ax.set_xlabel("step")
  ax.set_ylabel("cross-entropy (nats / token)")
  ax.set_title(title)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(png, dpi=110)
  plt.close(fig)
  return png

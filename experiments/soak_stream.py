"""Soak the streamed cache: thousands of decode steps on the tiny model through a small pool, the
adaptive policy, speculative rounds with planted rejections, and failed host-to-device copies
followed by retries; at the end the tokens must equal plain greedy decoding, and the host history
the plain cache of the same speculative rounds byte for byte.

  python -m experiments.soak_stream --steps=4000 --fault_every=23 --out=runs/soak

1. plain greedy decoding of `--steps` tokens (`kvjax.generate`, the plain cache): the reference;
2. speculative decoding (`kvjax.speculative.generate_speculative`) on an `AdaptiveStreamedKV`
   of `--pool_pages` pages, drafts from an oracle of the reference with every `--wrong_every`-th
   draft wrong (planted rejections: verify, rollback, truncate), every `--fault_every`-th
   host-to-device copy failing (`experiments.lib.faults`) and the failed forward retried.

The host history is compared with two plain caches: that of the same speculative rounds (the same
forward shapes; must be equal) and that of plain greedy decoding (reported: a verify forward of
1 + n rows need not round like n + 1 single-row forwards). Prints the checks and counts as a table
(last); exit status 1 when a required check fails; with `--out`, writes `soak.json`.
"""

from __future__ import annotations

import json
import os
import time

from absl import app, flags

def define_flags():
  """The command line's flags, defined when the module runs as a program (not at import: tests
  import several experiments into one process, and absl refuses a flag name defined twice)."""
  flags.DEFINE_integer("steps", 4000, "tokens to decode")
  flags.DEFINE_integer("prompt_tokens", 100, "seeded random prompt length")
  flags.DEFINE_integer("page_tokens", 64, "tokens per KV page")
  flags.DEFINE_integer("pool_pages", 0, "device pool of the streamed cache in pages (0: one cache layer's pages + 4, "
                       "so the ring holds a layer that streams every page; the tiny cache has 3 layers)")
  flags.DEFINE_integer("copy_pages", 4, "host copy unit (pages, a power of two)")
  flags.DEFINE_integer("n_max", 3, "drafts per speculative round")
  flags.DEFINE_integer("wrong_every", 5, "every N-th drafted position is wrong (planted rejection)")
  flags.DEFINE_integer("fault_every", 23, "a host-to-device copy fails after every N - 1 good ones (0: none)")
  flags.DEFINE_integer("seed", 0, "prompt and weight seed")
  flags.DEFINE_string("attn_impl", "auto", "span attention implementation (kvjax.api.load_model)")
  flags.DEFINE_string("out", None, "folder for soak.json")


FLAGS = flags.FLAGS


def planted_drafter(prompt, truth, wrong_every: int, vocab: int):
  """Drafts the reference continuation, with every `wrong_every`-th generated position wrong."""
  def drafter(history, m):
    at = len(history) - len(prompt)
    out = list(truth[at:at + m])
    return [(t + 1) % vocab if (at + i) % wrong_every == wrong_every - 1 else t for i, t in enumerate(out)]
  return drafter


def soak(steps: int, prompt_tokens: int = 100, page_tokens: int = 64, pool_pages: int = 0, copy_pages: int = 4,
         n_max: int = 3, wrong_every: int = 5, fault_every: int = 23, seed: int = 0,
         attn_impl: str = "auto") -> dict:
  """Run the soak -> its checks and counts (see the module docstring)."""
  import jax
  import numpy as np
  from experiments.lib.faults import RetryingRunner, copy_faults
  from kvjax import api, engine, generate as gen_lib, kv_build, speculative
  model = api.load_model(f"tiny:{seed}", page_tokens=page_tokens, attn_impl=attn_impl)
  cfg, runner, layout = model.cfg, model.runner, model.layout
  prompt = [int(t) for t in np.random.default_rng(seed).integers(0, cfg.vocab_size, prompt_tokens)]
  max_tokens = prompt_tokens + steps + n_max
  pool_pages = pool_pages or layout.pages_for(max_tokens) + 4
  t0 = time.perf_counter()
  plain_kv = engine.PlainKV(cfg, layout, max_tokens)
  plain = gen_lib.generate(runner, plain_kv, prompt, steps)
  t1 = time.perf_counter()
  drafter = planted_drafter(prompt, plain.tokens, wrong_every, cfg.vocab_size)
  draft = speculative.SpecConfig("ngram", n_max)
  # the same speculative rounds on the plain cache: the same forward shapes, so the same KV bytes
  spec_plain_kv = engine.PlainKV(cfg, layout, max_tokens)
  spec_plain = speculative.generate_speculative(runner, spec_plain_kv, prompt, steps, draft, drafter=drafter)
  t2 = time.perf_counter()
  # the adaptive cache make_kv plans for this pool (`plan_kv`; the ubatch of generate_speculative)
  kv = kv_build.build_from_plan(runner, kv_build.plan(runner, max_tokens, pool_pages=pool_pages, copy_pages=copy_pages,
                                                      policy="adaptive", ubatch=256, draft=draft))
  with copy_faults(every=fault_every) as faults:
    retrying = RetryingRunner(runner)
    res = speculative.generate_speculative(retrying, kv, prompt, steps, draft, drafter=drafter)
  t3 = time.perf_counter()
  n_tok = prompt_tokens + steps - 1          # rows every cache holds at the end
  hist = kv.histories["target"]

  def rows_equal(plain_cache):
    ok = True
    for a in range(cfg.num_attention_layers):
      k_host, v_host = hist.rows(a, n_tok)
      pages = plain_cache.layer_bytes(a, n_tok)
      k = pages[:, :layout.k_plane_bytes].reshape(-1, layout.k_row_bytes)[:n_tok]
      v = pages[:, layout.v_offset:layout.v_offset + layout.v_plane_bytes].reshape(-1, layout.v_row_bytes)[:n_tok]
      ok &= bool(np.array_equal(k_host, k) and np.array_equal(v_host, v))
    return ok

  m = res.metrics
  return {
      "steps": steps, "tokens_equal_plain_greedy": res.tokens == plain.tokens,
      "tokens_equal_spec_plain": res.tokens == spec_plain.tokens,
      "history_bytes_equal_spec_plain": rows_equal(spec_plain_kv),
      "history_bytes_equal_plain_greedy": rows_equal(plain_kv),
      "faults_injected": faults.injected, "retries": retrying.retries, "copies": faults.calls,
      "verify_rounds": m["verify_forwards"], "drafts": m["draft_generated"], "accepted": m["draft_accepted"],
      "pool_pages": pool_pages, "cache_pages": kv.n_layers * layout.pages_for(max_tokens),
      "forwards": kv.counters["forwards"], "policy_decisions": len(kv.decisions),
      "repartitions": sum(1 for d in kv.decisions if d.partition_changed),
      "ring_wraps": kv.counters["ring_wraps"], "streamed_pages": kv.counters["streamed_pages"],
      "staging_peak_bytes": kv.counters["staging_peak_bytes"], "staging_live_bytes_after": kv.stager.refill_bytes,
      "attn_impl": runner.opts.implementation, "device": str(jax.devices()[0]),
      "plain_s": t1 - t0, "spec_plain_s": t2 - t1, "soak_s": t3 - t2,
  }


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  for name in ("steps", "prompt_tokens", "page_tokens", "copy_pages", "n_max", "wrong_every"):
    if getattr(FLAGS, name) < 1:
      raise app.UsageError(f"--{name} must be >= 1, got {getattr(FLAGS, name)}")
  r = soak(FLAGS.steps, FLAGS.prompt_tokens, FLAGS.page_tokens, FLAGS.pool_pages, FLAGS.copy_pages, FLAGS.n_max,
           FLAGS.wrong_every, FLAGS.fault_every, FLAGS.seed, FLAGS.attn_impl)
  if FLAGS.out:
    os.makedirs(FLAGS.out, exist_ok=True)
    with open(os.path.join(FLAGS.out, "soak.json"), "w") as f:
      json.dump(r, f, indent=1)
  for k, v in r.items():
    if v is not None:
      print(f"{k:<24} {v if not isinstance(v, float) else f'{v:.1f}'}")
  if not (r["tokens_equal_plain_greedy"] and r["tokens_equal_spec_plain"] and r["history_bytes_equal_spec_plain"]):
    raise SystemExit(1)


if __name__ == "__main__":
  define_flags()
  app.run(main)

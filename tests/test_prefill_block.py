"""The prefill's block (`kvjax.generate.prefill(block=)`, `Runner.forward(chunk_rows=)`): micro-batches
run group-major in one forward, so that a streamed layer's history is uploaded once a block.

Tiny model, Q8_0 K / Q4_0 V pages of 16 tokens, CPU. Claims: the same bits as one forward a
micro-batch (plain and streamed, through copy waves, prompts ending mid-page and mid-copy-unit),
uploads that stay within twice the history's bytes where one forward a micro-batch re-streamed it
several times over, and the budget's choice of block and ring.
"""

import numpy as np
import pytest

from kvjax import api, engine, generate
from kvjax.streaming import StreamBudgetError, StreamedKV
from kvjax.streaming.budget import fixed_split, prefill_block_tokens
from kvjax_pallas.page_layout import PageLayout
from tiny_setup import build_tiny_runner


@pytest.fixture(scope="module")
def tiny16():
  return build_tiny_runner(0, page_tokens=16)


def _prefill_then_decode(runner, kv, prompt, block, ubatch=32, steps=3):
  """-> (every output: the prompt's logits [n, V], then each decode step's [V]; hidden rows [n, E])."""
  seq = generate.SequenceState(runner, kv)
  logits, hidden = generate.prefill(seq, prompt, ubatch=ubatch, all_logits=True, with_hidden=True, block=block)
  outs, tok = [np.asarray(logits)], int(np.argmax(logits[-1]))
  for _ in range(steps):
    outs.append(np.asarray(seq.forward([tok])))
    tok = int(np.argmax(outs[-1]))
  return outs, np.asarray(hidden.rows())


BLOCK_PROMPT, BLOCK_MAX_TOKENS = 700, 800


@pytest.fixture(scope="module")
def micro_batch_reference(tiny16):
  """The prompt and the outputs of one forward a micro-batch on the plain cache (every case's
  reference)."""
  cfg, runner, layout = tiny16
  prompt = list(np.random.default_rng(1).integers(0, cfg.vocab_size, BLOCK_PROMPT))
  return prompt, _prefill_then_decode(runner, engine.PlainKV(cfg, layout, BLOCK_MAX_TOKENS), prompt, None)


# 700 tokens: 43.75 pages (ends mid-page and, with 2-page copy units, mid-unit); blocks of 4 and 3
# micro-batches (the last block shorter); pools: all resident, a ring that holds a layer, copy waves,
# the minimum pool
@pytest.mark.parametrize("pool,block", [(None, 96), (60, 128), (20, 128), (4, 96)])
def test_block_prefill_has_the_bits_of_one_forward_a_micro_batch(tiny16, micro_batch_reference, pool, block):
  cfg, runner, layout = tiny16
  prompt, (want, want_hidden) = micro_batch_reference
  max_tokens = BLOCK_MAX_TOKENS
  kv = engine.PlainKV(cfg, layout, max_tokens) if pool is None else \
      StreamedKV(cfg, layout, max_tokens, fixed_split(pool, 3, max_tokens, layout, copy_pages=2))
  got, hidden = _prefill_then_decode(runner, kv, prompt, block)
  for i, (a, b) in enumerate(zip(want, got)):
    np.testing.assert_array_equal(b, a, err_msg=f"pool {pool} block {block}: output {i}")
  np.testing.assert_array_equal(hidden, want_hidden)
  if pool is not None:
    assert kv.counters["forwards"] == -(-700 // block) + 3
    if pool <= 20:
      assert kv.counters["waved_layers"] > 0      # the block's layers went through copy waves
    # the host history holds every row the block wrote
    k_host, _ = kv.histories["target"].rows(0, 703)
    assert k_host.shape[0] == 703 and np.any(k_host[690:700])



def test_micro_batch_past_one_attention_call(tiny16, micro_batch_reference):
  """A 512-row micro-batch (its projections one GEMM of 512 rows, its attention calls of 256 rows:
  `span_attention.api.ROWS_PER_CALL`): streamed through copy waves with the bits of the plain cache
  under the same micro-batch, and the outputs of 32-row micro-batches up to rounding."""
  cfg, runner, layout = tiny16
  prompt, (want, _) = micro_batch_reference
  plain, _ = _prefill_then_decode(runner, engine.PlainKV(cfg, layout, BLOCK_MAX_TOKENS), prompt, None, ubatch=512)
  kv = StreamedKV(cfg, layout, BLOCK_MAX_TOKENS, fixed_split(20, 3, BLOCK_MAX_TOKENS, layout, copy_pages=2))
  streamed, _ = _prefill_then_decode(runner, kv, prompt, None, ubatch=512)
  assert kv.counters["waved_layers"] > 0
  for i, (a, b, c) in enumerate(zip(want, plain, streamed)):
    np.testing.assert_array_equal(c, b, err_msg=f"output {i}")
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-4 * float(np.abs(a).max()), err_msg=f"output {i}")
  assert [int(np.argmax(x)) for x in plain[1:]] == [int(np.argmax(x)) for x in want[1:]]

@pytest.mark.parametrize("n", [2000, 4000])
def test_streamed_prefill_uploads_grow_linearly(n):
  """A 200-page pool of 16-token pages: the prefill (the cache's own block) uploads at most twice
  the history's bytes; one forward a micro-batch re-streamed it 4-8x (and a 4,000-token prompt
  stopped with "ring too small" before the ring held a copy wave's partition)."""
  model = api.load_model("tiny", page_tokens=16)
  prompt = list(np.random.default_rng(n).integers(0, model.cfg.vocab_size, n))
  history = n * model.runner.layout.token_bytes * model.cfg.num_attention_layers
  uploads = {}
  for block in ("budget", "micro-batch")[:2 if n == 2000 else 1]:
    kv = api.make_kv(model, n + 8, pool_pages=200)
    assert kv.info["prefill_block"] >= 1024
    if block == "micro-batch":
      kv.provider.prefill_block = None
    res = api.generate(model, kv, prompt_tokens=prompt, n_predict=1, ignore_eos=True)
    uploads[block] = res.metrics["h2d_bytes"] / history
  assert uploads["budget"] <= 2.0, uploads
  assert uploads.get("micro-batch", 9.0) > 2 * uploads["budget"], uploads


def test_block_budget_and_the_ring_of_copy_waves():
  # the block: the pool's bytes of hidden rows, whole micro-batches, capped, at least one
  assert prefill_block_tokens(256, 256, 680_000, 4008) == 2560
  assert prefill_block_tokens(256, 10240, 2**31, 262144) == 16384
  assert prefill_block_tokens(256, 10240, 1000, 262144) == 256
  assert prefill_block_tokens(256, 256, 2**30, 300) == 512
  layout = PageLayout(2, 64, "q8_0", "q4_0", page_tokens=16)
  # layers that stream in copy waves get a ring of at least one attention partition
  split = fixed_split(200, 3, 4008, layout, copy_pages=8, wave_pages=23)
  assert split.ring_slots >= 23 and split.resident_pages_per_layer[0] >= 1
  with pytest.raises(StreamBudgetError, match=r"23-page attention partitions.*19 more pages"):
    fixed_split(7, 3, 4008, layout, copy_pages=8, wave_pages=23)

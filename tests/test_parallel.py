"""kvjax.parallel: tensor-parallel decode over forced host devices, against the single-device model.

The device count of the CPU backend is fixed when jax starts (`XLA_FLAGS=
--xla_force_host_platform_device_count=N`), so the comparisons run this file as a program in a
fresh process with 4 host devices (`_run`): sharded over the first 2 and over all 4, against one
single-device reference; it prints one JSON line, the test judges it. The model: the tiny geometry
with 4 KV heads (so 2 and 4 devices divide them), one group (1 Gated DeltaNet + 1 attention: fewer
blocks to compile) and the MTP head.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = [3, 17, 101, 44, 250, 9, 77, 123, 5, 60, 61, 200, 31, 8, 99, 140, 12, 13, 300, 2, 41, 42]
DECODE = 8
PAGE_TOKENS = 8
POOL_PAGES = 3      # 2 cache layers (attention + MTP) + 1: the attention layer streams in copy waves
# Logits of the sharded model differ from one device's by the order of the partial sums (an
# all-reduce of per-device output projections instead of one matmul), and where such a last-bit
# difference in a K or V row meets a rounding boundary of the cache's codecs (Q8_0 K, Q4_0 V), one
# code moves by one step and the logits of that position and later ones move by more. Measured on
# this model (float32, |logits| <= 3.9): 2026-12-03, at most 1.1e-6 (target, 2 and 4 devices) and
# 1.3e-6 (MTP head); 2026-12-07 on a Sapphire Rapids CPU (jax 0.10.2, the suite's XLA flags), 4
# devices 1.0e-6 (MTP 2.0e-6), 2 devices 7.1e-5 from position 10 on (positions 0-9: <= 9.5e-7, no
# code moved yet) and MTP 2.0e-4 to 5.4e-4 as XLA's flags vary. Rows wired to the wrong place move
# logits by more than 1 (measured the same day, 2 devices, one shard's rows of attn_v, ssm_beta or
# ffn_down reversed: 2.1, 1.2, 4.0); the tolerance sits between, about four times the code flips'
# largest.
LOGIT_TOL = 2e-3
UBATCH = 1          # prefill row by row: one compiled shape a runner (decode's)


def _cfg():
  from kvjax import config
  return config.tiny(num_layers=2, full_attention_interval=2, num_attention_heads=8, num_kv_heads=4,
                     linear_num_key_heads=4, linear_num_value_heads=8)


def _greedy(runner, kv, prompt, n):
  """Prefill + greedy decode through the generation loop's pieces -> (tokens, logits of each step)."""
  from kvjax import generate as gen_lib
  seq = gen_lib.SequenceState(runner, kv)
  logits = gen_lib.prefill(seq, prompt, ubatch=UBATCH)
  toks, rows = [], []
  for _ in range(n):
    rows.append(np.asarray(logits, np.float32))
    toks.append(int(np.argmax(rows[-1])))
    logits = seq.forward([toks[-1]])
  return toks, np.stack(rows)


def worker(ns) -> dict:
  """The comparisons at each tensor parallel n of `ns` (run in a process with >= max(ns) host
  devices; n shards over the first n) against one single-device reference -> {n: results}."""
  import jax
  # one program at a time: with dispatch asynchronous, two programs' per-device parts can share the
  # CPU client's thread pool so that neither all-reduce gathers all its participants (seen once on a
  # loaded 2-core machine: 3 of 4 arrived, the process aborted after XLA's 40 s)
  jax.config.update("jax_cpu_enable_async_dispatch", False)
  from kvjax import api, engine, weights
  from kvjax.model import AttentionOptions
  from kvjax_pallas.page_layout import PageLayout
  cfg = _cfg()
  model = engine.build_model(cfg, weights.random_tensors(cfg, 1).items())
  layout = PageLayout(cfg.num_kv_heads, cfg.head_dim, "q8_0", "q4_0", page_tokens=PAGE_TOKENS)
  one = api.LoadedModel(engine.Runner(model, layout, AttentionOptions()), None, cfg, 0.0, "tiny-4kv")
  cap = len(PROMPT) + DECODE
  # the single-device reference runs the plain cache: a streamed cache gives its logits bit for bit
  # (tests/test_streaming.py), so one reference serves both sharded caches
  ref_toks, ref_logits = _greedy(one.runner, api.make_kv(one, cap).provider, PROMPT, DECODE)
  mtp_one = api.teacher_forced_logits(one, PROMPT, mtp=True, ubatch=UBATCH)
  return {n: _sharded(n, model, layout, cfg, ref_toks, ref_logits, mtp_one, len(jax.devices()))
          for n in ns}


def _sharded(n, model, layout, cfg, ref_toks, ref_logits, mtp_one, host_devices) -> dict:
  """The comparisons at tensor parallel n against the single-device reference."""
  from kvjax import api, parallel
  from kvjax.model import AttentionOptions
  tp = api.LoadedModel(parallel.ShardedRunner(model, layout, AttentionOptions(), n), None, cfg,
                       0.0, "tiny-4kv")
  out = {"host_devices": host_devices, "mesh_devices": int(tp.runner.mesh.devices.size),
         "local_kv_heads": tp.layout.num_kv_heads}
  cap = len(PROMPT) + DECODE
  out["tokens_one"] = ref_toks
  out["logit_max"] = float(np.abs(ref_logits).max())
  tp_logits = {}
  for kind, budget in (("plain", {}), ("streamed", {"pool_pages": POOL_PAGES, "copy_pages": 1})):
    kv = api.make_kv(tp, cap, **budget)
    toks, tp_logits[kind] = _greedy(tp.runner, kv.provider, PROMPT, DECODE)
    m = kv.metrics()
    out[kind] = {"tokens_tp": toks, "logit_diff": float(np.abs(ref_logits - tp_logits[kind]).max()),
                 "h2d_per_device": [int(b) for b in m.get("per_device_h2d_bytes", [])],
                 "waved_layers": int(m.get("waved_layers", 0))}
  out["streamed_equals_plain_tp"] = bool(np.array_equal(tp_logits["plain"], tp_logits["streamed"]))
  # the API end to end (generate on a streamed cache) and the MTP head (teacher-forced)
  gen = api.generate(tp, api.make_kv(tp, cap, pool_pages=POOL_PAGES, copy_pages=1), prompt_tokens=PROMPT,
                     n_predict=DECODE, ignore_eos=True, ubatch=UBATCH)
  out["api_tokens_tp"] = gen.tokens
  out["api_tensor_parallel"] = gen.metrics.get("tensor_parallel")
  refusals = []
  for call in (lambda: api.make_kv(tp, cap, pool_pages=POOL_PAGES, policy="adaptive"),
               lambda: api.generate(tp, prompt_tokens=PROMPT, n_predict=2, spec=api.SpecConfig("ngram"))):
    try:
      call()
      refusals.append(None)
    except api.ParameterError as e:
      refusals.append(str(e))
  out["refusals"] = refusals
  mtp_tp = api.teacher_forced_logits(tp, PROMPT, mtp=True, ubatch=UBATCH)
  out["mtp_logit_diff"] = float(np.abs(mtp_one - mtp_tp).max())
  out["mtp_logit_max"] = float(np.abs(mtp_one).max())
  return out


def _run(devices: int, ns) -> dict:
  flags = (f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices} "
           "--xla_cpu_collective_call_terminate_timeout_seconds=300")   # the suite's flags, then these
  env = dict(os.environ, XLA_FLAGS=flags.strip(), JAX_PLATFORMS="cpu",
             PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  proc = subprocess.run([sys.executable, os.path.abspath(__file__), *map(str, ns)], env=env, cwd=ROOT,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return {int(n): out for n, out in json.loads(proc.stdout.strip().splitlines()[-1]).items()}


def test_sharded_greedy_equals_one_device():
  """Sharded over 2 and over 4 devices (one process, 4 host devices): the single-device tokens and
  logits within the all-reduce's rounding, plain and streamed (copy waves on every device), through
  the API too, and the MTP head's; what is not built for several devices is refused."""
  outs = _run(4, (2, 4))
  assert sorted(outs) == [2, 4]
  for n, out in outs.items():
    _check_sharded(n, out)


def _check_sharded(n, out):
  assert out["host_devices"] == 4 and out["mesh_devices"] == n and out["local_kv_heads"] == 4 // n
  for kind in ("plain", "streamed"):
    r = out[kind]
    assert r["tokens_tp"] == out["tokens_one"], (kind, r, out["tokens_one"])
    assert r["logit_diff"] <= LOGIT_TOL, (kind, r["logit_diff"])
  assert out["logit_max"] > 1.0   # the comparison is of real logits, not zeros
  s = out["streamed"]
  assert len(s["h2d_per_device"]) == n and min(s["h2d_per_device"]) > 0, s   # every device streamed
  assert s["waved_layers"] > 0, s    # the copy-wave path ran sharded too
  assert out["streamed_equals_plain_tp"]   # sharded, streamed logits are the sharded plain bits
  assert out["api_tokens_tp"] == out["tokens_one"]
  assert out["api_tensor_parallel"] == n
  assert out["mtp_logit_diff"] <= LOGIT_TOL and out["mtp_logit_max"] > 1.0, out
  adaptive, spec = out["refusals"]   # not built for several devices: refused in one line
  assert adaptive.startswith(f"tensor_parallel {n} runs the fixed split without phases"), adaptive
  assert spec == f"spec and tensor_parallel {n} cannot be combined yet", spec


def test_refuses_n_not_dividing_kv_heads():
  from kvjax import api, config, parallel
  cfg = config.tiny()        # 2 KV heads
  with pytest.raises(ValueError, match=r"^tensor_parallel 4 must divide the model's 2 KV heads"):
    parallel.check_tensor_parallel(cfg, 4, devices=4)
  with pytest.raises(api.ParameterError, match=r"tensor_parallel 3 must divide the model's 2 KV heads") as e:
    api.load_model("tiny", tensor_parallel=3)
  assert e.value.params == ("tensor_parallel",)
  with pytest.raises(ValueError, match=r"tensor_parallel 2 needs 2 devices, 1 available"):
    parallel.check_tensor_parallel(cfg, 2, devices=1)
  parallel.check_tensor_parallel(cfg, 2, devices=2)     # 2 divides 2 KV heads, 2 key heads, FFN 128


def test_shard_indices_cover_every_head_once():
  """The per-device index sets partition each sharded axis, and Gated DeltaNet value heads stay
  with the key heads they read (GGUF's tiled order: value head j reads key head j % Hk)."""
  from kvjax import config, parallel
  cfg = config.qwen38_27b()
  for n in (2, 4):
    shards = [parallel.shard_indices(cfg, n, d) for d in range(n)]
    for attr, (axis, _) in shards[0].items():
      allidx = np.concatenate([s[attr][1] for s in shards])
      assert np.array_equal(np.sort(allidx), np.arange(len(allidx))), attr
    kl = cfg.linear_num_key_heads // n
    for d, s in enumerate(shards):
      v_heads = s["ssm_beta"][1]
      local_key = np.arange(len(v_heads)) % kl          # the shard's own tiled rule
      assert np.array_equal(v_heads % cfg.linear_num_key_heads, d * kl + local_key)


if __name__ == "__main__":
  print(json.dumps(worker([int(a) for a in sys.argv[1:]])))


def test_every_runner_step_declares_its_roles():
  """The engine declares how each step's arguments divide over devices (`engine.STEP_ROLES`), one
  role per positional array argument, for exactly the steps `Runner` calls (the sharded runner
  builds its shard_maps from that table)."""
  import inspect
  from kvjax import engine, parallel
  steps = {name for name, v in vars(engine.Runner).items()
           if isinstance(v, staticmethod) and name.endswith(("_step", "_begin", "_end")) and name != "mtp_draft_steps"}
  assert steps == set(engine.STEP_ROLES), steps ^ set(engine.STEP_ROLES)
  for name, roles in engine.STEP_ROLES.items():
    assert getattr(engine.Runner, name) is roles.step, name
    params = [p for p in inspect.signature(roles.step.__wrapped__).parameters.values()
              if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert len(params) == roles.graphdef + len(roles.inputs), (name, [p.name for p in params], roles.inputs)
    assert set(roles.inputs + roles.outputs) <= {engine.PARAMS, engine.SAME, engine.HEADS}
    assert roles.inputs.count(engine.PARAMS) == roles.graphdef     # the parameters come with the structure
    donated = {params[i].name for i in roles.donate}   # positions count the graphdef
    if name == "donating_group_step":                   # a forward's hidden rows and states too
      assert donated == {"pool_pn", "x_se", "rec_states"}, donated
    else:
      assert all(n.startswith("pool") for n in donated), (name, donated)
  assert set(parallel._STEPS) == set(engine.STEP_ROLES)

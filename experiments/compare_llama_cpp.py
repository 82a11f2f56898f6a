"""kvjax's logits against llama.cpp's on the same GGUF and the same tokens (top-1 agreement).

  python -m experiments.compare_llama_cpp --llama_cpp=/path/to/llama.cpp --llama_build=/path/to/build

For each model file (the packaged `code-tiny`, its matrices re-quantized to Q4_0, and random files
of a wider geometry whose matrices are Q4_K / Q5_K / Q6_K: every row a multiple of 256 values),
the same token ids go through llama.cpp (`experiments/llama_cpp/logits.c`, compiled here against
the given llama.cpp tree and its build's `libllama`, one decode with every row's logits) and
through `kvjax.api.teacher_forced_logits` with the weights kept quantized (`--weights_impl`).
Reported per file: the share of positions whose argmax agrees, how many of the disagreeing
positions were near ties in llama.cpp's own logits (top-2 gap < `--tie`), the largest logit
difference over the largest logit, and the same against kvjax with the weights dequantized at
load; for the random files also llama.cpp against itself with the same matrices dequantized to
f32 (its quantized products quantize the activations too: how far that alone moves its top-1). The tokens: text (Python source from the standard library) through code-tiny's tokenizer,
which the random files carry too.

llama.cpp is not installed by kvjax: build it yourself (CPU is enough, e.g. `cmake -B build
-DLLAMA_CURL=OFF && cmake --build build --target llama`). Results go to `--out`/results.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from absl import app, flags

FLAGS = flags.FLAGS
HERE = os.path.dirname(os.path.abspath(__file__))


def define_flags():
  """The flags, defined when the module runs as a program."""
  flags.DEFINE_string("llama_cpp", None, "llama.cpp source tree (include/llama.h, ggml/include)")
  flags.DEFINE_string("llama_build", None, "its cmake build folder (bin/libllama.so or src/libllama.so)")
  flags.DEFINE_list("cases", ["code-tiny", "code-tiny:q4_0", "wide:q4_k", "wide:q5_k", "wide:q6_k"],
                    "model files: code-tiny (its Q8_0 file), code-tiny:q4_0 (re-quantized), wide:FMT "
                    "(random weights, matrices in FMT), wide:FMT:f32 (the same matrices dequantized)")
  flags.DEFINE_integer("n_tokens", 512, "tokens a case")
  flags.DEFINE_string("weights_impl", "xla", "kvjax's quantized product: xla, fused, pallas, pallas_gemv")
  flags.DEFINE_float("tie", 0.05, "a top-2 gap below this (logits) is a near tie")
  flags.DEFINE_integer("threads", 2, "llama.cpp threads")
  flags.DEFINE_enum("kv", "q8_0/q4_0", ["q8_0/q4_0", "f16"], "the KV cache of both sides: kvjax's default "
                    "(Q8_0 K, Q4_0 V; llama.cpp with flash attention) or F16 (llama.cpp's default; kvjax "
                    "then holds K and V in f16)")
  flags.DEFINE_string("out", "runs/compare_llama_cpp", "output folder")


WIDE = dict(hidden_size=256, intermediate_size=512, num_layers=4, num_attention_heads=4, num_kv_heads=2,
            head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8, linear_head_dim=32)


def build_helper(out_dir: str) -> str:
  """Compile logits.c against the llama.cpp tree -> the program's path."""
  lib_dirs = [d for d in (os.path.join(FLAGS.llama_build, "bin"), os.path.join(FLAGS.llama_build, "src"))
              if os.path.isdir(d)]
  exe = os.path.join(out_dir, "llama_cpp_logits")
  cmd = ["cc", "-O2", os.path.join(HERE, "llama_cpp", "logits.c"), "-I", os.path.join(FLAGS.llama_cpp, "include"),
         "-I", os.path.join(FLAGS.llama_cpp, "ggml", "include")]
  for d in lib_dirs:
    cmd += ["-L", d, f"-Wl,-rpath,{d}"]
  subprocess.run(cmd + ["-lllama", "-o", exe], check=True)
  return exe


def model_file(case: str, out_dir: str) -> str:
  """The GGUF of `case`, written to out_dir where it is not the packaged file."""
  import numpy as np
  from kvjax import config as config_lib, gguf_io, qweights, tiny
  from kvjax import weights as weights_lib
  if case == "code-tiny":
    return tiny.builtin_path("code-tiny")
  path = os.path.join(out_dir, case.replace(":", "-") + ".gguf")
  if case.startswith("code-tiny:"):
    g = gguf_io.read_gguf(tiny.builtin_path("code-tiny"))
    tensors = dict(g.iter_tensors(np.float32))
    return gguf_io.write_gguf(path, g.config, tensors, g.tokenizer_spec or None, weight_type=case.split(":")[1])
  fmt, *as_f32 = case.split(":")[1:]
  code = gguf_io.read_gguf(tiny.builtin_path("code-tiny"))   # its tokenizer: llama.cpp needs one
  cfg = config_lib.tiny(**WIDE, vocab_size=code.config.vocab_size)
  tensors = weights_lib.random_tensors(cfg, 0)
  for i, name in enumerate(sorted(tensors)):
    if qweights.keeps_quantized(name):
      n, k = tensors[name].shape
      tensors[name] = qweights.random_quantized(fmt, n, k, seed=i)
      if as_f32:     # "wide:FMT:f32": the same matrices dequantized (llama.cpp then runs f32 products)
        tensors[name] = np.asarray(tensors[name].dequantize(), np.float32)
  return gguf_io.write_gguf(path, cfg, tensors, code.tokenizer_spec, weight_type="f32")


def tokens_for(model, n: int):
  import inspect
  from kvjax import api
  text = inspect.getsource(json.decoder) + inspect.getsource(json.encoder)
  ids = api.encode(model, text)
  if len(ids) < n:
    raise app.UsageError(f"--n_tokens {n}: the text gives only {len(ids)} tokens")
  return ids[:n]


def compare(ours, theirs, tie: float):
  import numpy as np
  top = np.sort(theirs, axis=-1)
  gap = top[:, -1] - top[:, -2]
  agree = ours.argmax(-1) == theirs.argmax(-1)
  return {"top1_agree": float(agree.mean()), "disagree": int((~agree).sum()),
          "disagree_near_ties": int((~agree & (gap < tie)).sum()),
          "max_rel_diff": float(np.abs(ours - theirs).max() / np.abs(theirs).max())}


def run_case(case: str, exe: str, out_dir: str):
  import numpy as np
  from kvjax import api
  path = model_file(case, out_dir)
  kv = dict(k_type="f16", v_type="f16") if FLAGS.kv == "f16" else dict(k_type="q8_0", v_type="q4_0")
  quant = api.load_model(path, weights="quantized", weights_impl=FLAGS.weights_impl, **kv)
  plain = api.load_model(path, weights="dequantized", **kv)
  tokens = tokens_for(quant, FLAGS.n_tokens)
  tok_file, logit_file = os.path.join(out_dir, "tokens.i32"), os.path.join(out_dir, "logits.f32")
  np.asarray(tokens, "<i4").tofile(tok_file)
  subprocess.run([exe, path, tok_file, logit_file, str(FLAGS.threads), FLAGS.kv], check=True, capture_output=True)
  theirs = np.fromfile(logit_file, np.float32).reshape(len(tokens), -1)
  row = {"case": case, "file": os.path.basename(path), "tokens": len(tokens), "weights_impl": FLAGS.weights_impl,
         "kv": FLAGS.kv}
  row["quantized"] = compare(api.teacher_forced_logits(quant, tokens), theirs, FLAGS.tie)
  row["dequantized"] = compare(api.teacher_forced_logits(plain, tokens), theirs, FLAGS.tie)
  if case.startswith("wide:") and not case.endswith(":f32"):   # llama.cpp against itself on f32 matrices
    f32_path = model_file(case + ":f32", out_dir)
    subprocess.run([exe, f32_path, tok_file, logit_file, str(FLAGS.threads), FLAGS.kv], check=True,
                   capture_output=True)
    row["llama_cpp_vs_its_f32"] = compare(theirs, np.fromfile(logit_file, np.float32).reshape(len(tokens), -1),
                                          FLAGS.tie)
  return row


def main(argv):
  del argv
  if not FLAGS.llama_cpp or not FLAGS.llama_build:
    raise app.UsageError("--llama_cpp and --llama_build are needed (a llama.cpp tree and its build)")
  os.makedirs(FLAGS.out, exist_ok=True)
  exe = build_helper(FLAGS.out)
  rows = [run_case(c, exe, FLAGS.out) for c in FLAGS.cases]
  with open(os.path.join(FLAGS.out, "results.json"), "w") as f:
    json.dump(rows, f, indent=1)
  print(f"{'case':>16} {'tokens':>6} {'top-1 agree':>11} {'disagree (near ties)':>21} {'max rel diff':>12} "
        f"{'dequantized: agree':>18} {'llama.cpp vs its f32':>20}")
  for r in rows:
    q, d = r["quantized"], r["dequantized"]
    own = r.get("llama_cpp_vs_its_f32")
    print(f"{r['case']:>16} {r['tokens']:>6} {q['top1_agree']:>11.4f} {q['disagree']:>10} ({q['disagree_near_ties']:>3})"
          f"{'':>6} {q['max_rel_diff']:>12.2e} {d['top1_agree']:>18.4f} "
          f"{'' if own is None else format(own['top1_agree'], '.4f'):>20}")
  print(f"wrote {os.path.join(FLAGS.out, 'results.json')}", file=sys.stderr)


if __name__ == "__main__":
  define_flags()
  app.run(main)

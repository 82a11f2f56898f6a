/* Teacher-forced logits of a token sequence from llama.cpp, for comparing kvjax with it
 * (experiments/compare_llama_cpp.py builds and runs this).
 *
 *   logits MODEL.gguf TOKENS.i32 OUT.f32 [THREADS [KV]]
 *
 * KV: "q8_0/q4_0" (kvjax's default cache: Q8_0 K, Q4_0 V, with flash attention, which a quantized V
 * needs) or "f16" (llama.cpp's default); default q8_0/q4_0.
 * TOKENS.i32: little-endian int32 token ids. OUT.f32: float32 logits [n_tokens, n_vocab], row t
 * the prediction after tokens 0..t, all rows from one decode of one sequence. Build against a
 * llama.cpp build (libllama, include/llama.h and ggml/include):
 *   cc -O2 logits.c -I$LLAMA/include -I$LLAMA/ggml/include -L$BUILD/bin -lllama -o logits
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "llama.h"

static void die(const char *what) { fprintf(stderr, "logits: %s\n", what); exit(1); }

int main(int argc, char **argv) {
  if (argc < 4) die("usage: logits MODEL.gguf TOKENS.i32 OUT.f32 [THREADS]");
  FILE *f = fopen(argv[2], "rb");
  if (!f) die("cannot open the token file");
  fseek(f, 0, SEEK_END);
  long bytes = ftell(f);
  fseek(f, 0, SEEK_SET);
  int n = (int)(bytes / 4);
  if (n < 1 || bytes % 4) die("the token file must hold whole int32 ids, at least one");
  llama_token *tokens = malloc(sizeof(llama_token) * n);
  if (fread(tokens, 4, n, f) != (size_t)n) die("short read of the token file");
  fclose(f);

  llama_backend_init();
  struct llama_model_params mp = llama_model_default_params();
  mp.n_gpu_layers = 0;
  struct llama_model *model = llama_model_load_from_file(argv[1], mp);
  if (!model) die("llama.cpp could not load the model");
  struct llama_context_params cp = llama_context_default_params();
  cp.n_ctx = n + 16;
  cp.n_batch = n;
  cp.n_ubatch = n;
  cp.n_threads = cp.n_threads_batch = argc > 4 ? atoi(argv[4]) : 2;
  const char *kv = argc > 5 ? argv[5] : "q8_0/q4_0";
  if (strcmp(kv, "q8_0/q4_0") == 0) {
    cp.type_k = GGML_TYPE_Q8_0;
    cp.type_v = GGML_TYPE_Q4_0;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_ENABLED;
  } else if (strcmp(kv, "f16") != 0) {
    die("KV must be q8_0/q4_0 or f16");
  }
  struct llama_context *ctx = llama_init_from_model(model, cp);
  if (!ctx) die("llama.cpp could not make a context");
  int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));

  struct llama_batch batch = llama_batch_init(n, 0, 1);
  for (int i = 0; i < n; i++) {
    batch.token[i] = tokens[i];
    batch.pos[i] = i;
    batch.n_seq_id[i] = 1;
    batch.seq_id[i][0] = 0;
    batch.logits[i] = 1;
  }
  batch.n_tokens = n;
  if (llama_decode(ctx, batch) != 0) die("llama_decode failed");

  FILE *out = fopen(argv[3], "wb");
  if (!out) die("cannot open the output file");
  for (int i = 0; i < n; i++) {
    const float *row = llama_get_logits_ith(ctx, i);
    if (!row || fwrite(row, sizeof(float), n_vocab, out) != (size_t)n_vocab) die("cannot write logits");
  }
  fclose(out);
  fprintf(stderr, "logits: %d tokens x %d vocab\n", n, n_vocab);
  llama_batch_free(batch);
  llama_free(ctx);
  llama_model_free(model);
  free(tokens);
  return 0;
}

"""Model geometry: one frozen dataclass, presets, and the GGUF tensor inventory.

Everything that depends on the shape of a Qwen3.8-style hybrid model (layer
pattern, head counts, GGUF tensor names and shapes) is derived here from one
`ModelConfig`, so that the model, the GGUF reader/writer, the float64 test
reference and the memory accounting cannot disagree.

Shapes follow numpy / GGUF-reader conventions: a matrix `W` is `[out, in]`
and is applied as `y = x @ W.T`.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from typing import Dict, Tuple

ARCH = "qwen35"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Geometry of a Qwen3.5-family hybrid target (+ optional MTP head)."""

  vocab_size: int
  hidden_size: int                 # E
  intermediate_size: int           # SwiGLU FFN size
  num_layers: int                  # target blocks (GDN + attention)
  num_attention_heads: int         # Hq
  num_kv_heads: int                # Hkv
  head_dim: int                    # D (key_length == value_length)
  rope_dim: int                    # rotary dims (NeoX pairs d, d + rope_dim/2)
  rope_theta: float
  linear_num_key_heads: int        # GDN Hk   (ssm.group_count)
  linear_num_value_heads: int      # GDN Hv   (ssm.time_step_rank)
  linear_head_dim: int             # GDN head dim for k and v (ssm.state_size)
  conv_kernel: int = 4
  full_attention_interval: int = 4
  rms_eps: float = 1e-6
  context_length: int = 262144
  mtp_layers: int = 1              # 0 or 1 (NextN block stored as block num_layers)
  tie_embeddings: bool = False     # no `output.weight`; logits use token_embd
  rope_sections: Tuple[int, ...] = (11, 11, 10, 0)

  def __post_init__(self):
    sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_attention_heads", "num_kv_heads",
             "head_dim", "rope_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_head_dim",
             "conv_kernel", "full_attention_interval", "context_length")
    bad = [f"{k} {getattr(self, k)!r}" for k in sizes
           if not isinstance(getattr(self, k), numbers.Integral) or isinstance(getattr(self, k), bool)
           or getattr(self, k) < 1]
    bad += [f"{k} {getattr(self, k)!r}" for k in ("rope_theta", "rms_eps")
            if not (isinstance(getattr(self, k), numbers.Real) and 0 < getattr(self, k) < float("inf"))]
    if bad:   # checked first: the checks below divide by these
      raise ValueError(f"invalid ModelConfig: expected positive sizes and positive finite floats, found {', '.join(bad)}")
    problems = []
    if self.num_attention_heads % self.num_kv_heads:
      problems.append(
          f"head_count {self.num_attention_heads} is not a multiple of "
          f"head_count_kv {self.num_kv_heads}")
    if self.linear_num_value_heads % self.linear_num_key_heads:
      problems.append(
          f"ssm.time_step_rank {self.linear_num_value_heads} is not a multiple "
          f"of ssm.group_count {self.linear_num_key_heads}")
    if self.rope_dim % 2 or self.rope_dim > self.head_dim:
      problems.append(f"rope dims {self.rope_dim} must be even and <= head_dim {self.head_dim}")
    if self.mtp_layers not in (0, 1):
      problems.append(f"multi-layer MTP is not supported (nextn_predict_layers={self.mtp_layers})")
    if self.full_attention_interval < 1 or self.num_layers < 1:
      problems.append("num_layers and full_attention_interval must be >= 1")
    if problems:
      raise ValueError("invalid ModelConfig: " + "; ".join(problems))

  # ---- derived geometry -------------------------------------------------
  def is_attention_layer(self, i: int) -> bool:
    """Full (gated) attention layers are i where (i + 1) % interval == 0."""
    if i == self.num_layers:  # the MTP block is a full-attention block
      return True
    return (i + 1) % self.full_attention_interval == 0

  @functools.cached_property   # read per layer in hot loops
  def attention_layers(self) -> Tuple[int, ...]:
    return tuple(i for i in range(self.num_layers) if self.is_attention_layer(i))

  @functools.cached_property
  def recurrent_layers(self) -> Tuple[int, ...]:
    return tuple(i for i in range(self.num_layers) if not self.is_attention_layer(i))

  @functools.cached_property
  def num_attention_layers(self) -> int:
    return len(self.attention_layers)

  @property
  def q_per_kv(self) -> int:
    return self.num_attention_heads // self.num_kv_heads

  @property
  def linear_key_dim(self) -> int:   # Hk * dk
    return self.linear_num_key_heads * self.linear_head_dim

  @property
  def linear_value_dim(self) -> int:  # Hv * dv  (ssm.inner_size)
    return self.linear_num_value_heads * self.linear_head_dim

  @property
  def conv_dim(self) -> int:          # channels of the causal conv (q, k, v)
    return 2 * self.linear_key_dim + self.linear_value_dim

  @property
  def kv_width(self) -> int:          # Hkv * D
    return self.num_kv_heads * self.head_dim

  @property
  def has_mtp(self) -> bool:
    return self.mtp_layers > 0

  @property
  def mtp_block(self) -> int:
    """GGUF block index of the NextN/MTP block."""
    return self.num_layers


def attention_block_shapes(cfg: ModelConfig) -> Dict[str, Tuple[int, ...]]:
  E, D = cfg.hidden_size, cfg.head_dim
  return {
      "attn_q.weight": (cfg.num_attention_heads * 2 * D, E),
      "attn_k.weight": (cfg.kv_width, E),
      "attn_v.weight": (cfg.kv_width, E),
      "attn_q_norm.weight": (D,),
      "attn_k_norm.weight": (D,),
      "attn_output.weight": (E, cfg.num_attention_heads * D),
  }


def recurrent_block_shapes(cfg: ModelConfig) -> Dict[str, Tuple[int, ...]]:
  E, Hv = cfg.hidden_size, cfg.linear_num_value_heads
  return {
      "attn_qkv.weight": (cfg.conv_dim, E),
      "attn_gate.weight": (cfg.linear_value_dim, E),
      "ssm_beta.weight": (Hv, E),
      "ssm_alpha.weight": (Hv, E),
      "ssm_dt.bias": (Hv,),
      "ssm_a": (Hv,),
      "ssm_conv1d.weight": (cfg.conv_dim, cfg.conv_kernel),
      "ssm_norm.weight": (cfg.linear_head_dim,),
      "ssm_out.weight": (E, cfg.linear_value_dim),
  }


def common_block_shapes(cfg: ModelConfig) -> Dict[str, Tuple[int, ...]]:
  E, F = cfg.hidden_size, cfg.intermediate_size
  return {
      "attn_norm.weight": (E,),
      "post_attention_norm.weight": (E,),
      "ffn_gate.weight": (F, E),
      "ffn_up.weight": (F, E),
      "ffn_down.weight": (E, F),
  }


MTP_OPTIONAL = ("nextn.shared_head_norm.weight", "nextn.shared_head_head.weight",
                "nextn.embed_tokens.weight")


def mtp_extra_shapes(cfg: ModelConfig) -> Dict[str, Tuple[int, ...]]:
  E = cfg.hidden_size
  return {
      "nextn.eh_proj.weight": (E, 2 * E),
      "nextn.enorm.weight": (E,),
      "nextn.hnorm.weight": (E,),
      "nextn.shared_head_norm.weight": (E,),
      "nextn.shared_head_head.weight": (cfg.vocab_size, E),
  }


def gguf_tensor_shapes(cfg: ModelConfig, include_optional: bool = True) -> Dict[str, Tuple[int, ...]]:
  """Every tensor of a `qwen35` GGUF for this geometry: name -> numpy shape.

  Optional tensors (`output.weight` when embeddings are tied, the MTP
  shared-head tensors) are included only when `include_optional`.
  """
  out: Dict[str, Tuple[int, ...]] = {
      "token_embd.weight": (cfg.vocab_size, cfg.hidden_size),
      "output_norm.weight": (cfg.hidden_size,),
  }
  if not cfg.tie_embeddings:
    out["output.weight"] = (cfg.vocab_size, cfg.hidden_size)
  blocks = list(range(cfg.num_layers)) + ([cfg.mtp_block] if cfg.has_mtp else [])
  for i in blocks:
    shapes = dict(common_block_shapes(cfg))
    shapes.update(attention_block_shapes(cfg) if cfg.is_attention_layer(i)
                  else recurrent_block_shapes(cfg))
    if i == cfg.mtp_block and cfg.has_mtp:
      extra = mtp_extra_shapes(cfg)
      if not include_optional:
        extra = {k: v for k, v in extra.items() if k not in MTP_OPTIONAL}
      shapes.update(extra)
    for name, shape in shapes.items():
      out[f"blk.{i}.{name}"] = shape
  return out


def required_tensor_names(cfg: ModelConfig):
  return set(gguf_tensor_shapes(cfg, include_optional=False))


# ---- presets ---------------------------------------------------------------

def qwen38_27b(**overrides) -> ModelConfig:
  """The real Qwen3.8-27B geometry (48 Gated DeltaNet + 16 gated attention + MTP)."""
  kw = dict(
      vocab_size=248320, hidden_size=5120, intermediate_size=17408,
      num_layers=64, num_attention_heads=24, num_kv_heads=4, head_dim=256,
      rope_dim=64, rope_theta=1e7, linear_num_key_heads=16,
      linear_num_value_heads=48, linear_head_dim=128, conv_kernel=4,
      full_attention_interval=4, rms_eps=1e-6, context_length=262144,
      mtp_layers=1)
  kw.update(overrides)
  return ModelConfig(**kw)


TINY_VOCAB = 384


def tiny(**overrides) -> ModelConfig:
  """A tiny model with the same structure (3 GDN : 1 attention, GQA, MTP).

  Query heads share KV heads 3:1, GDN value heads tile key heads 2:1, head
  dims are multiples of the 32-wide ggml quant block.
  """
  kw = dict(
      vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128,
      num_layers=8, num_attention_heads=6, num_kv_heads=2, head_dim=64,
      rope_dim=16, rope_theta=1e7, linear_num_key_heads=2,
      linear_num_value_heads=4, linear_head_dim=32, conv_kernel=4,
      full_attention_interval=4, rms_eps=1e-6, context_length=8192,
      mtp_layers=1)
  kw.update(overrides)
  return ModelConfig(**kw)


def tiny_deep(**overrides) -> ModelConfig:
  """The tiny model's widths at the 27B's depth (48 Gated DeltaNet + 16 attention layers + MTP): a
  forward dispatches as many steps and plans as many layers as the 27B's, so the host's share of a
  decode or a speculative round (Python, dispatch, page planning) can be studied on a CPU. With
  16-token pages, an 8,192-token history has the page and copy-unit counts of a 131,072-token one
  in 256-token pages."""
  return tiny(**{"num_layers": 64, "context_length": 65536, **overrides})


PRESETS = {"tiny": tiny, "tiny_deep": tiny_deep, "qwen38_27b": qwen38_27b}


def preset(name: str, **overrides) -> ModelConfig:
  try:
    return PRESETS[name](**overrides)
  except KeyError:
    raise ValueError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}") from None

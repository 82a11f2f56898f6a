"""Speculative decoding's configuration: `SpecConfig`, from the command line to the round.

One frozen dataclass: `kvjax.api` takes it (`generate(spec=)`, `make_kv(spec=)`), the round reads it
(`kvjax.speculative.speculate`). Its fields go by other names outside the API, all derived here from
the field names:

* config keys (`experiments.run`, configs/*.py) and metrics: "spec_" + the field (`config_key`);
* command-line flags: "--spec-" + the field, dashed (`flag_name`);

except where llama.cpp spells a field otherwise (`LLAMA_CPP_NAMES`, listed once: the drafter is
`--spec-type` / `spec_type`, whose values on the command line are llama.cpp's (`LLAMA_CPP_DRAFTS`),
and the draft sizes are `--spec-draft-n-max`, `--spec-ngram-size-n`, ...). A bad field raises
`kvjax.api.ParameterError` naming it as `spec.<field>`, so a front end renames it with the same names.

This module imports no JAX (the command line defines its flags from it before anything loads).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Mapping, Optional, Sequence

from kvjax import checks

DRAFTS = ("mtp", "ngram", "ngram+mtp", "oracle")
ROLLBACKS = ("replay", "device", "host")


def _field(default, help_text: str, choices: Optional[Sequence[str]] = None):
  return dataclasses.field(default=default, metadata={"help": help_text, "choices": choices})


@dataclasses.dataclass(frozen=True)
class SpecConfig:
  """Speculative decoding (greedy only). `draft` "mtp" (the model's attached MTP head proposes),
  "ngram" (ngram-simple: the tokens that followed the latest earlier occurrence of the last `ngram_n`
  tokens, up to `ngram_m`, 0 = n_max), "ngram+mtp" (ngram's match when there is one, MTP otherwise)
  or "oracle" (cost studies: plain greedy's tokens, each kept with probability `oracle_acceptance`,
  seeded by `oracle_seed`; the first planted rejection ends the round). At most `n_max` MTP / oracle
  drafts per round; MTP drafting stops below top-1 probability `p_min`. `rollback` "replay" (the
  verify keeps its rows' inputs; the states after the accepted row are rebuilt from the states
  before the verify, `ReplayRollback`), "device" (every verify row's recurrent states kept on the
  device, `DeviceRollback`) or "host" (host snapshots through a two-slot stage, `HostRollback`). `oracle_mtp` (oracle only, cost studies): the MTP head
  still catches up and drafts every round under its ring lease, its drafts unused: the oracle's
  acceptance at MTP drafting's cost. Each field's `help` (its metadata) is its flag's help text."""
  draft: str = _field("mtp", "speculative decoding (greedy only): drafts from the attached MTP head, from the "
                      "sequence's own n-grams, both (ngram's match, else MTP), or an oracle (plain greedy's tokens "
                      "with planted rejections, for cost studies), verified by the target with recurrent-state "
                      "rollback", DRAFTS)
  n_max: int = _field(3, "drafts per round (verify width 1 + n)")
  p_min: float = _field(0.0, "MTP drafting stops below this top-1 probability")
  ngram_n: int = _field(12, "ngram-simple match key length")
  ngram_m: int = _field(0, "ngram-simple drafts per round (0: the MTP / oracle drafts per round)")
  oracle_acceptance: float = _field(0.75, "oracle drafts: probability each draft is kept")
  oracle_seed: int = _field(0, "oracle drafts: seed of the planted rejections")
  rollback: str = _field("replay", "recurrent-state rollback: the verify's rows replayed from the states before "
                         "it, every verify row's states kept on the device, or host snapshots through a "
                         "two-slot device stage", ROLLBACKS)
  oracle_mtp: bool = _field(False, "oracle drafts: the MTP head still catches up and drafts every round (its "
                            "cost, drafts unused)")

  def __post_init__(self):
    if self.draft not in DRAFTS:
      raise _error(f"spec.draft must be one of {', '.join(DRAFTS)}, got {self.draft!r}", "draft")
    for ok, field, need in ((self.n_max >= 1, "n_max", ">= 1"), (0.0 <= self.p_min <= 1.0, "p_min", "in [0, 1]"),
                            (self.ngram_n >= 1, "ngram_n", ">= 1"), (self.ngram_m >= 0, "ngram_m", ">= 0"),
                            (0.0 <= self.oracle_acceptance <= 1.0, "oracle_acceptance", "in [0, 1]"),
                            (self.rollback in ROLLBACKS, "rollback", "one of " + ", ".join(ROLLBACKS))):
      if not ok:
        raise _error(f"spec.{field} must be {need}, got {getattr(self, field)!r}", field)
    if self.oracle_mtp and self.draft != "oracle":
      raise _error(f"spec.oracle_mtp runs the MTP head beside the oracle drafter: spec.draft must be 'oracle', "
                   f"got {self.draft!r}", "oracle_mtp", "draft")

  @property
  def uses_mtp(self) -> bool:
    return self.draft in ("mtp", "ngram+mtp") or self.oracle_mtp

  @property
  def uses_ngram(self) -> bool:
    return self.draft in ("ngram", "ngram+mtp")

  @property
  def ngram_width(self) -> int:
    return self.ngram_m or self.n_max

  @property
  def verify_width(self) -> int:
    """1 + the widest draft any configured drafter can produce (rows of the widest verify)."""
    widest = self.ngram_width if self.draft == "ngram" else \
        max(self.n_max, self.ngram_width) if self.draft == "ngram+mtp" else self.n_max
    return 1 + widest


def _error(message: str, *fields: str):
  return checks._error(message, *(f"spec.{f}" for f in fields))  # pylint: disable=protected-access


FIELDS = tuple(f.name for f in dataclasses.fields(SpecConfig))

# ---------------------------------------------------------------------------
# names outside the API
# ---------------------------------------------------------------------------

# llama.cpp's names of the fields it spells otherwise: the drafter's everywhere (`--spec-type`, and
# the config key and metric `spec_type`), the draft sizes' on the command line
LLAMA_CPP_NAMES = {"draft": "type", "n_max": "draft-n-max", "p_min": "draft-p-min", "ngram_n": "ngram-size-n",
                   "ngram_m": "ngram-size-m"}
# llama.cpp's `--spec-type` values -> `draft` ("none": no speculative decoding)
LLAMA_CPP_DRAFTS = {"draft-mtp": "mtp", "ngram-simple": "ngram", "ngram-simple,draft-mtp": "ngram+mtp",
                    "oracle": "oracle"}
NONE = "none"   # the drafter's value that turns speculative decoding off, on the command line and in configs


def config_key(field: str) -> str:
  """A field's config key and metric: "spec_" + the field ("spec_type" for `draft`)."""
  return "spec_" + (LLAMA_CPP_NAMES[field] if field == "draft" else field)


def flag_name(field: str) -> str:
  """A field's command-line flag, without its dashes: llama.cpp's name ("spec-draft-n-max" for n_max)."""
  return "spec-" + LLAMA_CPP_NAMES.get(field, field).replace("_", "-")


def names(prefix: str, name_of: Callable[[str], str]) -> Dict[str, str]:
  """{"spec.<field>": prefix + its name, "spec": the drafter's}: the API's parameters as a front end
  names them (for `ParameterError.renamed`), e.g. names("--", flag_name)."""
  out = {f"spec.{f}": prefix + name_of(f) for f in FIELDS}
  out["spec"] = out["spec.draft"]
  return out


def config_defaults() -> Dict[str, Any]:
  """Every field's config key and default (the drafter "none": no speculative decoding)."""
  return {config_key(f.name): NONE if f.name == "draft" else f.default for f in dataclasses.fields(SpecConfig)}


def from_config(cfg: Mapping[str, Any]) -> Optional[SpecConfig]:
  """The `SpecConfig` of a config's spec_* keys (an absent key: the field's default), or None where
  spec_type is absent, "none" or ""."""
  if cfg.get(config_key("draft"), NONE) in (NONE, ""):
    return None
  return SpecConfig(**{f: cfg[config_key(f)] for f in FIELDS if config_key(f) in cfg})


def from_flags(value_of: Callable[[str], Any]) -> Optional[SpecConfig]:
  """The `SpecConfig` of the command line's flags (`value_of(flag_name)`), or None for --spec-type none."""
  kind = value_of(flag_name("draft"))
  if kind == NONE:
    return None
  return SpecConfig(draft=LLAMA_CPP_DRAFTS[kind], **{f: value_of(flag_name(f)) for f in FIELDS if f != "draft"})


def define_flags(flag_values, name_of: Callable[[str], str], drafts: Sequence[str], skip: Sequence[str] = ()) -> None:
  """absl flags for the fields (but `skip`), named by `name_of` (`flag_name`, `config_key`), with
  the fields' defaults and help; the drafter's flag takes `drafts` (default "none")."""
  from absl import flags  # pylint: disable=import-outside-toplevel
  define = {"int": flags.DEFINE_integer, "float": flags.DEFINE_float, "bool": flags.DEFINE_bool}
  for f in dataclasses.fields(SpecConfig):
    if f.name in skip:
      continue
    name, help_text, choices = name_of(f.name), f.metadata["help"], f.metadata["choices"]
    if f.name == "draft":
      flags.DEFINE_enum(name, NONE, list(drafts), help_text, flag_values=flag_values)
    elif choices:
      flags.DEFINE_enum(name, f.default, list(choices), help_text, flag_values=flag_values)
    else:
      define[f.type](name, f.default, help_text, flag_values=flag_values)

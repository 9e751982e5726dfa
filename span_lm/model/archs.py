"""The architectures in one table: what span_lm asks of a model by its name (config.model.arch).

Code that depends on the architecture looks its record up, `ARCHS[cfg.arch].cache`, rather than
comparing names, so a new architecture is one record here (levanter registers a config class per
model; big_vision picks `models/<name>.py` once): an `Arch` subclass whose methods (context,
spans, identity, checks) read only its own sections of the ModelConfig. The records name what
lives in the model modules ('module:function', loaded on first use), so this module, which
model/config.py imports, imports none of them: the table stays below config in the import graph
(tests/test_import_graph.py).
"""
import dataclasses
import importlib
from typing import Any, Callable

DEFAULT = "span"  # config.model.arch's default (and what a config without the field means)

# ---- the record ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Arch:
  """One architecture: its model, its lengths, its costs, and what identifies its checkpoints.
  Each architecture is a subclass whose methods read only its own sections of the ModelConfig
  (SpanArch: span, plan; SparseArch: sparse), so neither passes as the other."""
  name: str
  # 'module:function': (cfg, plan, kv_cache) -> the Flax module (span_lm.model.build_model)
  build_at: str
  # 'module:function': (cfg, plan, block, batch) -> multiply-adds of one forward pass by component
  forward_macs_at: str
  # 'module:function': (cfg, plan, batch, block, train) -> bytes the forward pass keeps for the
  # backward pass, by kind (model/costs.py's activation_bytes)
  activation_bytes_at: str
  # 'module:function': (cfg, plan, block) -> elements of one sequence's widest float32 score
  # block, held with its gradient in the backward pass (model/costs.py's peak_activation_bytes)
  widest_scores_at: str
  # 'module:function': (cfg, m, w) -> (name, why): the attention implementation its layers run
  # for m queries and windows up to w on the current target (logs, the compile report)
  attention_at: str
  # Carries hidden states from block to block: caches of up to the context (else one unused
  # row), key/value caches for evaluation, one-token generation, cache rows in the FLOPs.
  cache: bool
  # Attention over learned-span windows through span_lm/kernels' door (span plans, kernels.select,
  # kernels/matmul.py's multi-threaded CPU matmuls); False: fixed patterns (kernels/sparse/door.py).
  banded: bool
  pers_mem: bool  # persistent memory (pers_mem > 0) may replace the feed-forward
  documents: bool  # document boundaries (doc_boundary >= 0)

  @property
  def build(self) -> Callable[..., Any]:
    return _load(self.build_at)

  @property
  def forward_macs(self) -> Callable[..., dict]:
    return _load(self.forward_macs_at)

  @property
  def activation_bytes(self) -> Callable[..., dict]:
    return _load(self.activation_bytes_at)

  @property
  def widest_scores(self) -> Callable[..., int]:
    return _load(self.widest_scores_at)

  @property
  def attention(self) -> Callable[..., tuple[str, str]]:
    return _load(self.attention_at)

  def context(self, model) -> int:
    """The farthest a query looks back, of a ModelConfig (or of a run config's model section)."""
    raise NotImplementedError

  def spans(self, cfg) -> str:
    """How its heads' attention spans behave (span plans, the span loss, reports): 'fixed',
    'adaptive' (learned per head) or 'dynamic' (per token)."""
    raise NotImplementedError

  def cache_len(self, cfg) -> int:
    """Rows of each layer's cache under the full plan: the context, or one unused row without a
    cache (not 0: Orbax refuses to save zero-size arrays)."""
    return self.context(cfg) if self.cache else 1

  def identity(self, cfg) -> dict[str, Any]:
    """Its fields a checkpoint must match besides IDENTITY's, flattened as a checkpoint's
    metadata names them: {dotted name: value}."""
    raise NotImplementedError

  def recorded(self, cfg) -> dict:
    """config.model as its checkpoints and exports record it (metadata 'model_cfg')."""
    return dataclasses.asdict(cfg)

  def check(self, cfg, bad) -> None:
    """Its sections against the rest of config.model; bad(field, why) raises for a field."""

# ---- checkpoint identity -------------------------------------------------------------------------

# Fields of config.model (flattened) every checkpoint must match, whatever its architecture: what
# the parameters mean. Both sections' fields count (a default section equals a default one);
# sparse.impl is how attention runs, not the model.
IDENTITY = ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "pers_mem", "arch",
            "span.mode")
IDENTITY_SECTIONS = ("sparse.", "adapt_io.")
NOT_IDENTITY = ("sparse.impl",)


def is_identity(key: str) -> bool:
  """Whether flattened config.model field `key` is one every checkpoint must match (IDENTITY)."""
  return key in IDENTITY or key.startswith(IDENTITY_SECTIONS) and key not in NOT_IDENTITY


# ---- span Transformer ----------------------------------------------------------------------------


class SpanArch(Arch):
  """The adaptive-span Transformer (span_lm/model/transformer.py): config.model.span and .plan."""

  def context(self, model) -> int:
    return model.span.size

  def spans(self, cfg) -> str:
    return cfg.span.mode

  def identity(self, cfg) -> dict[str, Any]:
    return {"span.size": cfg.span.size}  # S: the length of the key position embeddings

  def check(self, cfg, bad) -> None:
    del bad
    if cfg.sparse.scan_layers:
      raise ValueError("config.model.sparse.scan_layers=True: only arch='sparse' scans its layers "
                       "(the span model's layers differ: each has its own span plan and cache)")


SPAN = SpanArch(name="span", build_at="span_lm.model.transformer:build",
                forward_macs_at="span_lm.model.macs:span_forward_macs",
                activation_bytes_at="span_lm.model.costs:span_activation_bytes",
                widest_scores_at="span_lm.model.costs:span_widest_scores",
                attention_at="span_lm.model.transformer:attention_choice", cache=True,
                banded=True, pers_mem=True, documents=True)


# ---- Sparse Transformer --------------------------------------------------------------------------


class SparseArch(Arch):
  """The Sparse Transformer (span_lm/model/sparse_transformer.py): config.model.sparse. It has no
  spans: every head sees its whole context, so it reads none of config.model.span."""

  def context(self, model) -> int:
    return model.sparse.context

  def spans(self, cfg) -> str:
    del cfg
    return "fixed"

  def identity(self, cfg) -> dict[str, Any]:
    return {"sparse.context": cfg.sparse.context}

  def recorded(self, cfg) -> dict:
    """With the fixed span of n in place of config.model.span: what checkpoints recorded when the
    sparse model's config carried it, so older code restores them (its identity has span.mode
    'fixed') and what they hold reads the same."""
    fixed = type(cfg.span)(size=cfg.sparse.context, mode="fixed", loss=0.0, ramp=cfg.span.ramp)
    return dict(dataclasses.asdict(cfg), span=dataclasses.asdict(fixed))

  def check(self, cfg, bad) -> None:
    if cfg.pers_mem:
      bad("pers_mem", "arch='sparse' has no persistent memory")
    if cfg.adapt_io.enabled:
      raise ValueError("config.model.adapt_io.enabled=True: arch='sparse' has no adaptive "
                       "input/softmax")
    sp = cfg.sparse
    if cfg.d_qk % cfg.n_heads or cfg.d_qk < cfg.n_heads:
      raise ValueError(f"config.model.sparse.qk_ratio={sp.qk_ratio!r}: d_model * ratio must be "
                       f"divisible by n_heads={cfg.n_heads}")
    if sp.scan_layers and cfg.n_layers % sp.scan_period:
      raise ValueError(f"config.model.sparse.scan_layers=True: the blocks repeat every "
                       f"{sp.scan_period} layers (sparse.combine='interleaved'): "
                       f"n_layers={cfg.n_layers} must be a multiple")


SPARSE = SparseArch(name="sparse", build_at="span_lm.model.sparse_transformer:build",
                    forward_macs_at="span_lm.model.macs:sparse_forward_macs",
                    activation_bytes_at="span_lm.model.costs:sparse_activation_bytes",
                    widest_scores_at="span_lm.model.costs:sparse_widest_scores",
                    attention_at="span_lm.model.sparse_transformer:attention_choice", cache=False,
                    banded=False, pers_mem=False, documents=False)


def _load(path: str):
  module, name = path.split(":")
  return getattr(importlib.import_module(module), name)


# ---- the table -----------------------------------------------------------------------------------

# span_lm/model/transformer.py | span_lm/model/sparse_transformer.py
ARCHS = {a.name: a for a in (SPAN, SPARSE)}

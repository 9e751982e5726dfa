"""The architectures in one table: what span_lm asks of a model by its name (config.model.arch).

Code that depends on the architecture looks its record up, `ARCHS[cfg.arch].cache`, rather than
comparing names, so a new architecture is one record here (levanter registers a config class per
model; big_vision picks `models/<name>.py` once). The records import their models lazily: this
module is imported by model/config.py, before any model module can be.
"""
import dataclasses
from typing import Any, Callable

from span_lm.model import macs

DEFAULT = "span"  # config.model.arch's default (and what a config without the field means)

# ---- the record ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Arch:
  """One architecture: its model, its lengths, its cost, and what identifies its checkpoints."""
  name: str
  # '<section>.<field>': the farthest a query looks back, in the config.model section that holds
  # the architecture's own fields (where config.model's old flat `span` goes)
  context_field: str
  # (cfg, plan, kv_cache) -> the Flax module (span_lm.model.build_model)
  build: Callable[..., Any]
  # (cfg, plan, block, batch) -> multiply-adds of one forward pass by component (model/macs.py)
  forward_macs: Callable[..., dict]
  # Carries hidden states from block to block: caches of up to the context (else one unused
  # row), key/value caches for evaluation, one-token generation, cache rows in the FLOPs.
  cache: bool
  # Attention over learned-span windows through span_lm/kernels' door (span plans, kernels.select,
  # kernels/matmul.py's multi-threaded CPU matmuls); False: fixed patterns (kernels/sparse_door.py).
  banded: bool
  pers_mem: bool  # persistent memory (pers_mem > 0) may replace the feed-forward
  documents: bool  # document boundaries (doc_boundary >= 0)
  # Fields of config.model (flattened, dotted) a checkpoint must match besides IDENTITY's
  identity: tuple[str, ...]
  # (cfg) -> {field: value}: shared fields the architecture fixes (the sparse model's `span`)
  settle: Callable[[Any], dict]
  # (cfg, bad) -> None: its section's checks against the rest of config.model; bad(field, why)
  check: Callable[[Any, Callable], None]
  # (cfg, m, w) -> (name, why): the attention implementation its layers run for m queries and
  # windows up to w on the current target (logs, the compile report); why: '' or the reason
  attention: Callable[..., tuple[str, str]]

  def context(self, model) -> int:
    """The context length of a ModelConfig (or of a run config's model section)."""
    section, field = self.context_field.split(".")
    return getattr(getattr(model, section), field)

  def cache_len(self, cfg) -> int:
    """Rows of each layer's cache under the full plan: the context, or one unused row without a
    cache (not 0: Orbax refuses to save zero-size arrays)."""
    return self.context(cfg) if self.cache else 1


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


def _build_span(cfg, plan, kv_cache: bool):
  from span_lm.model.transformer import SpanTransformer  # pylint: disable=g-import-not-at-top
  return SpanTransformer(cfg, plan, kv_cache=kv_cache)


def _check_span(cfg, bad):
  del bad
  if cfg.sparse.scan_layers:
    raise ValueError("config.model.sparse.scan_layers=True: only arch='sparse' scans its layers "
                     "(the span model's layers differ: each has its own span plan and cache)")


def _span_attention(cfg, m=None, w=None) -> tuple[str, str]:
  from span_lm import kernels  # pylint: disable=g-import-not-at-top
  return kernels.choose(cfg, m, w), kernels.why(cfg, m, w)


SPAN = Arch(name="span", context_field="span.size", build=_build_span,
            forward_macs=macs.span_forward_macs, cache=True, banded=True, pers_mem=True,
            documents=True, identity=("span.size",), settle=lambda cfg: {}, check=_check_span,
            attention=_span_attention)


# ---- Sparse Transformer --------------------------------------------------------------------------


def _build_sparse(cfg, plan, kv_cache: bool):
  if kv_cache:
    raise ValueError("kv_cache applies to the span Transformer only (the sparse one has no cache)")
  from span_lm.model.sparse_transformer import SparseTransformer  # pylint: disable=g-import-not-at-top
  return SparseTransformer(cfg, plan)


def _settle_sparse(cfg) -> dict:
  """No learned spans: what reads model.span sees a fixed span of n."""
  return {"span": type(cfg.span)(size=cfg.sparse.context, mode="fixed", loss=0.0,
                                 ramp=cfg.span.ramp)}


def _check_sparse(cfg, bad):
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


def _sparse_attention(cfg, m=None, w=None) -> tuple[str, str]:
  """kernels/sparse_door.py's choice for the first block's head patterns (every block's heads
  have the same sizes, and the table's misfits depend on sizes only)."""
  del w
  from span_lm.kernels import sparse_door  # pylint: disable=g-import-not-at-top
  from span_lm.model import sparse  # pylint: disable=g-import-not-at-top
  sp = cfg.sparse
  heads = sparse.layer_heads(sp.pattern, sp.combine, cfg.n_heads, 0, sp.stride, sp.c,
                             sp.distinct)
  name, why = sparse_door.choose(sp.impl, heads, m or sp.context, cfg.d_qk // cfg.n_heads)
  return f"sparse {name}", why


SPARSE = Arch(name="sparse", context_field="sparse.context", build=_build_sparse,
              forward_macs=macs.sparse_forward_macs, cache=False, banded=False, pers_mem=False,
              documents=False, identity=("sparse.context",), settle=_settle_sparse,
              check=_check_sparse, attention=_sparse_attention)

# ---- the table -----------------------------------------------------------------------------------

# span_lm/model/transformer.py | span_lm/model/sparse_transformer.py
ARCHS = {a.name: a for a in (SPAN, SPARSE)}

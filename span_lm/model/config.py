"""ModelConfig: the static (hashable) description of a model, in sections, validated up front.

It is the schema of `config.model`: the run config's defaults are these dataclasses' (span_lm/
config.py `base_config`), so a field and its default are written once, here, and a bad value is a
ValueError naming the field (`config.model.span.ramp=0: ...`) before anything is traced or
compiled. The sections, each checking itself:

  config.model.*            the Transformer both architectures share (sizes, dropout, dtype, remat)
  config.model.span.*       the span model's attention span (S, fixed/adaptive/dynamic, the ramp)
  config.model.plan.*       how learned spans become compiled windows (span_lm/model/plan.py)
  config.model.attention.*  how attention executes (span_lm/kernels: implementation, tiles)
  config.model.adapt_io.*   adaptive input and softmax (span_lm/model/adaptive_io.py)
  config.model.sparse.*     arch='sparse': the Sparse Transformer (span_lm/model/sparse*.py)

Run directories and checkpoints written before the sections (flat fields: `span`, `span_mode`,
`attn_impl`, ...) load through `upgrade`.
"""
import dataclasses
import math
from typing import Any

from span_lm import kernels
from span_lm.kernels.sparse.door import SPARSE_IMPL_NAMES
from span_lm.model import archs
from span_lm.model import attention_rules

SPAN_MODES = ("fixed", "adaptive", "dynamic")
DTYPES = ("float32", "bfloat16", "float16")
REMAT = ("none", "layer")
SPARSE_PATTERNS = ("fixed", "strided", "local", "dense")  # span_lm/model/sparse.py
SPARSE_COMBINES = ("merged", "interleaved", "split")
SPARSE_POS = ("attn", "data", "none")
SPARSE_ACTS = ("gelu", "relu")
SPARSE_STREAMS = ("float32", "compute")
# jax.checkpoint_policies usable with remat='layer' (what the backward pass need not recompute).
REMAT_POLICIES = ("nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable",
                  "everything_saveable")


# The sparse model's layer scan (sparse.scan_layers=True) stacks its blocks' parameters under
# this name; the optimizer and the sharding rules find stacked leaves by it (sharding.is_stacked).
SCANNED_LAYERS = "layers"


def _checker(section: str, obj):
  def bad(field, why):
    raise ValueError(f"config.model.{section}{field}={getattr(obj, field)!r}: {why}")
  return bad


def _positive_int(x) -> bool:
  return isinstance(x, int) and not isinstance(x, bool) and x >= 1


class _Section:
  def replace(self, **changes):
    """A copy with `changes` (frozen dataclasses: `cfg.replace(span=cfg.span.replace(size=64))`)."""
    return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class Span(_Section):
  """`config.model.span`: each head's attention span (Sukhbaatar et al. 2019)."""
  size: int = 1024  # S, the maximum span (and the cache length)
  mode: str = "adaptive"  # fixed | adaptive | dynamic
  ramp: int = 32  # R, width of the soft mask ramp
  init: float = 0.0  # initial z' (adaptive)
  loss: float = 2e-6  # L1 span penalty coefficient
  cache: bool = True  # shrink each layer's cache with its span (reference: adapt_span_cache)
  dynamic_bias_init: float = -4.0  # b in z_t = S sigmoid(v.x_t + b)

  def __post_init__(self):
    bad = _checker("span.", self)
    if not _positive_int(self.size):
      bad("size", "must be a positive integer")
    if self.mode not in SPAN_MODES:
      bad("mode", f"unknown span mode; choose one of {SPAN_MODES}")
    if not _positive_int(self.ramp):
      bad("ramp", "the ramp width R must be an integer >= 1")
    if self.mode != "fixed" and self.size < self.ramp:
      bad("size", f"is below the soft mask's ramp span.ramp={self.ramp}: every distance keeps a "
          f"mask >= 1 - size/ramp, so spans cannot shrink; use size >= {self.ramp} or a smaller "
          "ramp")
    if not 0.0 <= self.init <= 1.0:
      bad("init", "z' lives in [0, 1]")
    if self.loss < 0:
      bad("loss", "must be >= 0")


@dataclasses.dataclass(frozen=True)
class Plan(_Section):
  """`config.model.plan`: how learned spans become the windows a step is compiled for."""
  granularity: int = 64  # span-plan bucket size (reference: 64)
  margin: int = 64  # extra window kept beyond the learned span (reference: 64)
  shrink_patience: int = 1000  # steps a smaller plan must persist before shrinking
  # Headroom: windows cover growth x the needed tokens (then rounded up to the granularity), so a
  # growing span recompiles every ~50 % of growth, not every 64 tokens.
  growth: float = 1.5
  head_grouping: bool = True  # group heads by span bucket (False: per-layer max, as the reference)

  def __post_init__(self):
    bad = _checker("plan.", self)
    if not _positive_int(self.granularity):
      bad("granularity", "must be a positive integer")
    if self.margin < 0:
      bad("margin", "must be >= 0")
    if self.shrink_patience < 0:
      bad("shrink_patience", "must be >= 0")
    if not 1.0 <= self.growth <= 4.0:
      bad("growth", "must be in [1, 4]")


@dataclasses.dataclass(frozen=True)
class AdaptIO(_Section):
  """`config.model.adapt_io`: adaptive input + adaptive softmax (span_lm/model/adaptive_io.py)."""
  enabled: bool = False
  cutoffs: tuple[int, ...] = (20000, 40000, 200000)  # cluster boundaries (frequency order)
  div: int = 4  # cluster i has dimension d_model // div**i
  tied: bool = False  # share the input and output cluster tables (--adapt-io-tied)

  def __post_init__(self):
    object.__setattr__(self, "cutoffs", tuple(self.cutoffs))  # hashable whatever the config held
    bad = _checker("adapt_io.", self)
    cuts = self.cutoffs
    if not all(isinstance(c, int) and c > 0 for c in cuts) or list(cuts) != sorted(set(cuts)):
      bad("cutoffs", "must be strictly increasing positive token counts")
    if not _positive_int(self.div):
      bad("div", "must be a positive integer")


@dataclasses.dataclass(frozen=True)
class Sparse(_Section):
  """`config.model.sparse`: the Sparse Transformer (Child et al. 2019), arch='sparse'."""
  context: int = 1024  # n, the context length (no cache, no spans)
  pattern: str = "fixed"  # fixed | strided | local | dense
  combine: str = "merged"  # merged (eq. 7) | interleaved (eq. 6) | split (eq. 8)
  stride: int = 128  # l
  c: int = 32  # fixed: summary positions per block per head
  distinct: bool = True  # fixed: heads attend to distinct c-sub-blocks (Sec. 4.3)
  # auto | jnp (O(n sqrt n)) | dense (the masked n x n reference) | splash (TPU) |
  # splash_interpret; 'fast' is read as 'jnp'. Chosen by kernels/sparse/door.py.
  impl: str = "auto"
  prenorm: bool = True  # pre-activation residual blocks (eqs. 9-14); False: post-LN
  act: str = "gelu"  # gelu: x * sigmoid(1.702 x) as the paper | relu
  init_scale: bool = True  # W_p and W_2 init scaled by 1/sqrt(2N)
  pos: str = "attn"  # attn: row/column in a width-l matrix | data: data_shape | none
  data_shape: tuple[int, ...] = ()  # e.g. (32, 32, 3): row, column, channel of an image
  qk_ratio: float = 1.0  # 0.5: half-size query and key projections
  # One nn.scan over the residual blocks (parameters stacked under 'layers', a leading axis of
  # n_layers) instead of n_layers traced copies: a 128-layer model compiles one block. False
  # keeps the per-layer 'layers_{i}' parameters (checkpoints restore only into the same kind).
  scan_layers: bool = False
  # The residual stream's dtype between and inside the blocks (and the layer norms' outputs):
  # float32, or 'compute': model.dtype, the paper's mixed precision (Sec. 5.6: weights in
  # float32, activations and their gradients in half precision). Layer-norm statistics, softmax
  # and the loss stay float32 either way. On a TPU it cuts the blocks' HBM traffic at small
  # d_model about a quarter (configs/cifar10_sparse.py, docs/kernels.md).
  stream_dtype: str = "float32"

  def __post_init__(self):
    object.__setattr__(self, "data_shape", tuple(self.data_shape))
    bad = _checker("sparse.", self)
    if not _positive_int(self.context):
      bad("context", "must be a positive integer")
    choices = {"pattern": SPARSE_PATTERNS, "combine": SPARSE_COMBINES, "impl": SPARSE_IMPL_NAMES,
               "pos": SPARSE_POS, "act": SPARSE_ACTS, "stream_dtype": SPARSE_STREAMS}
    for f, allowed in choices.items():
      if getattr(self, f) not in allowed:
        bad(f, f"choose one of {allowed}")
    if not _positive_int(self.stride):
      bad("stride", "must be a positive integer")
    if self.pattern == "fixed" and not (isinstance(self.c, int) and 1 <= self.c <= self.stride):
      bad("c", f"must be an integer in [1, sparse.stride={self.stride}]")
    if not 0 < self.qk_ratio <= 1:
      bad("qk_ratio", "must be in (0, 1]")
    if self.pos == "data":
      shape = self.data_shape
      if not shape or not all(isinstance(x, int) and x > 0 for x in shape):
        bad("data_shape", "sparse.pos='data' needs the data's shape, e.g. (32, 32, 3)")
      if math.prod(shape) < self.context:
        bad("data_shape", f"holds {math.prod(shape)} positions, fewer than the context "
            f"sparse.context={self.context}")

  @property
  def scan_period(self) -> int:
    """Layers after which the blocks' head patterns repeat (sparse.layer_heads)."""
    return 2 if self.combine == "interleaved" and self.pattern in ("fixed", "strided") else 1


SECTIONS = {"span": Span, "plan": Plan, "attention": kernels.Attention, "adapt_io": AdaptIO,
            "sparse": Sparse}


@dataclasses.dataclass(frozen=True)
class ModelConfig(_Section):
  vocab_size: int  # the run config's 0 means the dataset's vocabulary
  d_model: int = 256
  n_layers: int = 8
  n_heads: int = 4
  d_ff: int = 1024
  pers_mem: int = 0  # N persistent key/value vectors per head (all-attention); 0: off
  dropout: float = 0.0
  emb_dropout: float = 0.0
  # compute dtype: float32 | bfloat16 | float16 (V100, T4: with dynamic loss scaling,
  # train.loss_scale); params stay float32
  dtype: str = "float32"
  remat: str = "none"  # none | layer: recompute each layer in the backward pass
  # What a recomputed layer keeps from the forward pass (jax.checkpoint_policies): nothing_saveable
  # (least memory), dots_saveable, dots_with_no_batch_dims_saveable, everything_saveable.
  remat_policy: str = "nothing_saveable"
  arch: str = archs.DEFAULT  # span (span_lm/model/transformer.py) | sparse: model/archs.py
  # Document boundaries in the token stream (concatenated documents), span model only: the token
  # id that starts a new document (e.g. a separator/BOS id), or -1: off (the default; the model
  # is then the reference's, number for number). When set, a query attends only to keys of its
  # own document. The boundary token is the first token of the new document (the query that
  # predicts its first content token). Since a query sees only positions strictly before it, the
  # boundary token's query sees no key at all and its attention output is zero (persistent
  # memory alone with pers_mem). Segment ids are derived on device from the tokens; the carried
  # caches gain one last entry, (B, L) int32: 1 where a cached position is in the document of
  # the newest cached position, 0 elsewhere (older documents, and the zero states a stream
  # starts with, which are therefore not attended): blocks carried through the caches give the
  # outputs of one long block (model/caches.py, transformer.py).
  doc_boundary: int = -1
  # arch='sparse' reads none of it: every head sees its whole context, sparse.context.
  span: Span = dataclasses.field(default_factory=Span)
  plan: Plan = dataclasses.field(default_factory=Plan)
  attention: kernels.Attention = dataclasses.field(default_factory=kernels.Attention)
  adapt_io: AdaptIO = dataclasses.field(default_factory=AdaptIO)
  sparse: Sparse = dataclasses.field(default_factory=Sparse)

  def __post_init__(self):
    def bad(field, why):
      raise ValueError(f"config.model.{field}={getattr(self, field)!r}: {why}")

    for name, section in SECTIONS.items():  # a mapping (a dict, a ConfigDict) becomes its section
      value = getattr(self, name)
      if not isinstance(value, section):
        object.__setattr__(self, name, _section(section, name, value))
    for f in ("vocab_size", "d_model", "n_layers", "n_heads"):
      if not _positive_int(getattr(self, f)):
        bad(f, "must be a positive integer")
    if self.d_model % self.n_heads:
      bad("n_heads", f"must divide d_model={self.d_model}")
    if self.pers_mem < 0:
      bad("pers_mem", "must be >= 0")
    arch = archs.ARCHS.get(self.arch)  # an unknown one is refused below, after these
    if (self.pers_mem == 0 or arch is not None and not arch.pers_mem) and self.d_ff < 1:
      bad("d_ff", "must be >= 1 unless persistent memory replaces the feed-forward (pers_mem > 0)")
    for f in ("dropout", "emb_dropout"):
      if not 0.0 <= getattr(self, f) < 1.0:
        bad(f, "dropout must be in [0, 1)")
    if self.dtype not in DTYPES:
      bad("dtype", f"choose one of {DTYPES}")
    if self.remat not in REMAT:
      bad("remat", f"choose one of {REMAT}")
    if self.remat_policy not in REMAT_POLICIES:
      bad("remat_policy", f"choose one of {REMAT_POLICIES}")
    if arch is None:
      bad("arch", f"choose one of {tuple(archs.ARCHS)}")
    if isinstance(self.doc_boundary, bool) or not isinstance(self.doc_boundary, int) or (
        self.doc_boundary < -1 or self.vocab_size > 1 and self.doc_boundary >= self.vocab_size):
      bad("doc_boundary", f"must be -1 (off) or a token id in [0, vocab_size={self.vocab_size})")
    if self.doc_boundary >= 0 and not arch.documents:
      bad("doc_boundary", "document boundaries are for arch='span' (the sparse model has none)")
    attention_rules.check(self)  # an explicit fused kernel's tiling of these sizes
    arch.check(self, bad)  # its own section against the rest
    if self.adapt_io.enabled:
      cuts = self.adapt_io.cutoffs
      if self.vocab_size > 1 and cuts and cuts[-1] >= self.vocab_size:  # 1: not known yet
        raise ValueError(f"config.model.adapt_io.cutoffs={cuts!r}: must be < the vocabulary size "
                         f"{self.vocab_size}")
      if self.d_model // self.adapt_io.div ** len(cuts) < 1:
        raise ValueError(f"config.model.adapt_io.div={self.adapt_io.div!r}: leaves the last "
                         f"cluster of d_model={self.d_model} with no dimension")

  @property
  def context(self) -> int:
    """The farthest a query looks back: S for the span model, n for the sparse one."""
    return archs.ARCHS[self.arch].context(self)

  @property
  def spans(self) -> str:
    """How its heads' spans behave: span.mode for the span model; 'fixed' for the sparse model,
    whose every head sees its whole context."""
    return archs.ARCHS[self.arch].spans(self)

  @property
  def d_qk(self) -> int:
    """Query/key width (all heads); the paper's half-size q/k is sparse.qk_ratio=0.5."""
    return int(round(self.d_model * self.sparse.qk_ratio))

  @property
  def head_dim(self) -> int:
    return self.d_model // self.n_heads

  @property
  def attn_spec(self) -> kernels.Spec:
    """What the attention door reads of this model: causal windows of up to S, segmented (segment
    ids: documents) when doc_boundary is set."""
    return kernels.Spec(heads=self.n_heads, head_dim=self.head_dim, window=self.context,
                        ramp=self.span.ramp, mode=self.spans, dtype=self.dtype,
                        dropout=self.dropout, pers_mem=self.pers_mem,
                        segmented=self.doc_boundary >= 0, attention=self.attention)

  @classmethod
  def from_config(cls, model_cfg: Any, vocab_size: int | None = None) -> "ModelConfig":
    """Builds from an ml_collections ConfigDict (or dict) of config.model, in sections or in
    the old flat fields (`upgrade`); vocab_size overrides a 0 in the config."""
    d = upgrade(_as_dict(model_cfg))
    if vocab_size is not None and not d.get("vocab_size"):
      d["vocab_size"] = vocab_size
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
      raise ValueError(f"config.model has unknown fields {unknown}")
    return cls(**d)


def _as_dict(value: Any) -> dict:
  """A section as a plain dict, whether a dataclass, a ConfigDict or a mapping."""
  if dataclasses.is_dataclass(value):
    return dataclasses.asdict(value)
  return dict(value.to_dict() if hasattr(value, "to_dict") else value)


def _section(cls, name: str, value: Any):
  d = _as_dict(value)
  unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
  if unknown:
    raise ValueError(f"config.model.{name} has unknown fields {unknown}")
  return cls(**d)


# The flat fields of config.model before its sections, and where each lives now.
MOVED = {
    "span_mode": "span.mode", "ramp": "span.ramp", "span_init": "span.init",
    "span_loss": "span.loss", "span_cache": "span.cache",
    "dynamic_bias_init": "span.dynamic_bias_init",
    "plan_granularity": "plan.granularity", "plan_margin": "plan.margin",
    "plan_shrink_patience": "plan.shrink_patience", "plan_growth": "plan.growth",
    "head_grouping": "plan.head_grouping",
    "attn_impl": "attention.impl", "attn_block": "attention.block",
    "attn_precision": "attention.precision", "attn_tiles": "attention.tiles",
    "attn_chunk": "attention.chunk",
    "adapt_io_cutoffs": "adapt_io.cutoffs", "adapt_io_div": "adapt_io.div",
    "adapt_io_tied": "adapt_io.tied",
    "scan_layers": "sparse.scan_layers",
    **{f"sparse_{f}": f"sparse.{f}" for f in (
        "pattern", "combine", "stride", "c", "distinct", "impl", "prenorm", "act", "init_scale",
        "pos", "data_shape", "qk_ratio")},
}


# The old flat `span`: the architecture's context length, S or n (an unknown one: the default's).
SPAN_MOVED = {"span": "span.size", "sparse": "sparse.context"}


def moved_to(name: str, arch: str = archs.DEFAULT) -> str | None:
  """Where an old flat field of config.model lives now ('span.mode'), or None if it did not move."""
  if name == "span":
    return SPAN_MOVED.get(arch, SPAN_MOVED[archs.DEFAULT])
  if name == "adapt_io":
    return "adapt_io.enabled"
  return MOVED.get(name)


def _moved(name: str, value: Any) -> bool:
  """Whether (name, value) is one of config.model's old flat fields."""
  return (name in MOVED or (name == "span" and isinstance(value, int))
          or (name == "adapt_io" and isinstance(value, bool)))


def is_flat(d: dict) -> bool:
  """Whether a config.model mapping holds any of the old flat fields (before the sections)."""
  return any(_moved(k, v) for k, v in d.items())


def upgrade(d: dict) -> dict:
  """config.model as a dict of sections, from one in either form (or a mix): the old flat fields
  (a run directory's config.json, a checkpoint's metadata, a terse test) go to their sections,
  the rest is returned as it was."""
  if not is_flat(d):
    return d
  arch = d.get("arch", archs.DEFAULT)
  out = {k: v for k, v in d.items() if not _moved(k, v)}
  for k, v in d.items():
    if _moved(k, v):
      section, field = moved_to(k, arch).split(".")
      out[section] = {**_as_dict(out.get(section, {})), field: v}
  return out


def saved(cfg: ModelConfig) -> dict:
  """config.model as checkpoints and exports record it (their metadata's 'model_cfg'): the
  architecture's `recorded` form, read back by `ModelConfig.from_config`."""
  return archs.ARCHS[cfg.arch].recorded(cfg)


def updated(cfg: ModelConfig, **changes) -> ModelConfig:
  """`cfg` with `changes`, named as fields, dotted section fields (**{'span.mode': 'fixed'}),
  whole sections (span=Span(...)) or the old flat fields (span_mode='fixed'): what scripts that
  sweep one knob use."""
  merged = dataclasses.asdict(cfg)
  for k in [k for k in changes if "." in k]:
    section, field = k.split(".", 1)
    merged[section] = {**merged[section], field: changes.pop(k)}
  for k, v in upgrade({"arch": changes.get("arch", cfg.arch), **changes}).items():
    merged[k] = {**merged[k], **_as_dict(v)} if k in SECTIONS else v
  return ModelConfig.from_config(merged)


def config_defaults() -> dict[str, Any]:
  """config.model's defaults in a run config: ModelConfig's fields, its sections as dicts, and
  vocab_size 0 (the dataset's vocabulary)."""
  def defaults(cls) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(cls):
      if f.default is not dataclasses.MISSING:
        out[f.name] = f.default
      elif f.default_factory is not dataclasses.MISSING:
        out[f.name] = defaults(f.default_factory)
    return out
  return {"vocab_size": 0, **defaults(ModelConfig)}

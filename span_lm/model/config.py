"""ModelConfig: the static (hashable) description of a span Transformer, validated up front.

It is the schema of `config.model`: the run config's defaults are this dataclass's
(span_lm/config.py `base_config`), so a field and its default are written once, here, and a bad
value is a ValueError naming the field before anything is traced or compiled.
"""
import dataclasses
import logging
import math
from typing import Any

from span_lm import kernels

SPAN_MODES = ("fixed", "adaptive", "dynamic")
DTYPES = ("float32", "bfloat16", "float16")
REMAT = ("none", "layer")
ARCHS = ("span", "sparse")  # span_lm/model/transformer.py | span_lm/model/sparse_transformer.py
SPARSE_PATTERNS = ("fixed", "strided", "local", "dense")  # span_lm/model/sparse.py
SPARSE_COMBINES = ("merged", "interleaved", "split")
SPARSE_POS = ("attn", "data", "none")
SPARSE_ACTS = ("gelu", "relu")
# jax.checkpoint_policies usable with remat='layer' (what the backward pass need not recompute).
REMAT_POLICIES = ("nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable",
                  "everything_saveable")


# The sparse model's layer scan (scan_layers=True) stacks its blocks' parameters under this name;
# the optimizer and the sharding rules find stacked leaves by it (train/sharding.is_stacked).
SCANNED_LAYERS = "layers"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  vocab_size: int  # the run config's 0 means the dataset's vocabulary
  d_model: int = 256
  n_layers: int = 8
  n_heads: int = 4
  d_ff: int = 1024
  span: int = 1024  # S, the maximum attention span
  span_mode: str = "adaptive"  # fixed | adaptive | dynamic
  ramp: int = 32  # R, width of the soft mask ramp
  span_init: float = 0.0  # initial z' (adaptive)
  span_loss: float = 2e-6  # L1 span penalty coefficient
  span_cache: bool = True  # shrink each layer's cache with its span (reference: adapt_span_cache)
  dynamic_bias_init: float = -4.0  # b in z_t = S sigmoid(v.x_t + b)
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
  plan_granularity: int = 64  # span-plan bucket size (reference: 64)
  plan_margin: int = 64  # extra window kept beyond the learned span (reference: 64)
  plan_shrink_patience: int = 1000  # steps a smaller plan must persist before shrinking
  # Headroom of a plan: windows cover plan_growth x the needed tokens (then rounded up to the
  # granularity), so a growing span recompiles every ~50 % of growth, not every 64 tokens.
  plan_growth: float = 1.5
  head_grouping: bool = True  # group heads by span bucket (False: per-layer max, as the reference)
  attn_chunk: int = 0
  # auto (by target: cpu on CPUs, pallas on GPUs and pallas_tpu on TPUs where they fit, else
  # reference) | reference |
  # cpu | pallas | pallas_interpret: see span_lm/kernels/__init__.py. "xla" is read as "cpu".
  attn_impl: str = "auto"
  attn_block: int = 64  # pallas: query/key tile; divides the block length and the plan windows
  # pallas, float32 models: default (TF32 tensor cores on Ampere and later, as XLA's own float32
  # matmuls) | highest (exact float32, no tensor cores). bf16 models are unaffected.
  attn_precision: str = "default"
  # pallas (GPU): the kernel's (tile, warps, stages): table (pallas_gpu.TILES, by compute
  # capability and head size) | tune (time the candidates on this GPU at startup, cached:
  # kernels/autotune.py; the run then records what it chose) | "T,W,S", e.g. "64,4,2" (S, the
  # pipeline depth, 1-4: kernels/pallas_gpu.py).
  attn_tiles: str = "table"
  adapt_io: bool = False  # adaptive input + adaptive softmax (span_lm/model/adaptive_io.py)
  adapt_io_cutoffs: tuple[int, ...] = (20000, 40000, 200000)  # cluster boundaries (frequency order)
  adapt_io_div: int = 4  # cluster i has dimension d_model // div**i
  adapt_io_tied: bool = False  # share the input and output cluster tables (--adapt-io-tied)
  # arch='sparse': the Sparse Transformer (span_lm/model/sparse*.py); `span` is its context length
  # n (no cache, no spans; span_mode 'fixed'): configs/enwik8_sparse_fixed.py, cifar10_sparse.py.
  arch: str = "span"  # span | sparse
  sparse_pattern: str = "fixed"  # fixed | strided | local | dense
  sparse_combine: str = "merged"  # merged (eq. 7) | interleaved (eq. 6) | split (eq. 8)
  sparse_stride: int = 128  # l
  sparse_c: int = 32  # fixed: summary positions per block per head
  sparse_distinct: bool = True  # fixed: heads attend to distinct c-sub-blocks (Sec. 4.3)
  sparse_impl: str = "fast"  # fast (O(n sqrt n)) | dense (the masked n x n reference)
  sparse_prenorm: bool = True  # pre-activation residual blocks (eqs. 9-14); False: post-LN
  sparse_act: str = "gelu"  # gelu: x * sigmoid(1.702 x) as the paper | relu
  sparse_init_scale: bool = True  # W_p and W_2 init scaled by 1/sqrt(2N)
  sparse_pos: str = "attn"  # attn: row/column in a width-l matrix | data: sparse_data_shape | none
  sparse_data_shape: tuple[int, ...] = ()  # e.g. (32, 32, 3): row, column, channel of an image
  sparse_qk_ratio: float = 1.0  # 0.5: half-size query and key projections
  # arch='sparse': one nn.scan over the residual blocks (parameters stacked under 'layers', a
  # leading axis of n_layers) instead of n_layers traced copies: a 128-layer model compiles one
  # block. False keeps the per-layer 'layers_{i}' parameters (checkpoints of either kind restore
  # only into the same kind).
  scan_layers: bool = False

  def __post_init__(self):
    def bad(field, why):
      raise ValueError(f"config.model.{field}={getattr(self, field)!r}: {why}")

    for f in ("vocab_size", "d_model", "n_layers", "n_heads", "span", "plan_granularity"):
      if not isinstance(getattr(self, f), int) or getattr(self, f) < 1:
        bad(f, "must be a positive integer")
    if self.d_model % self.n_heads:
      bad("n_heads", f"must divide d_model={self.d_model}")
    if self.span_mode not in SPAN_MODES:
      bad("span_mode", f"unknown span mode; choose one of {SPAN_MODES}")
    if self.ramp < 1:
      bad("ramp", "the ramp width R must be >= 1")
    if self.span_mode != "fixed" and self.span < self.ramp:
      bad("span", f"is below the soft mask's ramp model.ramp={self.ramp}: every distance keeps a "
          f"mask >= 1 - span/ramp, so spans cannot shrink; use span >= {self.ramp} or a smaller "
          "ramp")
    if not 0.0 <= self.span_init <= 1.0:
      bad("span_init", "z' lives in [0, 1]")
    if self.span_loss < 0:
      bad("span_loss", "must be >= 0")
    if self.pers_mem < 0:
      bad("pers_mem", "must be >= 0")
    if self.pers_mem == 0 and self.d_ff < 1:
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
    if self.plan_margin < 0:
      bad("plan_margin", "must be >= 0")
    if self.plan_shrink_patience < 0:
      bad("plan_shrink_patience", "must be >= 0")
    if not 1.0 <= self.plan_growth <= 4.0:
      bad("plan_growth", "must be in [1, 4]")
    if self.attn_chunk < 0:
      bad("attn_chunk", "must be >= 0 (0: automatic)")
    if self.attn_impl in kernels.ALIASES:  # 'xla': its name before the one door
      new = kernels.ALIASES[self.attn_impl]
      logging.getLogger("span_lm").warning(
          f"config.model.attn_impl={self.attn_impl!r} is deprecated: it now reads {new!r} (or use "
          "'auto')")
      object.__setattr__(self, "attn_impl", new)
    kernels.check(self)  # names, precision, tiles; an explicit fused kernel's tiling
    # Hashable (the config is a jit static argument) whatever sequence the config held.
    object.__setattr__(self, "adapt_io_cutoffs", tuple(self.adapt_io_cutoffs))
    object.__setattr__(self, "sparse_data_shape", tuple(self.sparse_data_shape))
    if self.arch not in ARCHS:
      bad("arch", f"choose one of {ARCHS}")
    if self.arch == "sparse":
      self._check_sparse(bad)
    elif self.scan_layers:
      bad("scan_layers", "only arch='sparse' scans its layers (the span model's layers differ: "
          "each has its own span plan and cache)")
    if self.adapt_io:
      cuts = self.adapt_io_cutoffs
      if not all(isinstance(c, int) and c > 0 for c in cuts) or list(cuts) != sorted(set(cuts)):
        bad("adapt_io_cutoffs", "must be strictly increasing positive token counts")
      if self.vocab_size > 1 and cuts and cuts[-1] >= self.vocab_size:  # 1: not known yet
        bad("adapt_io_cutoffs", f"must be < the vocabulary size {self.vocab_size}")
      if not isinstance(self.adapt_io_div, int) or self.adapt_io_div < 1:
        bad("adapt_io_div", "must be a positive integer")
      if self.d_model // self.adapt_io_div ** len(cuts) < 1:
        bad("adapt_io_div", f"leaves the last cluster of d_model={self.d_model} with no dimension")

  def _check_sparse(self, bad):
    if self.span_mode != "fixed":
      bad("span_mode", "arch='sparse' has no learned spans: use 'fixed' (span is the context)")
    if self.pers_mem:
      bad("pers_mem", "arch='sparse' has no persistent memory")
    if self.adapt_io:
      bad("adapt_io", "arch='sparse' has no adaptive input/softmax")
    if self.d_ff < 1:
      bad("d_ff", "must be >= 1")
    choices = {"sparse_pattern": SPARSE_PATTERNS, "sparse_combine": SPARSE_COMBINES,
               "sparse_impl": ("fast", "dense"), "sparse_pos": SPARSE_POS,
               "sparse_act": SPARSE_ACTS}
    for f, allowed in choices.items():
      if getattr(self, f) not in allowed:
        bad(f, f"choose one of {allowed}")
    if not isinstance(self.sparse_stride, int) or self.sparse_stride < 1:
      bad("sparse_stride", "must be a positive integer")
    if self.sparse_pattern == "fixed" and not (
        isinstance(self.sparse_c, int) and 1 <= self.sparse_c <= self.sparse_stride):
      bad("sparse_c", f"must be an integer in [1, sparse_stride={self.sparse_stride}]")
    if not 0 < self.sparse_qk_ratio <= 1 or self.d_qk % self.n_heads or self.d_qk < self.n_heads:
      bad("sparse_qk_ratio", f"must be in (0, 1] with d_model * ratio divisible by "
          f"n_heads={self.n_heads}")
    if self.scan_layers and self.n_layers % self.scan_period:
      bad("scan_layers", f"the blocks repeat every {self.scan_period} layers "
          f"(sparse_combine='interleaved'): n_layers={self.n_layers} must be a multiple")
    shape = self.sparse_data_shape
    if self.sparse_pos == "data":
      if not shape or not all(isinstance(x, int) and x > 0 for x in shape):
        bad("sparse_data_shape", "sparse_pos='data' needs the data's shape, e.g. (32, 32, 3)")
      if math.prod(shape) < self.span:
        bad("sparse_data_shape", f"holds {math.prod(shape)} positions, fewer than the "
            f"context span={self.span}")

  @property
  def scan_period(self) -> int:
    """Layers after which the sparse blocks' head patterns repeat (sparse.layer_heads)."""
    alternating = self.sparse_combine == "interleaved" and self.sparse_pattern in ("fixed",
                                                                                   "strided")
    return 2 if alternating else 1

  @property
  def d_qk(self) -> int:
    """Query/key width (all heads); the paper's half-size q/k is sparse_qk_ratio=0.5."""
    return int(round(self.d_model * self.sparse_qk_ratio))

  @property
  def head_dim(self) -> int:
    return self.d_model // self.n_heads

  @classmethod
  def from_config(cls, model_cfg: Any, vocab_size: int | None = None) -> "ModelConfig":
    """Builds from an ml_collections ConfigDict (or dict); vocab_size overrides a 0 in the config."""
    d = dict(model_cfg.to_dict() if hasattr(model_cfg, "to_dict") else model_cfg)
    if vocab_size is not None and not d.get("vocab_size"):
      d["vocab_size"] = vocab_size
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
      raise ValueError(f"config.model has unknown fields {unknown}")
    return cls(**d)

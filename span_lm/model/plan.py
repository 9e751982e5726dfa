"""The compile-time span plan: what makes compute follow the learned span under jit, where shapes
are static.

For each layer the plan fixes (a) how many cached hidden states the layer keeps and (b) a partition
of its heads into groups, each attending over a window of W <= S distances. Windows are multiples
of the plan granularity (64 by default, as the reference) and a head's window always covers its
span plus the ramp, so trimming is exact. The cache keeps a margin beyond the largest window so that
a span that grows by less than the margin finds real hidden states rather than zeros. The reference
trims a layer to its longest head; grouping heads by window lets one long head leave seven short
heads cheap. Distances count back from the query: distance 1 is the previous token.
"""
import dataclasses
import math
from typing import Sequence

import jax
import numpy as np

from span_lm import kernels
from span_lm.model.archs import ARCHS
from span_lm.model.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class LayerPlan:
  cache_len: int  # hidden states kept from previous blocks
  groups: tuple[tuple[tuple[int, ...], int], ...]  # ((head indices), window) per group

  def head_windows(self, n_heads: int) -> tuple[int, ...]:
    w = [0] * n_heads
    for heads, window in self.groups:
      for h in heads:
        w[h] = window
    return tuple(w)


@dataclasses.dataclass(frozen=True)
class SpanPlan:
  layers: tuple[LayerPlan, ...]

  def describe(self) -> str:
    parts = []
    for i, lp in enumerate(self.layers):
      g = " ".join(f"{list(h)}:{w}" for h, w in lp.groups)
      parts.append(f"L{i} cache={lp.cache_len} {g}")
    return "; ".join(parts)

  def attention_keys(self) -> int:
    """Sum over layers and heads of the window: the banded attention cost per query."""
    return sum(len(h) * w for lp in self.layers for h, w in lp.groups)


def full_plan(cfg: ModelConfig) -> SpanPlan:
  """No trimming: every head sees its whole context (S; the sparse model: n) and every cache
  holds S states.

  arch='sparse' carries no hidden states between blocks: its caches hold one unused state
  (cache_len 1, not 0: Orbax refuses to save zero-size arrays).
  """
  lp = LayerPlan(cache_len=ARCHS[cfg.arch].cache_len(cfg),
                 groups=((tuple(range(cfg.n_heads)), cfg.context),))
  return SpanPlan(layers=(lp,) * cfg.n_layers)


def needed_tokens(cfg: ModelConfig, z_ratio, xp=np):
  """Distances with a non-zero mask for each head: ceil(z' S) + R, capped at S (as the reference).
  xp=jnp: the same on the device (train/steps.py checks a plan's coverage in the step)."""
  # The mask is non-zero iff d - 1 < R + z, i.e. d <= ceil(z) + R; z is formed in float32 as the
  # model forms it, so the host and the device agree on the boundary.
  z = xp.asarray(z_ratio, xp.float32) * xp.float32(cfg.span.size)
  ints = np.int64 if xp is np else xp.int32
  return xp.minimum(cfg.span.size, xp.ceil(z).astype(ints) + cfg.span.ramp).clip(1)


def _round_up(n: int, g: int, cap: int) -> int:
  return int(min(cap, max(g, math.ceil(n / g) * g)))


def layer_plan_from_windows(cfg: ModelConfig, windows: Sequence[int]) -> LayerPlan:
  """Groups heads by window (or one group at the max window without head grouping).

  The fused kernel (kernels.runtime_spans) takes one group: it skips each head's unused key
  blocks at run time, so only the layer's largest window is a compile-time shape.
  """
  windows = [int(w) for w in windows]
  if not cfg.plan.head_grouping or kernels.runtime_spans(cfg.attn_spec):
    windows = [max(windows)] * len(windows)
  by_w: dict[int, list[int]] = {}
  for h, w in enumerate(windows):
    by_w.setdefault(w, []).append(h)
  groups = tuple((tuple(hs), w) for w, hs in sorted(by_w.items()))
  if cfg.span.cache:
    cache_len = min(cfg.span.size, max(windows) + cfg.plan.margin)
  else:
    cache_len = cfg.span.size
  return LayerPlan(cache_len=cache_len, groups=groups)


def windows_for(cfg: ModelConfig, need: np.ndarray, growth: float = 1.0) -> list[int]:
  """Head windows for needed tokens: growth x need, rounded up to the granularity, capped at S."""
  if growth > 1.0:
    need = np.ceil(np.asarray(need) * growth).astype(np.int64)
  return [_round_up(int(n), cfg.plan.granularity, cfg.span.size) for n in need]


def plan_from_ratios(cfg: ModelConfig, ratios: Sequence[np.ndarray], growth: float = 1.0) -> SpanPlan:
  """The tightest plan for these spans; growth > 1 leaves that much headroom per head."""
  if cfg.spans != "adaptive":
    return full_plan(cfg)
  return SpanPlan(layers=tuple(
      layer_plan_from_windows(cfg, windows_for(cfg, needed_tokens(cfg, z), growth))
      for z in ratios))


def initial_plan(cfg: ModelConfig) -> SpanPlan:
  """The plan for freshly initialised span parameters (z' = span_init everywhere)."""
  return plan_from_ratios(cfg, [np.full(cfg.n_heads, cfg.span.init, np.float32)] * cfg.n_layers,
                          cfg.plan.growth)


def plan_from_params(cfg: ModelConfig, params) -> SpanPlan:
  """The tightest exact plan for the current span parameters (read on the host)."""
  if cfg.spans != "adaptive":
    return full_plan(cfg)
  return plan_from_ratios(cfg, span_ratios(params))


def check_plan(cfg: ModelConfig, params, plan: SpanPlan) -> None:
  """Refuses a plan that would silently truncate attention."""
  if len(plan.layers) != cfg.n_layers:
    raise ValueError(f"span plan has {len(plan.layers)} layers, the model {cfg.n_layers}")
  ratios = span_ratios(params) if cfg.spans == "adaptive" else None
  for i, lp in enumerate(plan.layers):
    windows = lp.head_windows(cfg.n_heads)
    seen = sorted(h for hs, _ in lp.groups for h in hs)
    if seen != list(range(cfg.n_heads)):
      raise ValueError(f"span plan layer {i}: groups must cover each head once, got {lp.groups}")
    if ratios is None:
      need = np.full(cfg.n_heads, cfg.context)
    else:
      need = needed_tokens(cfg, ratios[i])
    for h in range(cfg.n_heads):
      if windows[h] < need[h] or windows[h] > cfg.context:
        raise ValueError(
            f"span plan layer {i} head {h}: window {windows[h]} does not cover the span plus ramp "
            f"({int(need[h])} tokens, max {cfg.context}); re-derive the plan "
            "(plan.plan_from_params) instead of truncating attention")
    if lp.cache_len < max(windows) and ARCHS[cfg.arch].cache:  # sparse: no cache by design
      raise ValueError(f"span plan layer {i}: cache_len {lp.cache_len} < window {max(windows)}")


def span_ratio_leaves(params) -> list:
  """Per-layer z' parameters (H,) as they are (on the device, or traced), in layer order: the
  one place that knows where the span Transformer keeps them."""
  out = []
  i = 0
  while f"layers_{i}" in params:
    out.append(params[f"layers_{i}"]["attn"]["span_ratio"])
    i += 1
  return out


def span_ratios(params) -> list[np.ndarray]:
  """Per-layer z' arrays (H,) read on the host, in layer order."""
  return [np.asarray(jax.device_get(z)) for z in span_ratio_leaves(params)]


def with_span_ratios(params, ratios: Sequence) -> dict:
  """params with layer i's z' set to ratios[i] (a copy down to the layers; benchmarks and tests
  put spans where a case needs them)."""
  params = dict(params)
  for i, z in enumerate(ratios):
    layer = dict(params[f"layers_{i}"])
    layer["attn"] = dict(layer["attn"], span_ratio=z)
    params[f"layers_{i}"] = layer
  return params


def plan_to_json(plan: SpanPlan) -> list:
  return [{"cache_len": lp.cache_len, "groups": [[list(h), w] for h, w in lp.groups]}
          for lp in plan.layers]


def plan_from_json(data: list) -> SpanPlan:
  return SpanPlan(tuple(
      LayerPlan(cache_len=int(d["cache_len"]),
                groups=tuple((tuple(int(x) for x in h), int(w)) for h, w in d["groups"]))
      for d in data))

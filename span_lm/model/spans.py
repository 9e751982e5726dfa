"""Span masks, span losses and the compile-time span plan.

Distances count back from the query: distance 1 is the previous token, distance S the oldest key
a query may see. The reference's mask template gives column s (0..S-1) the distance d = S - s and
the value clamp((R + z - (d - 1)) / R, 0, 1): the previous token is the paper's "x = 0".

The plan is what makes compute follow the learned span under jit, where shapes are static. For each
layer it fixes (a) how many cached hidden states the layer keeps and (b) a partition of its heads
into groups, each attending over a window of W <= S distances. Windows are multiples of the plan
granularity (64 by default, as the reference) and a head's window always covers its span plus the
ramp, so trimming is exact. The cache keeps a margin beyond the largest window so that a span that
grows by less than the margin finds real hidden states rather than zeros. The reference trims a
layer to its longest head; grouping heads by window lets one long head leave seven short heads cheap.
"""
import dataclasses
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from span_lm.model.config import ModelConfig


def soft_mask(z, distance, ramp):
  """m_z(d) = clamp((R + z - (d - 1)) / R, 0, 1); z and distance broadcast."""
  return clamp01(soft_mask_ramp(z, distance, ramp))


@jax.custom_jvp
def clamp01(x):
  """clip(x, 0, 1) differentiated as the reference's torch.clamp: slope 1 on the closed interval
  [0, 1] (jnp.clip's is 1/2 at either end). Whole-token spans, z' = 0 included, sit on the ends."""
  return jnp.clip(x, 0.0, 1.0)


def clamp01_slope(x):
  """d clamp01(x) / dx: 1 where 0 <= x <= 1, else 0 (for backward passes written by hand)."""
  return jnp.where((x >= 0) & (x <= 1), 1.0, 0.0).astype(x.dtype)


@clamp01.defjvp
def _clamp01_jvp(primals, tangents):
  x, = primals
  t, = tangents
  return clamp01(x), t * clamp01_slope(x)


def soft_mask_ramp(z, distance, ramp):
  """soft_mask before the clamp, (R + z - (d - 1)) / R (for a backward that recomputes it)."""
  return (ramp + z - (distance - 1)) / ramp


def span_stats(z_tokens, cfg: ModelConfig):
  """Average and maximum span in tokens as the reference reports them (ramp included, in [0, S])."""
  avg = jnp.clip(jnp.ceil(jnp.mean(z_tokens)) + cfg.ramp, 0, cfg.span)
  mx = jnp.clip(jnp.ceil(jnp.max(z_tokens)) + cfg.ramp, 0, cfg.span)
  return avg, mx


def clamp_span_params(params):
  """Clips every adaptive span ratio z' (leaves named 'span_ratio') to [0, 1] after an update."""

  def clip(path, x):
    last = path[-1]
    name = getattr(last, "key", getattr(last, "name", None))
    return jnp.clip(x, 0.0, 1.0) if name == "span_ratio" else x

  return jax.tree_util.tree_map_with_path(clip, params)


def span_ratios(params) -> list[np.ndarray]:
  """Per-layer z' arrays (H,) read on the host, in layer order."""
  out = []
  i = 0
  while f"layers_{i}" in params:
    out.append(np.asarray(jax.device_get(params[f"layers_{i}"]["attn"]["span_ratio"])))
    i += 1
  return out


# ----------------------------------------------------------------------------------------------
# The plan.


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
  """No trimming: every head sees all S distances and every cache holds S states.

  arch='sparse' carries no hidden states between blocks: its caches hold one unused state
  (cache_len 1, not 0: Orbax refuses to save zero-size arrays).
  """
  cache_len = 1 if cfg.arch == "sparse" else cfg.span
  lp = LayerPlan(cache_len=cache_len, groups=((tuple(range(cfg.n_heads)), cfg.span),))
  return SpanPlan(layers=(lp,) * cfg.n_layers)


def needed_tokens(cfg: ModelConfig, z_ratio: np.ndarray) -> np.ndarray:
  """Distances with a non-zero mask for each head: ceil(z' S) + R, capped at S (as the reference)."""
  # The mask is non-zero iff d - 1 < R + z, i.e. d <= ceil(z) + R; z is formed in float32 as the
  # model forms it, so the host and the device agree on the boundary.
  z = np.asarray(z_ratio, np.float32) * np.float32(cfg.span)
  return np.minimum(cfg.span, np.ceil(z).astype(np.int64) + cfg.ramp).clip(1)


def _round_up(n: int, g: int, cap: int) -> int:
  return int(min(cap, max(g, math.ceil(n / g) * g)))


def layer_plan_from_windows(cfg: ModelConfig, windows: Sequence[int]) -> LayerPlan:
  """Groups heads by window (or one group at the max window without head grouping).

  The fused kernel (attn_impl != 'xla') takes one group: it skips each head's unused key blocks
  at run time, so only the layer's largest window is a compile-time shape.
  """
  windows = [int(w) for w in windows]
  if not cfg.head_grouping or cfg.attn_impl != "xla":
    windows = [max(windows)] * len(windows)
  by_w: dict[int, list[int]] = {}
  for h, w in enumerate(windows):
    by_w.setdefault(w, []).append(h)
  groups = tuple((tuple(hs), w) for w, hs in sorted(by_w.items()))
  if cfg.span_cache:
    cache_len = min(cfg.span, max(windows) + cfg.plan_margin)
  else:
    cache_len = cfg.span
  return LayerPlan(cache_len=cache_len, groups=groups)


def windows_for(cfg: ModelConfig, need: np.ndarray, growth: float = 1.0) -> list[int]:
  """Head windows for needed tokens: growth x need, rounded up to the granularity, capped at S."""
  if growth > 1.0:
    need = np.ceil(np.asarray(need) * growth).astype(np.int64)
  return [_round_up(int(n), cfg.plan_granularity, cfg.span) for n in need]


def plan_from_ratios(cfg: ModelConfig, ratios: Sequence[np.ndarray], growth: float = 1.0) -> SpanPlan:
  """The tightest plan for these spans; growth > 1 leaves that much headroom per head."""
  if cfg.span_mode != "adaptive":
    return full_plan(cfg)
  return SpanPlan(layers=tuple(
      layer_plan_from_windows(cfg, windows_for(cfg, needed_tokens(cfg, z), growth))
      for z in ratios))


def initial_plan(cfg: ModelConfig) -> SpanPlan:
  """The plan for freshly initialised span parameters (z' = span_init everywhere)."""
  return plan_from_ratios(cfg, [np.full(cfg.n_heads, cfg.span_init, np.float32)] * cfg.n_layers,
                          cfg.plan_growth)


def plan_from_params(cfg: ModelConfig, params) -> SpanPlan:
  """The tightest exact plan for the current span parameters (read on the host)."""
  if cfg.span_mode != "adaptive":
    return full_plan(cfg)
  return plan_from_ratios(cfg, span_ratios(params))


def check_plan(cfg: ModelConfig, params, plan: SpanPlan) -> None:
  """Refuses a plan that would silently truncate attention."""
  if len(plan.layers) != cfg.n_layers:
    raise ValueError(f"span plan has {len(plan.layers)} layers, the model {cfg.n_layers}")
  ratios = span_ratios(params) if cfg.span_mode == "adaptive" else None
  for i, lp in enumerate(plan.layers):
    windows = lp.head_windows(cfg.n_heads)
    seen = sorted(h for hs, _ in lp.groups for h in hs)
    if seen != list(range(cfg.n_heads)):
      raise ValueError(f"span plan layer {i}: groups must cover each head once, got {lp.groups}")
    if ratios is None:
      need = np.full(cfg.n_heads, cfg.span)
    else:
      need = needed_tokens(cfg, ratios[i])
    for h in range(cfg.n_heads):
      if windows[h] < need[h] or windows[h] > cfg.span:
        raise ValueError(
            f"span plan layer {i} head {h}: window {windows[h]} does not cover the span plus ramp "
            f"({int(need[h])} tokens, max {cfg.span}); re-derive the plan "
            "(spans.plan_from_params) instead of truncating attention")
    if lp.cache_len < max(windows) and cfg.arch != "sparse":  # sparse: no cache by design
      raise ValueError(f"span plan layer {i}: cache_len {lp.cache_len} < window {max(windows)}")


def to_ring(caches, pos, n_heads: int):
  """Key/value caches in stream order ((B, L, 2D), oldest state first, as a block leaves them)
  as rings for decoding (SpanTransformer(..., ring_pos=)): per layer (keys, values), each
  (B, H, L, Dh), head-major so that a query reads them where they lie, and after `pos` tokens
  slot j holds the token whose position is congruent to j mod L. pos may be traced."""
  out = []
  for c in caches:
    b, l, d2 = c.shape
    kv = c.reshape(b, l, 2, n_heads, d2 // (2 * n_heads)).transpose(2, 0, 3, 1, 4)
    kv = jnp.roll(kv, jnp.asarray(pos) % l, axis=3)
    out.append((kv[0], kv[1]))
  return tuple(out)


def from_ring(rings, pos):
  """The inverse of to_ring: rings after `pos` tokens -> (B, L, 2D) caches in stream order."""
  out = []
  for k, v in rings:
    b, h, l, dh = k.shape
    kv = jnp.roll(jnp.stack([k, v]), -(jnp.asarray(pos) % l), axis=3)
    out.append(kv.transpose(1, 3, 0, 2, 4).reshape(b, l, 2 * h * dh))
  return tuple(out)


def init_caches(cfg: ModelConfig, plan: SpanPlan | None, batch: int, dtype=jnp.float32,
                kv: bool = False):
  """Zero caches per layer: (B, L, D) hidden states, or (B, L, 2D) keys|values with kv=True."""
  plan = plan or full_plan(cfg)
  width = 2 * cfg.d_model if kv else cfg.d_model
  return tuple(jnp.zeros((batch, lp.cache_len, width), dtype) for lp in plan.layers)


def resize_caches(caches, cfg: ModelConfig, plan: SpanPlan | None):
  """Fits caches to a plan: keeps the newest states, zero-pads on the left (as the reference)."""
  plan = plan or full_plan(cfg)
  out = []
  for c, lp in zip(caches, plan.layers):
    n = c.shape[1]
    if n > lp.cache_len:
      c = c[:, n - lp.cache_len:]
    elif n < lp.cache_len:
      c = jnp.pad(c, ((0, 0), (lp.cache_len - n, 0), (0, 0)))
    out.append(c)
  return tuple(out)


class SpanPlanner:
  """Host-side keeper of the plan during training; every change is a recompilation.

  Growth is immediate (the next step never runs with a window shorter than a span needs) and
  leaves headroom: every head's window is re-fitted to `cfg.plan_growth` x its need (never below
  its current window), so a steadily growing span recompiles geometrically rarely and heads that
  grow together share one change. Shrinking is lazy and noise-proof: once per
  `cfg.plan_shrink_patience` steps the planner takes the largest need each head had over that
  window, adds the same headroom, and shrinks only if that saves at least `MIN_SHRINK_GAIN` of
  the attention keys. So there is at most one shrink per patience window and the shrunk plan still
  covers the spans' recent fluctuation. bench/plan_changes.py counts changes on long runs.
  """
  MIN_SHRINK_GAIN = 0.25

  def __init__(self, cfg: ModelConfig, plan: SpanPlan | None = None):
    self.cfg = cfg
    self.plan = plan or initial_plan(cfg)
    self.changes = 0
    self._shrink_since: int | None = None
    self._max_need: list[np.ndarray] | None = None  # per layer, over the current window
    self._last_growth: int | None = None
    self._burst = 0  # growths in a row, each within plan_shrink_patience steps of the last

  def _windows(self, plan: SpanPlan) -> list[np.ndarray]:
    return [np.asarray(lp.head_windows(self.cfg.n_heads)) for lp in plan.layers]

  def _replan(self, windows: Sequence[np.ndarray]) -> SpanPlan:
    return SpanPlan(tuple(layer_plan_from_windows(self.cfg, w) for w in windows))

  def update(self, ratios: Sequence[np.ndarray] | None, step: int) -> bool:
    """Takes the post-update z' of every layer; returns True when the plan changed."""
    if self.cfg.span_mode != "adaptive" or ratios is None:
      return False
    need = [needed_tokens(self.cfg, z) for z in ratios]
    current = self._windows(self.plan)
    if any(np.any(w < n) for w, n in zip(current, need)):  # grow now, with headroom
      # A growth soon after the last one (spans on the move, as early in training) doubles the
      # headroom for this change: a burst of per-head growths becomes a few changes.
      quick = self._last_growth is not None and step - self._last_growth < self.cfg.plan_shrink_patience
      self._burst = self._burst + 1 if quick else 0
      room = self.cfg.plan_growth * (2.0 ** min(self._burst, 2))
      self.plan = self._replan([np.maximum(w, windows_for(self.cfg, n, room))
                                for w, n in zip(current, need)])
      self._last_growth = step
      self._shrink_since = self._max_need = None
      self.changes += 1
      return True
    if self._shrink_since is None:
      self._shrink_since, self._max_need = step, need
      return False
    self._max_need = [np.maximum(a, n) for a, n in zip(self._max_need, need)]
    if step - self._shrink_since < self.cfg.plan_shrink_patience:
      return False
    target = self._replan([np.minimum(w, windows_for(self.cfg, m, self.cfg.plan_growth))
                           for w, m in zip(current, self._max_need)])
    self._shrink_since = self._max_need = None
    if target.attention_keys() <= (1 - self.MIN_SHRINK_GAIN) * self.plan.attention_keys():
      self.plan = target
      self.changes += 1
      return True
    return False

  def state_dict(self) -> dict[str, Any]:
    return {"plan": plan_to_json(self.plan), "changes": self.changes,
            "shrink_since": self._shrink_since,
            "max_need": None if self._max_need is None else [m.tolist() for m in self._max_need],
            "last_growth": self._last_growth, "burst": self._burst}

  def load_state_dict(self, d: dict[str, Any]) -> None:
    self.plan = plan_from_json(d["plan"])
    self.changes = int(d.get("changes", 0))
    self._shrink_since = d.get("shrink_since")
    m = d.get("max_need")
    self._max_need = None if m is None else [np.asarray(x, np.int64) for x in m]
    if self._shrink_since is not None and self._max_need is None:  # an older checkpoint
      self._shrink_since = None
    self._last_growth = d.get("last_growth")
    self._burst = int(d.get("burst", 0))


def plan_to_json(plan: SpanPlan) -> list:
  return [{"cache_len": lp.cache_len, "groups": [[list(h), w] for h, w in lp.groups]}
          for lp in plan.layers]


def plan_from_json(data: list) -> SpanPlan:
  return SpanPlan(tuple(
      LayerPlan(cache_len=int(d["cache_len"]),
                groups=tuple((tuple(int(x) for x in h), int(w)) for h, w in d["groups"]))
      for d in data))

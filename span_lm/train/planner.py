"""The host-side keeper of the span plan during training (every change is a recompilation)."""
from typing import Any, Sequence

import numpy as np

from span_lm.model.config import ModelConfig
from span_lm.model.plan import (SpanPlan, initial_plan, layer_plan_from_windows, needed_tokens,
                                plan_from_json, plan_to_json, windows_for)


class SpanPlanner:
  """Host-side keeper of the plan during training; every change is a recompilation.

  Growth is immediate (the next step never runs with a window shorter than a span needs) and
  leaves headroom: every head's window is re-fitted to `cfg.plan.growth` x its need (never below
  its current window), so a steadily growing span recompiles geometrically rarely and heads that
  grow together share one change. Shrinking is lazy and noise-proof: once per
  `cfg.plan.shrink_patience` steps the planner takes the largest need each head had over that
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
    if self.cfg.spans != "adaptive" or ratios is None:
      return False
    need = [needed_tokens(self.cfg, z) for z in ratios]
    current = self._windows(self.plan)
    if any(np.any(w < n) for w, n in zip(current, need)):  # grow now, with headroom
      # A growth soon after the last one (spans on the move, as early in training) doubles the
      # headroom for this change: a burst of per-head growths becomes a few changes.
      patience = self.cfg.plan.shrink_patience
      quick = self._last_growth is not None and step - self._last_growth < patience
      self._burst = self._burst + 1 if quick else 0
      room = self.cfg.plan.growth * (2.0 ** min(self._burst, 2))
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
    if step - self._shrink_since < self.cfg.plan.shrink_patience:
      return False
    target = self._replan([np.minimum(w, windows_for(self.cfg, m, self.cfg.plan.growth))
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

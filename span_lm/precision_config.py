"""The run config's loss-scaling fields (config.train.loss_scale*): names, range, the one check.

Plain Python (no JAX), below both users, as span_lm/optim_config.py: span_lm/config.py validates
a run config with it before anything is traced; span_lm/train/loss_scale.py implements the
scaling (its docstring says how and why).
"""
import math
from typing import Any

MODES = ("auto", "dynamic", "off")  # auto: dynamic for model.dtype='float16', else off
MIN_SCALE = 1.0  # at this scale an overflow is a true non-finite gradient: train.nonfinite decides
MAX_SCALE = 2.0 ** 64  # keeps the scale a finite float32 power of two, S * loss far from overflow


def enabled(mode: str, dtype: str) -> bool:
  """Whether a run with train.loss_scale=`mode` and model.dtype=`dtype` scales its loss."""
  return mode == "dynamic" or (mode == "auto" and dtype == "float16")


def check(mode: Any, initial: Any, period: Any) -> None:
  """Raises ValueError naming the field (config.train.loss_scale*) of a bad value."""
  if mode not in MODES:
    raise ValueError(f"config.train.loss_scale={mode!r}: choose one of {MODES} (auto: dynamic "
                     "loss scaling when model.dtype='float16')")
  ok = (isinstance(initial, (int, float)) and not isinstance(initial, bool)
        and math.isfinite(initial))
  if not (ok and MIN_SCALE <= initial <= MAX_SCALE and math.frexp(initial)[0] == 0.5):
    raise ValueError(f"config.train.loss_scale_init={initial!r}: must be a power of two in "
                     "[1, 2**64] (e.g. 32768.0 = 2**15): scaling by a power of two is exact")
  if isinstance(period, bool) or not isinstance(period, int) or period < 1:
    raise ValueError(f"config.train.loss_scale_period={period!r}: must be an integer >= 1 (finite "
                     "steps in a row before the scale doubles)")

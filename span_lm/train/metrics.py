"""Metrics: a JSON-lines file (the ground truth), TensorBoard events (the view), Weights & Biases
where asked (train/wandb_log.py), console lines, and a progress bar (tqdm: terminals and notebooks).

Only process 0 writes. Values are converted to plain Python numbers / lists before writing. A
resumed run first drops the rows past its checkpoint, so replayed steps are not logged twice.
"""
import json
import logging
import math
import os
import sys
import warnings
from typing import Any

import jax
import numpy as np

LN2 = math.log(2.0)


def _plain(v: Any) -> Any:
  v = jax.device_get(v)
  if isinstance(v, (np.ndarray, np.generic)):
    return v.tolist()
  return v


class MetricWriter:

  def __init__(self, workdir: str | None, tensorboard: bool = True, wandb=None):
    """wandb: a train/wandb_log.WandbLog that gets every row too (and is closed with this)."""
    self.active = workdir is not None and jax.process_index() == 0
    self._jsonl = None
    self._tb = None
    self._wandb = wandb
    if not self.active:
      return
    os.makedirs(workdir, exist_ok=True)
    self.path = os.path.join(workdir, "metrics.jsonl")
    self._jsonl = open(self.path, "a", encoding="utf-8")
    if tensorboard:
      try:
        from tensorboardX import SummaryWriter  # optional view
        self._tb = SummaryWriter(os.path.join(workdir, "tb"))
      except ImportError:  # pragma: no cover
        logging.warning("tensorboardX is not installed; writing metrics.jsonl only")

  def truncate_after(self, step: int) -> int:
    """Drops rows logged past `step` (and a torn last line): a resumed run replays those steps.

    Rewrites the file atomically; returns the number of rows dropped.
    """
    if not self.active:
      return 0
    self._jsonl.close()
    with open(self.path, encoding="utf-8") as f:
      lines = f.readlines()
    kept = []
    for line in lines:
      try:
        if int(json.loads(line)["step"]) <= step:
          kept.append(line if line.endswith("\n") else line + "\n")
      except (ValueError, KeyError, TypeError):  # a row cut short by a kill: dropped
        pass
    dropped = sum(1 for line in lines if line.strip()) - len(kept)
    if dropped:
      tmp = self.path + ".tmp"
      with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(kept)
      os.replace(tmp, self.path)
    self._jsonl = open(self.path, "a", encoding="utf-8")
    return dropped

  def write(self, step: int, split: str, values: dict[str, Any]) -> None:
    if not self.active:
      return
    rec = {"step": int(step), "split": split}
    rec.update({k: _plain(v) for k, v in values.items()})
    self._jsonl.write(json.dumps(rec) + "\n")
    self._jsonl.flush()
    if self._tb is not None:
      for k, v in rec.items():
        if k in ("step", "split"):
          continue
        if isinstance(v, (int, float)) and math.isfinite(v):
          self._tb.add_scalar(f"{split}/{k}", v, step)
        elif isinstance(v, list) and v and all(isinstance(x, (int, float)) for x in v):
          for i, x in enumerate(v):
            self._tb.add_scalar(f"{split}/{k}/{i}", x, step)
    if self._wandb is not None:
      self._wandb.write(int(step), split, {k: v for k, v in rec.items()
                                           if k not in ("step", "split")})

  def close(self) -> None:
    if self._jsonl is not None:
      self._jsonl.close()
      self._jsonl = None
    if self._tb is not None:
      self._tb.close()
      self._tb = None
    if self._wandb is not None:
      self._wandb.close()
      self._wandb = None


def read_metrics(workdir: str) -> list[dict[str, Any]]:
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def _interactive() -> bool:
  return sys.stderr.isatty() or "ipykernel" in sys.modules


def progress(total: int | None, initial: int = 0, desc: str = "train", leave: bool = True):
  """A tqdm bar on process 0 (tqdm.auto: a widget in Colab/Jupyter), or None (other processes,
  tqdm not installed). Off a terminal (CI logs, SLURM files) it redraws at most every 60 s so logs
  are not flooded; the step/loss lines are printed either way."""
  if jax.process_index() != 0:
    return None
  try:
    with warnings.catch_warnings():  # a notebook without ipywidgets: a text bar, no warning
      warnings.simplefilter("ignore")
      from tqdm.auto import tqdm  # pylint: disable=g-import-not-at-top
  except ImportError:  # pragma: no cover
    return None
  interactive = _interactive()
  return tqdm(total=total, initial=initial, desc=desc, unit="step" if desc == "train" else "block",
              dynamic_ncols=True, leave=leave, mininterval=0.2 if interactive else 60.0,
              maxinterval=60.0 if interactive else 600.0, smoothing=0.05, file=sys.stderr)


def echo(msg: str) -> None:
  """Prints a line on process 0 without tearing an active progress bar."""
  if jax.process_index() != 0:
    return
  try:
    from tqdm.auto import tqdm  # pylint: disable=g-import-not-at-top
  except ImportError:  # pragma: no cover
    print(msg, flush=True)
    return
  tqdm.write(msg, file=sys.stdout)
  sys.stdout.flush()


def say(msg: str) -> None:
  """`echo`, and the same line to the 'span_lm' logger (a run's log file keeps what it printed)."""
  echo(msg)
  logging.getLogger("span_lm").info(msg)

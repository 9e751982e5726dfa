"""Weights & Biases, optional (`pip install span_lm[wandb]`): --config.train.wandb=PROJECT logs the
rows metrics.jsonl gets (as `<split>/<name>`, lists as `<split>/<name>/<i>`) and the run's config.

The W&B run id is kept in <workdir>/wandb_id, so a resumed run continues the same W&B run
(resume='allow'); its files go to <workdir>/wandb/. W&B's own console capture is off (the
progress bar and the log lines stay as they are). Only process 0 logs. Offline: WANDB_MODE=offline
writes the run under <workdir>/wandb/ for a later `wandb sync`.
"""
import json
import math
import os
import secrets
import string
from typing import Any

ID_FILE = "wandb_id"


def new_id() -> str:
  """A W&B run id: 8 lowercase letters and digits, as W&B makes them."""
  return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def _id(workdir: str, new_id) -> tuple[str, bool]:
  """(the run's W&B id, whether it continues an earlier one): read from, or written to, ID_FILE."""
  path = os.path.join(workdir, ID_FILE)
  try:
    with open(path, encoding="utf-8") as f:
      run_id = f.read().strip()
    if run_id:
      return run_id, True
  except FileNotFoundError:
    pass
  run_id = new_id()
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    f.write(run_id + "\n")
  os.replace(tmp, path)
  return run_id, False


class WandbError(RuntimeError):
  """W&B could not start the run (not logged in, no network, a bad project or entity): one line."""


class WandbLog:
  """One W&B run for one run directory."""

  def __init__(self, config, workdir: str, echo=print):
    import wandb  # pylint: disable=g-import-not-at-top  (optional; validate refused it if absent)
    t = config.train
    run_id, resumed = _id(workdir, new_id)
    self._wandb = wandb
    try:
      self.run = wandb.init(
          project=t.wandb, entity=t.wandb_entity or None,
          name=t.wandb_name or os.path.basename(os.path.abspath(workdir)), id=run_id,
          resume="allow", dir=os.path.abspath(workdir),
          config=json.loads(config.to_json_best_effort()),
          settings=wandb.Settings(console="off"))
    except Exception as e:  # pylint: disable=broad-except  (W&B's errors: UsageError, CommError...)
      first = (str(e).strip().splitlines() or [type(e).__name__])[0]
      raise WandbError(
          f"wandb: could not start run {run_id} of project {t.wandb!r} ({type(e).__name__}: "
          f"{first[:300]}); log in with `wandb login` (or set WANDB_API_KEY), check "
          "--config.train.wandb/wandb_entity, or train offline with WANDB_MODE=offline") from e
    # A resumed W&B run already holds the steps up to where it stopped; W&B refuses steps below
    # its current one, which the resumed run replays from its checkpoint: those are not resent.
    self._first = int(getattr(self.run, "step", 0) or 0) if resumed else 0
    echo(f"wandb: {'resumed' if resumed else 'started'} run {run_id} of project {t.wandb}"
         + (f" ({self.run.url})" if getattr(self.run, "url", None) else "")
         + (f"; steps below {self._first} are already logged" if self._first else ""))

  def write(self, step: int, split: str, values: dict[str, Any]) -> None:
    if step < self._first:
      return
    row = {}
    for k, v in values.items():
      if isinstance(v, bool):
        v = int(v)
      if isinstance(v, (int, float)) and math.isfinite(v):
        row[f"{split}/{k}"] = v
      elif isinstance(v, list) and v and all(isinstance(x, (int, float)) for x in v):
        row.update({f"{split}/{k}/{i}": x for i, x in enumerate(v)})
    if row:
      self.run.log(row, step=int(step))

  def close(self) -> None:
    if self.run is not None:
      self.run.finish()
      self.run = None

"""The run config's optim section: the accepted names and the one check of its fields.

Plain Python (no JAX, no optax), below both users: span_lm/config.py validates a run config with
it before anything is traced, span_lm/train/optimizer.py builds the optimizer from the checked
fields. The config module imports nothing from span_lm/train (tests/test_import_graph.py).
"""
import math
from typing import Any

OPTIMIZERS = ("adagrad", "sgd", "momentum", "adam")
SCHEDULES = ("warmup", "cosine")  # warmup: linear warmup then constant


def _field(optim_cfg: Any, name: str, default: Any = None) -> Any:
  try:
    return optim_cfg[name]
  except (KeyError, AttributeError):
    if default is None:
      raise ValueError(f"config.optim.{name} is missing") from None
    return default


def check_config(optim_cfg: Any) -> dict[str, Any]:
  """Reads and checks the optim fields (the one check of them: config.validate calls it too), so a
  bad value fails before anything is traced; absent fields take the schema's defaults."""
  f = {"name": _field(optim_cfg, "name"), "lr": _field(optim_cfg, "lr"),
       "momentum": _field(optim_cfg, "momentum", 0.0),
       "grad_clip": _field(optim_cfg, "grad_clip", 0.0),
       "warmup": _field(optim_cfg, "warmup", 0),
       "batch_split": _field(optim_cfg, "batch_split", 1),
       "weight_decay": _field(optim_cfg, "weight_decay", 0.0),
       "schedule": _field(optim_cfg, "schedule", "warmup"),
       "decay_steps": _field(optim_cfg, "decay_steps", 0)}

  def bad(field, why):
    raise ValueError(f"config.optim.{field}={f[field]!r}: {why}")

  if f["name"] not in OPTIMIZERS:
    bad("name", f"unknown optimizer; choose one of {OPTIMIZERS}")
  for k in ("lr", "momentum", "grad_clip"):
    if isinstance(f[k], bool) or not isinstance(f[k], (int, float)) or not math.isfinite(f[k]):
      bad(k, "must be a finite number")
  if not f["lr"] > 0:
    bad("lr", "must be > 0")
  if not 0.0 <= f["momentum"] < 1.0:
    bad("momentum", "must be in [0, 1)")
  if f["name"] == "momentum" and f["momentum"] == 0:
    bad("momentum", "optimizer 'momentum' needs momentum > 0 (or use name 'sgd')")
  if not f["grad_clip"] >= 0:
    bad("grad_clip", "must be >= 0 (0: off)")
  for k in ("warmup", "batch_split"):
    if isinstance(f[k], bool) or not isinstance(f[k], int):
      bad(k, "must be an integer")
  if f["warmup"] < 0:
    bad("warmup", "must be >= 0 (0: off)")
  if f["batch_split"] < 1:
    bad("batch_split", "must be >= 1")
  wd = f["weight_decay"]
  if isinstance(wd, bool) or not isinstance(wd, (int, float)) or not wd >= 0:
    bad("weight_decay", "must be a number >= 0 (0: off)")
  if wd and f["name"] != "adam":
    bad("weight_decay", f"is implemented for 'adam' (decoupled, AdamW) only, not {f['name']!r}")
  if f["schedule"] not in SCHEDULES:
    bad("schedule", f"choose one of {SCHEDULES}")
  if isinstance(f["decay_steps"], bool) or not isinstance(f["decay_steps"], int):
    bad("decay_steps", "must be an integer")
  if f["schedule"] == "cosine" and f["decay_steps"] <= f["warmup"]:
    bad("decay_steps", f"the cosine needs decay_steps > warmup={f['warmup']} (usually train.steps)")
  return f

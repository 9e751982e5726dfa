"""Restoring a run from its checkpoints (train/checkpoint.py stores them; this reads them back).

Before any array is read a checkpoint's meta is checked against this run's model (`check_meta`):
a different model is a ValueError listing the fields, never a half-restored state. Without a step
the newest readable checkpoint is used: an unreadable one is reported by path and skipped. States
restore laid out for this run's mesh and loss scaling, whatever the saving run had. `init_from`
starts a new phase from another run's checkpoint.

`run` is a run.Run: what these read of it is its checkpointer, model config, abstract state and
layout (they never build one, so train/run.py imports this module, not the other way round).
"""
import json
import os

import jax
import jax.numpy as jnp

from span_lm import run_dir
from span_lm.model import archs
from span_lm.model import config as model_config
from span_lm.model import plan as plan_lib
from span_lm.train import checkpoint as ckpt_lib
from span_lm.train import loss_scale as loss_scale_lib
from span_lm.train import metrics as metrics_lib
from span_lm.train import sharding as sharding_lib

_echo = metrics_lib.say

# ---- identity ------------------------------------------------------------------------------------


def check_meta(model_cfg, meta: dict, directory: str) -> None:
  """Raises a ValueError listing the fields where the checkpoint's model (meta['model_cfg']) is
  not this config's: restoring it would give numbers for another model."""
  # Checkpoints written before config.model's sections hold its flat fields: upgraded first.
  saved = run_dir.flatten(run_dir.upgrade_model(meta.get("model_cfg", {})))
  mine = run_dir.flatten(json.loads(json.dumps(model_config.saved(model_cfg))))  # lists
  keys = [k for k in mine if archs.is_identity(k)] + list(archs.ARCHS[model_cfg.arch].identity(
      model_cfg))
  diff = [f"{k}: checkpoint {saved.get(k)!r}, config {mine[k]!r}" for k in keys
          if k in saved and saved[k] != mine[k]]
  if diff:
    raise ValueError(f"the checkpoint in {directory} was trained with a different "
                     "model:\n  " + "\n  ".join(diff))


# ---- the step to read ----------------------------------------------------------------------------


def newest_readable(run, read, step, move_aside: bool):
  """read(step) for `step`, or (None) for the newest step that reads: an unreadable one is
  reported by path and skipped (renamed '<step>.unreadable' when move_aside, so the run can
  save that step again; nothing is deleted), and so is a damaged one, whose contents differ from
  the fingerprints saved with it (checkpoint.CheckpointDamagedError: '<step>.damaged'). A model
  mismatch is never skipped. A step that
  vanished while read was deleted by a run saving into the directory (it keeps its newest
  max_to_keep): not damage; the directory is listed again and its newest step read."""
  if step is not None:
    return read(step)
  bad, damaged, tried, vanished = [], set(), set(), 0
  while True:
    untried = [s for s in run.ckpt.all_steps(reread=vanished > 0) if s not in tried]
    if not untried:
      break
    s = untried[-1]
    tried.add(s)
    try:
      out = read(s)
    except (ckpt_lib.CheckpointReadError, FileNotFoundError) as e:
      if s not in run.ckpt.all_steps(reread=True) and vanished < _VANISHED_MAX:
        vanished += 1
        _echo(f"checkpoint step {s} was deleted while read (a run is saving into "
              f"{run.ckpt.directory}); reading its newest step")
        continue
      _echo(f"warning: {e}; trying the previous checkpoint")
      bad.append(s)
      if isinstance(e, ckpt_lib.CheckpointDamagedError):
        damaged.add(s)
      continue
    if bad and move_aside and run.process_index == 0 and run.process_count == 1:
      for b in bad:
        why = "damaged" if b in damaged else "unreadable"
        _echo(f"warning: {why} checkpoint step {b} moved aside to "
              f"{run.ckpt.move_aside(b, why)}")
    if bad:
      _echo(f"using checkpoint step {s} in {run.ckpt.directory}")
    return out
  if bad:
    raise ckpt_lib.CheckpointReadError(
        bad[0], run.ckpt.directory,
        f"none of its {len(bad)} checkpoints can be read"
        + (f" ({len(damaged)} damaged: their contents differ from their saved fingerprints)"
           if damaged else "")
        + "; move the directory aside to start afresh, or restore it from a backup")
  raise FileNotFoundError(f"no checkpoint in {run.ckpt.directory}")


_VANISHED_MAX = 20  # steps deleted under a reader before it gives up (a run saving every step)


def meta_and_plan(run, step):
  """The meta of checkpoint `step` (checked: `check_meta`) and the span plan it was saved with."""
  meta = run.ckpt.restore_meta(step)
  try:
    plan = plan_lib.plan_from_json(meta["planner"]["plan"])
    int(meta["step"])
  except (KeyError, TypeError, ValueError) as e:
    raise ckpt_lib.CheckpointReadError(step, run.ckpt.step_path(step),
                                       f"its meta has no valid {e} entry") from e
  check_meta(run.model_cfg, meta, run.ckpt.directory)
  return meta, plan


# ---- states --------------------------------------------------------------------------------------


def restore(run, step=None, *, move_aside: bool = False):
  """(state, meta) from the work dir, laid out for this mesh (step None: the newest readable).
  A checkpoint saved with loss scaling restores into a run without (the scale is dropped) and
  the other way round (the scale starts at train.loss_scale_init), e.g. a float32 run resumed
  in float16: meta['loss_scale'] says which it has (absent before loss scaling existed)."""
  def read(s):
    meta, plan = meta_and_plan(run, s)
    return read_state(run, run.ckpt, s, meta, plan), meta
  return newest_readable(run, read, step, move_aside)


def read_state(run, ckpt, step, meta, plan):
  """The state of checkpoint `step` in `ckpt`, laid out for this mesh and this run's loss
  scaling: a scale saved by a run with scaling is dropped here without it, and one starts at
  train.loss_scale_init where the checkpoint has none (meta['loss_scale'])."""
  _, abstract, shardings = run.abstract_state(plan)
  mine, saved = "loss_scale" in abstract, bool(meta.get("loss_scale", False))
  if mine and not saved:
    abstract, shardings = dict(abstract), dict(shardings)
    del abstract["loss_scale"], shardings["loss_scale"]
  elif saved and not mine:
    ls = jax.eval_shape(lambda: loss_scale_lib.init(1.0))
    abstract = dict(abstract, loss_scale=ls)
    shardings = dict(shardings, loss_scale=jax.tree.map(lambda _: run.replicated, ls))
  state, _ = ckpt.restore(sharding_lib.with_shardings(abstract, shardings), step)
  if mine != saved:
    state = dict(state)
    if mine:
      state["loss_scale"] = jax.device_put(loss_scale_lib.init(run.loss_scale), run.replicated)
    else:
      del state["loss_scale"]
    _echo(f"checkpoint step {step} was saved {'without' if mine else 'with'} loss scaling; "
          + (f"the scale starts at {run.loss_scale:g}" if mine else "this run has none "
             f"(train.loss_scale={run.config.train.loss_scale!r}, model.dtype="
             f"{run.model_cfg.dtype!r}): its scale is dropped"))
  return state


def restore_params(run, step=None):
  """(params, span plan, meta) of a checkpoint: a params-only restore for evaluation/tools."""
  def read(s):
    meta, plan = meta_and_plan(run, s)
    _, abstract, shardings = run.abstract_state(plan)
    target = sharding_lib.with_shardings(abstract["params"], shardings["params"])
    params = run.ckpt.restore_params(target, s)
    plan_lib.check_plan(run.model_cfg, params, plan)
    return params, plan, meta
  return newest_readable(run, read, step, move_aside=False)


# ---- another run's checkpoint --------------------------------------------------------------------


def init_from(run, planner, fresh, path: str):
  """Starts a new phase (e.g. the reference's lr/10 fine-tuning) from another run's checkpoint:
  parameters, optimizer state and span plan come from it; step, data position and caches restart."""
  directory = os.path.join(path, "checkpoints") if os.path.isdir(os.path.join(path, "checkpoints")) else path
  with ckpt_lib.Checkpointer(directory, max_to_keep=None) as src:
    if src.latest_step() is None:
      raise FileNotFoundError(f"config.train.init_from={path!r}: no checkpoint in {directory}")
    meta = src.restore_meta()
    check_meta(run.model_cfg, meta, run.ckpt.directory)
    planner.load_state_dict(meta["planner"])
    planner.changes = 0
    state = read_state(run, src, src.latest_step(), meta, planner.plan)
  _echo(f"initialised from {directory} step {meta['step']} (params, optimizer state, span plan)")
  return dict(state, step=fresh["step"], rng=fresh["rng"],
              caches=tuple(jnp.zeros_like(c) for c in state["caches"]),
              eval_caches=tuple(jnp.zeros_like(c) for c in state["eval_caches"]))

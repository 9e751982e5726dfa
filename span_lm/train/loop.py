"""The training loop and the full evaluation, callable from main.py or a notebook.

`train(config)` resumes automatically from `config.workdir` when it holds a checkpoint. Every
check that can fail on the user's input (config values, data files, checkpoint compatibility)
runs before the first compilation (train/run.py builds the run, train/restore.py reads its
checkpoints), and before those the run directory's lock is taken (train/run_lock.py: one
training process per directory). Each log interval reports tokens/s and MFU; train.profile_*
traces steps (train/telemetry.py); train.wandb logs to Weights & Biases
(train/wandb_log.py); a device out of memory is one line naming the step (train/oom.py).

Several processes (span_lm/train/distributed.py): each reads only its own contiguous share of the
B streams and the global batch is assembled with jax.make_array_from_process_local_data; every
process runs the same loop (checkpoints are collective, Orbax writes them), only process 0 prints
and writes metrics. Faults: SIGTERM, the preemption sync point or a first Ctrl-C checkpoints the
current step and stops (a second Ctrl-C aborts); a non-finite loss is never applied (in the step)
and stops the run or is counted (config.train.nonfinite); an unreadable latest checkpoint is
reported by path and the run resumes from the newest readable one.

The host reads nothing from the device between logging, evaluation and checkpoint steps, so
steps are dispatched ahead for adaptive spans as for fixed ones: non-finite flags and span ratios
are read at those steps. A step whose span plan the spans outgrew in the meantime changes nothing
(train/steps.py); the host then widens the plan and replays the data from that step on
(train/pending.py keeps the unread steps and says what to replay). The plan's
headroom alone could not be trusted: Adagrad moves z' by up to lr per step (its accumulator holds
g^2, so |g| / sqrt(acc) <= 1), lr x S tokens, e.g. 573 at the paper's lr 0.07 and S 8192.
"""
import logging
import math
import os
import time
from typing import Any

import jax
import numpy as np

from span_lm.model import caches as caches_lib
from span_lm.model import config as model_config
from span_lm.model import plan as plan_lib
from span_lm.train import distributed as dist_lib
from span_lm.train import evaluation
from span_lm.train import metrics as metrics_lib
from span_lm.train import oom as oom_lib
from span_lm.train import pending as pending_lib
from span_lm.train import planner as planner_lib
from span_lm.train import restore as restore_lib
from span_lm.train import steps as steps_lib
from span_lm.train import telemetry
from span_lm.train.metrics import LN2, MetricWriter
from span_lm.train.run import Run

log = logging.getLogger("span_lm")

# Steps (and evaluation blocks) dispatched ahead of the host before it waits: train/pending.py
MAX_IN_FLIGHT = pending_lib.MAX_IN_FLIGHT

_echo = metrics_lib.say


def _host_reads():
  """Marks where the loop reads from the device (logging, evaluation, checkpoints): elsewhere a
  jax.transfer_guard_device_to_host('disallow_explicit') around training must hold."""
  return jax.transfer_guard_device_to_host("allow")


class NonFiniteLossError(FloatingPointError):
  """The loss or gradient went non-finite and config.train.nonfinite='stop'."""


def _fit_caches(run: Run, state, plan):
  state = dict(state)
  for key in ("caches", "eval_caches"):
    state[key] = tuple(jax.device_put(c, run.cache_sharding)
                       for c in caches_lib.resize_caches(state[key], run.model_cfg, plan))
  return state


def train(config) -> dict[str, Any]:
  """Trains (or resumes) the run described by `config`; returns the last metrics.

  last['stopped'] is None for a finished run, 'preempted' (SIGTERM, the preemption sync point) or
  'interrupted' (Ctrl-C) when it checkpointed the current step and stopped early.
  """
  run = Run(config, lock=True)
  try:
    return _train(run)
  finally:
    try:
      run.ckpt.close()
    finally:
      run.release()


def _train(run: Run) -> dict[str, Any]:
  try:
    run.where = "building the training state"
    tr = _Training(run)
    try:
      tr.train_steps()
      tr.finish()
    finally:
      tr.close()
  except Exception as e:  # pylint: disable=broad-except
    oom = oom_lib.of(e, run.where, run.config)
    if oom is None:
      raise
    raise oom from e
  return tr.result()


class _Training:
  """One call of `train`, cut into its phases (start, dispatch, read, log, evaluate, save,
  finish); the attributes are what the phases share."""

  def __init__(self, run: Run):
    self.run, self.config = run, run.config
    self.d, self.t = run.config.data, run.config.train
    self.planner = planner_lib.SpanPlanner(run.model_cfg)
    self.train_batcher = run.streams(run.splits.train, self.d.batch, self.config.seed)
    self.valid_batcher = run.streams(run.splits.valid, self.d.eval_batch, self.config.seed + 1)
    self.skipped = 0  # non-finite updates dropped so far (config.train.nonfinite='skip')
    self.start, self.state = self._start()
    t = self.t
    self.wandb = None
    if t.wandb:  # process 0 logs; the others stop with it if W&B cannot start
      from span_lm.train import wandb_log  # pylint: disable=g-import-not-at-top  (optional)
      self.wandb = dist_lib.on_process_0(
          lambda: wandb_log.WandbLog(self.config, run.workdir, echo=_echo),
          lambda: wandb_log.WandbError("wandb: process 0 could not start the W&B run (its "
                                       "output says why): not training"))
    self.writer = MetricWriter(run.workdir, tensorboard=t.tensorboard, wandb=self.wandb)
    dropped = self.writer.truncate_after(self.start)  # rows this run replays (after a kill -9)
    if dropped:
      log.info("metrics.jsonl: dropped %d rows past step %d", dropped, self.start)
    self.watch = dist_lib.PreemptionWatch(enabled=t.preemption)
    self.ctrl_c = dist_lib.CtrlC(enabled=run.process_count == 1)
    self.bar = metrics_lib.progress(t.steps, initial=self.start)
    self.throughput = telemetry.Throughput(
        run.model_cfg, self.d.batch, self.d.block, num_devices=jax.device_count(),
        device_kind=jax.devices()[0].device_kind, peak_tflops=t.peak_tflops)
    if self.throughput.peak is None:
      _echo(f"mfu: null in the logs: {self.throughput.peak_source}")
    self.profile = telemetry.Profile(run.workdir, t.profile_start, t.profile_steps,
                                     self.start + 1, _echo, active=run.process_index == 0)
    self.eval_batches = t.eval_batches or math.ceil(t.eval_every / 10)
    self.last: dict[str, Any] = {}
    self.window_t0 = time.perf_counter()
    self.pending = pending_lib.PendingSteps(MAX_IN_FLIGHT)
    self.metrics = None  # the last dispatched step's
    self.postfix: dict[str, str] = {}  # the progress bar's throughput fields
    self.stopped = None
    self.step = self.start

  def _start(self):
    """(first step, state): resumed from the work dir's checkpoint, or fresh (or init_from)."""
    run, cfg = self.run, self.run.model_cfg
    if run.ckpt.latest_step() is not None:
      state, meta = run.restore(move_aside=True)
      self.planner.load_state_dict(meta["planner"])
      self.train_batcher.state = meta["data"]["train"]
      self.valid_batcher.state = meta["data"]["valid"]
      start = int(meta["step"])
      self.skipped = int(meta.get("nonfinite_skipped", 0))
      _echo(f"resumed from {run.ckpt.directory} at step {start}")
      return start, state
    state = run.init_state(self.planner.plan)
    if self.t.init_from:
      from span_lm.train import from_export  # pylint: disable=g-import-not-at-top
      if from_export.export_dir(self.t.init_from):  # a directory mode=export wrote
        state = from_export.init_from(run, self.planner, self.t.init_from)
      else:
        state = restore_lib.init_from(run, self.planner, state, self.t.init_from)
    n_params = sum(x.size for x in jax.tree.leaves(state["params"]))
    _echo(f"model: {n_params / 1e6:.2f}M parameters; {cfg.n_layers} layers, span {cfg.context} "
          f"({cfg.spans}); data {run.splits.name}: {len(run.splits.train):,} train tokens, "
          f"vocab {run.splits.vocab_size}")
    # Never lose the config that produced a run.
    if jax.process_index() == 0:
      os.makedirs(run.workdir, exist_ok=True)
      with open(os.path.join(run.workdir, "config.json"), "w") as f:
        f.write(self.config.to_json_best_effort(indent=2))
    return 0, state

  def meta_at(self, step):
    return {"step": step, "planner": self.planner.state_dict(),
            "data": {"train": self.train_batcher.state.to_dict(),
                     "valid": self.valid_batcher.state.to_dict()},
            "model_cfg": model_config.saved(self.run.model_cfg), "config": self.config.to_dict(),
            "compilations": len(self.run.compiler.compilations),
            "nonfinite_skipped": self.skipped, "loss_scale": self.run.loss_scale is not None}

  def train_steps(self):
    t = self.t
    while self.step < t.steps:
      self._dispatch()
      step = self.step
      stop = self.watch.should_stop(step)
      if self.ctrl_c.requested and not stop:
        stop = "interrupted"
      elif stop:
        stop = "preempted"
      do_log = step % t.log_every == 0 or step == t.steps
      do_eval = step % t.eval_every == 0 or step == t.steps
      do_save = self.run.ckpt.should_save(step) or step == t.steps or stop
      if not (do_log or do_eval or do_save):
        continue
      with _host_reads():
        if self._read():  # never log, evaluate or checkpoint past an unread step
          continue
        if do_log:
          self._log()
        if do_eval:
          self._evaluate()
        if do_save:
          if self.run.lock is not None:
            self.run.lock.check()
          self.run.ckpt.save(step, self.state, self.meta_at(step),
                             force=step == t.steps or bool(stop))
        if stop:
          self._stop(stop)
          break

  def _dispatch(self):
    """Runs one step without waiting for it (the device queue is bounded by PendingSteps)."""
    run, plan, s = self.run, self.planner.plan, self.step + 1
    data_before = self.train_batcher.state
    blk = next(self.train_batcher)
    batch = run.put_batch(steps_lib.host_batch(blk.x, blk.y, blk.reset))
    self.profile.before(s)
    with jax.profiler.StepTraceAnnotation("train", step_num=s):
      run.where = f"compiling the train step for step {s}"
      fn = run.compiler.train(plan, self.state, batch)
      run.where = f"at step {s}"
      self.state, self.metrics = fn(self.state, batch)
    self.step = s
    self.pending.push(s, self.metrics, data_before, flops=self.throughput.step_flops(plan))
    self.profile.after(s, self.metrics)
    if self.bar is not None:
      self.bar.update(1)

  def _read(self) -> bool:
    """Reads the flags and span ratios of every pending step, in order; returns True when the
    run went back (a step ran on a plan its spans outgrew: it and all later ones were no-ops)."""
    if not len(self.pending):
      return False
    reads, refused = self.pending.drain()
    plan_changed = False
    for r in reads:
      if r.skipped:
        self._nonfinite(r.step)
      if r.ratios is not None and self.planner.update(r.ratios, r.step):
        plan_changed = True
        _echo(f"step {r.step}: span plan change #{self.planner.changes}: "
              f"{self.planner.plan.describe()}")
    if refused is not None:
      self._widen_and_replay(refused)
      plan_changed = True
    if plan_changed:
      self.state = _fit_caches(self.run, self.state, self.planner.plan)
    if self.bar is not None:
      self.bar.n = self.step
    return refused is not None

  def _nonfinite(self, s: int):
    """A step whose loss or gradient was not finite (its update was not applied)."""
    if self.t.nonfinite == "stop":
      latest = self.run.ckpt.latest_step()
      kept = (f"the last good checkpoint is step {latest} in {self.run.ckpt.directory}"
              if latest is not None else "no checkpoint was written yet")
      raise NonFiniteLossError(
          f"step {s}: the loss or gradient is not finite; the update was not applied and the "
          f"run stops (config.train.nonfinite='stop'); {kept}. Resume from it with a lower "
          "learning rate or more warmup, or pass --config.train.nonfinite=skip to drop such "
          "updates.")
    self.skipped += 1
    _echo(f"step {s}: non-finite loss or gradient, update skipped ({self.skipped} so far)")

  def _widen_and_replay(self, refused: pending_lib.Refused):
    """Widens the plan to the spans the refused step starts from; the data goes back to it."""
    cfg, s = self.run.model_cfg, refused.step
    self.planner.update(refused.ratios, s - 1)  # grows the plan unless an earlier step did
    if not all(np.all(np.asarray(lp.head_windows(cfg.n_heads)) >= plan_lib.needed_tokens(cfg, z))
               for lp, z in zip(self.planner.plan.layers, refused.ratios)):
      raise RuntimeError(f"internal: step {s} was refused and the plan still does not "
                         "cover its spans")
    _echo(f"step {s}: spans outgrew the plan before the host read them; widened to "
          f"{self.planner.plan.describe()}; replaying {refused.replay} step(s) from step {s}: "
          "they had changed nothing (a step whose spans outgrow its plan is not applied), so "
          "they are recomputed on the wider plan with nothing lost or logged twice; the progress "
          "bar steps back, and steps are slower now: longer spans cost more attention, and the "
          "new plan compiles once")
    self.step = s - 1
    self.train_batcher.state = refused.data_before

  def _log(self):
    step, run = self.step, self.run
    if run.lock is not None:
      run.lock.check()  # another process took the directory over: stop before writing
    losses = np.asarray(jax.device_get(self.pending.take_losses()))
    n = len(losses)
    secs = time.perf_counter() - self.window_t0
    rate = self.throughput.interval(n, sum(self.pending.take_flops()), secs)
    m = jax.device_get(self.metrics)
    last = {"loss": float(losses.mean()), "bpc": float(losses.mean() / LN2),
            "lr": float(run.schedule(step - 1)), "grad_norm": float(m["grad_norm"]),
            "span_loss": float(m["span_loss"]), "span_avg": m["span_avg"].tolist(),
            "span_max": m["span_max"].tolist(),
            "ms_per_step": 1000 * secs / max(n, 1), **rate,
            "compilations": len(run.compiler.compilations),
            "plan_changes": self.planner.changes, "skipped": self.skipped}
    if "loss_scale" in m:  # dynamic loss scaling: the scale now, attempts thrown away so far
      last["loss_scale"] = float(m["loss_scale"])
      last["loss_scale_skips"] = int(m["loss_scale_skips"])
    self.last = last
    self.writer.write(step, "train", last)
    _echo(f"step {step:7d} | loss {last['loss']:.4f} bpc {last['bpc']:.4f} | "
          f"{last['ms_per_step']:.0f} ms/step {last['tokens_per_s']:.0f} tok/s "
          f"{telemetry.readable_flops(last['model_tflops_per_s'])}"
          + ("" if last["mfu"] is None else f" MFU {100 * last['mfu']:.1f}%") + " | "
          f"window avg {np.mean(last['span_avg']):.0f} max {max(last['span_max']):.0f} | "
          f"lr {last['lr']:.4g}" + (f" | loss scale 2^{math.log2(last['loss_scale']):.0f} "
                                    f"({last['loss_scale_skips']} overflows)"
                                    if "loss_scale" in last else ""))
    self.postfix = {"tok/s": f"{last['tokens_per_s']:.0f}"}
    if last["mfu"] is not None:
      self.postfix["mfu"] = f"{100 * last['mfu']:.1f}%"
    if self.bar is not None:
      self.bar.set_postfix(loss=f"{last['loss']:.3f}", bpc=f"{last['bpc']:.3f}", **self.postfix,
                           refresh=False)
    self.window_t0 = time.perf_counter()

  def _evaluate(self):
    step, state, last = self.step, self.state, self.last
    self.run.where = f"in the validation at step {step}"
    res, eval_caches = evaluation.evaluate_stream(self.run, state["params"], self.planner.plan,
                                       self.run.splits.valid, self.d.eval_batch,
                                       caches=state["eval_caches"], batcher=self.valid_batcher,
                                       n_blocks=self.eval_batches, desc="valid")
    self.state = dict(state, eval_caches=eval_caches)
    self.writer.write(step, "valid", res)
    _echo(f"step {step:7d} | valid bpc {res['bpc']:.4f} ({res['tokens']} tokens)")
    last["valid_bpc"] = res["bpc"]
    if self.bar is not None:
      self.bar.set_postfix(loss=f"{last.get('loss', float('nan')):.3f}",
                           bpc=f"{last.get('bpc', float('nan')):.3f}",
                           valid_bpc=f"{res['bpc']:.3f}", **self.postfix, refresh=False)
    self.window_t0 = time.perf_counter()

  def _stop(self, stop: str):
    """After the checkpoint of a preempted or interrupted step: wait for it and say so."""
    self.stopped = stop
    self.run.ckpt.wait()
    why = "Ctrl-C" if stop == "interrupted" else "preempted"
    _echo(f"step {self.step:7d} | {why}: checkpoint at step {self.step} written to "
          f"{self.run.ckpt.directory}; stopping (rerun the same command to resume)")

  def finish(self):
    """The last read and checkpoint, then (train.full_eval_at_end) valid and test in full."""
    run, t = self.run, self.t
    with _host_reads():
      self._read()
      run.ckpt.wait()
      if self.bar is not None:
        self.bar.close()
        self.bar = None
      if t.full_eval_at_end and self.start < t.steps and not self.stopped:
        for name in ("valid", "test"):
          run.where = f"in the full {name} evaluation at step {self.step}"
          res, _ = evaluation.evaluate_stream(run, self.state["params"], self.planner.plan,
                                   run.splits.split(name), self.d.eval_batch,
                                   drop_last=t.eval_drop_last, desc=f"full {name}")
          self.writer.write(self.step, f"full_{name}", res)
          _echo(f"full {name}: bpc {res['bpc']:.4f} ppl {res['ppl']:.3f} over "
                f"{res['tokens']:,} tokens" + (" (last partial block dropped)"
                                               if t.eval_drop_last else ""))
          self.last[f"full_{name}_bpc"] = res["bpc"]

  def close(self):
    if self.bar is not None:
      self.bar.close()
    self.profile.stop()
    self.ctrl_c.close()
    self.watch.close()
    self.writer.close()

  def result(self) -> dict[str, Any]:
    return dict(self.last, preempted=self.stopped is not None, stopped=self.stopped,
                skipped=self.skipped, step=self.step, state=self.state, plan=self.planner.plan)


def evaluate(config, step: int | None = None) -> dict[str, Any]:
  """Full evaluation of a checkpoint on valid and test (params-only restore)."""
  directory = os.path.join(config.workdir or "", "checkpoints")
  if not config.workdir or not os.path.isdir(directory):
    raise FileNotFoundError(f"no checkpoint in {directory} to evaluate")
  run = Run(config)
  try:
    run.where = "in the evaluation"
    return evaluation.evaluate_checkpoint(run, step)
  except Exception as e:  # pylint: disable=broad-except
    oom = oom_lib.of(e, run.where, run.config)
    if oom is None:
      raise
    raise oom from e
  finally:
    run.ckpt.close()

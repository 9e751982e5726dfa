"""The training loop and the full evaluation, callable from main.py or a notebook.

`train(config)` resumes automatically from `config.workdir` when it holds a checkpoint. Every
check that can fail on the user's input (config values, data files, checkpoint compatibility)
runs before the first compilation, and before those the run directory's lock is taken
(train/run_lock.py: one training process per directory). Each log interval reports tokens/s and
MFU; train.profile_* traces steps (train/telemetry.py); train.wandb logs to Weights & Biases
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
import dataclasses
import json
import logging
import math
import os
import signal
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from span_lm import config as config_lib
from span_lm import kernels
from span_lm import run_dir
from span_lm.data import batching, sources
from span_lm.model import caches as caches_lib
from span_lm.model import plan as plan_lib
from span_lm.train import planner as planner_lib
from span_lm.model import config as model_config
from span_lm.model.config import ModelConfig
from span_lm.train import checkpoint as ckpt_lib
from span_lm.train import cpu_host
from span_lm.train import distributed as dist_lib
from span_lm.train import loss_scale as loss_scale_lib
from span_lm.train import optimizer as optimizer_lib
from span_lm.train import pending as pending_lib
from span_lm.train import sharding as sharding_lib
from span_lm.train import steps as steps_lib
from span_lm.train import metrics as metrics_lib
from span_lm.train import oom as oom_lib
from span_lm.train import run_lock
from span_lm.train import telemetry
from span_lm.train.metrics import LN2, MetricWriter

log = logging.getLogger("span_lm")

# Steps (and evaluation blocks) dispatched ahead of the host before it waits: train/pending.py
MAX_IN_FLIGHT = pending_lib.MAX_IN_FLIGHT


def _echo(msg: str) -> None:
  metrics_lib.echo(msg)
  log.info(msg)


def _host_reads():
  """Marks where the loop reads from the device (logging, evaluation, checkpoints): elsewhere a
  jax.transfer_guard_device_to_host('disallow_explicit') around training must hold."""
  return jax.transfer_guard_device_to_host("allow")


def _tflops(x: float) -> str:
  """Model FLOP/s in a readable unit."""
  for unit, scale in (("TFLOP/s", 1e12), ("GFLOP/s", 1e9)):
    if x * 1e12 >= scale:
      return f"{x * 1e12 / scale:.3g} {unit}"
  return f"{x * 1e6:.3g} MFLOP/s"


class _CtrlC:
  """A first Ctrl-C asks for a checkpoint at the current step and a stop (as SIGTERM does); a
  second one aborts at once. Lone processes only (several processes stop via the preemption
  sync point)."""

  def __init__(self, enabled: bool):
    self.requested = False
    self._previous = None
    if enabled:
      try:
        self._previous = signal.signal(signal.SIGINT, self._on_signal)
      except ValueError:  # not the main thread
        self._previous = None

  def _on_signal(self, signum, frame):
    del signum, frame
    if self.requested:
      raise KeyboardInterrupt
    self.requested = True
    sys.stderr.write("\nCtrl-C: checkpointing the current step, then stopping "
                     "(Ctrl-C again aborts without saving)\n")
    sys.stderr.flush()

  def close(self):
    if self._previous is not None:
      signal.signal(signal.SIGINT, self._previous)
      self._previous = None


class NonFiniteLossError(FloatingPointError):
  """The loss or gradient went non-finite and config.train.nonfinite='stop'."""


def _device_memory() -> int | None:
  """Bytes one GPU holds (the fit rule of `auto`'s attention: StepCompiler); None elsewhere."""
  dev = jax.devices()[0]
  if dev.platform != "gpu":
    return None
  try:
    return int((dev.memory_stats() or {}).get("bytes_limit") or 0) or None
  except Exception:  # pylint: disable=broad-except
    return None


def _on_process_0(fn, failed):
  """fn() on process 0 (None elsewhere). With several processes all learn whether it worked and
  stop together when it did not (else the others would wait in the first collective for ever):
  process 0 raises fn's error, the others `failed()`, an exception naming process 0's."""
  out, error = None, None
  if jax.process_index() == 0:
    try:
      out = fn()
    except Exception as e:  # pylint: disable=broad-except  (the others must hear of it too)
      error = e
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    ok = bool(multihost_utils.broadcast_one_to_all(np.int32(error is None)))
    if not ok and error is None:
      error = failed()
  if error is not None:
    raise error
  return out


def _take_lock(workdir: str) -> run_lock.RunLock | None:
  """The run directory's lock (train/run_lock.py), taken by process 0 only, for all."""
  lock = _on_process_0(lambda: run_lock.acquire(workdir), lambda: run_lock.RunLockedError(
      f"process 0 could not take the lock of run directory {workdir} (its output says who "
      "holds it): not training"))
  if lock is not None and lock.note:
    _echo(f"run directory lock: {lock.note}")
  return lock


class Run:
  """Everything a run needs, built (and checked) before anything compiles."""

  def __init__(self, config, *, need_workdir: bool = True, num_devices: int | None = None,
               lock: bool = False):
    """num_devices: build the mesh over the first N devices (default: all of them).
    lock: take the run directory's lock first (training: one writer per directory); released
    by `release`."""
    config_lib.validate(config)
    n_cpu, why = cpu_host.setup(config)  # before any backend use, as initialize
    dist_lib.initialize(config)  # before any backend use; a no-op for a lone process
    self.lock = _take_lock(config.workdir) if lock else None  # before anything is written
    try:
      self._build(config, need_workdir, num_devices, n_cpu, why)
    except BaseException:
      self.release(undo=True)  # a run directory made only for the lock goes too
      raise

  def release(self, undo: bool = False) -> None:
    """Gives the run directory's lock back (a no-op without one)."""
    if self.lock is not None:
      self.lock.release(undo=undo)
      self.lock = None

  def _build(self, config, need_workdir, num_devices, n_cpu, why):
    if n_cpu:
      _echo(f"CPU host split into {n_cpu} devices for data parallelism ({why})")
    if cpu_host.huge_pages_active() and jax.default_backend() == "cpu":
      _echo(f"CPU host: malloc with transparent huge pages ({cpu_host.HUGE_PAGES_TUNABLE})")
    self.where = "before training (data, kernels)"  # what the run is doing (out-of-memory line)
    kernels.check(config.model, backend=jax.default_backend())  # a kernel this host can run
    self.config = config
    self.process_index, self.process_count = jax.process_index(), jax.process_count()
    if config.train.compilation_cache:
      cache_dir = os.path.expanduser(config.train.compilation_cache)
      jax.config.update("jax_compilation_cache_dir", cache_dir)
      jax.config.update("jax_persistent_cache_min_compile_time_secs",
                        float(config.train.compilation_cache_min_secs))
    self.workdir = config.workdir
    if need_workdir and not self.workdir:
      raise ValueError("config.workdir is required: pass --config.workdir=DIR")
    self.splits = sources.load_splits(config.data)
    self.model_cfg = ModelConfig.from_config(config.model, vocab_size=self.splits.vocab_size)
    if self.model_cfg.vocab_size < self.splits.vocab_size:
      raise ValueError(f"config.model.vocab_size={self.model_cfg.vocab_size} is smaller than the "
                       f"dataset's vocabulary ({self.splits.vocab_size})")
    d = config.data
    sources.check_lengths(self.splits, d.block, d.batch, d.eval_batch)
    self.fsdp = config.dist.fsdp
    self.tx, self.schedule = optimizer_lib.make_optimizer(config.optim)
    # attention.tiles='tune' is timed here (tune_block), before any step compiles
    self.compiler = steps_lib.build(
        self.model_cfg, self.tx, batch=d.batch, eval_batch=d.eval_batch,
        batch_split=config.optim.batch_split, fsdp=self.fsdp, num_devices=num_devices,
        processes=self.process_count, tune_block=d.block, log=_echo,
        capacity=_device_memory(), debug_nan_at_step=config.train.debug_nan_at_step,
        loss_scale_period=config.train.loss_scale_period)
    self.model_cfg, self.layout = self.compiler.cfg, self.compiler.layout
    self.mesh, self.replicated = self.layout.mesh, self.layout.replicated
    self.batch_sharding, self.cache_sharding = self.layout.rows, self.layout.cache_rows
    # dynamic loss scaling (train/loss_scale.py): its initial scale, or None when off
    self.loss_scale = (float(config.train.loss_scale_init) if loss_scale_lib.enabled(
        config.train.loss_scale, self.model_cfg.dtype) else None)
    self.ckpt = None
    if self.workdir:
      self.ckpt = ckpt_lib.Checkpointer(os.path.join(self.workdir, "checkpoints"),
                                        max_to_keep=config.train.max_to_keep,
                                        save_every=config.train.checkpoint_every)

  # --- state -------------------------------------------------------------------------------------

  def abstract_state(self, plan):
    d = self.config.data
    fn = lambda: steps_lib.init_state(self.model_cfg, self.tx, plan, d.batch, d.eval_batch,
                                      self.config.seed, loss_scale=self.loss_scale)
    abstract = jax.eval_shape(fn)
    return fn, abstract, self.layout.state_shardings(abstract)

  def init_state(self, plan):
    fn, _, shardings = self.abstract_state(plan)
    return jax.jit(fn, out_shardings=shardings)()

  def _newest_readable(self, read, step, move_aside: bool):
    """read(step) for `step`, or (None) for the newest step that reads: an unreadable one is
    reported by path and skipped (renamed '<step>.unreadable' when move_aside, so the run can
    save that step again; nothing is deleted). A model mismatch is never skipped."""
    if step is not None:
      return read(step)
    bad = []
    for s in sorted(self.ckpt.all_steps(), reverse=True):
      try:
        out = read(s)
      except ckpt_lib.CheckpointReadError as e:
        _echo(f"warning: {e}; trying the previous checkpoint")
        bad.append(s)
        continue
      if bad and move_aside and self.process_index == 0 and self.process_count == 1:
        for b in bad:
          _echo(f"warning: unreadable checkpoint step {b} moved aside to {self.ckpt.move_aside(b)}")
      if bad:
        _echo(f"using checkpoint step {s} in {self.ckpt.directory}")
      return out
    if bad:
      raise ckpt_lib.CheckpointReadError(
          bad[0], self.ckpt.directory,
          f"none of its {len(bad)} checkpoints can be read; move the directory aside to start "
          "afresh, or restore it from a backup")
    raise FileNotFoundError(f"no checkpoint in {self.ckpt.directory}")

  def _meta_and_plan(self, step):
    meta = self.ckpt.restore_meta(step)
    try:
      plan = plan_lib.plan_from_json(meta["planner"]["plan"])
      int(meta["step"])
    except (KeyError, TypeError, ValueError) as e:
      raise ckpt_lib.CheckpointReadError(step, self.ckpt.step_path(step),
                                         f"its meta has no valid {e} entry") from e
    self._check_meta(meta)
    return meta, plan

  def restore(self, step=None, *, move_aside: bool = False):
    """(state, meta) from the work dir, laid out for this mesh (step None: the newest readable).
    A checkpoint saved with loss scaling restores into a run without (the scale is dropped) and
    the other way round (the scale starts at train.loss_scale_init), e.g. a float32 run resumed
    in float16: meta['loss_scale'] says which it has (absent before loss scaling existed)."""
    def read(s):
      meta, plan = self._meta_and_plan(s)
      return self.read_state(self.ckpt, s, meta, plan), meta
    return self._newest_readable(read, step, move_aside)

  def read_state(self, ckpt, step, meta, plan):
    """The state of checkpoint `step` in `ckpt`, laid out for this mesh and this run's loss
    scaling: a scale saved by a run with scaling is dropped here without it, and one starts at
    train.loss_scale_init where the checkpoint has none (meta['loss_scale'])."""
    _, abstract, shardings = self.abstract_state(plan)
    mine, saved = "loss_scale" in abstract, bool(meta.get("loss_scale", False))
    if mine and not saved:
      abstract, shardings = dict(abstract), dict(shardings)
      del abstract["loss_scale"], shardings["loss_scale"]
    elif saved and not mine:
      ls = jax.eval_shape(lambda: loss_scale_lib.init(1.0))
      abstract = dict(abstract, loss_scale=ls)
      shardings = dict(shardings, loss_scale=jax.tree.map(lambda _: self.replicated, ls))
    state, _ = ckpt.restore(sharding_lib.with_shardings(abstract, shardings), step)
    if mine != saved:
      state = dict(state)
      if mine:
        state["loss_scale"] = jax.device_put(loss_scale_lib.init(self.loss_scale),
                                             self.replicated)
      else:
        del state["loss_scale"]
      _echo(f"checkpoint step {step} was saved {'without' if mine else 'with'} loss scaling; "
            + (f"the scale starts at {self.loss_scale:g}" if mine else "this run has none "
               f"(train.loss_scale={self.config.train.loss_scale!r}, model.dtype="
               f"{self.model_cfg.dtype!r}): its scale is dropped"))
    return state

  def restore_params(self, step=None):
    """(params, span plan, meta) of a checkpoint: a params-only restore for evaluation/tools."""
    def read(s):
      meta, plan = self._meta_and_plan(s)
      _, abstract, shardings = self.abstract_state(plan)
      target = sharding_lib.with_shardings(abstract["params"], shardings["params"])
      params = self.ckpt.restore_params(target, s)
      plan_lib.check_plan(self.model_cfg, params, plan)
      return params, plan, meta
    return self._newest_readable(read, step, move_aside=False)

  def _check_meta(self, meta):
    # Checkpoints written before config.model's sections hold its flat fields: upgraded first.
    saved = run_dir.flatten(model_config.upgrade(meta.get("model_cfg", {})))
    mine = run_dir.flatten(json.loads(json.dumps(dataclasses.asdict(self.model_cfg))))  # lists
    arch = [k for k in mine if k in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff",
                                     "pers_mem", "arch", "span.mode")
            or k.startswith(("sparse.", "adapt_io.")) and k != "sparse.impl"]  # impl: how it runs
    arch.append("sparse.context" if self.model_cfg.arch == "sparse" else "span.size")
    diff = [f"{k}: checkpoint {saved.get(k)!r}, config {mine[k]!r}" for k in arch
            if k in saved and saved[k] != mine[k]]
    if diff:
      raise ValueError(f"the checkpoint in {self.ckpt.directory} was trained with a different "
                       "model:\n  " + "\n  ".join(diff))

  def put_batch(self, b):
    """Host batch -> global arrays; with several processes `b` holds this process's rows only."""
    return self.layout.shard_batch(b)

  def streams(self, split: np.ndarray, batch: int, seed: int) -> batching.StreamIterator:
    """This process's share of the B training-style streams of a split."""
    return batching.StreamIterator(split, batch, self.config.data.block, seed=seed,
                                   process_index=self.process_index,
                                   process_count=self.process_count,
                                   align=self.config.data.align)


def _fit_caches(run: Run, state, plan):
  state = dict(state)
  for key in ("caches", "eval_caches"):
    state[key] = tuple(jax.device_put(c, run.cache_sharding)
                       for c in caches_lib.resize_caches(state[key], run.model_cfg, plan))
  return state


def evaluate_stream(run: Run, params, plan, split: np.ndarray, batch: int, *, caches=None,
                    batcher=None, n_blocks: int | None = None, drop_last: bool = False,
                    kv_cache: bool | None = None, desc: str | None = None):
  """Scores blocks of a split with carried caches; returns (bpc-ready dict, caches).

  kv_cache (None: whenever the caches start fresh, for the span Transformer): cache projected
  keys/values instead of hidden states, so a block does not re-project the cached states (the
  same numbers: the weights are fixed here). Caches passed in are hidden states (the periodic
  validation's, kept in the training state). desc: show a progress bar with this name.
  """
  cfg, d = run.model_cfg, run.config.data
  if kv_cache is None:
    kv_cache = caches is None and cfg.arch == "span"
  if run.fsdp > 1:  # the eval step takes replicated parameters: gather them once
    params = jax.device_put(params, run.replicated)
  if caches is None:
    caches = tuple(jax.device_put(c, run.cache_sharding)
                   for c in caches_lib.init_caches(cfg, plan, batch, kv=kv_cache))
  total = count = 0.0
  pending = []
  if batcher is not None:  # periodic validation: a stream iterator like training
    blocks = (next(batcher) for _ in range(n_blocks))
    make = lambda blk: steps_lib.host_batch(blk.x, blk.y, blk.reset)
  else:
    blocks = batching.eval_blocks(split, batch, d.block, drop_last=drop_last,
                                  process_index=run.process_index,
                                  process_count=run.process_count, align=d.align)
    make = lambda blk: steps_lib.host_batch(blk.x, blk.y, False, blk.weights)
    stream_len = len(split) // batch // d.align * d.align
    n_blocks = sum(1 for _ in batching.eval_positions(stream_len, d.block, drop_last))
  bar = metrics_lib.progress(n_blocks, desc=desc, leave=False) if desc else None
  for blk in blocks:
    hb = make(blk)
    if "w" not in hb:
      hb["w"] = np.ones_like(hb["x"], np.float32)
    dev = run.put_batch(hb)
    fn = run.compiler.eval(plan, params, caches, dev, kv_cache=kv_cache)
    out, caches = fn(params, caches, dev)
    pending.append(out)
    if len(pending) > MAX_IN_FLIGHT:
      jax.block_until_ready(pending[-MAX_IN_FLIGHT - 1])
    if bar is not None:
      bar.update(1)
  if bar is not None:
    bar.close()
  for out in jax.device_get(pending):
    total += float(out["nll_sum"])
    count += float(out["count"])
  loss = total / max(count, 1.0)
  return {"loss": loss, "bpc": loss / LN2, "ppl": math.exp(min(loss, 50.0)),
          "tokens": int(count)}, caches


def _init_from(run: Run, planner, fresh, path: str):
  """Starts a new phase (e.g. the reference's lr/10 fine-tuning) from another run's checkpoint:
  parameters, optimizer state and span plan come from it; step, data position and caches restart."""
  directory = os.path.join(path, "checkpoints") if os.path.isdir(os.path.join(path, "checkpoints")) else path
  with ckpt_lib.Checkpointer(directory, max_to_keep=None) as src:
    if src.latest_step() is None:
      raise FileNotFoundError(f"config.train.init_from={path!r}: no checkpoint in {directory}")
    meta = src.restore_meta()
    run._check_meta(meta)
    planner.load_state_dict(meta["planner"])
    planner.changes = 0
    state = run.read_state(src, src.latest_step(), meta, planner.plan)
  _echo(f"initialised from {directory} step {meta['step']} (params, optimizer state, span plan)")
  return dict(state, step=fresh["step"], rng=fresh["rng"],
              caches=tuple(jnp.zeros_like(c) for c in state["caches"]),
              eval_caches=tuple(jnp.zeros_like(c) for c in state["eval_caches"]))


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


def _out_of_memory(e: Exception, run: Run):
  """A DeviceOutOfMemoryError for XLA's RESOURCE_EXHAUSTED (one line, train/oom.py), or None."""
  found = oom_lib.find(e)
  if found is None:
    return None
  return oom_lib.DeviceOutOfMemoryError(oom_lib.message(found, run.where, run.config))


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
    oom = _out_of_memory(e, run)
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
      self.wandb = _on_process_0(
          lambda: wandb_log.WandbLog(self.config, run.workdir, echo=_echo),
          lambda: wandb_log.WandbError("wandb: process 0 could not start the W&B run (its "
                                       "output says why): not training"))
    self.writer = MetricWriter(run.workdir, tensorboard=t.tensorboard, wandb=self.wandb)
    dropped = self.writer.truncate_after(self.start)  # rows this run replays (after a kill -9)
    if dropped:
      log.info("metrics.jsonl: dropped %d rows past step %d", dropped, self.start)
    self.watch = dist_lib.PreemptionWatch(enabled=t.preemption)
    self.ctrl_c = _CtrlC(enabled=run.process_count == 1)
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
      state = _init_from(run, self.planner, state, self.t.init_from)
    n_params = sum(x.size for x in jax.tree.leaves(state["params"]))
    _echo(f"model: {n_params / 1e6:.2f}M parameters; {cfg.n_layers} layers, span {cfg.span.size} "
          f"({cfg.span.mode}); data {run.splits.name}: {len(run.splits.train):,} train tokens, "
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
            "model_cfg": dataclasses.asdict(self.run.model_cfg), "config": self.config.to_dict(),
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
          f"{_tflops(last['model_tflops_per_s'])}"
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
    res, eval_caches = evaluate_stream(self.run, state["params"], self.planner.plan,
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
          res, _ = evaluate_stream(run, self.state["params"], self.planner.plan,
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
    return _evaluate(run, step)
  except Exception as e:  # pylint: disable=broad-except
    oom = _out_of_memory(e, run)
    if oom is None:
      raise
    raise oom from e
  finally:
    run.ckpt.close()


def _evaluate(run: Run, step: int | None) -> dict[str, Any]:
  config = run.config
  if run.ckpt.latest_step() is None:
    raise FileNotFoundError(f"no checkpoint in {run.ckpt.directory} to evaluate")
  params, plan, meta = run.restore_params(step)
  out = {"step": meta["step"]}
  writer = MetricWriter(run.workdir, tensorboard=False)
  for name in ("valid", "test"):
    res, _ = evaluate_stream(run, params, plan, run.splits.split(name), config.data.eval_batch,
                             drop_last=config.train.eval_drop_last, desc=f"eval {name}")
    out[name] = res
    writer.write(meta["step"], f"eval_{name}", res)
    _echo(f"eval step {meta['step']} {name}: bpc {res['bpc']:.4f} ppl {res['ppl']:.3f} over "
          f"{res['tokens']:,} tokens")
  writer.close()
  return out

"""The training loop and the full evaluation, callable from main.py or a notebook.

`train(config)` resumes automatically from `config.workdir` when it holds a checkpoint. Every
check that can fail on the user's input (config values, data files, checkpoint compatibility)
runs before the first compilation.

Several processes (span_lm/train/distributed.py): each reads only its own contiguous share of the
B streams and the global batch is assembled with jax.make_array_from_process_local_data; every
process runs the same loop (checkpoints are collective, Orbax writes them), only process 0 prints
and writes metrics. Faults: SIGTERM or the preemption sync point checkpoints the current step and
stops; a non-finite loss is never applied (in the step) and stops the run or is counted
(config.train.nonfinite).
"""
import json
import logging
import math
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from span_lm import config as config_lib
from span_lm.data import batching, sources
from span_lm.model import caches as caches_lib
from span_lm.model import plan as plan_lib
from span_lm.train import planner as planner_lib
from span_lm.model.config import ModelConfig
from span_lm.train import checkpoint as ckpt_lib
from span_lm.train import distributed as dist_lib
from span_lm.train import host_memory
from span_lm.train import optimizer as optimizer_lib
from span_lm.train import sharding as sharding_lib
from span_lm.train import steps as steps_lib
from span_lm.train.metrics import LN2, MetricWriter

log = logging.getLogger("span_lm")

# Steps dispatched ahead of the host before it waits for the oldest one. Unbounded asynchronous
# dispatch deadlocks XLA:CPU once a program with collectives (any multi-device mesh) has 32
# executions queued per device (an all-reduce rendezvous that never completes); on accelerators a
# few queued steps already hide the host's latency.
MAX_IN_FLIGHT = 8


def _echo(msg: str) -> None:
  if jax.process_index() == 0:
    print(msg, flush=True)
  log.info(msg)


class NonFiniteLossError(FloatingPointError):
  """The loss or gradient went non-finite and config.train.nonfinite='stop'."""


class Run:
  """Everything a run needs, built (and checked) before anything compiles."""

  def __init__(self, config, *, need_workdir: bool = True, num_devices: int | None = None):
    """num_devices: build the mesh over the first N devices (default: all of them)."""
    config_lib.validate(config)
    # Before any backend use (as initialize). A process whose backend already runs (a notebook, a
    # test session) keeps its allocator: its threads have their arenas and heaps already.
    fresh = not dist_lib.backend_started()
    n_cpu, why = dist_lib.setup_cpu_devices(config)
    if config.dist.cpu_keep_freed_memory and fresh and dist_lib.cpu_only():
      kept, how = host_memory.keep_freed_memory()
      log.info("host malloc: %s", how if kept else f"left as it is ({how})")
    dist_lib.initialize(config)  # before any backend use; a no-op for a lone process
    if n_cpu:
      _echo(f"CPU host split into {n_cpu} devices for data parallelism ({why})")
    if config.model.attn_impl == "pallas" and jax.default_backend() != "gpu":
      raise ValueError(f"config.model.attn_impl='pallas' runs a Triton kernel, which needs a GPU "
                       f"(Ampere or newer); this process has {jax.default_backend()} devices: use "
                       f"'xla' (or 'pallas_interpret' to run the kernel interpreted)")
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
    if self.fsdp > 1:  # parameters and optimizer state sharded over a second mesh axis
      self.mesh = dist_lib.fsdp_mesh(self.fsdp, num_devices)
      self.state_rule = dist_lib.fsdp_state_rule()
      batch_axes = dist_lib.BATCH_AXES
    else:
      self.mesh = sharding_lib.make_mesh(num_devices)
      self.state_rule = sharding_lib.default_state_rule
      batch_axes = sharding_lib.DATA_AXIS
    n_dev = self.mesh.devices.size
    for field, b in (("batch", d.batch), ("eval_batch", d.eval_batch)):
      if b % n_dev:
        raise ValueError(f"config.data.{field}={b} must be divisible by the {n_dev} devices")
      if b % self.process_count:
        raise ValueError(f"config.data.{field}={b} must be divisible by the "
                         f"{self.process_count} processes")
    if d.batch % config.optim.batch_split:
      raise ValueError(f"config.data.batch={d.batch} must be divisible by "
                       f"config.optim.batch_split={config.optim.batch_split}")
    self.tx, self.schedule = optimizer_lib.make_optimizer(config.optim)
    self.replicated = sharding_lib.replicated(self.mesh)
    self.batch_sharding = NamedSharding(self.mesh, P(batch_axes, None))
    self.cache_sharding = NamedSharding(self.mesh, P(batch_axes, None, None))
    self.compiler = steps_lib.StepCompiler(
        self.model_cfg, self.tx, self.mesh,
        lambda st: sharding_lib.state_shardings(st, self.mesh, self.state_rule),
        self.batch_sharding,
        self.replicated, batch_split=config.optim.batch_split, log=_echo,
        debug_nan_at_step=config.train.debug_nan_at_step)
    self.ckpt = None
    if self.workdir:
      self.ckpt = ckpt_lib.Checkpointer(os.path.join(self.workdir, "checkpoints"),
                                        max_to_keep=config.train.max_to_keep,
                                        save_every=config.train.checkpoint_every)

  # --- state -------------------------------------------------------------------------------------

  def abstract_state(self, plan):
    d = self.config.data
    fn = lambda: steps_lib.init_state(self.model_cfg, self.tx, plan, d.batch, d.eval_batch,
                                      self.config.seed)
    abstract = jax.eval_shape(fn)
    shardings = sharding_lib.state_shardings(abstract, self.mesh, self.state_rule)
    return fn, abstract, shardings

  def init_state(self, plan):
    fn, _, shardings = self.abstract_state(plan)
    return jax.jit(fn, out_shardings=shardings)()

  def restore(self, step=None):
    """(state, meta) from the work dir, laid out for this mesh."""
    meta = self.ckpt.restore_meta(step)
    self._check_meta(meta)
    plan = plan_lib.plan_from_json(meta["planner"]["plan"])
    _, abstract, shardings = self.abstract_state(plan)
    target = sharding_lib.with_shardings(abstract, shardings)
    state, meta = self.ckpt.restore(target, step)
    return state, meta

  def restore_params(self, step=None):
    """(params, span plan, meta) of a checkpoint: a params-only restore for evaluation/tools."""
    meta = self.ckpt.restore_meta(step)
    self._check_meta(meta)
    plan = plan_lib.plan_from_json(meta["planner"]["plan"])
    _, abstract, shardings = self.abstract_state(plan)
    target = sharding_lib.with_shardings(abstract["params"], shardings["params"])
    params = self.ckpt.restore_params(target, step)
    plan_lib.check_plan(self.model_cfg, params, plan)
    return params, plan, meta

  def _check_meta(self, meta):
    saved = meta.get("model_cfg", {})
    mine = json.loads(json.dumps(dataclass_dict(self.model_cfg)))  # tuples as JSON gives them back
    arch = ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "span", "span_mode", "pers_mem",
            "arch")
    arch += tuple(k for k in mine if k.startswith(("sparse_", "adapt_io")))
    diff = [f"{k}: checkpoint {saved.get(k)!r}, config {mine[k]!r}" for k in arch
            if k in saved and saved[k] != mine[k]]
    if diff:
      raise ValueError(f"the checkpoint in {self.ckpt.directory} was trained with a different "
                       "model:\n  " + "\n  ".join(diff))

  def put_batch(self, b):
    """Host batch -> global arrays; with several processes `b` holds this process's rows only."""
    if self.process_count == 1:
      return {k: jax.device_put(v, self.replicated if k == "reset" else self.batch_sharding)
              for k, v in b.items()}
    out = {}
    for k, v in b.items():
      if k == "reset":  # the same scalar in every process
        v = np.asarray(v)
        out[k] = jax.make_array_from_callback(v.shape, self.replicated, lambda idx, v=v: v[idx])
      else:
        out[k] = jax.make_array_from_process_local_data(self.batch_sharding, np.asarray(v))
    return out

  def streams(self, split: np.ndarray, batch: int, seed: int) -> batching.StreamIterator:
    """This process's share of the B training-style streams of a split."""
    return batching.StreamIterator(split, batch, self.config.data.block, seed=seed,
                                   process_index=self.process_index,
                                   process_count=self.process_count,
                                   align=self.config.data.align)


def dataclass_dict(dc) -> dict:
  import dataclasses
  return dataclasses.asdict(dc)


def _fit_caches(run: Run, state, plan):
  state = dict(state)
  for key in ("caches", "eval_caches"):
    state[key] = tuple(jax.device_put(c, run.cache_sharding)
                       for c in caches_lib.resize_caches(state[key], run.model_cfg, plan))
  return state


def evaluate_stream(run: Run, params, plan, split: np.ndarray, batch: int, *, caches=None,
                    batcher=None, n_blocks: int | None = None, drop_last: bool = False,
                    kv_cache: bool | None = None):
  """Scores blocks of a split with carried caches; returns (bpc-ready dict, caches).

  kv_cache (None: whenever the caches start fresh, for the span Transformer): cache projected
  keys/values instead of hidden states, so a block does not re-project the cached states (the
  same numbers: the weights are fixed here). Caches passed in are hidden states (the periodic
  validation's, kept in the training state).
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
    _, abstract, shardings = run.abstract_state(planner.plan)
    state, _ = src.restore(sharding_lib.with_shardings(abstract, shardings))
  _echo(f"initialised from {directory} step {meta['step']} (params, optimizer state, span plan)")
  return dict(state, step=fresh["step"], rng=fresh["rng"],
              caches=tuple(jnp.zeros_like(c) for c in state["caches"]),
              eval_caches=tuple(jnp.zeros_like(c) for c in state["eval_caches"]))


def train(config) -> dict[str, Any]:
  """Trains (or resumes) the run described by `config`; returns the last metrics."""
  run = Run(config)
  try:
    return _train(run)
  finally:
    run.ckpt.close()


def _train(run: Run) -> dict[str, Any]:
  config = run.config
  cfg, d, t = run.model_cfg, config.data, config.train
  planner = planner_lib.SpanPlanner(cfg)
  train_batcher = run.streams(run.splits.train, d.batch, config.seed)
  valid_batcher = run.streams(run.splits.valid, d.eval_batch, config.seed + 1)
  start = 0
  skipped = 0  # non-finite updates dropped so far (config.train.nonfinite='skip')
  if run.ckpt.latest_step() is not None:
    state, meta = run.restore()
    planner.load_state_dict(meta["planner"])
    train_batcher.state = meta["data"]["train"]
    valid_batcher.state = meta["data"]["valid"]
    start = int(meta["step"])
    skipped = int(meta.get("nonfinite_skipped", 0))
    _echo(f"resumed from {run.ckpt.directory} at step {start}")
  else:
    state = run.init_state(planner.plan)
    if t.init_from:
      state = _init_from(run, planner, state, t.init_from)
    n_params = sum(x.size for x in jax.tree.leaves(state["params"]))
    _echo(f"model: {n_params / 1e6:.2f}M parameters; {cfg.n_layers} layers, span {cfg.span} "
          f"({cfg.span_mode}); data {run.splits.name}: {len(run.splits.train):,} train tokens, "
          f"vocab {run.splits.vocab_size}")
    # Never lose the config that produced a run.
    if jax.process_index() == 0:
      os.makedirs(run.workdir, exist_ok=True)
      with open(os.path.join(run.workdir, "config.json"), "w") as f:
        f.write(config.to_json_best_effort(indent=2))

  def meta_at(step):
    return {"step": step, "planner": planner.state_dict(),
            "data": {"train": train_batcher.state.to_dict(),
                     "valid": valid_batcher.state.to_dict()},
            "model_cfg": dataclass_dict(cfg), "config": config.to_dict(),
            "compilations": len(run.compiler.compilations), "nonfinite_skipped": skipped}

  writer = MetricWriter(run.workdir, tensorboard=t.tensorboard)
  watch = dist_lib.PreemptionWatch(enabled=t.preemption)
  eval_batches = t.eval_batches or math.ceil(t.eval_every / 10)
  tokens_per_step = d.batch * d.block
  last: dict[str, Any] = {}
  window_t0, window_steps, window_loss = time.perf_counter(), 0, []
  pending_flags: list[tuple[int, jax.Array]] = []  # (step, metrics['skipped']) not yet read
  preempted = False
  step = start

  def read_flags(upto: int):
    """Reads the non-finite flags of steps <= upto (already computed or waited for)."""
    nonlocal skipped
    ready = [(s, f) for s, f in pending_flags if s <= upto]
    if not ready:
      return
    del pending_flags[:len(ready)]
    for s, flag in zip([s for s, _ in ready], jax.device_get([f for _, f in ready])):
      if not int(flag):
        continue
      if t.nonfinite == "stop":
        latest = run.ckpt.latest_step()
        kept = (f"the last good checkpoint is step {latest} in {run.ckpt.directory}"
                if latest is not None else "no checkpoint was written yet")
        raise NonFiniteLossError(
            f"step {s}: the loss or gradient is not finite; the update was not applied and the "
            f"run stops (config.train.nonfinite='stop'); {kept}. Resume from it with a lower "
            "learning rate or more warmup, or pass --config.train.nonfinite=skip to drop such "
            "updates.")
      skipped += 1
      _echo(f"step {s}: non-finite loss or gradient, update skipped ({skipped} so far)")

  try:
    while step < t.steps:
      blk = next(train_batcher)
      batch = run.put_batch(steps_lib.host_batch(blk.x, blk.y, blk.reset))
      fn = run.compiler.train(planner.plan, state, batch)
      state, metrics = fn(state, batch)
      step += 1
      window_steps += 1
      window_loss.append(metrics["loss"])
      pending_flags.append((step, metrics["skipped"]))
      if len(window_loss) > MAX_IN_FLIGHT:
        jax.block_until_ready(window_loss[-MAX_IN_FLIGHT - 1])
        read_flags(step - MAX_IN_FLIGHT)
      if "span_ratio" in metrics:
        ratios = np.asarray(jax.device_get(metrics["span_ratio"]))
        if planner.update(list(ratios), step):
          _echo(f"step {step}: span plan change #{planner.changes}: {planner.plan.describe()}")
          state = _fit_caches(run, state, planner.plan)
      if step % t.log_every == 0 or step == t.steps:
        read_flags(step)
        losses = np.asarray(jax.device_get(window_loss))
        secs = time.perf_counter() - window_t0
        m = jax.device_get(metrics)
        last = {"loss": float(losses.mean()), "bpc": float(losses.mean() / LN2),
                "lr": float(run.schedule(step - 1)), "grad_norm": float(m["grad_norm"]),
                "span_loss": float(m["span_loss"]), "span_avg": m["span_avg"].tolist(),
                "span_max": m["span_max"].tolist(),
                "ms_per_step": 1000 * secs / window_steps,
                "tokens_per_s": tokens_per_step * window_steps / secs,
                "compilations": len(run.compiler.compilations),
                "plan_changes": planner.changes, "skipped": skipped}
        writer.write(step, "train", last)
        _echo(f"step {step:7d} | loss {last['loss']:.4f} bpc {last['bpc']:.4f} | "
              f"{last['ms_per_step']:.0f} ms/step {last['tokens_per_s']:.0f} tok/s | "
              f"span avg {np.mean(last['span_avg']):.0f} max {max(last['span_max']):.0f} | "
              f"lr {last['lr']:.4g}")
        window_t0, window_steps, window_loss = time.perf_counter(), 0, []
      if step % t.eval_every == 0 or step == t.steps:
        res, eval_caches = evaluate_stream(run, state["params"], planner.plan, run.splits.valid,
                                           d.eval_batch, caches=state["eval_caches"],
                                           batcher=valid_batcher, n_blocks=eval_batches)
        state = dict(state, eval_caches=eval_caches)
        writer.write(step, "valid", res)
        _echo(f"step {step:7d} | valid bpc {res['bpc']:.4f} ({res['tokens']} tokens)")
        last["valid_bpc"] = res["bpc"]
        window_t0 = time.perf_counter()
      stop = watch.should_stop(step)
      if run.ckpt.should_save(step) or step == t.steps or stop:
        read_flags(step)  # never checkpoint past a non-finite step in 'stop' mode
        run.ckpt.save(step, state, meta_at(step), force=step == t.steps or stop)
      if stop:
        preempted = True
        run.ckpt.wait()
        _echo(f"step {step:7d} | preempted: checkpoint at step {step} written to "
              f"{run.ckpt.directory}; stopping (rerun the same command to resume)")
        break
    read_flags(step)
    run.ckpt.wait()
    if t.full_eval_at_end and start < t.steps and not preempted:
      for name in ("valid", "test"):
        res, _ = evaluate_stream(run, state["params"], planner.plan, run.splits.split(name),
                                 d.eval_batch, drop_last=t.eval_drop_last)
        writer.write(step, f"full_{name}", res)
        _echo(f"full {name}: bpc {res['bpc']:.4f} ppl {res['ppl']:.3f} over {res['tokens']:,} "
              f"tokens" + (" (last partial block dropped)" if t.eval_drop_last else ""))
        last[f"full_{name}_bpc"] = res["bpc"]
  finally:
    watch.close()
    writer.close()
  last["preempted"] = preempted
  last["skipped"] = skipped
  last["step"] = step
  last["state"] = state
  last["plan"] = planner.plan
  return last


def evaluate(config, step: int | None = None) -> dict[str, Any]:
  """Full evaluation of a checkpoint on valid and test (params-only restore)."""
  config_lib.validate(config)
  directory = os.path.join(config.workdir or "", "checkpoints")
  if not config.workdir or not os.path.isdir(directory):
    raise FileNotFoundError(f"no checkpoint in {directory} to evaluate")
  run = Run(config)
  try:
    return _evaluate(run, step)
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
                             drop_last=config.train.eval_drop_last)
    out[name] = res
    writer.write(meta["step"], f"eval_{name}", res)
    _echo(f"eval step {meta['step']} {name}: bpc {res['bpc']:.4f} ppl {res['ppl']:.3f} over "
          f"{res['tokens']:,} tokens")
  writer.close()
  return out

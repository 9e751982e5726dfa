"""A run: everything training and evaluation need, built and checked before anything compiles.

`Run(config)` takes the checked RunConfig (a ConfigDict is checked first: span_lm/config.py
`validate`), sets the host up (CPU devices, several processes), takes the
run directory's lock when asked (train/run_lock.py: one training process per directory), loads the
data, checks the kernels and the batch split, and builds the step compiler (train/steps.build) and
the checkpointer. Every check that can fail on the user's input runs here, before the first
compilation. Restoring goes through train/restore.py.
"""
import os

import jax
import numpy as np

from span_lm import config as config_lib
from span_lm.data import batching, sources
from span_lm.train import checkpoint as ckpt_lib
from span_lm.train import cpu_host
from span_lm.train import distributed as dist_lib
from span_lm.train import loss_scale as loss_scale_lib
from span_lm.train import metrics as metrics_lib
from span_lm.train import optimizer as optimizer_lib
from span_lm.train import restore as restore_lib
from span_lm.train import run_lock
from span_lm.train import steps as steps_lib

_echo = metrics_lib.say

# ---- the device ----------------------------------------------------------------------------------


def _device_memory() -> int | None:
  """Bytes one GPU holds (the fit rule of `auto`'s attention: StepCompiler); None elsewhere."""
  dev = jax.devices()[0]
  if dev.platform != "gpu":
    return None
  try:
    return int((dev.memory_stats() or {}).get("bytes_limit") or 0) or None
  except Exception:  # pylint: disable=broad-except
    return None


# ---- the run -------------------------------------------------------------------------------------


class Run:
  """Everything a run needs, built (and checked) before anything compiles."""

  def __init__(self, config, *, need_workdir: bool = True, num_devices: int | None = None,
               lock: bool = False):
    """config: a RunConfig, or a ConfigDict (a notebook's), checked here.
    num_devices: build the mesh over the first N devices (default: all of them).
    lock: take the run directory's lock first (training: one writer per directory); released
    by `release`."""
    config = config_lib.checked(config)
    n_cpu, why = cpu_host.setup(config)  # before any backend use, as initialize
    dist_lib.initialize(config)  # before any backend use; a no-op for a lone process
    # before anything is written
    self.lock = run_lock.take(config.workdir, echo=_echo) if lock else None
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
    config.check_kernels(backend=jax.default_backend())  # a kernel this host can run
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
    # checked once, by validate; the dataset's vocabulary settles a vocab_size of 0
    self.model_cfg = config.model_for(self.splits.vocab_size)
    if self.model_cfg.vocab_size < self.splits.vocab_size:
      raise ValueError(f"config.model.vocab_size={self.model_cfg.vocab_size} is smaller than the "
                       f"dataset's vocabulary ({self.splits.vocab_size})")
    d = config.data
    sources.check_lengths(self.splits, d.block, d.batch, d.eval_batch)
    self.fsdp = config.dist.fsdp
    self.tx, self.schedule = optimizer_lib.make_optimizer(config.optim)
    # attention.tiles='tune' is timed here (tune_block), before any step compiles
    self.compiler = steps_lib.build(self.model_cfg, self.tx, steps_lib.StepOptions(
        batch=d.batch, eval_batch=d.eval_batch, batch_split=config.optim.batch_split,
        fsdp=self.fsdp, num_devices=num_devices, processes=self.process_count, tune_block=d.block,
        log=_echo, capacity=_device_memory(), debug_nan_at_step=config.train.debug_nan_at_step,
        loss_scale_period=config.train.loss_scale_period))
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

  # --- checkpoints (train/restore.py) -----------------------------------------------------------

  def restore(self, step=None, *, move_aside: bool = False):
    """(state, meta) from the work dir, laid out for this mesh (restore.restore)."""
    return restore_lib.restore(self, step, move_aside=move_aside)

  def restore_params(self, step=None):
    """(params, span plan, meta) of a checkpoint (restore.restore_params)."""
    return restore_lib.restore_params(self, step)

  def put_batch(self, b):
    """Host batch -> global arrays; with several processes `b` holds this process's rows only."""
    return self.layout.shard_batch(b)

  def streams(self, split: np.ndarray, batch: int, seed: int) -> batching.StreamIterator:
    """This process's share of the B training-style streams of a split."""
    return batching.StreamIterator(split, batch, self.config.data.block, seed=seed,
                                   process_index=self.process_index,
                                   process_count=self.process_count,
                                   align=self.config.data.align)

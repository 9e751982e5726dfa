"""Multi-process start-up (jax.distributed) from config.dist and the environment, and preemption.

JAX's multi-controller runtime is the launcher protocol: every process runs the same program, calls
`jax.distributed.initialize()` before any JAX computation, and then sees all devices of the job in
`jax.devices()` (its own in `jax.local_devices()`). Decisions (config.dist.mode):

  off   never initialise (one process, whatever the environment says).
  on    always initialise; unset fields are filled by JAX's cluster detection (Cloud TPU VMs,
        SLURM, Open MPI) or the JAX_* environment variables.
  auto  initialise when something says the job has several processes: a coordinator address
        (config.dist.coordinator or JAX_COORDINATOR_ADDRESS), config.dist.num_processes > 1, a
        SLURM step with more than one task, or a multi-worker Cloud TPU VM (TPU_WORKER_HOSTNAMES
        or TPU_PROCESS_ADDRESSES listing several hosts). A lone process stays single-process, so
        `python main.py` on a laptop or inside `salloc` with one task needs no flags.

Preemption: a single process catches SIGTERM itself (a flag the loop polls after each step). With
several processes the signal reaches one process at a time and the checkpoint is a collective, so
the loop asks JAX's preemption sync point instead (the distributed runtime's own SIGTERM notifier;
Orbax's `reached_preemption` is the same call), which stops every process at the same step.
"""
import logging
import os
import signal
import sys
from typing import Mapping

import jax
import numpy as np
from jax.experimental import multihost_utils

log = logging.getLogger("span_lm")


def _int_env(env: Mapping[str, str], name: str) -> int | None:
  value = env.get(name)
  try:
    return int(value) if value not in (None, "") else None
  except ValueError:
    return None


def _multi_host_tpu(env: Mapping[str, str]) -> bool:
  hosts = env.get("TPU_PROCESS_ADDRESSES") or env.get("TPU_WORKER_HOSTNAMES") or ""
  return len([h for h in hosts.split(",") if h.strip()]) > 1


def _slurm_tasks(env: Mapping[str, str]) -> int:
  # A job step (srun), not merely an allocation: SLURM_STEP_ID is set by srun only.
  if "SLURM_JOB_ID" not in env or "SLURM_STEP_ID" not in env:
    return 0
  return _int_env(env, "SLURM_STEP_NUM_TASKS") or _int_env(env, "SLURM_NTASKS") or 0


def decide(dist, env: Mapping[str, str] | None = None) -> tuple[bool, str]:
  """(initialise?, why) for config.dist and an environment (os.environ by default)."""
  env = os.environ if env is None else env
  mode = dist.mode
  if mode == "off":
    return False, "config.dist.mode=off"
  if mode == "on":
    return True, "config.dist.mode=on"
  if dist.coordinator:
    return True, f"config.dist.coordinator={dist.coordinator}"
  if env.get("JAX_COORDINATOR_ADDRESS"):
    return True, f"JAX_COORDINATOR_ADDRESS={env['JAX_COORDINATOR_ADDRESS']}"
  if dist.num_processes > 1:
    return True, f"config.dist.num_processes={dist.num_processes}"
  if _slurm_tasks(env) > 1:
    return True, f"SLURM step with {_slurm_tasks(env)} tasks"
  if _multi_host_tpu(env):
    return True, "multi-worker Cloud TPU VM"
  return False, "single process (no coordinator, SLURM step or TPU pod detected)"


def init_kwargs(dist, env: Mapping[str, str] | None = None) -> dict:
  """Arguments for jax.distributed.initialize: only what config/env fix; JAX detects the rest."""
  env = os.environ if env is None else env
  kw = {"initialization_timeout": int(dist.init_timeout)}
  coordinator = dist.coordinator or env.get("JAX_COORDINATOR_ADDRESS") or None
  if coordinator:
    kw["coordinator_address"] = coordinator
  n = dist.num_processes if dist.num_processes > 0 else _int_env(env, "JAX_NUM_PROCESSES")
  if n:
    kw["num_processes"] = n
  pid = dist.process_id if dist.process_id >= 0 else _int_env(env, "JAX_PROCESS_ID")
  if pid is not None:
    kw["process_id"] = pid
  if dist.local_device_ids:
    kw["local_device_ids"] = [int(i) for i in str(dist.local_device_ids).split(",")]
  return kw


def initialize(config) -> bool:
  """Starts the distributed runtime if config/env ask for it; returns whether it is running.

  Must run before anything touches a JAX backend (jax.devices(), any array). Idempotent.
  """
  if jax.distributed.is_initialized():
    return True
  dist = config.dist
  start, why = decide(dist)
  if not start:
    log.info("jax.distributed not initialised: %s", why)
    return False
  kw = init_kwargs(dist)
  log.info("jax.distributed.initialize(%s) because %s", kw, why)
  jax.distributed.initialize(**kw)
  if jax.process_index() == 0:
    print(f"distributed: {jax.process_count()} processes, {jax.device_count()} devices "
          f"({jax.local_device_count()} per process; {why})", flush=True)
  return True


def reached_preemption_sync_point(step: int) -> bool:
  """True in every process at the same step once any of them was told to stop (as Orbax's
  CheckpointManager.reached_preemption); False when the runtime has no preemption service."""
  try:
    return bool(multihost_utils.reached_preemption_sync_point(step))
  except RuntimeError:  # jax_enable_preemption_service off
    return False


class PreemptionWatch:
  """Says when to checkpoint and stop: SIGTERM (one process) or the preemption sync point."""

  def __init__(self, enabled: bool = True):
    self.enabled = enabled
    self._flag = False
    self._previous = None
    self._use_sync_point = enabled and jax.distributed.is_initialized()
    # With the distributed runtime up, its notifier owns SIGTERM (replacing it would break the
    # sync point); on its own a process installs a Python handler (main thread only).
    if enabled and not self._use_sync_point:
      try:
        self._previous = signal.signal(signal.SIGTERM, self._on_signal)
      except ValueError:  # not the main thread (e.g. a notebook worker): no handler
        self._previous = None

  def _on_signal(self, signum, frame):
    del signum, frame
    self._flag = True

  def should_stop(self, step: int) -> bool:
    if not self.enabled:
      return False
    if self._use_sync_point:
      return reached_preemption_sync_point(step)
    return self._flag

  def close(self) -> None:
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)
      self._previous = None


# ---- Ctrl-C --------------------------------------------------------------------------------------


class CtrlC:
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


# ---- work on process 0 ---------------------------------------------------------------------------


def on_process_0(fn, failed):
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
    ok = bool(multihost_utils.broadcast_one_to_all(np.int32(error is None)))
    if not ok and error is None:
      error = failed()
  if error is not None:
    raise error
  return out

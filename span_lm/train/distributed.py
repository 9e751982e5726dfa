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
from typing import Mapping

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from span_lm import config as config_lib
from span_lm.train import sharding as sharding_lib

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


AUTO_MAX_CPU_DEVICES = 8  # a cap: more devices mean a wider all-reduce (docs/benchmarks.md)


def keeps_one_cpu_device(config) -> bool:
  """Whether auto (dist.cpu_devices=0) keeps the host as one device: bf16 span models, all of
  whose matmuls run multi-threaded on XLA:CPU (kernels/matmul.py), so splitting the host only
  halves each device's threads; one device measured faster for them, float32 slower
  (docs/benchmarks.md)."""
  return (str(config.model.get("dtype", "float32")) == "bfloat16"
          and config.model.get("arch", "span") == "span")


def choose_cpu_devices(requested: int, cores: int, batches: tuple[int, ...]) -> int:
  """Devices to split a CPU host into: `requested`, or (0) the most, up to the core count (at
  most AUTO_MAX_CPU_DEVICES), that divide every per-step batch."""
  if requested:
    return requested
  for n in range(max(1, min(cores, AUTO_MAX_CPU_DEVICES)), 0, -1):
    if all(b % n == 0 for b in batches):
      return n
  return 1


def accelerator_plugins() -> list[str]:
  """Installed PJRT plugins JAX would load (CUDA, ROCm, TPU), found without starting a backend."""
  import importlib.metadata  # pylint: disable=g-import-not-at-top
  import importlib.util  # pylint: disable=g-import-not-at-top
  import pkgutil  # pylint: disable=g-import-not-at-top
  names = [ep.name for ep in importlib.metadata.entry_points(group="jax_plugins")]
  try:
    import jax_plugins  # pylint: disable=g-import-not-at-top
    names += [m.name for m in pkgutil.iter_modules(jax_plugins.__path__)]
  except ImportError:
    pass
  if importlib.util.find_spec("libtpu") is not None:
    names.append("libtpu")
  return names


def backend_started() -> bool:
  """Whether a JAX backend is already running in this process (a notebook, a test session)."""
  try:
    from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
    return bool(xla_bridge.backends_are_initialized())
  except (ImportError, AttributeError):  # a JAX without it: assume so (leave things alone)
    return True


def cpu_only(env: Mapping[str, str] | None = None) -> bool:
  """Whether JAX will run on the host CPU (JAX_PLATFORMS, or no accelerator plugin installed),
  decided without starting a backend."""
  env = os.environ if env is None else env
  platforms = env.get("JAX_PLATFORMS", "")
  if platforms:
    return platforms.split(",")[0].strip() == "cpu"
  return not accelerator_plugins()


def setup_cpu_devices(config, env: Mapping[str, str] | None = None) -> tuple[int | None, str]:
  """Splits a CPU host into config.dist.cpu_devices JAX devices (0: auto) for data parallelism.

  Why: XLA:CPU runs most of one device's operations (everything but large matmuls) on one thread,
  and the banded attention and layer norms are such operations; with one device per core the
  halves of the batch run side by side (bench/train_step.py; docs/benchmarks.md). Auto keeps one
  device for bf16 span models, which measured faster that way (keeps_one_cpu_device). Must run
  before the backend starts; a user's --xla_force_host_platform_device_count is left alone.
  Returns (devices set or None, why).
  """
  env = os.environ if env is None else env
  requested = int(config.dist.cpu_devices)
  if "xla_force_host_platform_device_count" in env.get("XLA_FLAGS", ""):
    return None, "XLA_FLAGS sets --xla_force_host_platform_device_count"
  if requested == 1:
    return None, "config.dist.cpu_devices=1"
  if requested == 0:
    if not cpu_only(env):
      return None, "an accelerator platform is available"
    if decide(config.dist, env)[0]:
      return None, "multi-process run (set config.dist.cpu_devices explicitly)"
    if keeps_one_cpu_device(config):
      return None, f"auto: one device for {config.model.dtype} models"
  cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  n = choose_cpu_devices(requested, cores or 1,
                         tuple(config_lib.per_step_batches(config).values()))
  try:
    jax.config.update("jax_num_cpu_devices", n)
  except RuntimeError:  # the backend already started (a notebook, a test): keep its devices
    return None, "the JAX backend was already initialised"
  return n, f"config.dist.cpu_devices={requested}" if requested else "auto: one per core"


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


# ------------------------------------------------------------------------- FSDP-style layout

FSDP_AXIS = "fsdp"
BATCH_AXES = (sharding_lib.DATA_AXIS, FSDP_AXIS)  # batches and caches: over every device
# Parameters (and the optimizer state that mirrors them) split their model dimension over the
# 'fsdp' axis; GSPMD gathers each weight where it is used and reduce-scatters its gradient.
FSDP_RULES = (("batch", sharding_lib.DATA_AXIS), ("embed", FSDP_AXIS))


def fsdp_mesh(fsdp: int, num_devices: int | None = None) -> Mesh:
  """A 2-D ('data', 'fsdp') mesh; consecutive devices (one host's, first) share a 'data' row."""
  devices = jax.devices()
  n = len(devices) if num_devices is None else num_devices
  if not 1 <= n <= len(devices) or n % fsdp:
    raise ValueError(f"config.dist.fsdp={fsdp} must divide the {n} devices")
  grid = np.asarray(devices[:n]).reshape(n // fsdp, fsdp)
  return Mesh(grid, BATCH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 2)


def fsdp_state_rule():
  """Caches over all devices on their batch dim; params/optimizer state by logical names."""
  by_name = sharding_lib.make_state_rule(FSDP_RULES)

  def rule(path, leaf, mesh):
    if path and sharding_lib._key_name(path[0]) in sharding_lib.CACHE_KEYS:  # pylint: disable=protected-access
      return NamedSharding(mesh, P(BATCH_AXES, *([None] * (np.ndim(leaf) - 1))))
    return by_name(path, leaf, mesh)

  return rule

"""What a training run reports about itself besides its losses: a profiler trace of the steps asked
for (train.profile_start / profile_steps) and each log interval's throughput and MFU.

Profiling: jax.profiler traces steps profile_start .. profile_start + profile_steps - 1 (1-based)
into <workdir>/profile/plugins/profile/<time>/: <host>.xplane.pb for TensorBoard's profile plugin
(`tensorboard --logdir <workdir>/profile`) and perfetto_trace.json.gz for ui.perfetto.dev. Every step runs inside a
jax.profiler.StepTraceAnnotation('train', step_num=N), so the trace's steps are named; the last
traced step's outputs are waited for before the trace stops, so its device work is in it. A run
resumed past profile_start does not trace again.

MFU (model FLOPs utilisation) of an interval = the model FLOPs of the steps it ran / its wall
time / (the peak FLOP/s of one device for the run's dtype x the number of devices). The model
FLOPs of a step are span_lm/model/costs.py's exact matmul count of the train step for the span
plan that step ran with (the learned spans' plan, not the full span S), without the recomputation
of model.remat=layer (that is hardware work, not model work); they are counted once per plan, when
the plan is first used, not per step. The peak: train.peak_tflops when set, else the data sheet's
(span_lm/kernels/chips.py: dense bf16 for bfloat16 and float16 models, TF32 for float32 ones on GPUs
that have it, as XLA's default precision runs them); null where neither is known (CPU), and the log
says why once. The wall time is the interval's, compilations and checkpoints included (the log
names each compilation): a plan change shows as a slower interval.
"""
import os
from typing import Any, Callable

import jax

from span_lm.kernels import chips
from span_lm.model import costs as costs_lib
from span_lm.model.config import ModelConfig
from span_lm.model.plan import SpanPlan

PROFILE_DIR = "profile"


def peak_flops(device_kind: str, dtype: str) -> tuple[float | None, str]:
  """(peak FLOP/s of one device for a model dtype, where it comes from) from the chip table;
  (None, why) for a device the table does not know."""
  chip = chips.for_device_kind(device_kind)
  if chip is None:
    return None, (f"no peak FLOP/s is known for device kind {device_kind!r} "
                  "(span_lm/kernels/chips.py lists GPUs and TPUs); set --config.train.peak_tflops="
                  "PEAK (one device's, for the run's dtype) to log it")
  key = "bfloat16" if dtype != "float32" else ("tf32" if "tf32" in chip.peak_flops else "float32")
  return chip.peak_flops[key], f"{chip.name} {key} peak {chip.peak_flops[key] / 1e12:g} TFLOP/s"


def readable_flops(x: float) -> str:
  """Model FLOP/s (x in TFLOP/s) in a readable unit."""
  for unit, scale in (("TFLOP/s", 1e12), ("GFLOP/s", 1e9)):
    if x * 1e12 >= scale:
      return f"{x * 1e12 / scale:.3g} {unit}"
  return f"{x * 1e6:.3g} MFLOP/s"


class Throughput:
  """Model FLOPs per step (per plan, counted once) and each interval's tokens/s, TFLOP/s, MFU."""

  def __init__(self, cfg: ModelConfig, batch: int, block: int, *, num_devices: int,
               device_kind: str, peak_tflops: float = 0.0):
    self.cfg = cfg.replace(remat="none") if cfg.remat != "none" else cfg  # model FLOPs only
    self.batch, self.block, self.num_devices = batch, block, num_devices
    if peak_tflops:
      per_device, self.peak_source = float(peak_tflops) * 1e12, "train.peak_tflops"
    else:
      per_device, self.peak_source = peak_flops(device_kind, cfg.dtype)
    self.peak = None if per_device is None else per_device * num_devices
    self._per_plan: dict[SpanPlan, float] = {}

  def step_flops(self, plan: SpanPlan) -> float:
    """The model FLOPs of one train step with `plan` (a dict lookup after the first call)."""
    f = self._per_plan.get(plan)
    if f is None:
      f = self._per_plan[plan] = float(costs_lib.train_step_flops(self.cfg, plan, self.batch,
                                                                  self.block))
    return f

  def interval(self, steps: int, flops: float, seconds: float) -> dict[str, Any]:
    secs = max(seconds, 1e-9)
    out = {"tokens_per_s": self.batch * self.block * steps / secs,
           "model_tflops_per_s": flops / secs / 1e12}
    out["mfu"] = None if self.peak is None else flops / secs / self.peak
    return out


class Profile:
  """Starts and stops the jax.profiler trace around the steps asked for (1-based, inclusive)."""

  def __init__(self, workdir: str, start: int, steps: int, first_step: int,
               echo: Callable[[str], None], active: bool = True):
    """first_step: the step this run begins with (1 for a fresh run, resumed step + 1)."""
    self.start, self.end = start, start + steps - 1
    self.dir = os.path.abspath(os.path.join(workdir, PROFILE_DIR))
    self._echo = echo
    self.tracing = False
    self.done = not (active and start)
    if not self.done and first_step > start:
      self.done = True
      echo(f"profile: steps {start}-{self.end} (train.profile_start) came before this run's first "
           f"step {first_step} (resumed): not traced again")

  def before(self, step: int) -> None:
    """Called before dispatching `step`."""
    if not self.done and not self.tracing and step == self.start:
      os.makedirs(self.dir, exist_ok=True)
      jax.profiler.start_trace(self.dir, create_perfetto_trace=True)
      self.tracing = True
      self._echo(f"profile: tracing steps {self.start}-{self.end} into {self.dir}")

  def after(self, step: int, outputs) -> None:
    """Called after dispatching `step` with its outputs (waited for before the trace stops)."""
    if self.tracing and step >= self.end:
      jax.block_until_ready(outputs)
      self.stop()

  def stop(self) -> None:
    """Ends the trace (also when the run stops before its last traced step)."""
    if not self.tracing:
      return
    jax.profiler.stop_trace()
    self.tracing, self.done = False, True
    path = self.trace_path()
    perfetto = os.path.join(os.path.dirname(path), "perfetto_trace.json.gz")
    self._echo(f"profile: wrote the trace of steps {self.start}-{self.end} to {path} "
               f"(tensorboard --logdir {self.dir})"
               + (f" and {perfetto} (ui.perfetto.dev)" if os.path.exists(perfetto) else ""))

  def trace_path(self) -> str:
    """The newest .xplane.pb under the profile directory (its run directory when none)."""
    found = []
    for root, _, files in os.walk(self.dir):
      found += [os.path.join(root, f) for f in files if f.endswith(".xplane.pb")]
    return max(found, key=os.path.getmtime) if found else self.dir

"""Steps dispatched ahead of the host and read late (span_lm/train/loop.py).

The host reads nothing from the device between logging, evaluation and checkpoint steps, so a
step's flags (non-finite, plan too short) and span ratios are read some steps after it ran. A
step whose span plan the spans had outgrown changed nothing on the device (train/steps.py); the
host then widens the plan and replays the data from that step on. This object keeps what that
needs -- each unread step's metrics and the data position before it, and the losses since the
last log line -- so the lagged read is testable on numpy flags, without a model.
"""
import dataclasses
from typing import Any

import jax
import numpy as np

# Steps dispatched ahead of the host before it waits for the oldest one. Unbounded asynchronous
# dispatch deadlocks XLA:CPU once a program with collectives (any multi-device mesh) has 32
# executions queued per device (an all-reduce rendezvous that never completes); on accelerators a
# few queued steps already hide the host's latency.
MAX_IN_FLIGHT = 8

_FLAGS = ("skipped", "short", "span_ratio")


@dataclasses.dataclass(frozen=True)
class Read:
  """One applied (or non-finite, hence skipped) step as the host read it."""
  step: int
  skipped: bool  # the loss or gradient was not finite: the update was not applied
  ratios: list[np.ndarray] | None  # z' per layer after the step (adaptive spans), else None


@dataclasses.dataclass(frozen=True)
class Refused:
  """The first step that ran on a plan its spans had outgrown: it and every later unread step
  changed nothing on the device and must run again on a wider plan."""
  step: int
  ratios: list[np.ndarray]  # z' per layer the refused step starts from
  replay: int  # steps to run again: the refused one and those dispatched after it
  data_before: Any  # the data position before the refused step (to replay from)


class PendingSteps:
  """Dispatch ahead (`push`), read late (`drain`); a refused step rewinds the window."""

  def __init__(self, max_in_flight: int = MAX_IN_FLIGHT):
    self.max_in_flight = max_in_flight
    self._unread: list[tuple[int, dict, Any]] = []  # (step, metrics, data position before it)
    self.losses: list = []  # each step's loss since the last `take_losses` (the log window)
    self.flops: list[float] = []  # each of those steps' model FLOPs (its plan's; telemetry.py)

  def __len__(self) -> int:
    return len(self._unread)

  def push(self, step: int, metrics: dict, data_before: Any, flops: float = 0.0) -> None:
    """Records a dispatched step; waits for the one max_in_flight steps back (bounded queue).
    flops: the step's model FLOPs, summed by `take_flops` over the steps the window keeps."""
    self._unread.append((step, metrics, data_before))
    self.losses.append(metrics["loss"])
    self.flops.append(flops)
    if len(self._unread) > self.max_in_flight:
      jax.block_until_ready(self._unread[-self.max_in_flight - 1][1]["loss"])

  def drain(self) -> tuple[list[Read], Refused | None]:
    """Reads every unread step's flags in order: the steps that were applied (or skipped as
    non-finite) up to the first refused one, and that refusal (None when none was). A refusal
    drops it and the later steps from the loss window: they are replayed."""
    if not self._unread:
      return [], None
    got = jax.device_get([{k: m[k] for k in _FLAGS if k in m} for _, m, _ in self._unread])
    reads, refused = [], None
    for i, ((s, _, data_before), g) in enumerate(zip(self._unread, got)):
      ratios = list(np.asarray(g["span_ratio"])) if "span_ratio" in g else None
      if int(g.get("short", 0)):
        if not all(int(f["short"]) for f in got[i:]):  # a later step applied on a missing state
          raise RuntimeError(f"internal: step {s} was refused but a later step was applied")
        refused = Refused(s, ratios, len(self._unread) - i, data_before)
        del self.losses[len(self.losses) - refused.replay:]
        del self.flops[len(self.flops) - refused.replay:]
        break
      reads.append(Read(s, bool(int(g["skipped"])), ratios))
    self._unread.clear()
    return reads, refused

  def take_losses(self) -> list:
    """The losses of the window (the steps since the last call), which starts again."""
    out, self.losses = self.losses, []
    return out

  def take_flops(self) -> list[float]:
    """The model FLOPs of the window's steps (those take_losses returns), which starts again."""
    out, self.flops = self.flops, []
    return out

"""A device out of memory in one line: XLA's RESOURCE_EXHAUSTED, raised while a step compiles
(XLA:TPU refuses a program that does not fit) or runs (an allocation fails), becomes
DeviceOutOfMemoryError saying where (which step), the bytes asked against the device's where the
message or the device tells them, and the settings that would fit, with the compile-mode command
that checks them for this chip without running anything.

XLA's messages differ by platform and version; the ones parsed:
  GPU   'Out of memory while trying to allocate 34359738368 bytes.'
        'Failed to allocate request for 32.00GiB (34359738368B) on device ordinal 0'
  TPU   'Ran out of memory in memory space hbm. Used 20.05G of 15.48G hbm.'
        'Error allocating device buffer: Attempting to allocate 8.00G. That was not possible.
         There are 6.43G free.'
The device's size otherwise comes from its memory_stats() (bytes_limit) or the chip table.
"""
import os
import re
import shlex
import sys

from span_lm.kernels import chips

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


class DeviceOutOfMemoryError(RuntimeError):
  """The device ran out of memory (a user-fixable setting: batch split, remat, batch)."""


def _size(number: str, unit: str) -> int:
  return int(float(number) * _UNITS[(unit or "B")[0].upper()])


def _chain(exc: BaseException):
  seen, todo = set(), [exc]
  while todo:
    e = todo.pop()
    if e is None or id(e) in seen:
      continue
    seen.add(id(e))
    yield e
    todo += [e.__cause__, e.__context__]


def find(exc: BaseException) -> BaseException | None:
  """The XLA out-of-memory error in exc's chain, or None. A full disk (TensorStore's
  'RESOURCE_EXHAUSTED: No space left on device') is not one."""
  for e in _chain(exc):
    text = str(e)
    if "RESOURCE_EXHAUSTED" not in text or "No space left on device" in text:
      continue
    if "emory" in text or "allocat" in text or "hbm" in text.lower():
      return e
  return None


def parse(text: str) -> dict[str, int | None]:
  """{'asked', 'capacity', 'free'}: bytes from an XLA out-of-memory message (None: not said).
  asked: the allocation that failed, or the whole program (XLA:TPU's compile-time 'Used')."""
  out = {"asked": None, "capacity": None, "free": None}
  m = re.search(r"Used ([\d.]+)([KMGT]?)i?B? of ([\d.]+)([KMGT]?)i?B? hbm", text)
  if m:
    out["asked"], out["capacity"] = _size(m.group(1), m.group(2)), _size(m.group(3), m.group(4))
    return out
  m = re.search(r"\((\d+)B\)", text) or re.search(r"allocate (\d+) bytes", text)
  if m:
    out["asked"] = int(m.group(1))
  m = re.search(r"Attempting to allocate ([\d.]+)([KMGT]?)i?B?\b", text)
  if m and out["asked"] is None:
    out["asked"] = _size(m.group(1), m.group(2))
  m = re.search(r"There are ([\d.]+)([KMGT]?)i?B? free", text)
  if m:
    out["free"] = _size(m.group(1), m.group(2))
  return out


def _gib(x: int) -> str:
  return f"{x / 2**30:.2f} GiB"


def _device_bytes() -> tuple[int | None, str, int]:
  """(bytes one device holds, its kind, the number of devices)."""
  import jax  # pylint: disable=g-import-not-at-top
  dev = jax.devices()[0]
  limit = None
  try:
    limit = int((dev.memory_stats() or {}).get("bytes_limit") or 0) or None
  except Exception:  # pylint: disable=broad-except
    pass
  if limit is None:
    chip = chips.for_device_kind(dev.device_kind)
    limit = chip.memory_bytes if chip is not None and dev.platform != "cpu" else None
  return limit, dev.device_kind, jax.device_count()


def _next_split(batch: int, split: int, devices: int) -> int | None:
  """The smallest batch split above `split` whose pieces divide over the devices (as the compile
  mode requires), or None."""
  for s in range(split + 1, batch + 1):
    if batch % s == 0 and (batch // s) % devices == 0:
      return s
  return None


def _compile_command(overrides: list[str], target: str | None) -> str:
  """The compile-mode command for this run's config with the suggested overrides."""
  argv = sys.argv if os.path.basename(sys.argv[0] if sys.argv else "") == "main.py" else []
  keep = [a for a in argv[1:] if not a.startswith((
      "--config.mode", "--config.optim.batch_split", "--config.model.remat",
      "--config.compile.targets", "--config.data.batch", "--config.data.eval_batch"))]
  if not any(a.startswith("--config=") for a in keep):
    keep.insert(0, "--config=CONFIG.py")
  cmd = ["python", "main.py"] + keep + ["--config.mode=compile"]
  if target:
    cmd.append(f"--config.compile.targets={target}")
  return " ".join(shlex.quote(a) for a in cmd + overrides)


def message(e: BaseException, where: str, config, *, device=None) -> str:
  """The one line for an out-of-memory error `e` that happened `where`.

  device: (bytes, kind, count) of this host's devices (tests); default: jax's."""
  sizes = parse(str(e))
  limit, kind, count = device if device is not None else _device_bytes()
  capacity = sizes["capacity"] if sizes["capacity"] is not None else limit
  chip = chips.for_device_kind(kind)
  target = None
  if chip is not None:
    target = f"{chip.name}:{count}" if chip.platform == "gpu" else chip.name
  said = []
  if sizes["asked"] is not None:
    said.append(f"asked for {_gib(sizes['asked'])}")
  if sizes["free"] is not None:
    said.append(f"{_gib(sizes['free'])} free")
  said.append(f"on a device ({kind}) of {_gib(capacity)}" if capacity is not None
              else f"on a device ({kind}) of unknown size")
  sizes = ": " + ", ".join(said)
  evaluating = "eval" in where or "validation" in where
  fixes, overrides = [], []
  if evaluating:
    eb = config.data.eval_batch
    smaller = (eb // 2) // count * count  # the devices must still divide it
    if smaller >= count:
      fixes.append(f"--config.data.eval_batch={smaller} (streams evaluated at once)")
      overrides.append(f"--config.data.eval_batch={smaller}")
  else:
    split = _next_split(config.data.batch, config.optim.batch_split, count)
    if split is not None:
      fixes.append(f"--config.optim.batch_split={split} (the batch in {split} pieces of "
                   f"{config.data.batch // split} streams: the same step, less activation memory)")
      overrides.append(f"--config.optim.batch_split={split}")
    if config.model.remat != "layer":
      fixes.append("--config.model.remat=layer (each layer recomputed in the backward pass)")
      overrides.append("--config.model.remat=layer")
  if not fixes:
    fixes.append("a smaller model, block or batch (--config.data.batch), or more devices")
  return (f"out of device memory {where}{sizes}. To fit, try " + " and/or ".join(fixes)
          + f"; check what fits before running: {_compile_command(overrides, target)}")


def of(e: BaseException, where: str, config) -> DeviceOutOfMemoryError | None:
  """A DeviceOutOfMemoryError for XLA's RESOURCE_EXHAUSTED somewhere in `e` (one line: `message`),
  or None when `e` is not one."""
  found = find(e)
  if found is None:
    return None
  return DeviceOutOfMemoryError(message(found, where, config))

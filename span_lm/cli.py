"""Dispatch on config.mode; shared by main.py and notebooks. Errors a user can cause (config, data,
checkpoint, file system) become one line here; SPAN_LM_DEBUG=1 keeps the traceback."""
import errno
import logging
import os
import re
import sys
import traceback

from span_lm import config as config_lib
from span_lm import run_dir
from span_lm.data.sources import DatasetUnavailableError
from span_lm.train import loop
from span_lm.train.oom import DeviceOutOfMemoryError
from span_lm.train.run_lock import RunLockedError
from span_lm.train.wandb_log import WandbError

# What a user's mistake raises (besides errors of the file system, found by errno): each is one
# line. ValueError covers ConfigError, FormatError; OSError: CheckpointReadError, the data
# download's DataIntegrityError and DownloadError; FloatingPointError: NonFiniteLossError.
USER_ERRORS = (ValueError, OSError, FloatingPointError, DatasetUnavailableError, RunLockedError,
               DeviceOutOfMemoryError, WandbError)

EXIT_ERROR = 1
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: checkpointed and stopped early (SIGTERM, preemption): rerun
EXIT_INTERRUPTED = 130  # Ctrl-C (checkpointed after the first, not after a second)


def run(config):
  """Runs config.mode. The ConfigDict of the command line stops here: every mode but eval gets
  the checked RunConfig (checked once, here); eval's Run checks it after finding the checkpoint
  directory."""
  if config.mode == "eval":
    return loop.evaluate(config)
  config = config_lib.checked(config)
  if config.mode == "train":
    return loop.train(config)
  if config.mode in ("import", "export"):
    # A directory holding model.safetensors (import) or export_format / a path not ending in .pt
    # (export) is the safetensors format; a .pt file the reference's.
    from span_lm.tools import reference_checkpoint  # pylint: disable=g-import-not-at-top
    from span_lm.tools import safetensors_format  # pylint: disable=g-import-not-at-top
    if config.mode == "import":
      if safetensors_format.import_source(config.import_from) == "safetensors":
        return safetensors_format.import_export(config)
      return reference_checkpoint.import_reference(config)
    if safetensors_format.export_format(config) == "safetensors":
      return safetensors_format.export(config)
    return reference_checkpoint.export_reference(config)
  if config.mode == "verify":
    from span_lm.tools import verify  # pylint: disable=g-import-not-at-top
    return verify.report(config)
  if config.mode == "compile":
    from span_lm.tools import compile as compile_lib  # pylint: disable=g-import-not-at-top
    result = compile_lib.report(config)
    failed = compile_lib.failures(result)
    if failed and config.compile.strict:
      raise ValueError(f"--config.compile.strict: {'; '.join(failed)}")
    return 0
  if config.mode in config_lib.TOOL_MODES:
    from span_lm.tools import flops_report, sample, spans_report  # pylint: disable=g-import-not-at-top
    return {"spans": spans_report.report, "flops": flops_report.report,
            "sample": sample.sample}[config.mode](config)
  raise ValueError(unknown_mode(config.mode))


def unknown_mode(mode) -> str:
  return (f"config.mode={mode!r}: unknown mode; choose one of {', '.join(config_lib.MODES)} "
          "(python main.py --help describes each)")


def run_config(config, override_names=()):
  """The config a command runs with: for the modes that read a run (eval, spans, flops, sample)
  whose workdir holds a config.json, that saved config with the command line's overrides on top
  (a --config file's other values are not used: the run's own are the truth)."""
  mode, workdir = config.get("mode"), config.get("workdir")
  if mode not in run_dir.RUN_MODES or not workdir:
    return config
  if not os.path.isfile(run_dir.config_path(workdir)):
    return config
  try:
    saved = run_dir.load_saved(workdir)
  except (OSError, ValueError):
    return config  # an unreadable config.json: the given config, checked against the checkpoint
  names = set(override_names) | {"mode", "workdir"}
  return run_dir.with_overrides(saved, config, sorted(names))


def _chain(exc: BaseException):
  """The exception, its causes/contexts and the members of exception groups, once each."""
  seen, todo = set(), [exc]
  while todo:
    e = todo.pop()
    if e is None or id(e) in seen:
      continue
    seen.add(id(e))
    yield e
    todo += [e.__cause__, e.__context__] + list(getattr(e, "exceptions", ()))


_FS_HINTS = {
    errno.ENOSPC: "the disk is full: free space or point --config.workdir at another disk",
    errno.EDQUOT: "the disk quota is exhausted: free space or point --config.workdir elsewhere",
    errno.EACCES: "no permission: choose a writable --config.workdir (or fix its permissions)",
    errno.EPERM: "not permitted: choose a writable --config.workdir (or fix its permissions)",
    errno.EROFS: "a read-only file system: choose a writable --config.workdir",
    errno.ENOTDIR: "a path component is a file, not a directory: choose another path",
}


def user_message(exc: BaseException, workdir: str | None = None) -> str | None:
  """One line for an error the user can fix, or None for a bug (which keeps its traceback)."""
  chain = list(_chain(exc))
  for e in chain:
    code = getattr(e, "errno", None)
    if code is None and "No space left on device" in str(e):
      code = errno.ENOSPC
    if code in _FS_HINTS:
      where = getattr(e, "filename", None) or workdir or "the run directory"
      saved = ""
      if code in (errno.ENOSPC, errno.EDQUOT) and workdir:
        saved = f"; checkpoints already committed in {os.path.join(workdir, 'checkpoints')} are intact"
      return f"{os.strerror(code)} writing {where}: {_FS_HINTS[code]}{saved}"
  if isinstance(exc, USER_ERRORS):
    text = str(exc).strip() or type(exc).__name__
    if isinstance(exc, OSError) and exc.filename and exc.strerror:
      text = f"{exc.strerror}: {exc.filename}"
      if workdir and os.path.abspath(workdir).startswith(os.path.abspath(str(exc.filename))):
        text += f" (making config.workdir={workdir!r}: choose a directory you can write)"
    return one_line(text)
  return None


def one_line(text: str) -> str:
  """A message's lines joined into one (e.g. a list of mismatched fields after a colon)."""
  lines = [l.strip() for l in str(text).splitlines() if l.strip()]
  out = ""
  for l in lines:
    out += l if not out else (" " if out.endswith(":") else "; ") + l
  return out


def override_error(exc: BaseException, override_names=()) -> str:
  """One line for a --config.FIELD=V that names no field (ml_collections' message is multi-line)."""
  text = str(exc).strip().strip("'\"").replace("\\n", "\n").replace("\\'", "'")
  lines = [l.strip().strip("'\"") for l in text.splitlines() if l.strip()]
  bad = lines[0] if lines else ""
  suggestion = next((m.group(1) for l in lines for m in [re.search(r'Did you mean "([^"]+)"', l)]
                     if m), None)
  flag = next((n for n in override_names if bad in n.split(".")), None)
  where = f"--config.{flag}" if flag else f"config field {bad!r}"
  parts = flag.split(".") if flag else []
  parent = ("config." + ".".join(parts[:parts.index(bad)])) if flag and parts.index(bad) else \
      "the config"
  if bad:
    msg = f"{where}: {parent} has no field {bad!r}"
  else:
    msg = f"{where}: {type(exc).__name__}"
  if suggestion:
    msg += f"; did you mean {suggestion!r}?"
  return msg + " (schema: span_lm/config.py)"


class _QuietOrbax(logging.Filter):
  """Drops Orbax's own error reports (a failed async write logs several tracebacks from its
  threads); the failure itself reaches the loop as an exception and is reported in one line."""

  def filter(self, record):
    marker = f"{os.sep}orbax{os.sep}"
    if marker in (record.pathname or ""):
      return False
    # asyncio's "Task exception was never retrieved" for an Orbax write task that failed on the
    # file system (full disk, permissions): logged by asyncio (its own pathname) when the task is
    # collected, naming Orbax's coroutine and frames; the loop reports that error in one line.
    # Other failures of Orbax tasks are kept.
    if record.name == "asyncio":
      try:
        text = record.getMessage()
      except Exception:  # pylint: disable=broad-except
        text = str(record.msg)
      tb = record.exc_info[2] if record.exc_info else None
      frames = traceback.extract_tb(tb) if tb is not None else []
      exc = str(record.exc_info[1]) if record.exc_info else ""
      orbax = marker in text or any(marker in f.filename for f in frames)
      if orbax and any(os.strerror(code) in text + exc for code in _FS_HINTS):
        return False
    return True


_QUIET = []


def _quiet_background_errors():
  """Without SPAN_LM_DEBUG: Orbax's logged tracebacks, and the 'Event loop is closed' that
  TensorStore's callbacks report (sys.unraisablehook) after a failed write, are not shown."""
  if _QUIET:
    return
  _QUIET.append(True)
  quiet = _QuietOrbax()
  for logger in (logging.getLogger(), logging.getLogger("absl"), logging.getLogger("asyncio")):
    logger.addFilter(quiet)
    for handler in logger.handlers:  # records of child loggers meet the handlers' filters only
      handler.addFilter(quiet)
  closed = lambda e: isinstance(e, RuntimeError) and str(e) == "Event loop is closed"
  previous, previous_unraisable = sys.excepthook, sys.unraisablehook

  def hook(kind, value, tb):
    if not closed(value):
      previous(kind, value, tb)

  def unraisable_hook(unraisable):
    if not closed(unraisable.exc_value):
      previous_unraisable(unraisable)
  sys.excepthook, sys.unraisablehook = hook, unraisable_hook


def main(config) -> int:
  """Runs a command as main.py does: returns the exit status; user errors print one line."""
  debug = bool(os.environ.get("SPAN_LM_DEBUG"))
  workdir = config.get("workdir")
  if not debug:
    _quiet_background_errors()
  if config.get("mode") not in config_lib.MODES:  # before anything starts
    print(f"error: {unknown_mode(config.get('mode'))}", file=sys.stderr)
    return EXIT_ERROR
  try:
    out = run(config)
  except KeyboardInterrupt:
    if debug:
      raise
    print("\naborted (Ctrl-C): nothing was saved after the last checkpoint", file=sys.stderr)
    return EXIT_INTERRUPTED
  except Exception as e:  # pylint: disable=broad-except
    msg = None if debug else user_message(e, workdir)
    if msg is None:
      raise
    print(f"error: {msg}", file=sys.stderr)
    return EXIT_ERROR
  if isinstance(out, dict) and out.get("exit_status"):  # verify: a damaged checkpoint
    return int(out["exit_status"])
  stopped = out.get("stopped") if isinstance(out, dict) else None
  if stopped == "preempted":
    return EXIT_PREEMPTED
  if stopped == "interrupted":
    return EXIT_INTERRUPTED
  return 0

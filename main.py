"""span_lm entry point: `python main.py --config=configs/tiny.py [--config.x=y ...]`.

Modes (--config.mode=MODE):
  train    (default) train, resuming from config.workdir automatically; one training process per
           run directory (a second is refused in one line naming the holder)
  eval     full evaluation of the latest checkpoint in config.workdir on the valid and test splits
  spans    the learned spans per head and layer (the paper's Fig. 4; Fig. 5 for dynamic spans)
  flops    multiply-adds per token and train-step memory of the run's plan, beside XLA's count
  sample   text from the latest checkpoint (--config.sample.prompt, .temperature, .top_k)
  import   a reference PyTorch checkpoint (--config.import_from=FILE.pt), or a directory export
           wrote (model.safetensors; no --config needed), into config.workdir
  export   config.workdir's latest checkpoint as a safetensors directory (--config.export_to=DIR:
           model.safetensors, config.json, README.md) or a reference .pt (export_to=FILE.pt)
  compile  the train and eval steps compiled for chips this host lacks (--config.compile.targets)
  verify   every checkpoint in config.workdir read back and checked against the fingerprints
           saved with it: a table (step, saved when, verified / damaged leaves / saved before
           fingerprints); exit status 1 when one is damaged or unreadable
eval, spans, flops, sample and verify read a run and may run while it trains. They use its saved
config.json: `--config.workdir=DIR --config.mode=eval` needs no --config, and with one the command
line's own overrides apply on top.
Training options to watch a run: --config.train.profile_start=STEP --config.train.profile_steps=K
(a jax.profiler trace into DIR/profile), --config.train.wandb=PROJECT (Weights & Biases);
metrics.jsonl, TensorBoard (DIR/tb) and the log carry tokens/s and MFU.
Errors a user can cause are one line (SPAN_LM_DEBUG=1 shows the traceback); exit status 75 means
"stopped early, checkpointed: rerun to resume" (preemption, SIGTERM), 130 a Ctrl-C. On a CPU host
it re-executes itself once with glibc's huge-page tunable (config.dist.cpu_huge_pages).
All logic lives in the span_lm library so a notebook can call it without absl.
"""
import os
import re
import sys

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Run config file (configs/*.py[:variant]).",
                                          lock_config=True)
_RUN_DIR_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "span_lm", "run_dir.py")
_EXPORT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "span_lm", "tools",
                              "safetensors_format.py")


def _flag_value(argv, name):
  """The value of --name=V or --name V in argv (the last one), or None."""
  value = None
  for i, a in enumerate(argv):
    if a.startswith(f"--{name}="):
      value = a.split("=", 1)[1]
    elif a == f"--{name}" and i + 1 < len(argv):
      value = argv[i + 1]
  return value


def _override_names(argv):
  """Dotted fields given as --config.a.b=V on the command line."""
  return [a[len("--config."):].split("=", 1)[0] for a in argv[1:] if a.startswith("--config.")]


def _prepare_argv(argv):
  """Without --config, a run directory's saved config stands in (for the modes that read one)."""
  if _flag_value(argv, "config") is not None or any(a in ("-h", "--help", "--helpfull",
                                                          "--helpshort") for a in argv):
    return argv
  workdir = _flag_value(argv, "config.workdir")
  source = _flag_value(argv, "config.import_from")
  if _flag_value(argv, "config.mode") == "import" and source and os.path.isfile(
      os.path.join(source, "model.safetensors")):  # an export: the config it was trained with
    return argv[:1] + [f"--config={_EXPORT_CONFIG}:{source}"] + argv[1:]
  if workdir is None:
    raise SystemExit("error: pass --config=configs/FILE.py (e.g. configs/tiny.py), or "
                     "--config.workdir=DIR of a run to use its saved config.json")
  from span_lm import run_dir  # pylint: disable=g-import-not-at-top
  if not os.path.isfile(run_dir.config_path(workdir)):
    raise SystemExit(f"error: {run_dir.config_path(workdir)}: no such file; "
                     f"config.workdir={workdir!r} holds no run: pass --config=configs/FILE.py")
  return argv[:1] + [f"--config={_RUN_DIR_CONFIG}:{workdir}"] + argv[1:]


def _parse_flags(argv):
  """absl's parser, with a missing config file and a config override naming no field reported in
  one line (absl defers a config file's load error to a 35-line traceback in main)."""
  config = _flag_value(argv, "config")
  file = None if config is None else config.partition(":")[0]  # as config_flags: FILE[:ARG]
  if file is not None and not os.path.isfile(file):
    why = "is a directory, not a config file" if os.path.isdir(file) else "no such file"
    raise SystemExit(f"error: --config={config}: {why} (relative to {os.getcwd()}; e.g. "
                     "--config=configs/tiny.py)")
  from span_lm import config as config_lib  # pylint: disable=g-import-not-at-top
  for a in argv[1:]:
    if a.startswith("--config."):
      name, _, value = a[len("--config."):].partition("=")
      moved = config_lib.moved_override(name, value or None)
      if moved:
        raise SystemExit(f"error: {moved}")
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    # A config file that sets what is now a section (`c.model.span = 512`): ml_collections
    # refuses to replace a ConfigDict with a number; name the field's new place instead.
    section = re.search(r"Could not override field '(\w+)'.*ConfigDict", str(e), re.S)
    moved = section and config_lib.moved_override(f"model.{section.group(1)}")
    if moved and not os.environ.get("SPAN_LM_DEBUG"):
      why = moved.split(": ", 1)[1]
      raise SystemExit(f"error: --config={config}: {why}; the config file sets the section "
                       "itself") from None
    raise SystemExit(f"error: {e}") from None
  except (AttributeError, KeyError, TypeError, ValueError) as e:
    if os.environ.get("SPAN_LM_DEBUG"):
      raise
    from span_lm import cli  # pylint: disable=g-import-not-at-top
    raise SystemExit(f"error: {cli.override_error(e, _override_names(argv))}") from None


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)
  from span_lm import cli  # imported late: flags are parsed before JAX initialises
  config = cli.run_config(_CONFIG.value, _override_names(sys.argv))
  if config.get("mode") in ("train", "eval", "sample"):
    from span_lm.train import cpu_host  # pylint: disable=g-import-not-at-top
    cpu_host.exec_with_huge_pages(config)  # CPU runs: once, before JAX starts
  sys.exit(cli.main(config))


if __name__ == "__main__":
  sys.argv = _prepare_argv(sys.argv)
  app.run(main, flags_parser=_parse_flags)

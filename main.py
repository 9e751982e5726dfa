"""span_lm entry point: `python main.py --config=configs/tiny.py [--config.x=y ...]`.

Modes (config.mode): train (default; resumes from config.workdir automatically), eval (full
evaluation of the latest checkpoint in config.workdir on the valid and test splits).
All logic lives in the span_lm library so a notebook can call it without absl.
"""
from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Run config file (configs/*.py[:variant]).",
                                          lock_config=True)
flags.mark_flags_as_required(["config"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)
  from span_lm import cli  # imported late: flags are parsed before JAX initialises
  from span_lm import config as config_lib
  try:
    cli.run(_CONFIG.value)  # validates the config once, before anything compiles
  except config_lib.ConfigError as e:  # a bad value: the message, not a traceback
    raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
  app.run(main)

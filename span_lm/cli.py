"""Dispatch on config.mode; shared by main.py and notebooks."""
from span_lm import config as config_lib
from span_lm.train import loop


def run(config):
  config_lib.validate(config)
  if config.mode == "train":
    return loop.train(config)
  if config.mode == "eval":
    return loop.evaluate(config)
  if config.mode in ("import", "export"):
    from span_lm.tools import reference_checkpoint  # pylint: disable=g-import-not-at-top
    if config.mode == "import":
      return reference_checkpoint.import_reference(config)
    return reference_checkpoint.export_reference(config)
  if config.mode in config_lib.TOOL_MODES:
    from span_lm.tools import flops_report, sample, spans_report  # pylint: disable=g-import-not-at-top
    return {"spans": spans_report.report, "flops": flops_report.report,
            "sample": sample.sample}[config.mode](config)
  raise ValueError(f"config.mode={config.mode!r}: unknown mode")

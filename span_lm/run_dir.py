"""A run directory's own config: modes that inspect a run (eval, spans, flops, sample) read
`<workdir>/config.json`, written when the run started, so the training command's --config and
overrides need not be repeated. Also a config file for `--config=span_lm/run_dir.py:DIR`.
"""
import json
import os
import sys
from typing import Any, Iterable

import ml_collections
from ml_collections import config_dict

from span_lm import config as config_lib
from span_lm.model import config as model_config

CONFIG_NAME = "config.json"
RUN_MODES = ("eval", "spans", "flops", "sample", "verify")  # read a run, never write its checkpoints
# Defaults that change no result: host and launch settings; the sparse model's context, which an
# older span run's flat config.model lacked (a sparse run's old `span` becomes it); what a run
# reports (profiling, the MFU peak, Weights & Biases).
QUIET_DEFAULTS = ("dist.", "model.sparse.context", "train.profile_", "train.peak_tflops",
                  "train.wandb", "compile.strict",
                  "model.doc_boundary",
                  "model.sparse.stream_dtype",  # added with its old behaviour as the default
                  "export_format", "tools.dtype")  # how an export is written, not the run


def config_path(workdir: str) -> str:
  return os.path.join(workdir, CONFIG_NAME)


def _tuples(x: Any) -> Any:
  """JSON lists back to the tuples the configs use (to_json writes tuples as lists)."""
  if isinstance(x, dict):
    return {k: _tuples(v) for k, v in x.items()}
  if isinstance(x, list):
    return tuple(_tuples(v) for v in x)
  return x


def load_saved(workdir: str) -> ml_collections.ConfigDict:
  """The config a run was started with (its config.json), locked like a --config file's."""
  path = config_path(workdir)
  try:
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
  except FileNotFoundError:
    raise FileNotFoundError(f"{path}: no such file; config.workdir={workdir!r} holds no run "
                            "(pass --config=configs/FILE.py to start one)") from None
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f"{path} is not a readable run config ({e}); pass --config=configs/FILE.py "
                     "with the run's overrides instead") from None
  if not isinstance(data, dict) or "model" not in data:
    raise ValueError(f"{path} is not a span_lm run config; pass --config=configs/FILE.py instead")
  config, filled = upgrade(data)
  filled = [n for n in filled if not n.startswith(QUIET_DEFAULTS)]
  if filled:  # fields that can change results: say which defaults stand in
    print(f"note: {path} predates config field(s) {', '.join(filled)}; their defaults are used "
          "(pass them as --config.FIELD=V if the run used other values)", file=sys.stderr)
  config.workdir = workdir  # the directory as given now (the run may have moved)
  config.lock()
  return config


def upgrade(saved: dict) -> tuple[ml_collections.ConfigDict, list[str]]:
  """A run config saved by any span_lm (a run directory's config.json, an export's run_config) in
  today's schema: config.model's old flat fields in their sections, JSON's lists as tuples, fields
  added since at their defaults (returned: their dotted names), nulls as typed placeholders.
  The one place old run configs are brought up to date."""
  if isinstance(saved.get("model"), dict):
    saved = {**saved, "model": upgrade_model(saved["model"])}  # before the sections
  config = ml_collections.ConfigDict(_tuples(saved))
  defaults = config_lib.base_config()
  filled = _fill_missing(config, defaults)
  typed_placeholders(config, defaults)
  return config, filled


def upgrade_model(saved_model: dict) -> dict:
  """A saved config.model (a run's config.json, a checkpoint's metadata 'model_cfg') in today's
  sections: its old flat fields moved (model/config.py's `upgrade`), the rest as it was."""
  return model_config.upgrade(saved_model)


def typed_placeholders(config: ml_collections.ConfigDict,
                       defaults: ml_collections.ConfigDict) -> None:
  """A field saved as null whose default is a typed placeholder (export_to, tools.step) becomes
  that placeholder again, so --config.FIELD=V overrides it (JSON's null has no type to parse V)."""
  for key, value in defaults.items():
    if key not in config:
      continue
    if isinstance(value, ml_collections.ConfigDict):
      if isinstance(config[key], ml_collections.ConfigDict):
        typed_placeholders(config[key], value)
    elif config[key] is None and value is None:
      kind = defaults.get_ref(key).get_type()
      if kind is not None and kind is not type(None):
        config[key] = config_dict.placeholder(kind)


def _fill_missing(config: ml_collections.ConfigDict, defaults: ml_collections.ConfigDict,
                  prefix: str = "") -> list[str]:
  """Fields added to the schema after the run started take their defaults (a run from an older
  span_lm stays readable); what the run saved is kept. Returns the dotted names filled."""
  filled = []
  for key, value in defaults.items():
    if key not in config:
      config[key] = value
      filled.append(prefix + key)
    elif isinstance(value, ml_collections.ConfigDict) and \
        isinstance(config[key], ml_collections.ConfigDict):
      filled += _fill_missing(config[key], value, f"{prefix}{key}.")
  return filled


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """`--config=span_lm/run_dir.py:DIR`: the saved config of the run in DIR."""
  if not arg:
    raise ValueError("span_lm/run_dir.py needs the run directory: --config=span_lm/run_dir.py:DIR")
  return load_saved(arg)


def flatten(config, prefix: str = "") -> dict[str, Any]:
  """A ConfigDict's (or nested dict's) leaves by dotted name ({'span': {'size': 8}} ->
  {'span.size': 8})."""
  out = {}
  for k, v in config.items():
    if isinstance(v, (ml_collections.ConfigDict, dict)):
      out.update(flatten(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def with_overrides(saved: ml_collections.ConfigDict, given: ml_collections.ConfigDict,
                   names: Iterable[str]) -> ml_collections.ConfigDict:
  """The saved config with the fields `names` (dotted, as given on the command line) taken from
  `given`; a name the saved config lacks is refused by name."""
  saved = ml_collections.ConfigDict(saved.to_dict())  # a copy that accepts new values
  flat = flatten(given)
  for name in names:
    if name not in flat:  # a section (--config.model=...) is not an override of one field
      continue
    *parents, leaf = name.split(".")
    try:
      node = saved
      for part in parents:
        node = node[part]
      node[leaf] = flat[name]
    except (KeyError, AttributeError):
      raise ValueError(f"config.{name}: not a field of the run's saved {CONFIG_NAME}") from None
  saved.lock()
  return saved

"""Run configs at the command line's edge: the schema (`base_config()`), `validate(config)` and
`load_config(path)`.

The schema is written once, as typed sections (span_lm/run_config.py; `config.model` is ModelConfig,
span_lm/model/config.py); base_config() is the ConfigDict of their defaults that configs/base.py
hands the run files and --config.x=y overrides edit. `validate` turns such a ConfigDict into the
checked RunConfig, rejecting every inconsistent or out-of-range value with a ConfigError naming
the field (`config.data.block=0: must be an integer >= 1`) before anything is traced or compiled.
The accepted names are module-level tuples (MODES, and those of the modules that use them) that
later features extend.
"""
import dataclasses
import importlib.util
import os
import pathlib
import sys
import typing
from typing import Any, Mapping

import ml_collections
from ml_collections import config_dict

from span_lm import run_config
from span_lm.model import config as model_config
from span_lm.run_config import (  # pylint: disable=unused-import  (names users import from here)
    COMPILE_PLANS, COMPILE_STEPS, DIST_MODES, MODES, TOOL_MODES, ConfigError, ConfigPathError,
    RunConfig, per_step_batches)
from span_lm.run_config import _bad


def base_config() -> ml_collections.ConfigDict:
  """The defaults of every run config (the reference's enwik8_small shapes), field by field, from
  RunConfig's: its top-level fields, config.model (ModelConfig's, vocab_size 0: the dataset's),
  then its sections (data, optim, train, dist, tools, compile, sample). A field whose default is
  None is a typed placeholder, so --config.FIELD=V parses V as its type."""
  c = ml_collections.ConfigDict()
  for f in dataclasses.fields(RunConfig):
    if f.name == "model":
      c.model = ml_collections.ConfigDict(model_config.config_defaults())
    elif f.name in run_config.SECTIONS:
      c[f.name] = ml_collections.ConfigDict(
          {s.name: _default(s) for s in dataclasses.fields(f.default_factory)})
    elif f.name not in ("vocab_from_data", "source"):
      c[f.name] = _default(f)
  return c


def _default(f: dataclasses.Field) -> Any:
  """A field's default; None becomes a placeholder of the type its annotation allows."""
  if f.default is not None:
    return f.default
  kind = next(t for t in typing.get_args(f.type) if t is not type(None))
  return config_dict.placeholder(kind)


def _check_unknown_fields(config):
  schema = base_config()
  unknown = sorted(set(config.keys()) - set(schema.keys()))
  if unknown:
    raise ConfigError(f"config has unknown top-level fields {unknown} (schema: span_lm/config.py)")
  def check(schema_node, node, prefix):
    for name in schema_node.keys():
      if not isinstance(schema_node[name], ml_collections.ConfigDict):
        continue
      if name not in node:
        raise ConfigError(
            f"config.{prefix}{name} is missing (the schema: span_lm.config.base_config)")
      section = node[name]
      if not isinstance(section, ml_collections.ConfigDict):
        _bad(prefix + name, section, "is a section: set its fields (config." + prefix + name
             + ".FIELD), not the section")
      extra = sorted(set(section.keys()) - set(schema_node[name].keys()))
      if extra:
        raise ConfigError(f"config.{prefix}{name} has unknown fields {extra}" + _moved_hint(
            prefix + name, extra, config) + " (schema: span_lm/config.py)")
      check(schema_node[name], section, prefix + name + ".")
  check(schema, config, "")


def moved_override(name: str, value: Any = None) -> str | None:
  """The one line refusing an override of a config.model field that moved into a section
  (`model.span_mode` -> `model.span.mode`), or None. name: dotted, as after --config."""
  parts = name.split(".")
  if len(parts) != 2 or parts[0] != "model":
    return None
  new = model_config.moved_to(parts[1])
  if new is None:
    return None
  if parts[1] == "span":
    new = "span.size (the sparse model's context: model.sparse.context)"
  shown = "" if value is None else f"={value}"
  return (f"--config.{name}{shown}: config.model.{parts[1]} is now config.model.{new} "
          f"(config.model is in sections: span_lm/model/config.py)")


def _moved_hint(section: str, names: list[str], config) -> str:
  """'; span_mode is now model.span.mode' for fields that config.model held before its sections."""
  if section != "model":
    return ""
  arch = config.model.get("arch", "span")
  moved = [f"{n} is now model.{model_config.moved_to(n, arch)}" for n in names
           if model_config.moved_to(n, arch)]
  return ("; " + ", ".join(moved)) if moved else ""


def validate(config: ml_collections.ConfigDict) -> RunConfig:
  """The checked, typed run config (RunConfig) of a ConfigDict; raises ConfigError (a ValueError)
  naming the first bad field.

  Checks the schema (no unknown fields), the mode, that a training run has a workdir, the model
  (ModelConfig), then each section (span_lm/run_config.py) and the checks across them. Files
  named by config.data.path and config.train.init_from must exist (ConfigPathError: also a
  FileNotFoundError). Starts no JAX backend: the device-count divisibility of the batch is
  checked where the mesh is built.
  """
  try:
    _check_unknown_fields(config)
    return RunConfig.from_config(config, MODES)
  except ConfigError:
    raise
  except ValueError as e:  # ModelConfig's and the optimizer's own checks, which name the field
    raise ConfigError(str(e)) from None


def checked(config: Any) -> RunConfig:
  """A RunConfig as it is, a ConfigDict validated: what the trainer's entry points take."""
  return config if isinstance(config, RunConfig) else validate(config)


def _import_folder_package(file: pathlib.Path) -> None:
  """Makes a config file's folder importable as its package (configs/ -> `configs`).

  Config files import their siblings through it (`from configs import base`); loading the folder
  by path lets them do so from any working directory, without adding anything to sys.path. A
  module of that name imported already (from this folder or elsewhere) is left as it is.
  """
  folder = file.parent
  if (not (folder / "__init__.py").is_file() or not folder.name.isidentifier()
      or folder.name in sys.modules):
    return
  spec = importlib.util.spec_from_file_location(
      folder.name, folder / "__init__.py", submodule_search_locations=[str(folder)])
  package = importlib.util.module_from_spec(spec)
  sys.modules[folder.name] = package
  try:
    spec.loader.exec_module(package)
  except BaseException:
    del sys.modules[folder.name]
    raise


def load_config(path: str, overrides: Mapping[str, Any] | None = None) -> ml_collections.ConfigDict:
  """Builds a config from `file.py[:variant]` as --config=... would, without absl flags.

  path: a config file, relative to the working directory as for --config, optionally followed by
    `:arg` for its get_config (e.g. 'configs/tiny.py:smoke').
  overrides: dotted field -> value (`{'model.d_model': 32}`), applied like --config.FIELD=VALUE;
    an unknown field raises ValueError.
  Returns the locked ConfigDict (values can change, fields cannot be added). It is not validated:
  building the run validates it, once workdir etc. are set.
  """
  file, _, arg = path.partition(":")  # as config_flags: everything after the first colon is the arg
  if not os.path.isfile(file):
    raise ConfigPathError(f"config file {file!r} not found (relative to {os.getcwd()})")
  file = pathlib.Path(file).resolve()
  _import_folder_package(file)
  # importlib by path, as config_flags does (its loader uses the deprecated load_module).
  spec = importlib.util.spec_from_file_location(f"_span_lm_config_{file.stem}", file)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not hasattr(module, "get_config"):
    raise ValueError(f"{file} defines no get_config(arg=None)")
  config = module.get_config(arg) if ":" in path else module.get_config()
  if not isinstance(config, ml_collections.ConfigDict):
    raise ValueError(f"{path}: get_config() returned {type(config).__name__}, not a ConfigDict")
  config.lock()
  if overrides:
    for key, value in overrides.items():
      moved = moved_override(key)
      if moved:
        raise ValueError(moved.replace("--config.", "config.", 1))
      try:
        config.update_from_flattened_dict({key: value})
      except KeyError:
        raise ValueError(f"config.{key} is not a field of {path}") from None
      except TypeError as e:
        raise ValueError(f"config.{key}={value!r}: {e}") from None
  return config

"""Run-config checks and loading: `validate(config)` and `load_config('configs/tiny.py:smoke')`.

`validate` rejects every inconsistent or out-of-range value with a ValueError naming the field
(`config.data.block=0: must be an integer >= 1`) before anything is traced or compiled. The
accepted names live in module-level tuples (MODES, DATASETS, OPTIMIZERS) that later features extend.
"""
import importlib.util
import math
import os
import pathlib
import sys
from typing import Any, Mapping

import ml_collections

from span_lm.model.config import ModelConfig

MODES = ("train", "eval", "import", "export")
TOOL_MODES = ("spans", "flops", "sample")  # inspection of a run (span_lm/tools)
MODES += TOOL_MODES
DATASETS = ("enwik8", "text8", "wikitext103", "enwik8_head", "file", "synthetic", "cifar10")
OPTIMIZERS = ("adagrad", "sgd", "momentum", "adam")

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
_SECTIONS = ("data", "optim", "train", "dist")  # config.model is checked by ModelConfig


class ConfigPathError(ValueError, FileNotFoundError):
  """A config field names a file that does not exist (both a ValueError and a FileNotFoundError)."""


def _bad(name: str, value: Any, why: str, error: type[ValueError] = ValueError):
  raise error(f"config.{name}={value!r}: {why}")


def _get(config: Any, name: str) -> Any:
  node = config
  for part in name.split("."):
    try:
      node = node[part]
    except (KeyError, AttributeError, TypeError):
      raise ValueError(f"config.{name} is missing (see configs/base.py for the schema)") from None
  return node


def _check_int(config, name: str, minimum: int):
  v = _get(config, name)
  if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
    _bad(name, v, f"must be an integer >= {minimum}")
  return v


def _check_number(config, name: str, minimum: float, strict: bool, maximum: float | None = None):
  v = _get(config, name)
  ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
  ok = ok and (v > minimum if strict else v >= minimum) and (maximum is None or v < maximum)
  if not ok:
    rng = f"{'>' if strict else '>='} {minimum}" + ("" if maximum is None else f" and < {maximum}")
    _bad(name, v, f"must be a finite number {rng}")
  return v


def _check_choice(config, name: str, choices: tuple[str, ...]):
  v = _get(config, name)
  if v not in choices:
    _bad(name, v, f"choose one of {choices}")
  return v


def _check_unknown_fields(config):
  _ensure_configs_importable()
  try:
    from configs import base  # pylint: disable=g-import-not-at-top
  except ImportError:  # span_lm used without its repository: no schema to compare with
    return
  schema = base.get_base_config()
  unknown = sorted(set(config.keys()) - set(schema.keys()))
  if unknown:
    raise ValueError(f"config has unknown top-level fields {unknown} (schema: configs/base.py)")
  for section in _SECTIONS:
    sub = _get(config, section)
    extra = sorted(set(sub.keys()) - set(schema[section].keys()))
    if extra:
      raise ValueError(f"config.{section} has unknown fields {extra} (schema: configs/base.py)")


def _validate_data(config):
  _check_choice(config, "data.dataset", DATASETS)
  _check_choice(config, "data.file_vocab", ("reference", "bytes"))
  _check_choice(config, "data.vocab_order", ("auto", "first", "frequency"))
  block = _check_int(config, "data.block", 1)
  align = _check_int(config, "data.align", 1)
  if block % align:
    _bad("data.align", align, f"must divide config.data.block={block} (blocks stay on records)")
  batch = _check_int(config, "data.batch", 1)
  _check_int(config, "data.eval_batch", 1)
  split = _check_int(config, "optim.batch_split", 1)
  if batch % split:
    _bad("data.batch", batch, f"must be divisible by config.optim.batch_split={split}")
  data_dir = _get(config, "data.data_dir")
  if not isinstance(data_dir, str) or not data_dir:
    _bad("data.data_dir", data_dir, "must be a non-empty directory path")

  fr = _get(config, "data.split_fractions")
  if (not isinstance(fr, (tuple, list)) or len(fr) != 3
      or not all(isinstance(f, (int, float)) and f > 0 for f in fr) or sum(fr) > 1 + 1e-9):
    _bad("data.split_fractions", fr,
         "must be three positive (train, valid, test) fractions summing to <= 1")

  sb = _get(config, "data.split_bytes")
  if sb:
    if (not isinstance(sb, (tuple, list)) or len(sb) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) for b in sb)
        or not 0 < sb[0] < sb[1]):
      _bad("data.split_bytes", sb,
           "must be () or increasing positive byte offsets (train_end, valid_end)")

  path = _get(config, "data.path")
  if path is None and _get(config, "data.dataset") == "file":
    _bad("data.path", path, "config.data.dataset='file' needs the raw file to read")
  if path is not None:
    if not isinstance(path, str) or not path:
      _bad("data.path", path, "must be a file path (or None to use config.data.dataset)")
    if not os.path.isfile(path):
      _bad("data.path", path,
           f"no such file (relative paths are read from the working directory {os.getcwd()})",
           ConfigPathError)
    size = os.path.getsize(path)
    if sb and sb[1] >= size:
      _bad("data.split_bytes", sb,
           f"valid_end must be < the size of config.data.path ({size} bytes) to leave a test split")
    from span_lm.data import sources  # pylint: disable=g-import-not-at-top
    sources.check_file_size(path, _get(config, "data.block"), batch,
                            _get(config, "data.eval_batch"), tuple(fr), tuple(sb or ()))

  _check_int(config, "data.synthetic_distance", 1)
  _check_int(config, "data.synthetic_vocab", 2)
  _check_number(config, "data.synthetic_noise", 0.0, strict=False, maximum=1.0)
  length = _check_int(config, "data.synthetic_length", 1)
  distance = _get(config, "data.synthetic_distance")
  if _get(config, "data.dataset") == "synthetic" and length <= distance:
    _bad("data.synthetic_length", length, "must exceed config.data.synthetic_distance")


def _validate_optim(config):
  _check_choice(config, "optim.name", OPTIMIZERS)
  _check_number(config, "optim.lr", 0.0, strict=True)
  _check_number(config, "optim.momentum", 0.0, strict=False, maximum=1.0)
  _check_number(config, "optim.grad_clip", 0.0, strict=False)
  _check_int(config, "optim.warmup", 0)
  _check_int(config, "optim.batch_split", 1)


def _validate_train(config):
  _check_int(config, "train.steps", 0)
  _check_number(config, "train.compilation_cache_min_secs", 0.0, strict=False)
  for name in ("log_every", "eval_every", "checkpoint_every"):
    _check_int(config, f"train.{name}", 1)
  _check_int(config, "train.eval_batches", 0)
  _check_int(config, "train.max_to_keep", 1)
  init_from = _get(config, "train.init_from")
  if init_from is not None:
    if not isinstance(init_from, str) or not init_from:
      _bad("train.init_from", init_from, "must be a checkpoint path (or None)")
    if "://" not in init_from and not os.path.exists(init_from):
      _bad("train.init_from", init_from, "no such checkpoint file or directory", ConfigPathError)


def _validate_faults_and_dist(config):
  _check_choice(config, "train.nonfinite", ("stop", "skip"))
  _check_int(config, "train.debug_nan_at_step", 0)
  if not isinstance(_get(config, "train.preemption"), bool):
    _bad("train.preemption", _get(config, "train.preemption"), "must be True or False")
  _check_choice(config, "dist.mode", ("auto", "on", "off"))
  coordinator = _get(config, "dist.coordinator")
  if not isinstance(coordinator, str) or (coordinator and ":" not in coordinator):
    _bad("dist.coordinator", coordinator, "must be '' or host:port of process 0")
  n = _check_int(config, "dist.num_processes", 0)
  pid = _check_int(config, "dist.process_id", -1)
  if n and pid >= n:
    _bad("dist.process_id", pid, f"must be < config.dist.num_processes={n}")
  ids = _get(config, "dist.local_device_ids")
  if not isinstance(ids, str) or (ids and not all(p.strip().isdigit() for p in ids.split(","))):
    _bad("dist.local_device_ids", ids, "must be '' or comma-separated device ids like '0,1'")
  _check_int(config, "dist.init_timeout", 1)
  _check_int(config, "dist.fsdp", 1)
  n_cpu = _check_int(config, "dist.cpu_devices", 0)
  if not isinstance(_get(config, "dist.cpu_keep_freed_memory"), bool):
    _bad("dist.cpu_keep_freed_memory", _get(config, "dist.cpu_keep_freed_memory"),
         "must be True or False")
  if n_cpu > 1:
    for field, b in per_step_batches(config).items():
      if b % n_cpu:
        _bad("dist.cpu_devices", n_cpu, f"must divide the per-step batch of config.{field} ({b})")


def per_step_batches(config) -> dict[str, int]:
  """Streams per compiled train step (batch / batch_split) and per eval step: what a device
  count must divide."""
  return {"data.batch": config.data.batch // config.optim.batch_split,
          "data.eval_batch": config.data.eval_batch}


def validate(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming the first bad field of a run config; returns None when it is sound.

  Checks the schema (no unknown fields), the model (via ModelConfig), data, optimizer and train
  settings, the mode, and that a training run has a workdir. Files named by config.data.path and
  config.train.init_from must exist (ConfigPathError: a ValueError and a FileNotFoundError).
  Does not touch JAX: the device-count divisibility of the batch is checked where the mesh is built.
  """
  _check_unknown_fields(config)
  mode = _check_choice(config, "mode", MODES)
  workdir = _get(config, "workdir")
  if workdir is not None and (not isinstance(workdir, str) or not workdir):
    _bad("workdir", workdir, "must be a directory path")
  if mode == "train" and workdir is None:
    raise ValueError("config.workdir is not set: training needs a run directory; "
                     "pass --config.workdir=DIR")
  if mode in ("import", "export") and workdir is None:
    raise ValueError(f"config.workdir is not set: mode={mode} needs the run directory that "
                     "holds (or will hold) the checkpoint; pass --config.workdir=DIR")
  for field, needed in (("import_from", mode == "import"), ("export_to", mode == "export")):
    value = _get(config, field)
    if needed and (not isinstance(value, str) or not value):
      _bad(field, value, f"mode={mode} needs a reference checkpoint path (--config.{field}=FILE)")
  if mode == "import" and not os.path.isfile(_get(config, "import_from")):
    _bad("import_from", _get(config, "import_from"), "no such file", ConfigPathError)
  seed = _get(config, "seed")
  if isinstance(seed, bool) or not isinstance(seed, int):
    _bad("seed", seed, "must be an integer")
  vocab = _get(config, "model.vocab_size")
  model = ModelConfig.from_config(_get(config, "model"), vocab_size=None if vocab else 1)
  block = _get(config, "data.block")
  if model.attn_impl != "xla" and isinstance(block, int) and block % model.attn_block:
    _bad("data.block", block,
         f"must be a multiple of model.attn_block={model.attn_block} with the fused kernel")
  _validate_data(config)
  _validate_optim(config)
  _validate_train(config)
  _validate_faults_and_dist(config)


def _ensure_configs_importable():
  """Config files do `from configs import base`: put the repository root on sys.path if needed."""
  root = str(REPO_ROOT)
  if (REPO_ROOT / "configs" / "base.py").is_file() and root not in sys.path:
    try:
      import configs  # pylint: disable=g-import-not-at-top,unused-import
    except ImportError:
      sys.path.insert(0, root)


def load_config(path: str, overrides: Mapping[str, Any] | None = None) -> ml_collections.ConfigDict:
  """Builds a config from `file.py[:variant]` as --config=... would, without absl flags.

  path: a config file, relative to the working directory or to the repository root, optionally
    followed by `:arg` for its get_config (e.g. 'configs/tiny.py:smoke').
  overrides: dotted field -> value (`{'model.d_model': 32}`), applied like --config.FIELD=VALUE;
    an unknown field raises ValueError.
  Returns the locked ConfigDict (values can change, fields cannot be added). It is not validated:
  call validate() once workdir etc. are set.
  """
  file, _, arg = path.partition(":")  # as config_flags: everything after the first colon is the arg
  if not os.path.isfile(file) and (REPO_ROOT / file).is_file():
    file = str(REPO_ROOT / file)
  if not os.path.isfile(file):
    raise ConfigPathError(f"config file {file!r} not found (from {os.getcwd()} or {REPO_ROOT})")
  _ensure_configs_importable()
  # importlib by path, as config_flags does (its loader uses the deprecated load_module).
  spec = importlib.util.spec_from_file_location(f"_span_lm_config_{pathlib.Path(file).stem}", file)
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
      try:
        config.update_from_flattened_dict({key: value})
      except KeyError:
        raise ValueError(f"config.{key} is not a field of {path}") from None
      except TypeError as e:
        raise ValueError(f"config.{key}={value!r}: {e}") from None
  return config

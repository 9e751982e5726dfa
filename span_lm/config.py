"""Run configs: the schema (`base_config()`), `validate(config)` and `load_config(path)`.

The schema is written once, here: `config.model` takes its fields and defaults from ModelConfig
(span_lm/model/config.py), the other sections are below, and configs/base.py hands it to the run
files. `validate` rejects every inconsistent or out-of-range value with a ConfigError naming the
field (`config.data.block=0: must be an integer >= 1`) before anything is traced or compiled; it
runs once per command, where the run is built (span_lm/train/run.py `Run`). The accepted names
are module-level tuples (MODES, and those of the modules that use them) that later features extend.
"""
import dataclasses
import importlib.util
import math
import os
import pathlib
import sys
from typing import Any, Mapping

import ml_collections
from ml_collections import config_dict

from span_lm import optim_config
from span_lm import precision_config
from span_lm.data.sources import DATASETS
from span_lm.model import attention_rules
from span_lm.model.config import ModelConfig

MODES = ("train", "eval", "import", "export")
TOOL_MODES = ("spans", "flops", "sample")  # inspection of a run (span_lm/tools)
MODES += TOOL_MODES + ("compile",)  # compile: for named chips, no device (span_lm/tools/compile.py)
MODES += ("verify",)  # every checkpoint checked against its fingerprints (span_lm/tools/verify.py)
COMPILE_PLANS = ("full", "initial")
COMPILE_STEPS = ("train", "eval")
DIST_MODES = ("auto", "on", "off")  # span_lm/train/distributed.py


def base_config() -> ml_collections.ConfigDict:
  """The defaults of every run config (the reference's enwik8_small shapes), field by field.

  model.*   architecture: ModelConfig's fields and defaults (vocab_size 0: the dataset's)
  data.*    dataset and batching (block = M, batch = B streams)
  optim.*   optimizer (the reference's Adagrad with per-tensor step clipping by default)
  train.*   loop lengths, logging, checkpointing;  dist.* several processes and devices
  """
  c = ml_collections.ConfigDict()
  c.workdir = config_dict.placeholder(str)  # run directory; resume is automatic
  c.seed = 42
  c.mode = "train"  # train | eval | import | export
  # mode=import: a reference (facebookresearch/adaptive-span) .pt checkpoint, or a directory
  # mode=export wrote (model.safetensors + config.json), to make an Orbax checkpoint in workdir;
  # mode=export: where to write workdir's latest checkpoint (span_lm/tools/reference_checkpoint.py,
  # span_lm/tools/safetensors_format.py).
  c.import_from = config_dict.placeholder(str)
  c.export_to = config_dict.placeholder(str)
  # export: 'safetensors' (a directory: model.safetensors, config.json, README.md) | 'pt' (the
  # reference's torch file); "": 'pt' where export_to ends in .pt, else 'safetensors'
  c.export_format = ""

  c.model = ml_collections.ConfigDict({"vocab_size": 0, **_defaults(ModelConfig)})

  c.data = d = ml_collections.ConfigDict()
  d.dataset = "enwik8"  # enwik8 | text8 | wikitext103 | enwik8_head | file | synthetic | cifar10
  d.data_dir = "data_cache"
  d.path = config_dict.placeholder(str)  # local raw file; overrides dataset when set
  d.split_fractions = (0.9, 0.05, 0.05)  # train/valid/test fractions for a local file
  d.split_bytes = ()  # explicit (train_end, valid_end) byte offsets for a local file
  d.file_vocab = "reference"  # local file: reference (newline -> <eos>, first-appearance ids) | bytes
  d.vocab_order = "auto"  # auto (frequency for wikitext103, else first appearance) | first | frequency
  d.block = 256  # M
  d.align = 1  # records of this many tokens: streams and restart offsets keep to their boundaries
  d.batch = 64  # B
  d.eval_batch = 8  # streams for the full evaluation
  d.synthetic_distance = 64  # D for the synthetic source
  d.synthetic_vocab = 16
  d.synthetic_noise = 0.1
  d.synthetic_length = 2_000_000
  d.synthetic_seed = 0

  c.optim = o = ml_collections.ConfigDict()
  o.name = "adagrad"  # adagrad (reference) | sgd | momentum | adam
  o.lr = 0.07
  o.momentum = 0.0
  o.grad_clip = 0.03  # adagrad: per-tensor step clip; sgd/adam: global-norm clip; 0: off
  o.warmup = 8000
  o.batch_split = 1  # gradient accumulation pieces (the reference's memory knob)
  # (several devices: each accumulates its own rows and the gradients are reduced once per step,
  # when each device's rows divide into the pieces; dropout masks then depend on the device count)
  o.weight_decay = 0.0  # adam only: decoupled (AdamW) decay of weight matrices
  o.schedule = "warmup"  # warmup (linear, then constant) | cosine (warmup, then cosine to 0)
  o.decay_steps = 0  # cosine: the update where the rate reaches 0 (usually train.steps)

  c.train = t = ml_collections.ConfigDict()
  t.steps = 150_000
  t.log_every = 100
  t.eval_every = 1000  # the reference's "iteration" (nbatches)
  t.eval_batches = 0  # 0: ceil(eval_every / 10), as the reference
  t.checkpoint_every = 1000
  t.max_to_keep = 3
  # Checkpoint (run directory or checkpoint path) whose parameters and optimizer state start this
  # run, e.g. the "+20k steps at lr/10" fine-tuning phases (the configs' `finetune` variants). The
  # step counter restarts at 0 in the new workdir, so `steps` is this phase's length. None: scratch.
  t.init_from = config_dict.placeholder(str)
  t.full_eval_at_end = True
  t.eval_drop_last = False  # True reproduces the reference's dropping of the partial last block
  t.tensorboard = True
  # Persistent XLA compilation cache: restarts and span-plan changes seen before do not recompile
  # from scratch. Empty string: off.
  t.compilation_cache = "~/.cache/span_lm/xla"
  t.compilation_cache_min_secs = 1.0  # only compilations slower than this are written to it
  # A non-finite loss or gradient: the update is never applied (checked inside the jitted step).
  # stop: end the run with an error, the last checkpoint untouched; skip: drop that update, count
  # it (metrics 'skipped') and go on.
  t.nonfinite = "stop"
  # Dynamic loss scaling (span_lm/train/loss_scale.py): the loss is multiplied by a power-of-two
  # scale before the gradient and the float32 gradients divided by it; an attempt whose gradients
  # overflow is retried on the device with half the scale (same batch), and the scale doubles
  # after loss_scale_period finite steps. auto: on for model.dtype='float16' (V100, T4), off for
  # float32 and bfloat16 | dynamic: on for any dtype | off. Gradient overflows are its business
  # while the scale can still halve; a non-finite loss, or non-finite gradients at scale 1, go to
  # train.nonfinite above.
  t.loss_scale = "auto"
  t.loss_scale_init = 2.0 ** 15
  t.loss_scale_period = 2000
  t.preemption = True  # SIGTERM / the preemption sync point: checkpoint the current step, stop
  t.debug_nan_at_step = 0  # testing aid: make the loss of this step (1-based) NaN; 0: off
  # Profiling (jax.profiler, span_lm/train/telemetry.py): trace profile_steps steps starting at
  # step profile_start (1-based) into <workdir>/profile/ (TensorBoard's profile plugin, Perfetto).
  # 0: off. A run resumed past profile_start does not trace again.
  t.profile_start = 0
  t.profile_steps = 0
  # MFU (logged with tokens_per_s): the peak TFLOP/s of one device for the run's dtype. 0: the data
  # sheet's for the device (span_lm/kernels/chips.py); unknown devices (CPU) log mfu null unless
  # set.
  t.peak_tflops = 0.0
  # Weights & Biases (optional: pip install span_lm[wandb]): the project to log the same metrics
  # and the config to ('': off). A resumed run continues the same W&B run (its id is kept in
  # <workdir>/wandb_id). Process 0 only.
  t.wandb = ""
  t.wandb_entity = ""  # the team or user ('': W&B's default)
  t.wandb_name = ""  # the run's display name ('': the run directory's name)

  # Multi-process runs (span_lm/train/distributed.py, launch/README.md).
  c.dist = ds = ml_collections.ConfigDict()
  ds.mode = "auto"  # auto (when a coordinator, SLURM step or TPU pod is detected) | on | off
  ds.coordinator = ""  # host:port of process 0; "": JAX_COORDINATOR_ADDRESS or auto-detection
  ds.num_processes = 0  # 0: from JAX_NUM_PROCESSES or auto-detection
  ds.process_id = -1  # -1: from JAX_PROCESS_ID or auto-detection
  ds.local_device_ids = ""  # comma-separated device ids this process uses; "": all (JAX default)
  ds.init_timeout = 300  # seconds to wait for the other processes
  # FSDP-style: >1 makes the mesh ('data', 'fsdp') with this many devices on 'fsdp', over which
  # parameters and optimizer state are split (logical axis 'embed'); batches use every device.
  ds.fsdp = 1
  # CPU hosts: split the host into this many JAX devices and train data-parallel over them (XLA:CPU
  # runs most of one device's work on one thread). 0: auto (one per core, at most 8, reduced to
  # divide the batches; only when no accelerator plugin is installed); 1: off. XLA_FLAGS'
  # --xla_force_host_platform_device_count, when set, wins.
  ds.cpu_devices = 0
  # CPU-only runs: True sets glibc malloc to one arena, no trim, mmap above 32 MiB
  # (span_lm/train/cpu_host.py). Off by default: it measured no faster than glibc's defaults
  # (docs/benchmarks.md, "malloc and peak resident memory"); the faster no-mmap setting raised
  # peak resident memory, so it was dropped.
  ds.cpu_keep_freed_memory = False
  # CPU-only runs: malloc with transparent huge pages (glibc.malloc.hugetlb=1; main.py re-executes
  # itself once with GLIBC_TUNABLES set): far fewer page faults for XLA's per-step temporaries at
  # the same peak memory (span_lm/train/cpu_host.py, docs/benchmarks.md "Huge pages").
  ds.cpu_huge_pages = True

  # Inspecting a run (span_lm/tools): --config.mode=spans | flops | sample, on config.workdir.
  c.tools = tl = ml_collections.ConfigDict()
  tl.step = config_dict.placeholder(int)  # checkpoint step to inspect; None: the latest
  tl.text = config_dict.placeholder(str)  # spans, dynamic span (Fig. 5): the text; None: valid split
  tl.xla = True  # flops: also compile the train step and report XLA's cost and memory analyses
  tl.dtype = config_dict.placeholder(str)  # export (safetensors): float32 | bfloat16 | float16
  # --config.mode=compile: the train and eval steps compiled for chips this host does not have
  # (span_lm/tools/compile.py). targets: comma-separated; GPUs as chip[:count] (h100:8, a100_40:8,
  # v100_16:8), TPUs as chip[:topology] (v5e:4x4, v5p:2x2x2, v6e:2x4, v4:2x2x2).
  c.compile = cp = ml_collections.ConfigDict()
  cp.targets = "h100:8,v5p:2x2x2"
  cp.plan = "full"  # full (every head at model.span.size: the worst case) | initial (the start)
  cp.steps = "train,eval"
  cp.out = ""  # report directory; "": config.workdir, else ./compile_report
  cp.strict = False  # exit 1 (one line) when a step does not compile or does not fit (CI's guard)
  c.sample = s = ml_collections.ConfigDict()
  s.prompt = ""  # text to continue ("": start a new line)
  s.length = 200  # tokens to generate
  s.temperature = 1.0  # 0: greedy
  s.top_k = 0  # draw among the k most likely tokens; 0: all
  s.seed = 0
  return c


def _defaults(cls) -> dict[str, Any]:
  """A dataclass's fields and defaults as a dict, its sections (dataclass defaults) as dicts."""
  out = {}
  for f in dataclasses.fields(cls):
    if f.default is not dataclasses.MISSING:
      out[f.name] = f.default
    elif f.default_factory is not dataclasses.MISSING:
      out[f.name] = _defaults(f.default_factory)
  return out


class ConfigError(ValueError):
  """A run-config value is wrong; the message names the field (main.py prints it, no traceback)."""


class ConfigPathError(ConfigError, FileNotFoundError):
  """A config field names a file that does not exist (both a ConfigError and a FileNotFoundError)."""


def _bad(name: str, value: Any, why: str, error: type[ValueError] = ConfigError):
  raise error(f"config.{name}={value!r}: {why}")


def _get(config: Any, name: str) -> Any:
  node = config
  for part in name.split("."):
    try:
      node = node[part]
    except (KeyError, AttributeError, TypeError):
      raise ConfigError(f"config.{name} is missing (the schema: span_lm.config.base_config)") from None
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
  schema = base_config()
  unknown = sorted(set(config.keys()) - set(schema.keys()))
  if unknown:
    raise ConfigError(f"config has unknown top-level fields {unknown} (schema: span_lm/config.py)")
  def check(schema_node, prefix):
    for name in schema_node.keys():
      if not isinstance(schema_node[name], ml_collections.ConfigDict):
        continue
      section = _get(config, prefix + name)
      if not isinstance(section, ml_collections.ConfigDict):
        _bad(prefix + name, section, "is a section: set its fields (config." + prefix + name
             + ".FIELD), not the section")
      extra = sorted(set(section.keys()) - set(schema_node[name].keys()))
      if extra:
        raise ConfigError(f"config.{prefix}{name} has unknown fields {extra}" + _moved_hint(
            prefix + name, extra, config) + " (schema: span_lm/config.py)")
      check(schema_node[name], prefix + name + ".")
  check(schema, "")


def moved_override(name: str, value: Any = None) -> str | None:
  """The one line refusing an override of a config.model field that moved into a section
  (`model.span_mode` -> `model.span.mode`), or None. name: dotted, as after --config."""
  from span_lm.model import config as model_config  # pylint: disable=g-import-not-at-top
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
  from span_lm.model import config as model_config  # pylint: disable=g-import-not-at-top
  arch = config.model.get("arch", "span")
  moved = [f"{n} is now model.{model_config.moved_to(n, arch)}" for n in names
           if model_config.moved_to(n, arch)]
  return ("; " + ", ".join(moved)) if moved else ""


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
  precision_config.check(_get(config, "train.loss_scale"), _get(config, "train.loss_scale_init"),
                         _get(config, "train.loss_scale_period"))
  _check_int(config, "train.debug_nan_at_step", 0)
  _validate_observability(config)
  if not isinstance(_get(config, "train.preemption"), bool):
    _bad("train.preemption", _get(config, "train.preemption"), "must be True or False")
  _check_choice(config, "dist.mode", DIST_MODES)
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
  if not isinstance(_get(config, "dist.cpu_huge_pages"), bool):
    _bad("dist.cpu_huge_pages", _get(config, "dist.cpu_huge_pages"), "must be True or False")
  if not isinstance(_get(config, "dist.cpu_keep_freed_memory"), bool):
    _bad("dist.cpu_keep_freed_memory", _get(config, "dist.cpu_keep_freed_memory"),
         "must be True or False")
  if n_cpu > 1:
    for field, b in per_step_batches(config).items():
      if b % n_cpu:
        _bad("dist.cpu_devices", n_cpu, f"must divide the per-step batch of config.{field} ({b})")


def _validate_observability(config):
  """Profiling, the MFU peak and Weights & Biases: refused in one line before anything starts."""
  start = _check_int(config, "train.profile_start", 0)
  steps = _check_int(config, "train.profile_steps", 0)
  if bool(start) != bool(steps):
    given, other = ("profile_start", "profile_steps") if start else ("profile_steps",
                                                                     "profile_start")
    _bad(f"train.{given}", _get(config, f"train.{given}"),
         f"profiling needs both: set --config.train.{other} too (the first step to trace, "
         "1-based, and how many steps; 0 and 0: off)")
  _check_number(config, "train.peak_tflops", 0.0, strict=False)
  for name in ("wandb", "wandb_entity", "wandb_name"):
    if not isinstance(_get(config, f"train.{name}"), str):
      _bad(f"train.{name}", _get(config, f"train.{name}"), "must be a string ('': unset)")
  project = _get(config, "train.wandb")
  if project and _get(config, "mode") == "train" and importlib.util.find_spec("wandb") is None:
    _bad("train.wandb", project, "the wandb package is not installed: pip install "
         "'span_lm[wandb]' (or pip install 'wandb>=0.16,<1'), or leave out --config.train.wandb")


def per_step_batches(config) -> dict[str, int]:
  """Streams per compiled train step (batch / batch_split) and per eval step: what a device
  count must divide."""
  return {"data.batch": config.data.batch // config.optim.batch_split,
          "data.eval_batch": config.data.eval_batch}


def validate(config: ml_collections.ConfigDict) -> None:
  """Raises ConfigError (a ValueError) naming the first bad field of a run config.

  Checks the schema (no unknown fields), the model (ModelConfig), data, optimizer
  (span_lm/optim_config.py's check) and train settings, the mode, and that a training run has a
  workdir. Files named by config.data.path and config.train.init_from must exist
  (ConfigPathError: also a FileNotFoundError). Starts no JAX backend: the device-count
  divisibility of the batch is checked where the mesh is built.
  """
  try:
    _validate(config)
  except ConfigError:
    raise
  except ValueError as e:  # ModelConfig's and the optimizer's own checks, which name the field
    raise ConfigError(str(e)) from None


def _validate(config):
  _check_unknown_fields(config)
  mode = _check_choice(config, "mode", MODES)
  workdir = _get(config, "workdir")
  if workdir is not None and (not isinstance(workdir, str) or not workdir):
    _bad("workdir", workdir, "must be a directory path")
  if mode == "train" and workdir is None:
    raise ConfigError("config.workdir is not set: training needs a run directory; "
                      "pass --config.workdir=DIR")
  if mode == "verify" and workdir is None:
    raise ConfigError("config.workdir is not set: mode=verify checks the checkpoints of a run "
                      "directory; pass --config.workdir=DIR")
  if mode in ("import", "export") and workdir is None:
    raise ConfigError(f"config.workdir is not set: mode={mode} needs the run directory that "
                      "holds (or will hold) the checkpoint; pass --config.workdir=DIR")
  for field, needed in (("import_from", mode == "import"), ("export_to", mode == "export")):
    value = _get(config, field)
    if needed and (not isinstance(value, str) or not value):
      _bad(field, value, f"mode={mode} needs a path (--config.{field}=FILE.pt or DIR)")
  if mode == "import" and not os.path.exists(_get(config, "import_from")):
    _bad("import_from", _get(config, "import_from"), "no such file or directory", ConfigPathError)
  seed = _get(config, "seed")
  if isinstance(seed, bool) or not isinstance(seed, int):
    _bad("seed", seed, "must be an integer")
  vocab = _get(config, "model.vocab_size")
  model = ModelConfig.from_config(_get(config, "model"), vocab_size=None if vocab else 1)
  block = _get(config, "data.block")
  attention_rules.check(model, block=block if isinstance(block, int) else None)  # the kernel's tile
  _validate_data(config)
  if mode == "compile":  # the targets' names are checked by tools/compile.py, before compiling
    _check_choice(config, "compile.plan", COMPILE_PLANS)
    for step in str(_get(config, "compile.steps")).split(","):
      if step.strip() not in COMPILE_STEPS:
        _bad("compile.steps", _get(config, "compile.steps"),
             f"comma-separated steps out of {COMPILE_STEPS}")
  optim_config.check_config(_get(config, "optim"))
  _validate_train(config)
  _validate_faults_and_dist(config)


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

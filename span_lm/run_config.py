"""The run config as typed sections: one frozen dataclass per section, its defaults as field
defaults, its checks as today's one-line messages (`config.data.block=0: must be an integer >= 1`).

`RunConfig.from_config(config_dict)` is the validation: span_lm/config.py's `validate` calls it
where a command starts, and base_config() (the ConfigDict that --config files and --config.x=y
overrides edit) is generated from these defaults. Cross-section checks live in RunConfig, in the
order the fields were always checked, so a bad config's first error is the one it always was.
Plain Python below the trainer: train/optimizer.py and train/loss_scale.py read the optim and
loss-scale names from here (tests/test_import_graph.py).
"""
import copy
import dataclasses
import importlib.util
import json
import math
import os
from typing import Any

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
OPTIMIZERS = ("adagrad", "sgd", "momentum", "adam")
SCHEDULES = ("warmup", "cosine")  # warmup: linear warmup then constant
LOSS_SCALE_MODES = ("auto", "dynamic", "off")  # auto: dynamic for model.dtype='float16', else off
MIN_SCALE = 1.0  # at this scale an overflow is a true non-finite gradient: train.nonfinite decides
MAX_SCALE = 2.0 ** 64  # keeps the scale a finite float32 power of two, S * loss far from overflow


class ConfigError(ValueError):
  """A run-config value is wrong; the message names the field (main.py prints it, no traceback)."""


class ConfigPathError(ConfigError, FileNotFoundError):
  """A config field names a file that does not exist (a ConfigError and a FileNotFoundError)."""


def _bad(name: str, value: Any, why: str, error: type[ValueError] = ConfigError):
  raise error(f"config.{name}={value!r}: {why}")


def _int(name: str, v: Any, minimum: int) -> int:
  if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
    _bad(name, v, f"must be an integer >= {minimum}")
  return v


def _number(name: str, v: Any, minimum: float, strict: bool, maximum: float | None = None):
  ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
  ok = ok and (v > minimum if strict else v >= minimum) and (maximum is None or v < maximum)
  if not ok:
    rng = f"{'>' if strict else '>='} {minimum}" + ("" if maximum is None else f" and < {maximum}")
    _bad(name, v, f"must be a finite number {rng}")
  return v


def _choice(name: str, v: Any, choices: tuple[str, ...]):
  if v not in choices:
    _bad(name, v, f"choose one of {choices}")
  return v


def _flag(name: str, v: Any):
  if not isinstance(v, bool):
    _bad(name, v, "must be True or False")


@dataclasses.dataclass(frozen=True)
class Data:
  """config.data: dataset and batching (block = M, batch = B streams)."""
  dataset: str = "enwik8"  # enwik8 | text8 | wikitext103 | enwik8_head | file | synthetic | cifar10
  data_dir: str = "data_cache"
  path: str | None = None  # local raw file; overrides dataset when set
  split_fractions: tuple = (0.9, 0.05, 0.05)  # train/valid/test fractions for a local file
  split_bytes: tuple = ()  # explicit (train_end, valid_end) byte offsets for a local file
  # local file: reference (newline -> <eos>, first-appearance ids) | bytes
  file_vocab: str = "reference"
  # auto (frequency for wikitext103, else first appearance) | first | frequency
  vocab_order: str = "auto"
  block: int = 256  # M
  # records of this many tokens: streams and restart offsets keep to their boundaries
  align: int = 1
  batch: int = 64  # B
  eval_batch: int = 8  # streams for the full evaluation
  synthetic_distance: int = 64  # D for the synthetic source
  synthetic_vocab: int = 16
  synthetic_noise: float = 0.1
  synthetic_length: int = 2_000_000
  synthetic_seed: int = 0

  def check(self, batch_split: Any) -> None:
    """batch_split: config.optim.batch_split, which the batch must divide into."""
    _choice("data.dataset", self.dataset, DATASETS)
    _choice("data.file_vocab", self.file_vocab, ("reference", "bytes"))
    _choice("data.vocab_order", self.vocab_order, ("auto", "first", "frequency"))
    block, align = _int("data.block", self.block, 1), _int("data.align", self.align, 1)
    if block % align:
      _bad("data.align", align, f"must divide config.data.block={block} (blocks stay on records)")
    batch = _int("data.batch", self.batch, 1)
    _int("data.eval_batch", self.eval_batch, 1)
    split = _int("optim.batch_split", batch_split, 1)
    if batch % split:
      _bad("data.batch", batch, f"must be divisible by config.optim.batch_split={split}")
    if not isinstance(self.data_dir, str) or not self.data_dir:
      _bad("data.data_dir", self.data_dir, "must be a non-empty directory path")
    fr = self.split_fractions
    if (not isinstance(fr, (tuple, list)) or len(fr) != 3
        or not all(isinstance(f, (int, float)) and f > 0 for f in fr) or sum(fr) > 1 + 1e-9):
      _bad("data.split_fractions", fr,
           "must be three positive (train, valid, test) fractions summing to <= 1")
    sb = self.split_bytes
    if sb and (not isinstance(sb, (tuple, list)) or len(sb) != 2
               or not all(isinstance(b, int) and not isinstance(b, bool) for b in sb)
               or not 0 < sb[0] < sb[1]):
      _bad("data.split_bytes", sb,
           "must be () or increasing positive byte offsets (train_end, valid_end)")
    self._check_path()
    _int("data.synthetic_distance", self.synthetic_distance, 1)
    _int("data.synthetic_vocab", self.synthetic_vocab, 2)
    _number("data.synthetic_noise", self.synthetic_noise, 0.0, strict=False, maximum=1.0)
    length = _int("data.synthetic_length", self.synthetic_length, 1)
    if self.dataset == "synthetic" and length <= self.synthetic_distance:
      _bad("data.synthetic_length", length, "must exceed config.data.synthetic_distance")

  def _check_path(self) -> None:
    """A local file exists and holds the splits' blocks (read from disk: the one check that is)."""
    path, sb = self.path, self.split_bytes
    if path is None and self.dataset == "file":
      _bad("data.path", path, "config.data.dataset='file' needs the raw file to read")
    if path is None:
      return
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
    sources.check_file_size(path, self.block, self.batch, self.eval_batch,
                            tuple(self.split_fractions), tuple(sb or ()))


@dataclasses.dataclass(frozen=True)
class Optim:
  """config.optim: the optimizer (the reference's Adagrad with per-tensor step clipping)."""
  name: str = "adagrad"  # adagrad (reference) | sgd | momentum | adam
  lr: float = 0.07
  momentum: float = 0.0
  grad_clip: float = 0.03  # adagrad: per-tensor step clip; sgd/adam: global-norm clip; 0: off
  warmup: int = 8000
  batch_split: int = 1  # gradient accumulation pieces (the reference's memory knob)
  # (several devices: each accumulates its own rows and the gradients are reduced once per step,
  # when each device's rows divide into the pieces; dropout masks then depend on the device count)
  weight_decay: float = 0.0  # adam only: decoupled (AdamW) decay of weight matrices
  schedule: str = "warmup"  # warmup (linear, then constant) | cosine (warmup, then cosine to 0)
  decay_steps: int = 0  # cosine: the update where the rate reaches 0 (usually train.steps)

  def check(self) -> None:
    def bad(field, why):
      raise ValueError(f"config.optim.{field}={getattr(self, field)!r}: {why}")
    f = dataclasses.asdict(self)
    if self.name not in OPTIMIZERS:
      bad("name", f"unknown optimizer; choose one of {OPTIMIZERS}")
    for k in ("lr", "momentum", "grad_clip"):
      if isinstance(f[k], bool) or not isinstance(f[k], (int, float)) or not math.isfinite(f[k]):
        bad(k, "must be a finite number")
    if not self.lr > 0:
      bad("lr", "must be > 0")
    if not 0.0 <= self.momentum < 1.0:
      bad("momentum", "must be in [0, 1)")
    if self.name == "momentum" and self.momentum == 0:
      bad("momentum", "optimizer 'momentum' needs momentum > 0 (or use name 'sgd')")
    if not self.grad_clip >= 0:
      bad("grad_clip", "must be >= 0 (0: off)")
    for k in ("warmup", "batch_split"):
      if isinstance(f[k], bool) or not isinstance(f[k], int):
        bad(k, "must be an integer")
    if self.warmup < 0:
      bad("warmup", "must be >= 0 (0: off)")
    if self.batch_split < 1:
      bad("batch_split", "must be >= 1")
    wd = self.weight_decay
    if isinstance(wd, bool) or not isinstance(wd, (int, float)) or not wd >= 0:
      bad("weight_decay", "must be a number >= 0 (0: off)")
    if wd and self.name != "adam":
      bad("weight_decay", f"is implemented for 'adam' (decoupled, AdamW) only, not {self.name!r}")
    if self.schedule not in SCHEDULES:
      bad("schedule", f"choose one of {SCHEDULES}")
    if isinstance(self.decay_steps, bool) or not isinstance(self.decay_steps, int):
      bad("decay_steps", "must be an integer")
    if self.schedule == "cosine" and self.decay_steps <= self.warmup:
      bad("decay_steps",
          f"the cosine needs decay_steps > warmup={self.warmup} (usually train.steps)")


# What check_optim reads for an optim field a mapping lacks (a terse test's, a notebook's):
# the optimizer's neutral values, not the schema's defaults; name and lr must be given.
_OPTIM_ABSENT = {"momentum": 0.0, "grad_clip": 0.0, "warmup": 0, "batch_split": 1,
                 "weight_decay": 0.0, "schedule": "warmup", "decay_steps": 0}


def check_optim(optim_cfg: Any) -> dict[str, Any]:
  """Reads and checks config.optim (an Optim, a ConfigDict or a mapping) and returns its fields:
  what the optimizer is built from (train/optimizer.py)."""
  if isinstance(optim_cfg, Optim):
    optim = optim_cfg
  else:
    given = {}
    for f in dataclasses.fields(Optim):
      try:
        given[f.name] = optim_cfg[f.name]
      except (KeyError, AttributeError):
        if f.name not in _OPTIM_ABSENT:
          raise ValueError(f"config.optim.{f.name} is missing") from None
        given[f.name] = _OPTIM_ABSENT[f.name]
    optim = Optim(**given)
  optim.check()
  return dataclasses.asdict(optim)


def loss_scale_enabled(mode: str, dtype: str) -> bool:
  """Whether a run with train.loss_scale=`mode` and model.dtype=`dtype` scales its loss."""
  return mode == "dynamic" or (mode == "auto" and dtype == "float16")


def check_loss_scale(mode: Any, initial: Any, period: Any) -> None:
  """Raises ValueError naming the field (config.train.loss_scale*) of a bad value."""
  if mode not in LOSS_SCALE_MODES:
    raise ValueError(f"config.train.loss_scale={mode!r}: choose one of {LOSS_SCALE_MODES} (auto: "
                     "dynamic loss scaling when model.dtype='float16')")
  ok = (isinstance(initial, (int, float)) and not isinstance(initial, bool)
        and math.isfinite(initial))
  if not (ok and MIN_SCALE <= initial <= MAX_SCALE and math.frexp(initial)[0] == 0.5):
    raise ValueError(f"config.train.loss_scale_init={initial!r}: must be a power of two in "
                     "[1, 2**64] (e.g. 32768.0 = 2**15): scaling by a power of two is exact")
  if isinstance(period, bool) or not isinstance(period, int) or period < 1:
    raise ValueError(f"config.train.loss_scale_period={period!r}: must be an integer >= 1 (finite "
                     "steps in a row before the scale doubles)")


@dataclasses.dataclass(frozen=True)
class Train:
  """config.train: loop lengths, logging, checkpointing, faults, profiling, reporting."""
  steps: int = 150_000
  log_every: int = 100
  eval_every: int = 1000  # the reference's "iteration" (nbatches)
  eval_batches: int = 0  # 0: ceil(eval_every / 10), as the reference
  checkpoint_every: int = 1000
  max_to_keep: int = 3
  # Checkpoint (run directory or checkpoint path) whose parameters and optimizer state start this
  # run, e.g. the "+20k steps at lr/10" fine-tuning phases (the configs' `finetune` variants). The
  # step counter restarts at 0 in the new workdir, so `steps` is this phase's length. None: scratch.
  init_from: str | None = None
  full_eval_at_end: bool = True
  eval_drop_last: bool = False  # True reproduces the reference's dropping of the partial last block
  tensorboard: bool = True
  # Persistent XLA compilation cache: restarts and span-plan changes seen before do not recompile
  # from scratch. Empty string: off.
  compilation_cache: str = "~/.cache/span_lm/xla"
  compilation_cache_min_secs: float = 1.0  # only compilations slower than this are written to it
  # A non-finite loss or gradient: the update is never applied (checked inside the jitted step).
  # stop: end the run with an error, the last checkpoint untouched; skip: drop that update, count
  # it (metrics 'skipped') and go on.
  nonfinite: str = "stop"
  # Dynamic loss scaling (span_lm/train/loss_scale.py): the loss is multiplied by a power-of-two
  # scale before the gradient and the float32 gradients divided by it; an attempt whose gradients
  # overflow is retried on the device with half the scale (same batch), and the scale doubles
  # after loss_scale_period finite steps. auto: on for model.dtype='float16' (V100, T4), off for
  # float32 and bfloat16 | dynamic: on for any dtype | off. Gradient overflows are its business
  # while the scale can still halve; a non-finite loss, or non-finite gradients at scale 1, go to
  # train.nonfinite above.
  loss_scale: str = "auto"
  loss_scale_init: float = 2.0 ** 15
  loss_scale_period: int = 2000
  preemption: bool = True  # SIGTERM / the preemption sync point: checkpoint the current step, stop
  debug_nan_at_step: int = 0  # testing aid: make the loss of this step (1-based) NaN; 0: off
  # Profiling (jax.profiler, span_lm/train/telemetry.py): trace profile_steps steps starting at
  # step profile_start (1-based) into <workdir>/profile/ (TensorBoard's profile plugin, Perfetto).
  # 0: off. A run resumed past profile_start does not trace again.
  profile_start: int = 0
  profile_steps: int = 0
  # MFU (logged with tokens_per_s): the peak TFLOP/s of one device for the run's dtype. 0: the data
  # sheet's for the device (span_lm/kernels/chips.py); unknown devices (CPU) log mfu null unless
  # set.
  peak_tflops: float = 0.0
  # Weights & Biases (optional: pip install span_lm[wandb]): the project to log the same metrics
  # and the config to ('': off). A resumed run continues the same W&B run (its id is kept in
  # <workdir>/wandb_id). Process 0 only.
  wandb: str = ""
  wandb_entity: str = ""  # the team or user ('': W&B's default)
  wandb_name: str = ""  # the run's display name ('': the run directory's name)

  def check(self, mode: str) -> None:
    """mode: config.mode (W&B's package is needed only to train)."""
    _int("train.steps", self.steps, 0)
    _number("train.compilation_cache_min_secs", self.compilation_cache_min_secs, 0.0, False)
    for name in ("log_every", "eval_every", "checkpoint_every"):
      _int(f"train.{name}", getattr(self, name), 1)
    _int("train.eval_batches", self.eval_batches, 0)
    _int("train.max_to_keep", self.max_to_keep, 1)
    init_from = self.init_from
    if init_from is not None:
      if not isinstance(init_from, str) or not init_from:
        _bad("train.init_from", init_from, "must be a checkpoint path (or None)")
      if "://" not in init_from and not os.path.exists(init_from):
        _bad("train.init_from", init_from, "no such checkpoint file or directory",
             ConfigPathError)
    _choice("train.nonfinite", self.nonfinite, ("stop", "skip"))
    check_loss_scale(self.loss_scale, self.loss_scale_init, self.loss_scale_period)
    _int("train.debug_nan_at_step", self.debug_nan_at_step, 0)
    self._check_observability(mode)
    _flag("train.preemption", self.preemption)

  def _check_observability(self, mode: str) -> None:
    """Profiling, the MFU peak and Weights & Biases: refused in one line before anything starts."""
    start = _int("train.profile_start", self.profile_start, 0)
    steps = _int("train.profile_steps", self.profile_steps, 0)
    if bool(start) != bool(steps):
      given, other = (("profile_start", "profile_steps") if start
                      else ("profile_steps", "profile_start"))
      _bad(f"train.{given}", getattr(self, given),
           f"profiling needs both: set --config.train.{other} too (the first step to trace, "
           "1-based, and how many steps; 0 and 0: off)")
    _number("train.peak_tflops", self.peak_tflops, 0.0, strict=False)
    for name in ("wandb", "wandb_entity", "wandb_name"):
      if not isinstance(getattr(self, name), str):
        _bad(f"train.{name}", getattr(self, name), "must be a string ('': unset)")
    if self.wandb and mode == "train" and importlib.util.find_spec("wandb") is None:
      _bad("train.wandb", self.wandb, "the wandb package is not installed: pip install "
           "'span_lm[wandb]' (or pip install 'wandb>=0.16,<1'), or leave out --config.train.wandb")


@dataclasses.dataclass(frozen=True)
class Dist:
  """config.dist: several processes and devices (span_lm/train/distributed.py,
  launch/README.md)."""
  mode: str = "auto"  # auto (when a coordinator, SLURM step or TPU pod is detected) | on | off
  coordinator: str = ""  # host:port of process 0; "": JAX_COORDINATOR_ADDRESS or auto-detection
  num_processes: int = 0  # 0: from JAX_NUM_PROCESSES or auto-detection
  process_id: int = -1  # -1: from JAX_PROCESS_ID or auto-detection
  local_device_ids: str = ""  # comma-separated device ids this process uses; "": all (JAX default)
  init_timeout: int = 300  # seconds to wait for the other processes
  # FSDP-style: >1 makes the mesh ('data', 'fsdp') with this many devices on 'fsdp', over which
  # parameters and optimizer state are split (logical axis 'embed'); batches use every device.
  fsdp: int = 1
  # CPU hosts: split the host into this many JAX devices and train data-parallel over them (XLA:CPU
  # runs most of one device's work on one thread). 0: auto (one per core, at most 8, reduced to
  # divide the batches; only when no accelerator plugin is installed); 1: off. XLA_FLAGS'
  # --xla_force_host_platform_device_count, when set, wins.
  cpu_devices: int = 0
  # CPU-only runs: True sets glibc malloc to one arena, no trim, mmap above 32 MiB
  # (span_lm/train/cpu_host.py). Off by default: it measured no faster than glibc's defaults
  # (docs/benchmarks.md, "malloc and peak resident memory"); the faster no-mmap setting raised
  # peak resident memory, so it was dropped.
  cpu_keep_freed_memory: bool = False
  # CPU-only runs: malloc with transparent huge pages (glibc.malloc.hugetlb=1; main.py re-executes
  # itself once with GLIBC_TUNABLES set): far fewer page faults for XLA's per-step temporaries at
  # the same peak memory (span_lm/train/cpu_host.py, docs/benchmarks.md "Huge pages").
  cpu_huge_pages: bool = True

  def check(self) -> None:
    _choice("dist.mode", self.mode, DIST_MODES)
    if not isinstance(self.coordinator, str) or (self.coordinator and ":" not in self.coordinator):
      _bad("dist.coordinator", self.coordinator, "must be '' or host:port of process 0")
    n = _int("dist.num_processes", self.num_processes, 0)
    pid = _int("dist.process_id", self.process_id, -1)
    if n and pid >= n:
      _bad("dist.process_id", pid, f"must be < config.dist.num_processes={n}")
    ids = self.local_device_ids
    if not isinstance(ids, str) or (ids and not all(p.strip().isdigit() for p in ids.split(","))):
      _bad("dist.local_device_ids", ids, "must be '' or comma-separated device ids like '0,1'")
    _int("dist.init_timeout", self.init_timeout, 1)
    _int("dist.fsdp", self.fsdp, 1)
    _int("dist.cpu_devices", self.cpu_devices, 0)
    _flag("dist.cpu_huge_pages", self.cpu_huge_pages)
    _flag("dist.cpu_keep_freed_memory", self.cpu_keep_freed_memory)


@dataclasses.dataclass(frozen=True)
class Tools:
  """config.tools: inspecting a run (span_lm/tools): --config.mode=spans | flops | sample, on
  config.workdir."""
  step: int | None = None  # checkpoint step to inspect; None: the latest
  text: str | None = None  # spans, dynamic span (Fig. 5): the text; None: valid split
  xla: bool = True  # flops: also compile the train step and report XLA's cost and memory analyses
  dtype: str | None = None  # export (safetensors): float32 | bfloat16 | float16


@dataclasses.dataclass(frozen=True)
class Compile:
  """config.compile: --config.mode=compile: the train and eval steps compiled for chips this host
  does not have (span_lm/tools/compile.py). targets: comma-separated; GPUs as chip[:count] (h100:8,
  a100_40:8, v100_16:8), TPUs as chip[:topology] (v5e:4x4, v5p:2x2x2, v6e:2x4, v4:2x2x2)."""
  targets: str = "h100:8,v5p:2x2x2"
  plan: str = "full"  # full (every head at model.span.size: the worst case) | initial (the start)
  steps: str = "train,eval"
  out: str = ""  # report directory; "": config.workdir, else ./compile_report
  # exit 1 (one line) when a step does not compile or does not fit (CI's guard)
  strict: bool = False

  def check(self) -> None:
    """The plan and steps (the targets' names are checked by tools/compile.py, before compiling)."""
    _choice("compile.plan", self.plan, COMPILE_PLANS)
    for step in str(self.steps).split(","):
      if step.strip() not in COMPILE_STEPS:
        _bad("compile.steps", self.steps, f"comma-separated steps out of {COMPILE_STEPS}")


@dataclasses.dataclass(frozen=True)
class Sample:
  """config.sample: --config.mode=sample's text."""
  prompt: str = ""  # text to continue ("": start a new line)
  length: int = 200  # tokens to generate
  temperature: float = 1.0  # 0: greedy
  top_k: int = 0  # draw among the k most likely tokens; 0: all
  seed: int = 0


SECTIONS = {"data": Data, "optim": Optim, "train": Train, "dist": Dist, "tools": Tools,
            "compile": Compile, "sample": Sample}


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """A checked run config: the top-level fields, config.model as the ModelConfig it describes
  (vocab_size 1 where the config leaves it to the dataset: Run settles it), and the sections.
  Built (and so checked) once, by `from_config`, where a command starts."""
  workdir: str | None = None  # run directory; resume is automatic
  seed: int = 42
  mode: str = "train"  # train | eval | import | export
  # mode=import: a reference (facebookresearch/adaptive-span) .pt checkpoint, or a directory
  # mode=export wrote (model.safetensors + config.json), to make an Orbax checkpoint in workdir;
  # mode=export: where to write workdir's latest checkpoint (span_lm/tools/reference_checkpoint.py,
  # span_lm/tools/safetensors_format.py).
  import_from: str | None = None
  export_to: str | None = None
  # export: 'safetensors' (a directory: model.safetensors, config.json, README.md) | 'pt' (the
  # reference's torch file); "": 'pt' where export_to ends in .pt, else 'safetensors'
  export_format: str = ""
  model: ModelConfig | None = None  # architecture: ModelConfig's fields (vocab_size 0: the data's)
  data: Data = dataclasses.field(default_factory=Data)
  optim: Optim = dataclasses.field(default_factory=Optim)
  train: Train = dataclasses.field(default_factory=Train)
  dist: Dist = dataclasses.field(default_factory=Dist)
  tools: Tools = dataclasses.field(default_factory=Tools)
  compile: Compile = dataclasses.field(default_factory=Compile)
  sample: Sample = dataclasses.field(default_factory=Sample)
  vocab_from_data: bool = True  # config.model.vocab_size was 0: the dataset's settles it (Run)
  # The config as given (plain dicts, its fields in the order they were set): config.model as
  # written, for what a run directory's config.json and a checkpoint's metadata record.
  source: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

  @property
  def vocab_size(self) -> int | None:
    """config.model.vocab_size as configured, or None where it was 0 (the dataset's)."""
    return None if self.vocab_from_data else self.model.vocab_size

  def model_for(self, vocab_size: int) -> ModelConfig:
    """config.model with its vocabulary settled: `vocab_size` (the dataset's, a checkpoint's)
    where config.model.vocab_size was 0, else as configured."""
    if not self.vocab_from_data:
      return self.model
    return dataclasses.replace(self.model, vocab_size=vocab_size)

  def _as_given(self) -> dict[str, Any]:
    """The fields in the given order, the sections' and top-level values from this RunConfig."""
    out = copy.deepcopy(self.source)
    for name in out:
      if name in SECTIONS:
        section = getattr(self, name)
        out[name] = {k: getattr(section, k, v) for k, v in out[name].items()}
      elif name != "model" and hasattr(self, name):
        out[name] = getattr(self, name)
    return out

  def to_dict(self) -> dict[str, Any]:
    """The nested dict a ConfigDict's to_dict gives (fields sorted by name, tuples kept): what a
    checkpoint's metadata records, so old and new runs read each other."""
    def ordered(d):
      return {k: ordered(d[k]) if isinstance(d[k], dict) else d[k] for k in sorted(d)}
    return ordered(self._as_given())

  def to_json_best_effort(self, **kwargs) -> str:
    """The JSON a ConfigDict writes (fields in the order set, tuples as lists): config.json."""
    return json.dumps(self._as_given(), default=str, **kwargs)

  @classmethod
  def from_config(cls, config: Any, modes: tuple[str, ...] = MODES) -> "RunConfig":
    """Checks a run config (a ConfigDict whose schema is base_config's) and returns it typed.
    Raises ConfigError naming the first bad field, in the order the fields were always checked.
    modes: the accepted config.mode values (span_lm.config.MODES, which later features extend)."""
    get = lambda name: _get(config, name)
    mode = _choice("mode", get("mode"), modes)
    workdir = get("workdir")
    _check_run(mode, workdir, get("import_from"), get("export_to"), get("seed"))
    vocab = get("model.vocab_size")
    model = ModelConfig.from_config(get("model"), vocab_size=None if vocab else 1)
    sections = {name: _section(cls_, config, name) for name, cls_ in SECTIONS.items()}
    source = _in_given_order(config)
    run = cls(workdir=workdir, seed=get("seed"), mode=mode, import_from=get("import_from"),
              export_to=get("export_to"), export_format=get("export_format"), model=model,
              vocab_from_data=not vocab, source=source, **sections)
    run.check()
    return run

  def check(self) -> None:
    """The sections' own checks and those across sections, in today's order."""
    self.check_kernels()
    self.data.check(self.optim.batch_split)
    if self.mode == "compile":
      self.compile.check()
    self.optim.check()
    self.train.check(self.mode)
    self.dist.check()
    n_cpu = self.dist.cpu_devices
    if n_cpu > 1:
      for field, b in per_step_batches(self).items():
        if b % n_cpu:
          _bad("dist.cpu_devices", n_cpu, f"must divide the per-step batch of config.{field} ({b})")

  def check_kernels(self, backend: str | None = None) -> None:
    """An explicit fused kernel's tiling of the model and the block length; with `backend` (jax's,
    once the run has started it), a kernel this host can run (model/attention_rules.py): the one
    place a run checks them."""
    block = self.data.block if isinstance(self.data.block, int) else None
    attention_rules.check(self.model, block=block, backend=backend)


def _check_run(mode, workdir, import_from, export_to, seed) -> None:
  """The top-level fields: a workdir where the mode needs one, the paths import and export need."""
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
  for field, value, needed in (("import_from", import_from, mode == "import"),
                               ("export_to", export_to, mode == "export")):
    if needed and (not isinstance(value, str) or not value):
      _bad(field, value, f"mode={mode} needs a path (--config.{field}=FILE.pt or DIR)")
  if mode == "import" and not os.path.exists(import_from):
    _bad("import_from", import_from, "no such file or directory", ConfigPathError)
  if isinstance(seed, bool) or not isinstance(seed, int):
    _bad("seed", seed, "must be an integer")


def _get(config: Any, name: str) -> Any:
  node = config
  for part in name.split("."):
    try:
      node = node[part]
    except (KeyError, AttributeError, TypeError):
      raise ConfigError(
          f"config.{name} is missing (the schema: span_lm.config.base_config)") from None
  return node


def _section(cls, config: Any, name: str):
  """A section of a ConfigDict as its dataclass (values as given: its check judges them)."""
  return cls(**{f.name: _get(config, f"{name}.{f.name}") for f in dataclasses.fields(cls)})


def _in_given_order(config: Any) -> dict[str, Any]:
  """A ConfigDict (or mapping) as nested plain dicts: its values as to_dict gives them (tuples
  kept), its fields in the order they were set (as its JSON has them; to_dict sorts them)."""
  values = config.to_dict() if hasattr(config, "to_dict") else copy.deepcopy(dict(config))
  if not hasattr(config, "to_json_best_effort"):
    return values
  def order(value, like):
    if not isinstance(value, dict) or not isinstance(like, dict):
      return value
    keys = [k for k in like if k in value] + [k for k in value if k not in like]
    return {k: order(value[k], like.get(k)) for k in keys}
  return order(values, json.loads(config.to_json_best_effort()))


def per_step_batches(config) -> dict[str, int]:
  """Streams per compiled train step (batch / batch_split) and per eval step: what a device
  count must divide."""
  return {"data.batch": config.data.batch // config.optim.batch_split,
          "data.eval_batch": config.data.eval_batch}

"""The span attention door: `select` picks an implementation (an `Impl` of the table `IMPLS`)
for a layer's `Spec` once, and the model calls its functions (`impl.project_kv`, `impl.attend`,
...); `check` refuses, naming the field, an explicit choice that cannot run. Only this door names
a platform implementation (as MaxText's AttentionOp.apply_attention does), and it reads a `Spec`
and nothing else: what only a model config knows is model/attention_rules.py's.

The rows (`model.attention.impl`): reference, cpu, pallas (GPU), pallas_tpu (TPU), the two
kernels interpreted (pallas_interpret, pallas_tpu_interpret: any backend, for tests), and auto,
which picks by the target platform (kernels/target.py), what the kernel tiles, and on a GPU by
evidence (`gpu_preference`) and memory (`fit_fallback`). Each row's functions live in its
impl_* module, imported on first use, so the Pallas kernels load only where chosen. This module
imports no jax: the config validates with it. docs/kernels.md, "The span door", has the table.
"""
import dataclasses
import importlib
import logging
from types import ModuleType
from typing import Any, NamedTuple

from span_lm.kernels import target
from span_lm.kernels.heads import kv_group  # pylint: disable=unused-import  (the door's name for it)

ATTN_PRECISIONS = ("default", "highest")  # float32 dots of the fused kernels
ALIASES = {"xla": "cpu"}  # old names, read as the new (with a warning)
log = logging.getLogger("span_lm")
_logged: set = set()


@dataclasses.dataclass(frozen=True)
class Attention:
  """`config.model.attention`: how span attention executes. Nothing here changes the model's
  maths (beyond float32 rounding with `precision`); it is owned here, beside the implementations
  that read it, and checks itself on construction (the sizes a kernel must tile: `check`)."""
  # auto (by target: cpu on CPUs; on GPUs and TPUs the fused kernel where it fits and is faster,
  # else reference) | reference | cpu | pallas | pallas_interpret | pallas_tpu |
  # pallas_tpu_interpret: the module docstring above.
  impl: str = "auto"
  block: int = 64  # fused kernels: query/key tile; divides the block length and the plan windows
  # fused kernels, float32 models: default (TF32 tensor cores on Ampere and later, as XLA's own
  # float32 matmuls) | highest (exact float32, no tensor cores). bf16 models are unaffected.
  precision: str = "default"
  # pallas (GPU): the kernel's (tile, warps, stages): table (gpu_tiles.TILES, by compute
  # capability and head size) | tune (time the candidates on this GPU at startup, cached:
  # kernels/span/autotune.py; the run then records what it chose) | "T,W,S", e.g. "64,4,2" (S, the
  # pipeline depth, 1-4: kernels/span/pallas_gpu.py).
  tiles: str = "table"
  chunk: int = 0  # reference/cpu: queries per chunk of the banded scores (0: automatic)

  def __post_init__(self):
    def bad(field, why):
      raise ValueError(f"config.model.attention.{field}={getattr(self, field)!r}: {why}")

    if self.impl in ALIASES:  # 'xla': its name before the one door
      log.warning(f"config.model.attention.impl={self.impl!r} is deprecated: it now reads "
                  f"{ALIASES[self.impl]!r} (or use 'auto')")
      object.__setattr__(self, "impl", ALIASES[self.impl])
    if self.impl not in ATTN_IMPLS:
      bad("impl", f"choose one of {ATTN_IMPLS}")
    if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 1:
      bad("block", "must be a positive integer")
    if self.precision not in ATTN_PRECISIONS:
      bad("precision", f"choose one of {ATTN_PRECISIONS}")
    if self.tiles not in ("table", "tune"):
      tiles = parse_tiles(self.tiles)
      if tiles is None:
        bad("tiles", "'table', 'tune', or 'TILE,WARPS,STAGES' (e.g. '64,4,2': a power of two "
            ">= 16, warps 1-16 a power of two, stages 1-4)")
      if self.block % tiles[0]:  # a larger tile leaves a remainder too
        bad("tiles", f"its tile must divide attention.block={self.block}")
    if isinstance(self.chunk, bool) or not isinstance(self.chunk, int) or self.chunk < 0:
      bad("chunk", "must be an integer >= 0 (0: automatic)")

  def replace(self, **changes) -> "Attention":
    return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class Spec:
  """What the door needs of one layer's span attention, and nothing else: the model
  (`ModelConfig.attn_spec`) and the drop-in layer (span_lm/layers) each build one, so both call
  the same functions. Frozen and hashable (a jit static).

  Keys lie at distances 1..window behind a query (distance 1: the previous row; the mask reads
  distance d as x = d - 1) and, when ahead > 0, 1..ahead in front of it (x = distance): the rows
  an implementation's `attend` is given are the window, the block of queries and the rows ahead.
  """
  heads: int
  head_dim: int
  window: int  # W: the longest window behind (the span S; a plan's windows are <= W)
  ahead: int = 0  # A: the window ahead of each query; 0: causal
  ramp: int = 32  # R, the soft mask's ramp
  mode: str = "adaptive"  # fixed | adaptive | dynamic: the span mask (residual accounting)
  dtype: str = "float32"
  dropout: float = 0.0  # on the attention weights, in training
  pers_mem: int = 0  # persistent key/value vectors per head, in the same softmax
  segmented: bool = False  # segment ids given (padding, packing): `Segments`
  attention: Attention = dataclasses.field(default_factory=Attention)
  # key/value heads (GQA; 1: MQA): query head h reads key/value head h // (heads // kv_heads),
  # with no repeated copy in any implementation. None: heads (one key/value head per query head)
  kv_heads: int | None = None

  def __post_init__(self):
    for f in ("heads", "head_dim", "window", "ahead", "ramp", "pers_mem"):
      v = getattr(self, f)
      if isinstance(v, bool) or not isinstance(v, int) or v < (0 if f in ("ahead", "pers_mem")
                                                               else 1):
        raise ValueError(f"attention spec {f}={v!r}: must be an integer >= "
                         f"{0 if f in ('ahead', 'pers_mem') else 1}")
    kv = self.kv_heads
    if kv is not None and (isinstance(kv, bool) or not isinstance(kv, int) or kv < 1
                           or self.heads % kv):
      raise ValueError(f"attention spec kv_heads={kv!r}: must be a positive integer dividing "
                       f"heads={self.heads}")

  @property
  def group(self) -> int:
    """Query heads per key/value head (1 without grouped heads)."""
    return 1 if self.kv_heads is None else self.heads // self.kv_heads

  def replace(self, **changes) -> "Spec":
    return dataclasses.replace(self, **changes)


class Segments(NamedTuple):
  """Segment ids (int32) of the queries, (B, M), and of the key rows, (B, W + M + A): a query
  attends only to keys of its own segment; id 0 is padding, attended by no query, and a query of
  id 0 gives zeros (also with persistent memory)."""
  q: Any
  kv: Any


class KV(NamedTuple):
  """Keys and values of one head group as rows, each (B, G, T, Dh): what every implementation's
  `attend` takes. Its `project_kv` and `split_kv` may return its own layout instead. Grouped
  heads (GQA): (B, G_kv, T, Dh) for G queries' heads, G_kv dividing G (`kv_group`)."""
  k: Any
  v: Any


@dataclasses.dataclass(frozen=True)
class Impl:
  """One implementation: what `select` and `check` need to know of it, and its functions (the
  module `ops`, imported on first use). Every ops module offers the functions below with the
  implementation as first argument (as a method's self)."""
  name: str
  ops_module: str
  fused: bool = False  # a kernel: spans as runtime values, block and windows in whole tiles
  platform: str | None = None  # the backend its compiled kernel needs (None: any)
  needs: str = ""  # the kernel and what it needs, for `check`'s refusal
  interpret: bool = False  # the kernel interpreted (any backend; slow: for tests)

  @property
  def ops(self) -> ModuleType:
    return importlib.import_module(self.ops_module)

  def misfit(self, spec: Spec, m: int | None = None, w: int | None = None) -> str:
    """Why this cannot run a layer of m queries and windows up to w ('' when it can)."""
    if not self.fused:
      return ""
    field, rule = fused_misfit(spec, m, w)
    return f"{field} {rule}" if field else self.ops.misfit(self, spec, m, w)

  def project_kv(self, spec, cache_BxLxD, h_BxMxD, w_kv_Dx2Z, *, window: int, heads: int):
    """Keys and values of `heads` heads (w_kv: their [key | value] columns) over the last
    `window` cached states and the block, in this implementation's layout."""
    return self.ops.project_kv(self, spec, cache_BxLxD, h_BxMxD, w_kv_Dx2Z,
                               window=window, heads=heads)

  def split_kv(self, spec, kv_BxTx2Z, *, window: int, heads: int):
    """Keys and values from already projected [keys | values] rows (a key/value cache)."""
    return self.ops.split_kv(self, spec, kv_BxTx2Z, window=window, heads=heads)

  def attend(self, spec, q_BxGxMxD, kv, key_pe_DxW, *, key_pe_ahead_DxA=None, span_z=None,
             span_z_ahead=None, segments=None, pers_k_GxDxN=None, pers_v_GxNxD=None,
             dropout=None, dropout_seed=None):
    """Banded span attention of one head group: (B, G, M, Dh) outputs.

    kv: a `KV` (rows: the W window rows, the M queries' rows, the A rows ahead) or what
      project_kv/split_kv returned (causal only).
    key_pe_DxW: position embeddings behind, column W - d for distance d; key_pe_ahead_DxA
      (spec.ahead > 0): ahead, column a - 1 for distance a.
    span_z, span_z_ahead: spans in tokens behind and ahead (ahead None: span_z), each (1 or B,
      G, 1 or M), or None (fixed span).
    segments: a `Segments` (spec.segmented), or None. pers_k_GxDxN, pers_v_GxNxD: persistent
      memory (scaled). dropout: applied to the attention weights (None: none); the fused
      kernels draw their own keep mask from dropout_seed()."""
    if (key_pe_ahead_DxA is not None) != (spec.ahead > 0):
      raise ValueError(f"attend: spec.ahead={spec.ahead} but key_pe_ahead "
                       f"{'missing' if key_pe_ahead_DxA is None else 'given'}")
    if (segments is not None) != spec.segmented:
      raise ValueError(f"attend: spec.segmented={spec.segmented} but segments "
                       f"{'missing' if segments is None else 'given'}")
    extra = {}
    if spec.ahead:
      extra.update(key_pe_ahead_DxA=key_pe_ahead_DxA, span_z_ahead=span_z_ahead)
    if spec.segmented:
      extra["segments"] = segments
    return self.ops.attend(self, spec, q_BxGxMxD, kv, key_pe_DxW, span_z=span_z,
                           pers_k_GxDxN=pers_k_GxDxN, pers_v_GxNxD=pers_v_GxNxD,
                           dropout=dropout, dropout_seed=dropout_seed, **extra)

  def cached_rows(self, w: int) -> int:
    """Cached positions read for a window of w (the TPU kernel's: whole 128-lane tiles)."""
    return self.ops.cached_rows(self, w)

  def residual_bytes(self, spec, batch: int, m: int, heads: int, w: int, train: bool) -> dict:
    """Bytes one head group's attention keeps for the backward pass, by kind (keys_values,
    score_bands, weights), as this implementation saves them (model/costs.py asks here)."""
    return self.ops.residual_bytes(self, spec, batch, m, heads, w, train)

  def schedule_cost(self, spec, batch: int, m: int, w: int, span: float | None) -> dict | None:
    """{kernel: FLOPs, HBM bytes and bytes_min} of one layer's fused GPU kernels (batch streams,
    all heads, a block of m, window w, every row at `span`) for the compile mode's roofline;
    None elsewhere (XLA's cost analysis sees the rest, the TPU kernel through its estimate)."""
    return self.ops.schedule_cost(self, spec, batch, m, w, span)

  def compiler_options(self) -> dict:
    """XLA compile options a step running this needs (ptxas' floor for the GPU kernel)."""
    return self.ops.compiler_options(self)


_GPU = "a Triton kernel, which needs a GPU (Ampere or newer)"
_TPU = "a Mosaic kernel, which needs a TPU"
IMPLS: dict[str, Impl] = {i.name: i for i in (
    Impl("reference", "span_lm.kernels.span.impl_reference"),
    Impl("cpu", "span_lm.kernels.span.impl_cpu"),
    Impl("pallas", "span_lm.kernels.span.impl_gpu", fused=True, platform="gpu", needs=_GPU),
    Impl("pallas_interpret", "span_lm.kernels.span.impl_gpu", fused=True, interpret=True),
    Impl("pallas_tpu", "span_lm.kernels.span.impl_tpu", fused=True, platform="tpu", needs=_TPU),
    Impl("pallas_tpu_interpret", "span_lm.kernels.span.impl_tpu", fused=True, interpret=True),
)}
ATTN_IMPLS = ("auto",) + tuple(IMPLS)  # what config.model.attention.impl may name


def parse_tiles(text: str) -> tuple[int, int, int] | None:
  """'T,W,S' as (tile, warps, stages) for the fused GPU kernel, or None if it is not one. S is
  Triton's pipeline depth, 1 to 4 (kernels/span/pallas_gpu.py)."""
  try:
    tile, warps, stages = (int(x) for x in str(text).split(","))
  except ValueError:
    return None
  pow2 = lambda n: n > 0 and not n & (n - 1)
  if not (pow2(tile) and tile >= 16 and pow2(warps) and warps <= 16 and 1 <= stages <= 4):
    return None
  return tile, warps, stages


def tile_misfit(block, sizes) -> tuple[str, str]:
  """('', '') when the fused kernels' tile, attention.block, is a power of two >= 16 that divides
  every size of `sizes` ((field, size) pairs; None: not known), else (field, what it must be):
  the one rule, which the model applies to its own fields too (model/attention_rules.py)."""
  if not isinstance(block, int) or block < 16 or block & (block - 1):
    return "attention.block", "must be a power of two >= 16"
  for f, n in sizes:
    if n is not None and n % block:
      return f, f"must be a multiple of attention.block={block}"
  return "", ""


def fused_misfit(spec: Spec, m: int | None = None, w: int | None = None) -> tuple[str, str]:
  """('', '') when the fused kernels (GPU and TPU) tile a layer with a block of m queries and a
  window of w (None: the spec's own sizes only), else (field, what it must be): `select` falls
  back to the reference where it fails, `check` refuses an explicit choice."""
  return tile_misfit(spec.attention.block, (("pers_mem", spec.pers_mem), ("window", spec.window),
                                            ("block", m), ("window", w)))


def check(spec: Spec, *, block: int | None = None, backend: str | None = None) -> None:
  """Raises a ValueError naming the field where an explicit fused choice cannot run: the spec's
  sizes the kernel cannot tile, and `check_attention`'s rules. Names, precision and tiles are
  `Attention`'s own checks."""
  name = spec.attention.impl
  impl = IMPLS.get(name)
  if impl is None or not impl.fused:
    return
  field, why = fused_misfit(spec)
  if field:
    value = spec
    for part in field.split("."):
      value = getattr(value, part)
    raise ValueError(f"config.model.{field}={value!r}: {why} with attention.impl={name!r}")
  check_attention(spec.attention, block=block, backend=backend)


def check_attention(attention, *, block: int | None = None, backend: str | None = None) -> None:
  """Raises a ValueError where an explicit fused choice (attention: an `Attention`, or the run
  config's section of one) cannot run whatever the layer's sizes: the run's block length
  (`block`) the kernel cannot tile, or (with `backend`, jax's, once known) a compiled kernel on a
  backend without it, or a GPU kernel without Triton."""
  name = attention.impl
  impl = IMPLS.get(name)
  if impl is None or not impl.fused:
    return
  if block is not None and block % attention.block:
    raise ValueError(f"config.data.block={block!r}: must be a multiple of "
                     f"model.attention.block={attention.block} with the fused kernel")
  if backend is not None and impl.platform not in (None, backend):
    raise ValueError(f"config.model.attention.impl={name!r} runs {impl.needs}; this process has "
                     f"{backend} devices: use 'auto' (or {name + '_interpret'!r} to run the "
                     "kernel interpreted)")
  if impl.ops_module == IMPLS["pallas"].ops_module:
    target.refuse_without_triton("attention.impl", name, impl.needs, "reference")


def _gpu_runs_triton(platform: target.Platform) -> bool:
  """Pallas' Triton backend: NVIDIA GPUs of compute capability >= 8.0 (Ampere and later)."""
  cc = platform.compute_capability
  return platform.name == "gpu" and cc is not None and cc >= 8.0


# Forward + backward of one layer's attention timed on a GPU (docs/gpu/), by (compute capability
# major, padded head size): the fused kernel's version timed, its milliseconds and the XLA path's
# (`reference`) in the same run, per span setting. `auto` runs the kernel only where every
# timing of the current version (pallas_gpu.VERSION) has it faster.
GPU_TIMINGS = {
    (9, 64): {"version": "scratch-1", "source": "docs/gpu/kernel_check_h200_2026-11-27.json",
              "shapes": "B=8 H=8 M=512 W=8192 bf16 (H200)",
              "ms": {"learned spans": (8.069, 5.685), "all spans at S": (20.27, 5.683)}},
}


def gpu_preference(compute_capability: float, head_dim: int) -> tuple[str, str]:
  """(implementation, why) `auto` runs on an NVIDIA GPU where the kernel applies, before memory
  is considered (`fit_fallback`): the one timed faster on this GPU generation at this head size,
  and `reference` while the current kernel is untimed there."""
  # pylint: disable=g-import-not-at-top  (a GPU target: jax)
  from span_lm.kernels.span import gpu_tiles, pallas_gpu
  key = (int(compute_capability), gpu_tiles.padded_head_dim(head_dim))
  timed = GPU_TIMINGS.get(key)
  where = f"sm_{int(10 * compute_capability)}, head size {key[1]}"
  if timed is None or timed["version"] != pallas_gpu.VERSION:
    return "reference", (f"the fused kernel ({pallas_gpu.VERSION}) is untimed on {where}: the XLA "
                         "path where the step fits in memory")
  faster = all(k < x for k, x in timed["ms"].values())
  rows = ", ".join(f"{n} {k:.3g} vs {x:.3g} ms" for n, (k, x) in timed["ms"].items())
  return ("pallas" if faster else "reference"), (
      f"{'fused kernel' if faster else 'XLA path'} timed faster on {where} ({rows}; "
      f"{timed['source']})")


def fit_fallback(spec: Spec) -> Spec | None:
  """The spec to compile instead when a step does not fit in device memory: `auto`'s reference
  on a GPU falls back to the fused kernel, which saves O(block) per layer for the backward pass
  (its position scores, O(block x window), are recomputed per layer) where the XLA path saves
  O(block x window) score bands per layer; None where there is nothing to fall back to (an
  explicit choice, sizes the kernel cannot tile; a GPU without Triton). The model adds its own
  rules (model/attention_rules.py)."""
  if (spec.attention.impl != "auto" or not _gpu_runs_triton(target.current())
      or target.triton_missing()):
    return None
  if fused_misfit(spec)[0] or select(spec).fused:
    return None
  return spec.replace(attention=spec.attention.replace(impl="pallas"))


def select(spec: Spec, m: int | None = None, w: int | None = None) -> Impl:
  """The implementation that runs a layer with a block of m queries and windows up to w.

  An explicit fused choice falls back to the reference where the kernel does not fit (init's
  one-token block); `auto` picks by backend, and on a GPU by `gpu_preference`. Logged once per
  distinct choice and shape."""
  impl, why = _select(spec, m, w)
  key = (spec.attention.impl, impl.name, m, w, why)
  if key not in _logged:
    _logged.add(key)
    log.info("attention: %s (attention.impl=%s, block %s, window %s%s)", impl.name,
             spec.attention.impl, m, w, f"; {why}" if why else "")
  return impl


def choose(spec: Spec, m: int | None = None, w: int | None = None) -> str:
  """The name of what `select` picks (logs, reports)."""
  return select(spec, m, w).name


def why(spec: Spec, m: int | None = None, w: int | None = None) -> str:
  """Why `select` picks what it picks ('' where the choice is the config's own or the CPU's)."""
  return _select(spec, m, w)[1]


def _select(spec: Spec, m, w) -> tuple[Impl, str]:
  if spec.attention.impl != "auto":
    impl = IMPLS[spec.attention.impl]
    why = impl.misfit(spec, m, w)
    return (IMPLS["reference"] if why else impl), why
  platform = target.current()
  if platform.name == "cpu":
    return IMPLS["cpu"], ""
  if _gpu_runs_triton(platform):
    why = target.triton_missing()
    if why:
      return IMPLS["reference"], why + ": the XLA path"
    why = IMPLS["pallas"].misfit(spec, m, w)
    if why:
      return IMPLS["reference"], why
    name, why = gpu_preference(platform.compute_capability, spec.head_dim)
    return IMPLS[name], why
  if platform.name == "tpu" and "v4" in platform.kind:
    return IMPLS["reference"], "TPU v4: Mosaic has no strided rotate (the kernel's skew)"
  if platform.name == "tpu":
    why = IMPLS["pallas_tpu"].misfit(spec, m, w)
    return IMPLS["reference" if why else "pallas_tpu"], why
  return IMPLS["reference"], f"backend {platform.name}"


def runtime_spans(spec: Spec) -> bool:
  """Whether spans are runtime values (the fused kernel), so a layer's plan is one head group."""
  return select(spec).fused


def chunk(spec: Spec, m: int, w: int) -> int:
  """Queries per chunk of the banded scores for a block of m and a window of w (the reference's
  choose_chunk: config.model.attention.chunk, else automatic), for the counts of model/macs.py
  and model/costs.py."""
  # pylint: disable=g-import-not-at-top
  from span_lm.kernels.span.banded_reference import choose_chunk
  return choose_chunk(m, w, spec.attention.chunk)


def gpu_tiles(spec: Spec, impl: str, dtype) -> tuple[int, int, int]:
  """The GPU kernel's (tile, warps, stages) for a GPU implementation (impl_gpu.tiles)."""
  return IMPLS[impl].ops.tiles(IMPLS[impl], spec, dtype)


def decode(spec: Spec, q_BxHxD, ring, key_pe_DxS, pos, windows_H, *, span_z=None, pers_k_HxDxN=None,
           pers_v_HxNxD=None):
  """One-token attention over ring caches ((keys, values), each (B, H, L, Dh)): (B, H, Dh)."""
  from span_lm.kernels.span import ring as ring_lib  # pylint: disable=g-import-not-at-top  (jax)
  return ring_lib.ring_attention(q_BxHxD, ring[0], ring[1], key_pe_DxS, pos, windows_H,
                                 span_z=span_z, ramp=spec.ramp, pers_k_HxDxN=pers_k_HxDxN,
                                 pers_v_HxNxD=pers_v_HxNxD)


# ptxas, given a kernel's block size (.reqntid) and no occupancy target, may hold a kernel to 32
# registers and spill (the float32 kernels at head size 128, in bwd_q on an A100). One CTA per
# SM as the floor lets it use what it needs (docs/kernels.md).
GPU_COMPILER_OPTIONS = {"xla_gpu_ptx_compiler_extra_flags": "--minnctapersm=1"}


def compiler_options(spec: Spec) -> dict:
  """XLA compile options for a step running this attention on the target platform: ptxas'
  occupancy floor where the fused GPU kernel runs, else none."""
  return select(spec).compiler_options()

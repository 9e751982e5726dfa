"""The one door to span attention: the model calls `choose`, `project_kv`, `attend` and `decode`
here, and only this module picks a platform implementation (as MaxText's
AttentionOp.apply_attention does).

Implementations (`model.attn_impl`):
  reference         banded_reference: the readable definition, plain autodiff; the numerical
                    reference for the others. Default on TPU, and on GPU where the kernel does not apply.
  cpu               banded_cpu: the same maths laid out for XLA:CPU (docs/benchmarks.md). CPU default.
  pallas            pallas_gpu: the fused Triton kernel, spans as runtime values. On a GPU `auto`
                    picks it where it was measured faster than `reference` (GPU_TIMINGS), or where
                    the reference's step does not fit in memory.
  pallas_interpret  the same kernel interpreted (any backend; slow: for tests).
  pallas_tpu        pallas_tpu: the fused Mosaic kernel, spans as runtime values. TPU default
                    (v5e and later).
  pallas_tpu_interpret  the TPU kernel interpreted (any backend; slow: for tests).
  auto              one of the above by the target platform (kernels/target.py: the host's
                    backend, or the chip a deviceless compile names), what the kernel supports,
                    and on a GPU by evidence (`gpu_preference`) and memory (`fit_fallback`).
"""
import dataclasses
import logging
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from span_lm.kernels import banded_cpu
from span_lm.kernels import banded_reference
from span_lm.kernels import decode as decode_lib
from span_lm.kernels import pallas_gpu
from span_lm.kernels import pallas_tpu
from span_lm.kernels import target
from span_lm.model import config as model_config

IMPLS = model_config.ATTN_IMPLS
GPU_FUSED = ("pallas", "pallas_interpret")
TPU_FUSED = ("pallas_tpu", "pallas_tpu_interpret")
FUSED = GPU_FUSED + TPU_FUSED
log = logging.getLogger("span_lm")
_logged: set = set()


class KV(NamedTuple):
  """Keys and values of one head group, as the chosen implementation lays them out: each
  (B, G, T, Dh) rows; cpu's positions_last: each (B, G, Dh, T); the TPU kernel's (tpu_parts):
  k holds the last L cached positions' [keys; values] (B, 2, G, Dh, L; `cached_rows`), v the
  block's (B, 2, G, Dh, M)."""
  k: Any
  v: Any
  positions_last: bool = False
  tpu_parts: bool = False


def _misfit(cfg, m, w) -> str:
  """Why the fused kernels cannot run this layer ('' when they can): ModelConfig's one rule."""
  field, rule = cfg.fused_misfit(m, w)
  return f"{field} {rule}" if field else ""


def _tpu_misfit(cfg, m, w) -> str:
  """Mosaic's lane rule for the TPU kernel's tiles at this layer's shape ('' when unknown)."""
  if m is None or w is None:
    return ""
  return pallas_tpu.misfit(cfg.attn_block, m, w, cfg.pers_mem)


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
  key = (int(compute_capability), pallas_gpu.padded_head_dim(head_dim))
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


def fit_fallback(cfg):
  """The model config to compile instead when a step of `cfg` does not fit in device memory:
  `auto`'s reference on a GPU falls back to the fused kernel, which saves O(block) per layer for
  the backward pass (its position scores, O(block x window), are recomputed per layer) where the
  XLA path saves O(block x window) score bands per layer; None where there is nothing to fall
  back to."""
  if cfg.attn_impl != "auto" or choose(cfg) != "reference":
    return None
  platform = target.current()
  if platform.name != "gpu" or not _gpu_runs_triton(platform):
    return None
  return dataclasses.replace(cfg, attn_impl="pallas")


def choose(cfg, m: int | None = None, w: int | None = None) -> str:
  """The implementation that runs a layer with a block of m queries and windows up to w.

  An explicit fused choice falls back to the reference where the kernel does not fit (init's
  one-token block); `auto` picks by backend, and on a GPU by `gpu_preference`. Logged once per
  distinct choice and shape."""
  impl, why = _choose(cfg, m, w)
  key = (cfg.attn_impl, impl, m, w, why)
  if key not in _logged:
    _logged.add(key)
    log.info("attention: %s (attn_impl=%s, block %s, window %s%s)", impl, cfg.attn_impl, m, w,
             f"; {why}" if why else "")
  return impl


def why(cfg, m: int | None = None, w: int | None = None) -> str:
  """Why `choose` picks what it picks ('' where the choice is the config's own or the CPU's)."""
  return _choose(cfg, m, w)[1]


def _choose(cfg, m, w) -> tuple[str, str]:
  impl, why = cfg.attn_impl, ""
  if impl == "auto":
    platform = target.current()
    backend = platform.name
    if backend == "cpu":
      impl = "cpu"
    elif backend == "gpu" and _gpu_runs_triton(platform):
      why = _misfit(cfg, m, w)
      if why:
        impl = "reference"
      else:
        impl, why = gpu_preference(platform.compute_capability, cfg.head_dim)
    elif backend == "tpu" and "v4" in platform.kind:
      impl, why = "reference", "TPU v4: Mosaic has no strided rotate (the kernel's skew)"
    elif backend == "tpu":
      why = _misfit(cfg, m, w) or _tpu_misfit(cfg, m, w)
      impl = "reference" if why else "pallas_tpu"
    else:
      impl, why = "reference", f"backend {backend}"
  elif impl in FUSED:
    why = _misfit(cfg, m, w) or (_tpu_misfit(cfg, m, w) if impl == "pallas_tpu" else "")
    impl = "reference" if why else impl
  return impl, why


def runtime_spans(cfg) -> bool:
  """Whether spans are runtime values (the fused kernel), so a layer's plan is one head group."""
  return choose(cfg) in FUSED


def project_kv(cfg, impl: str, cache_BxLxD, h_BxMxD, w_kv_Dx2Z, *, window: int, heads: int) -> KV:
  """Keys and values of `heads` heads (w_kv: their [key | value] columns) over the last `window`
  cached states and the block."""
  m = h_BxMxD.shape[1]
  if impl == "cpu":
    last = banded_cpu.prefer_positions_last(m, window, cfg.attn_chunk, h_BxMxD.dtype)
    return KV(*banded_cpu.project_kv(cache_BxLxD, h_BxMxD, w_kv_Dx2Z, window, heads, last), last)
  if impl in TPU_FUSED:
    return KV(*pallas_tpu.project_kv(cache_BxLxD, h_BxMxD, w_kv_Dx2Z, window, heads),
              tpu_parts=True)
  return KV(*banded_reference.project_kv(cache_BxLxD, h_BxMxD, w_kv_Dx2Z, window, heads))


def split_kv(cfg, impl: str, kv_BxTx2Z, *, window: int, heads: int) -> KV:
  """Keys and values from already projected [keys | values] rows (a key/value cache)."""
  if impl == "cpu":
    last = banded_cpu.prefer_positions_last(kv_BxTx2Z.shape[1] - window, window, cfg.attn_chunk,
                                            kv_BxTx2Z.dtype)
    return KV(*banded_cpu.split_kv(kv_BxTx2Z, heads, last), last)
  if impl in TPU_FUSED:
    return KV(*pallas_tpu.split_kv(kv_BxTx2Z, heads, window), tpu_parts=True)
  return KV(*banded_reference.split_kv(kv_BxTx2Z, heads))


def attend(cfg, impl: str, q_BxGxMxD, kv: KV, key_pe_DxW, *, span_z=None, pers_k_GxDxN=None,
           pers_v_GxNxD=None, dropout: Callable | None = None,
           dropout_seed: Callable[[], Any] | None = None):
  """Banded span attention of one head group: (B, G, M, Dh) outputs.

  span_z: spans in tokens, (1 or B, G, 1 or M), or None (fixed span). dropout: applied to the
  attention weights (None: none); the fused kernel draws its own keep mask from dropout_seed()."""
  if impl == "cpu":
    return banded_cpu.banded_attention(
        q_BxGxMxD, kv.k, kv.v, key_pe_DxW, span_z=span_z, ramp=cfg.ramp,
        pers_k_GxDxN=pers_k_GxDxN, pers_v_GxNxD=pers_v_GxNxD, chunk=cfg.attn_chunk,
        dropout=dropout, positions_last=kv.positions_last)[0].astype(q_BxGxMxD.dtype)
  if impl == "reference":
    return banded_reference.banded_attention(
        q_BxGxMxD, kv.k, kv.v, key_pe_DxW, span_z=span_z, ramp=cfg.ramp,
        pers_k_GxDxN=pers_k_GxDxN, pers_v_GxNxD=pers_v_GxNxD, chunk=cfg.attn_chunk,
        dropout=dropout)
  if impl not in FUSED:
    raise ValueError(f"attention: unknown implementation {impl!r}; choose one of {IMPLS}")
  b, g, m, _ = q_BxGxMxD.shape
  z = None if span_z is None else jnp.broadcast_to(jnp.asarray(span_z, jnp.float32), (b, g, m))
  seed = None if dropout is None else dropout_seed()
  rate = cfg.dropout if seed is not None else 0.0
  if impl in TPU_FUSED:  # float32 parameters go in as such: their gradients stay float32
    cached = kv.k.shape[-1] if kv.tpu_parts else pallas_tpu.layout_window(key_pe_DxW.shape[-1])
    bq, bk = pallas_tpu.tiles(cfg.attn_block, m, cached,
                              0 if pers_k_GxDxN is None else pers_k_GxDxN.shape[-1])
    fused = pallas_tpu.span_attention_kv if kv.tpu_parts else pallas_tpu.span_attention
    return fused(
        q_BxGxMxD, kv.k, kv.v, key_pe_DxW.astype(jnp.float32), z, ramp=cfg.ramp,
        block=bq, block_k=bk, pers_k_HxDxN=pers_k_GxDxN, pers_v_HxNxD=pers_v_GxNxD,
        dropout_rate=rate, dropout_seed=seed, interpret=impl == "pallas_tpu_interpret",
        precision=cfg.attn_precision)
  tile, warps, stages = gpu_tiles(cfg, impl, q_BxGxMxD.dtype)
  return pallas_gpu.span_attention(
      q_BxGxMxD, kv.k, kv.v, key_pe_DxW, z, ramp=cfg.ramp, block=tile,
      block_k=gpu_key_tile(cfg, impl, q_BxGxMxD.dtype, tile), num_warps=warps, num_stages=stages,
      # float32 parameters go in as such: the kernel casts them, their gradients stay float32
      pers_k_HxDxN=pers_k_GxDxN, pers_v_HxNxD=pers_v_GxNxD,
      dropout_rate=rate, dropout_seed=seed,
      interpret=impl == "pallas_interpret", precision=cfg.attn_precision)


def gpu_tiles(cfg, impl: str, dtype) -> tuple[int, int, int]:
  """The GPU kernel's (tile, warps, stages): the config's own 'T,W,S' (or what 'tune' measured:
  train/loop.py writes it there), else pallas_gpu's table for the target (interpret mode: none)."""
  explicit = model_config.parse_tiles(cfg.attn_tiles)
  if explicit is not None:
    return explicit
  cc = target.current().compute_capability if impl == "pallas" else None
  return pallas_gpu.tiles(cc, cfg.head_dim, dtype, cfg.attn_block)


def gpu_key_tile(cfg, impl: str, dtype, tile: int) -> int:
  """The GPU kernel's key tile for a query tile (pallas_gpu.TILES; interpret mode: the tile)."""
  cc = target.current().compute_capability if impl == "pallas" else None
  return pallas_gpu.key_tile(cc, cfg.head_dim, dtype, tile)


def decode(cfg, q_BxHxD, ring, key_pe_DxS, pos, windows_H, *, span_z=None, pers_k_HxDxN=None,
           pers_v_HxNxD=None):
  """One-token attention over ring caches ((keys, values), each (B, H, L, Dh)): (B, H, Dh)."""
  return decode_lib.ring_attention(q_BxHxD, ring[0], ring[1], key_pe_DxS, pos, windows_H,
                                   span_z=span_z, ramp=cfg.ramp, pers_k_HxDxN=pers_k_HxDxN,
                                   pers_v_HxNxD=pers_v_HxNxD)


# ptxas, given a kernel's block size (.reqntid) and no occupancy target, may hold a kernel to 32
# registers and spill (the float32 kernels at head size 128, in bwd_q on an A100). One CTA per
# SM as the floor lets it use what it needs (docs/kernels.md).
GPU_COMPILER_OPTIONS = {"xla_gpu_ptx_compiler_extra_flags": "--minnctapersm=1"}


def compiler_options(cfg) -> dict:
  """XLA compile options for a step of this model on the target platform: ptxas' occupancy
  floor where the fused GPU kernel runs, else none."""
  return dict(GPU_COMPILER_OPTIONS) if choose(cfg) == "pallas" else {}


def schedule_cost(cfg, impl: str, batch: int, m: int, w: int, span: float | None) -> dict | None:
  """{kernel: FLOPs, HBM bytes (upper bound) and bytes_min (lower bound)} of one layer's fused
  GPU kernels (batch streams, all heads, a block of m, window w, every row at `span`), for the
  compile mode's per-kernel roofline; None for other implementations (XLA's cost analysis sees
  the TPU kernel through its pl.CostEstimate)."""
  if impl not in GPU_FUSED:
    return None
  tile = gpu_tiles(cfg, impl, cfg.dtype)[0]
  return pallas_gpu.schedule_cost(batch, cfg.n_heads, m, w, cfg.head_dim, cfg.dtype, tile,
                                  span=span, ramp=cfg.ramp, n_pers=cfg.pers_mem,
                                  key_tile=gpu_key_tile(cfg, impl, cfg.dtype, tile))


def cached_rows(impl: str, w: int) -> int:
  """Cached positions an implementation reads for a window of w: the TPU kernel's cache part is
  laid out in whole 128-lane tiles (pallas_tpu.layout_window), the others read w."""
  return pallas_tpu.layout_window(w) if impl in TPU_FUSED else w


def residual_bytes(cfg, impl: str, batch: int, m: int, heads: int, w: int, train: bool) -> dict:
  """Bytes one head group's attention keeps for the backward pass, by kind (keys_values,
  score_bands, weights), as the implementation saves them (tools/flops asks here)."""
  drop = train and cfg.dropout > 0
  if impl in FUSED:  # the kernel saves its inputs, its output and two row statistics
    dt = jnp.dtype(cfg.dtype).itemsize
    dp = (pallas_tpu if impl in TPU_FUSED else pallas_gpu).padded_head_dim(cfg.head_dim)
    w = cached_rows(impl, w)
    return {"keys_values": 2 * batch * heads * (w + m) * dp * dt,
            "score_bands": 2 * batch * heads * m * 4, "weights": batch * heads * m * dp * dt}
  if impl == "reference":
    return banded_reference.residual_bytes(cfg.span_mode, cfg.pers_mem, cfg.dtype, batch, m,
                                           heads, w, cfg.head_dim, cfg.attn_chunk, drop)
  return banded_cpu.residual_bytes(cfg.span_mode, cfg.pers_mem, cfg.dtype, batch, m, heads, w,
                                   cfg.head_dim, cfg.attn_chunk, drop)


"""`pallas_tpu` and `pallas_tpu_interpret` behind the door (span_lm/kernels/span/door.py):
pallas_tpu's fused Mosaic kernel. Its own key/value layout, `TpuKV`, positions last as XLA:TPU's
projection writes them. Imported only where one of them is chosen: it loads Pallas."""
from typing import Any, NamedTuple

import jax.numpy as jnp

from span_lm import kernels
from span_lm.kernels.span import impl_reference
from span_lm.kernels.span import cost
from span_lm.kernels.span import tpu_tiles
from span_lm.kernels.span import pallas_tpu


class TpuKV(NamedTuple):
  """[keys; values] of the last L cached positions, (B, 2, G, Dh, L) (L = `cached_rows`), and of
  the block, (B, 2, G, Dh, M)."""
  cached: Any
  block: Any


def project_kv(impl, spec, cache_BxLxD, h_BxMxD, w_kv_Dx2Z, *, window: int, heads: int) -> TpuKV:
  del impl, spec
  return TpuKV(*pallas_tpu.project_kv(cache_BxLxD, h_BxMxD, w_kv_Dx2Z, window, heads))


def split_kv(impl, spec, kv_BxTx2Z, *, window: int, heads: int) -> TpuKV:
  del impl, spec
  return TpuKV(*pallas_tpu.split_kv(kv_BxTx2Z, heads, window))


def attend(impl, spec, q_BxGxMxD, kv, key_pe_DxW, *, key_pe_ahead_DxA=None, span_z=None,
           span_z_ahead=None, segments=None, pers_k_GxDxN=None, pers_v_GxNxD=None, dropout=None,
           dropout_seed=None):
  """kv: a TpuKV (causal), or the door's KV (rows: window, block, the A ahead), which the
  kernel lays out itself. Windows ahead, their spans and segment ids go to the kernel as they
  are (segment ids with either layout)."""
  b, g, m, _ = q_BxGxMxD.shape
  # grouped heads: the kernel's index maps share the key/value heads
  kernels.kv_group(g, (kv.cached.shape[2] if isinstance(kv, TpuKV) else kv.k.shape[1]))
  spans = lambda x: jnp.broadcast_to(jnp.asarray(x, jnp.float32), (b, g, m))
  z = None if span_z is None else spans(span_z)
  seed = None if dropout is None else dropout_seed()
  laid_out = isinstance(kv, TpuKV)
  extra = {}
  if key_pe_ahead_DxA is not None:
    if laid_out:
      raise ValueError("pallas_tpu: windows ahead take the door's key rows (kernels.KV), not TpuKV")
    extra["key_pe_ahead_DxA"] = key_pe_ahead_DxA.astype(jnp.float32)
    if z is not None and span_z_ahead is not None:  # a fixed span has no spans ahead either
      extra["z_ahead_BxHxM"] = spans(span_z_ahead)
  if segments is not None:
    extra.update(q_seg_BxM=segments.q, kv_seg_BxT=segments.kv)
  cached = kv.cached.shape[-1] if laid_out else cached_rows(impl, key_pe_DxW.shape[-1])
  bq, bk = tpu_tiles.tiles(spec.attention.block, m, cached,
                            0 if pers_k_GxDxN is None else pers_k_GxDxN.shape[-1])
  fused = pallas_tpu.span_attention_kv if laid_out else pallas_tpu.span_attention
  return fused(  # float32 parameters go in as such: their gradients stay float32
      q_BxGxMxD, *kv, key_pe_DxW.astype(jnp.float32), z, ramp=spec.ramp,
      block=bq, block_k=bk, pers_k_HxDxN=pers_k_GxDxN, pers_v_HxNxD=pers_v_GxNxD,
      dropout_rate=spec.dropout if seed is not None else 0.0, dropout_seed=seed,
      interpret=impl.interpret, precision=spec.attention.precision, **extra)


def cached_rows(impl, w: int) -> int:
  """The cache part is laid out in whole 128-lane tiles (tpu_tiles.layout_window)."""
  del impl
  return tpu_tiles.layout_window(w)


def residual_bytes(impl, spec, batch: int, m: int, heads: int, w: int, train: bool) -> dict:
  """The kernel's inputs as it saves them: the cached part, the block and (two-sided) the rows
  ahead padded to whole key tiles."""
  del train
  rows = cached_rows(impl, w)
  if spec.ahead:
    bk = tpu_tiles.tiles(spec.attention.block, m, rows, spec.pers_mem)[1]
    rows += -(-spec.ahead // bk) * bk
  return impl_reference.grouped_kv_bytes(spec, cost.fused_residual_bytes(
      batch, m, heads, rows, tpu_tiles.padded_head_dim(spec.head_dim),
      jnp.dtype(spec.dtype).itemsize))


def schedule_cost(impl, spec, batch: int, m: int, w: int, span) -> None:
  del impl, spec, batch, m, w, span  # XLA's cost analysis sees the kernel's pl.CostEstimate


def compiler_options(impl) -> dict:
  del impl
  return {}


def misfit(impl, spec, m, w) -> str:
  """Mosaic's lane rule for the kernel's tiles at this layer's shape ('' when unknown, and
  interpreted). Windows ahead and segment ids run (the rows ahead are padded to whole key
  tiles), so they add no rule."""
  if impl.interpret or m is None or w is None:
    return ""
  return tpu_tiles.misfit(spec.attention.block, m, w, spec.pers_mem)

"""`pallas_tpu` and `pallas_tpu_interpret` behind the door (span_lm/kernels/__init__.py):
pallas_tpu's fused Mosaic kernel. Its own key/value layout, `TpuKV`, positions last as XLA:TPU's
projection writes them. Imported only where one of them is chosen: it loads Pallas."""
from typing import Any, NamedTuple

import jax.numpy as jnp

from span_lm import kernels
from span_lm.kernels import pallas_tpu


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


def attend(impl, spec, q_BxGxMxD, kv, key_pe_DxW, *, span_z=None, pers_k_GxDxN=None,
           pers_v_GxNxD=None, dropout=None, dropout_seed=None):
  """kv: a TpuKV, or the door's KV (rows), which the kernel lays out itself."""
  b, g, m, _ = q_BxGxMxD.shape
  z = None if span_z is None else jnp.broadcast_to(jnp.asarray(span_z, jnp.float32), (b, g, m))
  seed = None if dropout is None else dropout_seed()
  laid_out = isinstance(kv, TpuKV)
  cached = kv.cached.shape[-1] if laid_out else cached_rows(impl, key_pe_DxW.shape[-1])
  bq, bk = pallas_tpu.tiles(spec.attention.block, m, cached,
                            0 if pers_k_GxDxN is None else pers_k_GxDxN.shape[-1])
  fused = pallas_tpu.span_attention_kv if laid_out else pallas_tpu.span_attention
  return fused(  # float32 parameters go in as such: their gradients stay float32
      q_BxGxMxD, *kv, key_pe_DxW.astype(jnp.float32), z, ramp=spec.ramp,
      block=bq, block_k=bk, pers_k_HxDxN=pers_k_GxDxN, pers_v_HxNxD=pers_v_GxNxD,
      dropout_rate=spec.dropout if seed is not None else 0.0, dropout_seed=seed,
      interpret=impl.interpret, precision=spec.attention.precision)


def cached_rows(impl, w: int) -> int:
  """The cache part is laid out in whole 128-lane tiles (pallas_tpu.layout_window)."""
  del impl
  return pallas_tpu.layout_window(w)


def residual_bytes(impl, spec, batch: int, m: int, heads: int, w: int, train: bool) -> dict:
  del train
  return kernels.fused_residual_bytes(batch, m, heads, cached_rows(impl, w),
                                      pallas_tpu.padded_head_dim(spec.head_dim),
                                      jnp.dtype(spec.dtype).itemsize)


def schedule_cost(impl, spec, batch: int, m: int, w: int, span) -> None:
  del impl, spec, batch, m, w, span  # XLA's cost analysis sees the kernel's pl.CostEstimate


def compiler_options(impl) -> dict:
  del impl
  return {}


def misfit(impl, spec, m, w) -> str:
  """Mosaic's lane rule for the kernel's tiles at this layer's shape ('' when unknown, and
  interpreted)."""
  if spec.ahead:
    return "windows ahead (bidirectional) are not in this kernel yet"
  if spec.segmented:
    return "segment ids are not in this kernel yet"
  if impl.interpret or m is None or w is None:
    return ""
  return pallas_tpu.misfit(spec.attention.block, m, w, spec.pers_mem)

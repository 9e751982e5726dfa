"""`cpu` behind the door (span_lm/kernels/span/door.py): banded_cpu, the reference's maths laid
out for XLA:CPU. Its own key/value layout, `CpuKV`, may lie positions last."""
from typing import Any, NamedTuple

from span_lm.kernels.span import banded_cpu
from span_lm.kernels.span import impl_reference


class CpuKV(NamedTuple):
  """Keys and values, each (B, G, T, Dh), or (B, G, Dh, T) positions_last
  (banded_cpu.prefer_positions_last)."""
  k: Any
  v: Any
  positions_last: bool


def project_kv(impl, spec, cache_BxLxD, h_BxMxD, w_kv_Dx2Z, *, window: int, heads: int) -> CpuKV:
  del impl
  last = banded_cpu.prefer_positions_last(h_BxMxD.shape[1], window, spec.attention.chunk,
                                          h_BxMxD.dtype)
  return CpuKV(*banded_cpu.project_kv(cache_BxLxD, h_BxMxD, w_kv_Dx2Z, window, heads, last), last)


def split_kv(impl, spec, kv_BxTx2Z, *, window: int, heads: int) -> CpuKV:
  del impl
  last = banded_cpu.prefer_positions_last(kv_BxTx2Z.shape[1] - window, window, spec.attention.chunk,
                                          kv_BxTx2Z.dtype)
  return CpuKV(*banded_cpu.split_kv(kv_BxTx2Z, heads, last), last)


def attend(impl, spec, q_BxGxMxD, kv, key_pe_DxW, *, span_z=None, pers_k_GxDxN=None,
           pers_v_GxNxD=None, dropout=None, dropout_seed=None, key_pe_ahead_DxA=None,
           span_z_ahead=None, segments=None):
  """kv: a CpuKV, or the door's KV (rows)."""
  del impl, dropout_seed  # dropout draws its own mask
  return banded_cpu.banded_attention(
      q_BxGxMxD, kv.k, kv.v, key_pe_DxW, span_z=span_z, ramp=spec.ramp,
      pers_k_GxDxN=pers_k_GxDxN, pers_v_GxNxD=pers_v_GxNxD, chunk=spec.attention.chunk,
      dropout=dropout, positions_last=isinstance(kv, CpuKV) and kv.positions_last,
      key_pe_ahead_DxA=key_pe_ahead_DxA, span_z_ahead=span_z_ahead, segments=segments,
  )[0].astype(q_BxGxMxD.dtype)


cached_rows = impl_reference.cached_rows
schedule_cost = impl_reference.schedule_cost
compiler_options = impl_reference.compiler_options
misfit = impl_reference.misfit


def residual_bytes(impl, spec, batch: int, m: int, heads: int, w: int, train: bool) -> dict:
  del impl
  return impl_reference.grouped_kv_bytes(spec, banded_cpu.residual_bytes(
      spec.mode, spec.pers_mem, spec.dtype, batch, m, heads, w, spec.head_dim,
      spec.attention.chunk, train and spec.dropout > 0))

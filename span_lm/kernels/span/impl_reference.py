"""`reference` behind the door (span_lm/kernels/span/door.py): banded_reference's readable maths,
keys and values as rows (kernels.KV). The functions every implementation module offers, the
implementation (a kernels.Impl) first."""
from span_lm.kernels import KV
from span_lm.kernels.span import banded_reference


def project_kv(impl, spec, cache_BxLxD, h_BxMxD, w_kv_Dx2Z, *, window: int, heads: int) -> KV:
  del impl, spec
  return KV(*banded_reference.project_kv(cache_BxLxD, h_BxMxD, w_kv_Dx2Z, window, heads))


def split_kv(impl, spec, kv_BxTx2Z, *, window: int, heads: int) -> KV:
  del impl, spec, window
  return KV(*banded_reference.split_kv(kv_BxTx2Z, heads))


def attend(impl, spec, q_BxGxMxD, kv: KV, key_pe_DxW, *, key_pe_ahead_DxA=None, span_z=None,
           span_z_ahead=None, segments=None, pers_k_GxDxN=None, pers_v_GxNxD=None, dropout=None,
           dropout_seed=None):
  del impl, dropout_seed  # dropout draws its own mask
  return banded_reference.banded_attention(
      q_BxGxMxD, kv.k, kv.v, key_pe_DxW, key_pe_ahead_DxA=key_pe_ahead_DxA, span_z=span_z,
      span_z_ahead=span_z_ahead, segments=segments, ramp=spec.ramp,
      pers_k_GxDxN=pers_k_GxDxN, pers_v_GxNxD=pers_v_GxNxD, chunk=spec.attention.chunk,
      dropout=dropout)


def cached_rows(impl, w: int) -> int:
  del impl
  return w


def residual_bytes(impl, spec, batch: int, m: int, heads: int, w: int, train: bool) -> dict:
  del impl
  out = banded_reference.residual_bytes(spec.mode, spec.pers_mem, spec.dtype, batch, m, heads,
                                        w, spec.head_dim, spec.attention.chunk,
                                        train and spec.dropout > 0)
  return grouped_kv_bytes(spec, out)


def grouped_kv_bytes(spec, out: dict) -> dict:
  """A residual_bytes count for grouped heads: the keys and values saved are the spec's
  kv_heads heads', 1 / group of the query heads' (no implementation repeats them)."""
  if spec.group > 1:
    out = dict(out, keys_values=out["keys_values"] // spec.group)
  return out


def schedule_cost(impl, spec, batch: int, m: int, w: int, span) -> None:
  del impl, spec, batch, m, w, span  # XLA's own cost analysis covers it


def compiler_options(impl) -> dict:
  del impl
  return {}


def misfit(impl, spec, m, w) -> str:
  del impl, spec, m, w
  return ""

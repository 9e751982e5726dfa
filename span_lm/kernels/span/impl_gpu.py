"""`pallas` and `pallas_interpret` behind the door (span_lm/kernels/span/door.py): pallas_gpu's
fused Triton kernel, keys and values as rows (kernels.KV, projected as the reference's).
Imported only where one of them is chosen: it loads Pallas."""
import jax.numpy as jnp

from span_lm import kernels
from span_lm.kernels.span import impl_reference
from span_lm.kernels.span import cost
from span_lm.kernels.span import gpu_tiles
from span_lm.kernels.span import pallas_gpu
from span_lm.kernels import target

project_kv = impl_reference.project_kv
split_kv = impl_reference.split_kv
cached_rows = impl_reference.cached_rows


def _cc(impl):
  """The target's compute capability, whose table entry the kernel runs (interpreted: none)."""
  return None if impl.interpret else target.current().compute_capability


def tiles(impl, spec, dtype) -> tuple[int, int, int]:
  """The kernel's (tile, warps, stages): the config's own 'T,W,S' (or what 'tune' measured:
  train/steps.build writes it there), else pallas_gpu's table for the target."""
  explicit = kernels.parse_tiles(spec.attention.tiles)
  if explicit is not None:
    return explicit
  return gpu_tiles.tiles(_cc(impl), spec.head_dim, dtype, spec.attention.block,
                         two_sided=spec.ahead > 0)


def key_tile(impl, spec, dtype, tile: int) -> int:
  """The kernel's key tile for a query tile (gpu_tiles.TILES; interpreted: the tile)."""
  return gpu_tiles.key_tile(_cc(impl), spec.head_dim, dtype, tile, two_sided=spec.ahead > 0)


def attend(impl, spec, q_BxGxMxD, kv, key_pe_DxW, *, key_pe_ahead_DxA=None, span_z=None,
           span_z_ahead=None, segments=None, pers_k_GxDxN=None, pers_v_GxNxD=None, dropout=None,
           dropout_seed=None):
  b, g, m, _ = q_BxGxMxD.shape
  kernels.kv_group(g, kv.k.shape[1])  # grouped heads: the kernel's index maps share them
  rows = lambda x: None if x is None else jnp.broadcast_to(jnp.asarray(x, jnp.float32), (b, g, m))
  z = rows(span_z)
  z_ahead = rows(span_z_ahead) if z is not None else None  # a fixed span: none ahead either
  seed = None if dropout is None else dropout_seed()
  tile, warps, stages = tiles(impl, spec, q_BxGxMxD.dtype)
  return pallas_gpu.span_attention(
      q_BxGxMxD, kv.k, kv.v, key_pe_DxW, z, ramp=spec.ramp, block=tile,
      block_k=key_tile(impl, spec, q_BxGxMxD.dtype, tile), num_warps=warps, num_stages=stages,
      # float32 parameters go in as such: the kernel casts them, their gradients stay float32
      pers_k_HxDxN=pers_k_GxDxN, pers_v_HxNxD=pers_v_GxNxD,
      dropout_rate=spec.dropout if seed is not None else 0.0, dropout_seed=seed,
      interpret=impl.interpret, precision=spec.attention.precision,
      key_pe_ahead_DxA=key_pe_ahead_DxA if spec.ahead else None, z_ahead_BxHxM=z_ahead,
      q_segments_BxM=None if segments is None else segments.q,
      kv_segments_BxT=None if segments is None else segments.kv)


def residual_bytes(impl, spec, batch: int, m: int, heads: int, w: int, train: bool) -> dict:
  del train
  return impl_reference.grouped_kv_bytes(spec, cost.fused_residual_bytes(
      batch, m, heads, cached_rows(impl, w) + spec.ahead,
      gpu_tiles.padded_head_dim(spec.head_dim), jnp.dtype(spec.dtype).itemsize))


def schedule_cost(impl, spec, batch: int, m: int, w: int, span) -> dict:
  tile = tiles(impl, spec, spec.dtype)[0]
  return cost.schedule_cost(batch, spec.heads, m, w, spec.head_dim, spec.dtype, tile,
                                  span=span, ramp=spec.ramp, n_pers=spec.pers_mem,
                                  key_tile=key_tile(impl, spec, spec.dtype, tile),
                                  ahead=spec.ahead)


def compiler_options(impl) -> dict:
  return {} if impl.interpret else dict(kernels.GPU_COMPILER_OPTIONS)


def misfit(impl, spec, m, w) -> str:
  """'' : beyond the door's fused rule (whole tiles: kernels.fused_misfit), the kernel takes
  every spec: windows ahead of any size (padded to whole key tiles), segment ids, persistent
  memory, dropout."""
  del impl, spec, m, w
  return ""

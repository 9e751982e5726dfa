"""The fused GPU kernel's tiles (kernels/span/pallas_gpu.py): the table per target, from a
deviceless ptxas sweep (bench/kernel_sweep.py), and the head size the kernel runs with. Its own
module, so the door, the autotune and the benchmarks read the table without the kernel."""
import jax.numpy as jnp


def padded_head_dim(dh: int) -> int:
  """The head size the kernels run with: the next power of two >= 16 (Triton's tiles are powers
  of two), e.g. 128 for the large paper models' 96."""
  return max(16, 1 << (dh - 1).bit_length())


# Tiles per target: (compute capability major, padded head size, dtype) -> (query tile, key tile,
# warps, stages), from a deviceless ptxas sweep (bench/kernel_sweep.py; docs/kernels.md): 64-row
# query tiles with no spills in bf16 on Hopper and Ampere (A100's mma.sync keeps its accumulators
# in registers: 32-key tiles there; at head size 128 64-key tiles spilled in bwd_q with
# persistent memory), the fewest spills in float32. Hopper bf16 at head size 128 takes 32-key
# tiles too: at 64 x 64 bwd_kv sat at 255 registers and spilled 8+8 B in enwik8_large's step
# (B=4, H=8, M=512, W=8192, dropout 0.4; 2-4 stages alike; not at the PTX test's B=1, H=2):
# 64 x 32 compiles at most 203 registers, no spills, wgmma in fwd and bwd_q (bwd_kv's 32-row
# dk/dv products run as mma.sync). Hopper bf16 at head size 64 likewise: at 64 x 64 bwd_q sat at
# 255 registers and spilled 4+4 B at enwik8_pers' shapes (B=4, H=8, M=512, W=8192, 2,048
# persistent vectors, dropout 0.4); 64 x 32 (the two-sided kernels' launch) at most 219, no
# spills at every paper config's shape tried. Untimed on a device: `attention.tiles=tune`
# measures the candidates on the GPU at hand (kernels/span/autotune.py).
TILES = {
    (9, 64, "bfloat16"): (64, 32, 4, 3), (9, 128, "bfloat16"): (64, 32, 8, 3),
    (9, 64, "float32"): (64, 32, 4, 2), (9, 128, "float32"): (64, 16, 8, 2),
    (8, 64, "bfloat16"): (64, 32, 4, 2), (8, 128, "bfloat16"): (64, 32, 8, 2),
    (8, 64, "float32"): (32, 32, 4, 2), (8, 128, "float32"): (32, 16, 8, 2),
}
# Two-sided kernels (windows ahead: the two-sided visit test, the mask's x = |dist - 1|, spans
# ahead learned apart) hold more per tile: at the table above bwd_q spilled in bf16 (A100, head
# size 128: 52 B with one span, 204 B with spans apart; H100 with spans apart: 140-200 B). From a
# deviceless sweep of both (segment ids, persistent memory, dropout; docs/kernels.md): no bf16
# spills, the fewest in float32 while Hopper keeps wgmma (64-row tiles).
TILES_TWO_SIDED = {
    (9, 64, "bfloat16"): (64, 32, 4, 3), (9, 128, "bfloat16"): (64, 32, 8, 3),
    (9, 64, "float32"): (64, 16, 4, 2), (9, 128, "float32"): (64, 16, 8, 2),
    (8, 64, "bfloat16"): (64, 32, 4, 2), (8, 128, "bfloat16"): (32, 32, 8, 2),
    (8, 64, "float32"): (32, 32, 4, 2), (8, 128, "float32"): (16, 16, 4, 2),
}
DEFAULT_TILES = (64, 4, 2)  # elsewhere (interpret mode, unknown targets): the attn_block itself


def _entry(compute_capability, head_dim, dtype, two_sided=False):
  dp = padded_head_dim(head_dim)
  key = (None if compute_capability is None else int(compute_capability), min(dp, 128),
         jnp.dtype(dtype).name)
  return (TILES_TWO_SIDED if two_sided else TILES).get(key)


def tiles(compute_capability: float | None, head_dim: int, dtype, block: int,
          two_sided: bool = False):
  """(tile, num_warps, num_stages) for a target (None: not a GPU) and an attn_block; two_sided:
  the kernels with windows ahead (TILES_TWO_SIDED)."""
  entry = _entry(compute_capability, head_dim, dtype, two_sided)
  tile, warps, stages = (entry[0], *entry[2:]) if entry else (block, *DEFAULT_TILES[1:])
  return min(tile, block), warps, stages


def key_tile(compute_capability: float | None, head_dim: int, dtype, tile: int,
             two_sided: bool = False) -> int:
  """The key tile that goes with a query tile on a target: the table's, at most the tile."""
  entry = _entry(compute_capability, head_dim, dtype, two_sided)
  return min(entry[1], tile) if entry else tile

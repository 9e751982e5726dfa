"""The fused TPU kernel's tiles (kernels/span/pallas_tpu.py): the query and key tiles for a
layer, Mosaic's lane rule for them, the laid-out window, the head size the kernel runs with and
its scoped-VMEM limit. Its own module, beside the kernel, so the door reads them without it."""
import jax.numpy as jnp

LANES = 128


def padded_head_dim(dh: int) -> int:
  """The head size the kernels run with: dh itself when a multiple of 32 (32, 64, 96, 128 compile
  unpadded for v5e), else the next multiple of 128 lanes."""
  return dh if dh % 32 == 0 else -(-dh // LANES) * LANES


def layout_window(w: int) -> int:
  """The cached positions the kernel reads for a window of w: w rounded up to 128 lanes (keys
  lie positions last; the extra, oldest ones are never visited)."""
  return -(-w // LANES) * LANES


def tiles(attn_block: int, n_rows: int, w: int, n_pers: int = 0) -> tuple[int, int]:
  """(query tile bq, key tile bk) for a block of n_rows queries, w cached positions (the layout's:
  `layout_window`) and n_pers persistent vectors: the widest key tile of 512, 256 that divides
  w, n_rows and n_pers and is at most a quarter of w (learned spans skip key blocks: a narrow window
  keeps them fine), else 128 where it divides them, else attn_block; then half as many query
  rows, at least 128, where n_rows allows (K/V are re-read once per query block; the position term's
  matmul spans bq + bk distances per bk keys, so bq = bk / 2 keeps it at 1.5x the content
  matmul), else bq = bk. Each compiles for v5e, v5p and v6e (tests/kernels/test_pallas_tpu.py);
  docs/kernels.md has the cost model."""
  fits = lambda tile: tile >= attn_block and not (w % tile or n_rows % tile or n_pers % tile)
  bk = next((tile for tile in (512, 256) if fits(tile) and 4 * tile <= w), None)
  bk = bk or (LANES if fits(LANES) else attn_block)
  half = max(LANES, bk // 2)
  bq = half if n_rows % half == 0 and bk % LANES == 0 else bk
  return bq, bk


def misfit(attn_block: int, n_rows: int, w: int, n_pers: int = 0) -> str:
  """'' when `tiles` gives Mosaic-legal tiles for this layer (window w), else why not (a TPU then
  runs the reference): keys lie positions last, so the key tile is a multiple of 128 lanes."""
  bq, bk = tiles(attn_block, n_rows, layout_window(w), n_pers)
  if bk % LANES or (bq + bk) % LANES:
    return (f"TPU tiles {bq} x {bk}: the key tile must be a multiple of 128 lanes (block {n_rows}, "
            f"{n_pers} persistent vectors, attn_block {attn_block}: multiples of 128 fit)")
  return ""


def vmem_bytes(w: int, dp: int, bq: int, bk: int, dtype, pe_dtype=jnp.float32, n_pers: int = 0,
               pers_dtype=jnp.float32, row_stats: int = 0, key_ids: bool = False) -> int:
  """A scoped-VMEM limit for the kernels at these shapes (w: the key_pe rows, L + A): the
  resident key_pe and (twice, as an output block) its float32 gradient, the persistent vectors
  (double-buffered) and their float32 gradients, the double-buffered tiles (row_stats more
  lane-replicated (bq, 128) row blocks: spans ahead and their gradient, segment ids; key_ids:
  the key tile's (1, bk) ids, 8 sublanes in VMEM), the tile temporaries; with half again for
  Mosaic's own, and at least 32 MiB."""
  rows = w + 2 * (bq + bk)
  act = jnp.dtype(dtype).itemsize
  resident = rows * dp * (jnp.dtype(pe_dtype).itemsize + 2 * 4)
  resident += 2 * 2 * n_pers * dp * (jnp.dtype(pers_dtype).itemsize + 4)
  tiles = 2 * (4 * bq * dp * act + 4 * bk * dp * act + 6 * bq * LANES * 4)  # K/V: two parts
  tiles += 2 * (row_stats * bq * LANES * 4 + key_ids * 8 * bk * 4)
  temps = 12 * bq * (bq + bk) * 4 + 4 * (bq + bk) * dp * 4
  return int(max(32 << 20, 1.5 * (resident + tiles + temps) + (4 << 20)))

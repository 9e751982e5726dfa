"""Cost models of the fused span kernels, apart from the kernels: the GPU kernel's tile schedule
(FLOPs and HBM bytes per kernel, for the compile mode's roofline) and what either fused kernel
saves for the backward pass (model/costs.py asks through the door)."""
import math

import jax.numpy as jnp

from span_lm.kernels.span.gpu_tiles import padded_head_dim


def schedule_cost(b: int, h: int, n_rows: int, w: int, head_dim: int, dtype, tile: int,
                  span: float | None = None, ramp: int = 32, n_pers: int = 0,
                  key_tile: int | None = None, ahead: int = 0) -> dict:
  """FLOPs and HBM bytes of one call's kernels (B=b, H=h, a block of n_rows queries, window w behind
  and `ahead` in front), every row at `span` on both sides (None: a fixed span, every distance of
  both windows visited), as {kernel: {"flops", "bytes", "bytes_min"}}: the three Triton kernels'
  tile schedules, and "position", the XLA matmuls around them (G = q [pe | pe_ahead] forward and
  again backward, dq += dG pe^T, d pe = q^T dG over the whole band: their cost does not fall with
  the spans). "bytes" counts every block a program loads or stores (keys, values and position
  tiles once per query block that visits them), so re-reads that L2 catches count in full: an
  upper bound; "bytes_min" each input read and each output written once: the lower bound.
  Segment ids are not counted (one segment: no tile skipped for them). The compile mode's
  per-kernel roofline (tools/compile.py) reads it; cost_analysis has none for a Triton call."""
  dp, isz = padded_head_dim(head_dim), jnp.dtype(dtype).itemsize
  bq, bk = tile, key_tile or tile
  a_rows = -(-ahead // bk) * bk  # the rows ahead in whole key tiles
  band = w + a_rows  # G's row: the band's columns (and one zero column)
  win = w if span is None else max(1, min(w, int(math.floor(span)) + ramp + 1))
  wa = ahead if span is None else max(0, min(ahead, int(math.floor(span)) + ramp))
  tiles = 0  # visited (query block, key block) pairs: the kernels' range per query block
  for i0 in range(0, n_rows, bq):
    lo, hi = (w + i0 - win) // bk, (w + i0 + bq - 2 + wa) // bk + 1
    tiles += hi - lo
  tiles *= b * h
  progs_q, progs_k = b * h * (n_rows // bq), b * h * ((w + n_rows + a_rows) // bk)
  qk = 2 * bq * bk * dp
  rows, keys, s_pos_tile = bq * dp * isz, bk * dp * isz, bq * bk * isz
  pers_mm, pers_io = 2 * bq * n_pers * dp, 2 * n_pers * dp * isz
  keys_read = ((w + n_rows - 2 + wa) // bk + 1 - (w - win) // bk) * bk  # the spans' keys, in tiles
  q_all, kv_all = b * h * n_rows * dp * isz, b * h * keys_read * dp * isz
  s_pos_all = b * h * n_rows * (band + 1) * isz
  s_pos_read, stat = b * h * n_rows * keys_read * isz, b * h * n_rows * 4
  minimum = {"fwd": 2 * q_all + 2 * kv_all + s_pos_read + 3 * stat + pers_io * h,
             "bwd_q": 2 * q_all + q_all * 4 // isz + 2 * kv_all + 2 * s_pos_read + 4 * stat
                      + pers_io * h * 3,
             "bwd_kv": 2 * q_all + 4 * kv_all + s_pos_read + 4 * stat,
             "position": 4 * q_all + 3 * s_pos_all + (band + 1) * dp * (isz + 4)}
  cost = {
      "fwd": {"flops": tiles * 2 * qk + progs_q * 2 * pers_mm,
              "bytes": tiles * (2 * keys + s_pos_tile)
                       + progs_q * (2 * rows + 3 * bq * 4 + pers_io)},
      "bwd_q": {"flops": tiles * 3 * qk + progs_q * 5 * pers_mm,
                "bytes": tiles * (2 * keys + 2 * s_pos_tile)
                         + progs_q * (2 * rows + bq * dp * 4 + 4 * bq * 4 + pers_io
                                      + 4 * n_pers * dp * 4)},
      "bwd_kv": {"flops": tiles * 4 * qk,
                 "bytes": tiles * (2 * rows + 4 * bq * 4 + s_pos_tile) + progs_k * 4 * keys},
      "position": {"flops": 4 * 2 * b * h * n_rows * (band + 1) * dp,
                   "bytes": 4 * q_all + 4 * s_pos_all + (band + 1) * dp * (isz + 4)},
  }
  return {k: dict(v, bytes_min=minimum[k]) for k, v in cost.items()}


def fused_residual_bytes(batch: int, m: int, heads: int, rows: int, dp: int,
                         itemsize: int) -> dict:
  """What either fused kernel saves for the backward pass: its inputs (keys and values of `rows`
  cached positions and the block, head size padded to dp), its output and two float32 row
  statistics."""
  return {"keys_values": 2 * batch * heads * (rows + m) * dp * itemsize,
          "score_bands": 2 * batch * heads * m * 4, "weights": batch * heads * m * dp * itemsize}

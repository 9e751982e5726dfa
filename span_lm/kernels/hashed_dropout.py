"""Attention dropout's keep mask as a hash of (seed, head, row, key), shared by the fused kernels.

A fused kernel never stores the attention weights, so its backward pass must regenerate the
forward's keep mask: each weight's keep bit is a pure function of its coordinates and a seed. The
GPU (Triton) and TPU (Mosaic) kernels call this same function, so one seed gives one mask on
either chip, and the tests hand it to `banded_reference` as its dropout to compare exactly.

Arithmetic is int32 with logical shifts and wrapping products, which both compilers lower (Mosaic
has few unsigned vector ops); the bits are those of the uint32 hash.
"""
import numpy as np
from jax import lax
import jax.numpy as jnp


def _i32(x):
  x = jnp.asarray(x)
  if x.dtype == jnp.uint32:
    return lax.bitcast_convert_type(x, jnp.int32)
  return x.astype(jnp.int32)


def _const(c: int):
  return jnp.int32(np.uint32(c).view(np.int32))


def _fmix32(x):
  """murmur3's finaliser: a cheap 32-bit bijection with good avalanche."""
  x = x ^ lax.shift_right_logical(x, jnp.int32(16))
  x = x * _const(0x85EBCA6B)
  x = x ^ lax.shift_right_logical(x, jnp.int32(13))
  x = x * _const(0xC2B2AE35)
  return x ^ lax.shift_right_logical(x, jnp.int32(16))


def dropout_scale(seed, bh, row, key, *, n_rows: int, n_keys: int, rate: float):
  """keep / (1 - rate) for attention weight (b * H + h, row, key), float32.

  seed: a 32-bit seed (uint32 or int32). bh, row and key broadcast: the head's index b * H + h in
  its call, the query row in the block (n_rows of them), the key index (window and block keys
  first, then persistent vectors: n_keys in all)."""
  counter = (_i32(bh) * jnp.int32(n_rows) + _i32(row)) * jnp.int32(n_keys) + _i32(key)
  bits = _fmix32(_fmix32(counter) ^ _i32(seed))
  threshold = jnp.int32(round((1.0 - rate) * (1 << 24)))
  keep = lax.shift_right_logical(bits, jnp.int32(8)) < threshold
  return jnp.where(keep, 1.0 / (1.0 - rate), 0.0).astype(jnp.float32)


def shard_seed(seed, axes):
  """The seed a kernel uses inside shard_map over mesh `axes`: each shard's own, so shards that
  hold different streams draw different masks (their (b * H + h) indices restart at 0)."""
  shard = lax.convert_element_type(lax.axis_index(axes), jnp.uint32)
  return seed ^ (shard * jnp.uint32(0x9E3779B9))

"""Content fingerprints of a state's leaves: what a checkpoint saves beside its arrays, and what
every read recomputes before anything uses them (train/checkpoint.py).

Orbax stores arrays through TensorStore's OCDBT driver with zarr chunks compressed by zstd; OCDBT
checksums its manifest and b-tree nodes (CRC-32C), never the array values, so a flipped bit in a
chunk can decompress into a different value and restore without an error. A fingerprint per leaf,
computed from the array's global contents, closes that gap.

The algorithm (ALGORITHM = 'wsum32x2-fmix32'). The leaf is read as a sequence of 32-bit words
w_i, i the global index of the word in C order over the global shape (a 4-byte element is one
word; 1- and 2-byte elements (bool, int8, float8, bfloat16, float16) are widened to one word each,
zero-extended from their bits; an 8-byte element is two words, its low half first). With
fmix32 MurmurHash3's 32-bit finalizer (a bijection of uint32) and k_i = fmix32(i ^ 0x9e3779b9),
all arithmetic modulo 2^32:

    h1 = sum_i w_i * (k_i | 1)         (a sum of the bits times an odd function of the index)
    h2 = sum_i fmix32(w_i ^ k_i)       (a second, nonlinear sum)

and the fingerprint is the 16 hex digits of h1 then h2.

Why this construction:
- Any single changed word changes both sums, with certainty, not with high probability: k_i | 1
  is odd, hence invertible modulo 2^32, so (w' - w)(k_i | 1) is never 0 for w' != w; and
  w -> fmix32(w ^ k_i) is a bijection. A flipped bit, a changed element, a NaN for a number: all
  are single changes of at least one word.
- Several changed words (a chunk that decompressed to garbage, a chunk written at another chunk's
  place, two elements swapped) cancel in h1 only if a linear combination with pseudo-random odd
  weights does, and in h2 only if sums of a nonlinear mixing do; the index-dependent k_i makes
  moved data count as changed. Not a cryptographic hash: it guards against damage, not against
  someone forging a checkpoint.
- Both sums are integer sums modulo 2^32, exact, associative and commutative, so XLA may reduce
  the shards of a sharded array in any order and all-reduce the partial sums: the value is the
  same for every mesh, sharding and number of processes, and equals `fingerprint_numpy` of the
  gathered array. A byte-stream hash (CRC-32C, SHA-256) would need the array gathered in order
  on one host; this is one fused pass over each device's shards (one read of the state) and one
  small device-to-host transfer (8 bytes per leaf).

`fingerprints(tree)` computes every leaf's on the devices (one small jitted program per top-level
entry of the state, one transfer of the results); `fingerprint_numpy` is the same function on the
host (the tests' reference).
"""
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from span_lm.train.sharding import path_str

ALGORITHM = "wsum32x2-fmix32"
_GOLDEN = 0x9E3779B9


def _fmix32(x):
  """MurmurHash3's finalizer: a bijection of uint32 (jnp or numpy uint32 arrays)."""
  x = x ^ (x >> np.uint32(16))
  x = x * np.uint32(0x85EBCA6B)
  x = x ^ (x >> np.uint32(13))
  x = x * np.uint32(0xC2B2AE35)
  return x ^ (x >> np.uint32(16))


def _words(x: jax.Array) -> jax.Array:
  """The leaf's 32-bit words, shape x.shape (4-byte or smaller elements) or x.shape + (2,)
  (8-byte elements, low word first): elementwise, so the layout stays x's sharding."""
  dtype = np.dtype(x.dtype)
  if dtype == np.bool_:
    return x.astype(jnp.uint32)
  if dtype.kind not in "biuf" and not jax.dtypes.issubdtype(dtype, np.floating):
    raise TypeError(f"no fingerprint for dtype {dtype.name}")
  size = dtype.itemsize
  if size == 4:
    return jax.lax.bitcast_convert_type(x, jnp.uint32)
  if size in (1, 2):
    return jax.lax.bitcast_convert_type(x, jnp.uint8 if size == 1 else jnp.uint16).astype(
        jnp.uint32)
  if size == 8:  # XLA splits a wider element along a new minor dimension, low word first
    return jax.lax.bitcast_convert_type(x, jnp.uint32)
  raise TypeError(f"no fingerprint for dtype {dtype.name} ({size}-byte elements)")


def _global_index(shape) -> jax.Array:
  """Each element's C-order index in `shape`, uint32 (wrapping past 2^32 words: the sums stay
  well defined, and a single change is still detected)."""
  idx = jnp.zeros(shape, jnp.uint32)
  stride = 1
  for d in reversed(range(len(shape))):
    idx = idx + jax.lax.broadcasted_iota(jnp.uint32, shape, d) * np.uint32(stride % 2**32)
    stride *= shape[d]
  return idx


def _add_pairs(a, b):
  return a[0] + b[0], a[1] + b[1]


def _leaf_sums(x: jax.Array) -> jax.Array:
  """(h1, h2) of one leaf, uint32[2]: one variadic reduction, so XLA fuses both sums into one
  loop that reads the leaf once (two jnp.sum calls compile to two passes over it)."""
  w = _words(x)
  k = _fmix32(_global_index(w.shape) ^ np.uint32(_GOLDEN))
  zero = np.uint32(0)
  h1, h2 = jax.lax.reduce((w * (k | np.uint32(1)), _fmix32(w ^ k)), (zero, zero), _add_pairs,
                          tuple(range(w.ndim)))
  return jnp.stack([h1, h2])


@jax.jit
def _all_sums(leaves: list) -> jax.Array:
  if not leaves:
    return jnp.zeros((0, 2), jnp.uint32)
  return jnp.stack([_leaf_sums(x) for x in leaves])


def _hex(pair) -> str:
  return f"{int(pair[0]):08x}{int(pair[1]):08x}"


def _to_host(x: jax.Array) -> np.ndarray:
  """A small result to numpy, in every process (with several processes an array is not fully
  addressable; a replicated one is whole in each process)."""
  if x.is_fully_addressable:
    return np.asarray(jax.device_get(x))
  if x.is_fully_replicated:
    return np.asarray(x.addressable_data(0))
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def leaf_paths(tree: Any) -> list:
  """The leaves' names as fingerprints and error messages use them ('params/layers_3/...')."""
  return [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def fingerprints(tree: Any) -> dict:
  """{leaf path (train.sharding.path_str): 16-hex-digit fingerprint} of every array leaf of
  `tree`, computed on the devices that hold it, the same value for any mesh, sharding or number
  of processes. ALGORITHM names the construction (the module's docstring). With several
  processes every process calls it (a collective) and gets the same answer.

  One jitted program per top-level entry of the tree (a state's params, opt_state, caches, ...;
  and per set of devices, should leaves live on several), all dispatched before one
  device-to-host read of 8 bytes per leaf. Per entry, so that a new span plan, which changes the
  caches' shapes, compiles the caches' small program again, not the parameters'.
  """
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  paths = [path_str(p) for p, _ in flat]
  leaves = [x if isinstance(x, jax.Array) else jnp.asarray(x) for _, x in flat]
  groups = {}  # (top-level entry, device set) -> leaf indices
  for i, (p, x) in enumerate(zip(paths, leaves)):
    groups.setdefault((p.split("/", 1)[0], frozenset(x.sharding.device_set)), []).append(i)
  pending = [(idx, _all_sums([leaves[i] for i in idx])) for idx in groups.values()]
  out = [None] * len(leaves)
  for idx, sums in pending:  # the transfers of every group, after every program was dispatched
    sums = _to_host(sums)
    if sums.shape != (len(idx), 2):
      raise RuntimeError(f"internal: fingerprint sums of shape {sums.shape} for {len(idx)} leaves")
    for i, s in zip(idx, sums):
      out[i] = _hex(s)
  return dict(zip(paths, out))


def fingerprint_numpy(x) -> str:
  """The fingerprint of one array computed on the host with numpy (the reference the device
  computation is tested against; reads the whole array)."""
  a = np.ascontiguousarray(np.asarray(x))
  size = a.dtype.itemsize
  if a.dtype == np.bool_:
    w = a.astype(np.uint32).reshape(-1)
  elif size == 4:
    w = a.view(np.uint32).reshape(-1)
  elif size in (1, 2):
    w = a.view(np.uint8 if size == 1 else np.uint16).astype(np.uint32).reshape(-1)
  elif size == 8:
    w = a.view("<u4").reshape(-1) if a.dtype.byteorder in "<=|" else a.astype(
        a.dtype.newbyteorder("<")).view("<u4").reshape(-1)
  else:
    raise TypeError(f"no fingerprint for dtype {a.dtype.name}")
  with np.errstate(over="ignore"):
    i = np.arange(w.size, dtype=np.uint64).astype(np.uint32)
    k = _fmix32(i ^ np.uint32(_GOLDEN))
    h1 = np.sum(w * (k | np.uint32(1)), dtype=np.uint32)
    h2 = np.sum(_fmix32(w ^ k), dtype=np.uint32)
  return _hex((h1, h2))


def mismatches(stored: dict, computed: dict) -> list:
  """Leaf paths of `computed` whose stored fingerprint differs or is missing, in order."""
  return [p for p, fp in computed.items() if stored.get(p) != fp]

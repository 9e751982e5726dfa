"""On-device autotune of the fused GPU kernel's tiles (`--config.model.attention.tiles=tune`).

gpu_tiles.TILES comes from a deviceless ptxas sweep (bench/kernel_sweep.py): it knows registers,
spills and shared memory, not time. On a GPU, `tune` times the forward and backward of one layer's
attention at the run's own shapes (per-device batch, heads, block, the widest window, persistent
memory, dropout) for each candidate that compiles, keeps the fastest, and caches the answer per
device kind, jax version and shape, so the next run starts at once. train/steps.build calls
`resolve` on the model's attention spec before anything compiles and writes the choice into the
model config as 'T,W,S'. Pallas loads only when the kernel is timed (every run calls `resolve`).
"""
import itertools
import json
import logging
import os
import statistics
import time
from typing import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from span_lm import kernels
from span_lm.kernels import target
from span_lm.kernels.span import gpu_tiles

log = logging.getLogger("span_lm")

# (tile, warps, stages): the sweep's axes (docs/kernels.md), every one a legal Triton launch.
CANDIDATES = tuple(itertools.product((32, 64, 128), (4, 8), (2, 3)))


def cache_path() -> str:
  root = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
  return os.path.join(root, "span_lm", "gpu_tiles.json")


def cache_key(spec: kernels.Spec, device_kind: str, batch: int, m: int, w: int) -> str:
  """What the fastest tile depends on: the chip, the compiler, and the layer's shapes."""
  from span_lm.kernels.span import pallas_gpu  # pylint: disable=g-import-not-at-top
  return (f"{device_kind}|jax {jax.__version__}|kernel {pallas_gpu.VERSION}|{spec.dtype}|"
          f"precision {spec.attention.precision}|"
          f"B{batch} H{spec.heads} M{m} W{w} Dh{spec.head_dim} N{spec.pers_mem}|"
          f"dropout {spec.dropout > 0}|spans {spec.mode != 'fixed'}")


def _read(path: str) -> dict:
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError):  # none yet, or unreadable: measure again (and rewrite it)
    return {}


def _write(path: str, cache: dict) -> None:
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  tmp = f"{path}.{os.getpid()}.tmp"
  with open(tmp, "w") as f:
    json.dump(cache, f, indent=1, sort_keys=True)
  os.replace(tmp, path)  # whole or not at all: a concurrent reader never sees half a file


def _inputs(spec: kernels.Spec, batch: int, m: int, w: int):
  ks = jax.random.split(jax.random.PRNGKey(0), 6)
  dt, h, dh, n = jnp.dtype(spec.dtype), spec.heads, spec.head_dim, spec.pers_mem
  q = jax.random.normal(ks[0], (batch, h, m, dh), dt)
  k = jax.random.normal(ks[1], (batch, h, w + m, dh), dt)
  v = jax.random.normal(ks[2], (batch, h, w + m, dh), dt)
  pe = 0.1 * jax.random.normal(ks[3], (dh, w), jnp.float32)
  z = None if spec.mode == "fixed" else jnp.full((batch, h, m), float(w), jnp.float32)
  pk = 0.1 * jax.random.normal(ks[4], (h, dh, n), jnp.float32) if n else None
  pv = 0.1 * jax.random.normal(ks[5], (h, n, dh), jnp.float32) if n else None
  return q, k, v, pe, z, pk, pv


def _compile(f, args, interpret: bool):
  lowered = f.lower(*args)
  if interpret:
    return lowered.compile()
  try:
    return lowered.compile(compiler_options=dict(kernels.GPU_COMPILER_OPTIONS))
  except Exception as e:  # pylint: disable=broad-except
    if "xla_gpu_ptx_compiler_extra_flags" not in str(e):
      raise
    return lowered.compile()  # a jaxlib without the option: as the step compiles (steps.py)


def measure(spec: kernels.Spec, *, batch: int, m: int, w: int, candidates: Iterable = CANDIDATES,
            reps: int = 5, interpret: bool = False,
            echo: Callable[[str], None] = log.info) -> dict[tuple[int, int, int], float]:
  """{(tile, warps, stages): median seconds of forward + backward} for the candidates whose tile
  divides the block, the window and the persistent vectors, and which compile here."""
  from span_lm.kernels.span import pallas_gpu  # pylint: disable=g-import-not-at-top
  args = _inputs(spec, batch, m, w)
  ct = jax.random.normal(jax.random.PRNGKey(1), args[0].shape, args[0].dtype)
  times = {}
  for tile, warps, stages in candidates:
    if spec.attention.block % tile or w % tile or spec.pers_mem % tile:  # as the door's rule
      continue

    cc = None if interpret else target.current().compute_capability
    bk = gpu_tiles.key_tile(cc, spec.head_dim, spec.dtype, tile)

    def loss(q, k, v, pe, z, pk, pv, tile=tile, bk=bk, warps=warps, stages=stages):
      out = pallas_gpu.span_attention(
          q, k, v, pe, z, ramp=spec.ramp, block=tile, block_k=bk, num_warps=warps,
          num_stages=stages,
          pers_k_HxDxN=pk, pers_v_HxNxD=pv, dropout_rate=spec.dropout,
          dropout_seed=jnp.uint32(7) if spec.dropout else None, interpret=interpret,
          precision=spec.attention.precision)
      return jnp.sum(out.astype(jnp.float32) * ct.astype(jnp.float32))

    grads = tuple(i for i, a in enumerate(args) if a is not None)
    f = jax.jit(jax.value_and_grad(loss, argnums=grads))
    try:
      step = _compile(f, args, interpret)
      jax.block_until_ready(step(*args))  # the first run's one-off costs stay out of the timing
    except Exception as e:  # pylint: disable=broad-except  (shared memory, registers: next one)
      echo(f"attention.tiles=tune: {tile},{warps},{stages} does not run here: "
           f"{str(e).splitlines()[0][:160]}")
      continue
    runs = []
    for _ in range(reps):
      t0 = time.perf_counter()
      jax.block_until_ready(step(*args))
      runs.append(time.perf_counter() - t0)
    times[(tile, warps, stages)] = statistics.median(runs)
    echo(f"attention.tiles=tune: {tile},{warps},{stages}: "
         f"{1e3 * times[(tile, warps, stages)]:.3f} ms")
  return times


def tune(spec: kernels.Spec, *, batch: int, m: int, w: int, candidates: Iterable = CANDIDATES,
         reps: int = 5, path: str | None = None, interpret: bool = False,
         echo: Callable[[str], None] = log.info) -> str:
  """The fastest candidate as 'T,W,S', from the cache at `path` (default `cache_path()`) or
  measured now and added to it."""
  path = path or cache_path()
  key = cache_key(spec, jax.devices()[0].device_kind + (" interpret" if interpret else ""),
                  batch, m, w)
  cache = _read(path)
  cached = cache.get(key, {}).get("tiles")
  if cached is not None and kernels.parse_tiles(cached) is not None:
    echo(f"attention.tiles=tune: {cached} (cached in {path})")
    return cached
  if cached is not None:  # an entry the config no longer accepts: measure again
    echo(f"attention.tiles=tune: the cached {cached} is no longer allowed; measuring again")
  times = measure(spec, batch=batch, m=m, w=w, candidates=candidates, reps=reps,
                  interpret=interpret, echo=echo)
  if not times:
    raise ValueError(f"attention.tiles=tune: no candidate tile runs this layer (block {m}, window "
                     f"{w}, attention.block {spec.attention.block}); name one as 'T,W,S' or use "
                     "'table'")
  best = min(times, key=times.get)
  tiles = ",".join(map(str, best))
  cache = _read(path)  # another process may have added keys meanwhile
  cache[key] = {"tiles": tiles, "ms": {",".join(map(str, c)): 1e3 * t for c, t in times.items()}}
  _write(path, cache)
  echo(f"attention.tiles=tune: {tiles} is fastest of {len(times)} ({1e3 * times[best]:.3f} ms); "
       f"cached in {path}")
  return tiles


def resolve(spec: kernels.Spec, *, batch: int, m: int,
            echo: Callable[[str], None] = log.info) -> kernels.Spec:
  """The spec with attention.tiles='tune' replaced by the measured 'T,W,S' where the fused GPU
  kernel runs; elsewhere the spec as it is ('tune' then reads as 'table')."""
  if spec.attention.tiles != "tune":
    return spec
  impl = kernels.select(spec, m, spec.window)
  if impl.platform != "gpu":  # the compiled GPU kernel, timed on this GPU
    echo(f"attention.tiles=tune times the fused GPU kernel; this run's attention is {impl.name!r}: "
         "nothing to tune")
    return spec
  tiles = tune(spec, batch=batch, m=m, w=spec.window, echo=echo)
  if jax.process_count() > 1:  # every process must compile the same kernel: process 0's choice
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    chosen = multihost_utils.broadcast_one_to_all(np.asarray(tiles.split(","), np.int32))
    tiles = ",".join(str(int(x)) for x in chosen)
  return spec.replace(attention=spec.attention.replace(tiles=tiles))

"""The fused GPU kernel on a real GPU, one process (the first family of bench/gpu_run.py):

  1. correctness: values and every gradient (q, k, v, key_pe, spans, persistent keys/values) of
     `pallas_gpu.span_attention` against `banded_reference.banded_attention` (the `reference`
     impl's function) in float32 with exact dots, at small shapes, for every variant: fixed /
     adaptive / dynamic spans, learned spans far below the window, persistent memory, attention
     dropout (the plain path given the kernel's hashed keep mask), head dims 64 and 96, bf16 and
     float32; then the attention layer (SeqAttention, attn_impl=pallas) against the plain
     definition (span_lm/testing.py run under jax) with a learned plan whose windows are
     shorter than S (heads grouped by window);
  2. timings at configs/enwik8.py's layer shapes (B=8, H=8, M=512, W=8192, Dh=64, bf16): forward
     and forward+backward ms of the kernel (all spans at S; learned spans 3 to 0.7 W; the table's
     tiles and one other pipeline depth), the XLA path (`reference`), and cuDNN's flash attention
     (`jax.nn.dot_product_attention(implementation='cudnn')`) on plain attention with the same
     query and key counts (q 512, keys W+M = 8704, not causal).

  python -m bench.gpu_kernel_check --out /tmp/kcheck.json     # a GPU machine (~1-2 minutes)
  python -m bench.gpu_kernel_check --dry_run                  # CPU rehearsal: tiny shapes, the
      kernel interpreted, cuDNN replaced by implementation='xla' (marked "cudnn_standin")

Each row is printed as it completes ("ROW {json}" lines: bench/gpu_run.py appends them to its
row file), so a run cut short keeps what it measured. --deadline (epoch seconds) skips what
would start after it, each skip recorded as a row.
"""
import jax
import jax.numpy as jnp
import numpy as np

from bench import gpu_families
from bench import gpu_layer_check
from bench import harness
from span_lm.kernels.span import banded_reference
from span_lm.kernels.span import gpu_tiles
from span_lm.kernels import hashed_dropout
from span_lm.kernels.span import pallas_gpu

RAMP = 32
TOL = gpu_layer_check.TOL  # TF32 / bf16 against the float32 definition
NAMES = ("q", "k", "v", "pe", "z", "pk", "pv")
DROPOUT_SEED = 1234567



def _case(name: str) -> tuple:
  """(name, dtype, head dim, spans, persistent vectors, dropout rate) read from a case's name,
  'dtype/spans[+pers][+dropout]/dHEAD' (learned_short: learned spans far below the window)."""
  dtype, what, dh = name.split("/")
  spans, *extra = what.split("+")
  return (name, {"bf16": "bfloat16", "f32": "float32"}[dtype], int(dh[1:]),
          "short" if spans == "learned_short" else spans, int("pers" in extra),
          0.3 if "dropout" in extra else 0.0)


# Most telling first.
CASES = tuple(_case(n) for n in (
    "bf16/adaptive/d64", "bf16/dynamic/d64", "bf16/fixed/d64", "bf16/learned_short/d64",
    "bf16/adaptive+pers/d64", "bf16/dynamic+dropout/d64", "bf16/adaptive+pers+dropout/d96",
    "bf16/dynamic/d96", "f32/adaptive/d64", "f32/dynamic+pers/d64", "f32/fixed+dropout/d64",
    "f32/learned_short+pers/d96", "f32/dynamic+dropout/d96"))
# The CPU rehearsal's share (the interpreted kernel compiles for ~15 s a case): every dtype,
# head dim, span kind, persistent memory and dropout at least once. tests/kernels/ checks the
# kernel itself in interpret mode; the rehearsal checks this harness.
DRY_CASES = ("bf16/adaptive+pers+dropout/d96", "f32/fixed+dropout/d64", "f32/dynamic+pers/d64")
SMALL_HEAD_DIM = {64: 16, 96: 24}  # at --small: a power of two and not, as 64 and 96
# The attention layer with a learned plan (windows < S, heads grouped by window), via the model.
MODEL_CASES = (
    {"dtype": "bfloat16", "head_dim": 64, "span_mode": "adaptive", "pers_mem": False},
    {"dtype": "float32", "head_dim": 96, "span_mode": "adaptive", "pers_mem": True},
)


def inputs(b, h, m, w, dh, dtype, spans, n_pers, seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 7)
  rnd = lambda k, s: jax.random.normal(k, s, jnp.float32)
  q, k, v = rnd(ks[0], (b, h, m, dh)), rnd(ks[1], (b, h, w + m, dh)), rnd(ks[2], (b, h, w + m, dh))
  pe = rnd(ks[3], (dh, w))
  if spans == "fixed":
    z = None
  elif spans in ("adaptive", "learned"):  # one span per head: 3 tokens to 0.7 W
    z = jnp.broadcast_to(jnp.linspace(3.0, 0.7 * w, h)[None, :, None], (b, h, m))
  elif spans == "short":  # learned spans far below the window: most key blocks skipped
    z = jnp.broadcast_to(jnp.linspace(3.0, 0.25 * w, h)[None, :, None], (b, h, m))
  elif spans == "all_S":
    z = jnp.full((b, h, m), float(w))
  else:  # dynamic: a span per query row
    z = jax.random.uniform(ks[4], (b, h, m), minval=0.0, maxval=float(w))
  pk = pv = None
  if n_pers:
    pk, pv = rnd(ks[5], (h, dh, n_pers)), rnd(ks[6], (h, n_pers, dh))
  cast = lambda x: x.astype(dtype)
  if z is not None:  # strongly typed: every span kind shares one compile of the same shapes
    z = jnp.asarray(np.asarray(z, np.float32))
  return dict(q=cast(q), k=cast(k), v=cast(v), pe=pe, z=z, pk=pk, pv=pv)


def band_dropout(rate, b, h, m, w, n_pers):
  """The kernel's hashed keep mask on banded_reference's (B, H, n, C, W [+N]) weights: column s
  < W of row i is key i + s, column W + n is persistent key W + M + n (hashed_dropout's order)."""
  def drop(p):
    c, cols = p.shape[3], p.shape[4]
    rows = jnp.arange(m).reshape(1, 1, m // c, c, 1)
    bh = (jnp.arange(b)[:, None] * h + jnp.arange(h)[None, :]).reshape(b, h, 1, 1, 1)
    s = jnp.arange(cols).reshape(1, 1, 1, 1, cols)
    keys = jnp.where(s < w, rows + s, m + s)
    return p * hashed_dropout.dropout_scale(jnp.uint32(DROPOUT_SEED), bh, rows, keys, n_rows=m,
                                            n_keys=w + m + n_pers, rate=rate)
  return drop


def fused(block, warps, stages, interpret, rate=0.0):
  def attn(q, k, v, pe, z, pk, pv):
    return pallas_gpu.span_attention(
        q, k, v, pe, z, ramp=RAMP, pers_k_HxDxN=pk, pers_v_HxNxD=pv, block=block,
        num_warps=warps, num_stages=stages, interpret=interpret, dropout_rate=rate,
        dropout_seed=jnp.uint32(DROPOUT_SEED) if rate else None)
  return attn


def plain(dropout=None):
  def attn(q, k, v, pe, z, pk, pv):
    f32 = lambda a: None if a is None else a.astype(jnp.float32)
    with jax.default_matmul_precision("highest"):
      return banded_reference.banded_attention(f32(q), f32(k), f32(v), pe, span_z=z, ramp=RAMP,
                                               pers_k_GxDxN=pk, pers_v_GxNxD=pv, dropout=dropout)
  return attn


def values_and_grads(attn, x, g):
  """One jit: the output and the gradients of <out, g> for every input that is not None."""
  names = [n for n in NAMES if x[n] is not None]

  def f(*args):
    out, vjp = jax.vjp(lambda *a: attn(**{**{n: None for n in NAMES}, **dict(zip(names, a))}
                                       ).astype(jnp.float32), *args)
    return out, vjp(g)
  out, grads = jax.jit(f)(*[x[n] for n in names])
  return {"out": out, **dict(zip(names, grads))}


def correctness(a, env, deadline):
  b, h, m, w, block, n_pers = (1, 2, 32, 64, 16, 16) if a.small else (2, 4, 256, 1024, 64, 64)
  runs = [(c, None) for c in CASES if not (a.dry_run and c[0] not in DRY_CASES)]
  if not a.interpret:  # the first two cases at the other pipeline depth too (timed below): is
    runs[2:2] = [(c, "other") for c in CASES[:2]]  # it safe to ship if it is faster?
  for (name, dtype, dh, spans, pers, rate), variant in runs:
    if a.small:
      dh = SMALL_HEAD_DIM[dh]
    tile, warps, stages = gpu_tiles.tiles(env["cc"], dh, jnp.dtype(dtype), block)
    if variant == "other":
      stages = 1 if stages > 1 else 2
    row = {"kind": "check", "case": name, "dtype": dtype, "head_dim": dh, "spans": spans,
           "pers": n_pers if pers else 0, "dropout": rate, "shape": [b, h, m, w],
           "block": block, "tiles": [tile, warps, stages], "tol": TOL[dtype],
           "interpret": a.interpret, "shipped_tiles": variant is None}

    def check(dtype=dtype, dh=dh, spans=spans, pers=pers, rate=rate, tiles=(tile, warps, stages)):
      x = inputs(b, h, m, w, dh, jnp.dtype(dtype), spans, n_pers if pers else 0)
      g = jax.random.normal(jax.random.PRNGKey(9), (b, h, m, dh), jnp.float32)
      drop = band_dropout(rate, b, h, m, w, n_pers if pers else 0) if rate else None
      want = values_and_grads(plain(drop), x, g)
      got = values_and_grads(fused(*tiles, a.interpret, rate), x, g)
      return harness.check_fields(got, want, TOL[dtype])
    harness.CHILD.measure(row, deadline, check)


def model_correctness(a, env, deadline):
  """SeqAttention (attention.impl pallas; pallas_interpret in the rehearsal) against the plain
  definition (bench/gpu_layer_check.py): a learned plan with one short head, so windows are
  shorter than S and the heads run as groups of different windows (cache trimmed, key_pe
  sliced)."""
  del env
  use = gpu_families.gpu_kernel(a.interpret)
  shape = (2, 2, 32, 64, 16) if a.small else (4, 2, 128, 512, 64)  # heads, batch, block, S, tile
  for case in MODEL_CASES[-1:] if a.dry_run else MODEL_CASES:  # the rehearsal: the one with more
    if a.small:
      case = dict(case, head_dim=SMALL_HEAD_DIM[case["head_dim"]])
    row = dict(case, kind="model_check", impl=use, tol=TOL[case["dtype"]])

    def check(case=case):
      setup = gpu_layer_check.case_setup(jax, jnp, np, case, [use], *shape)
      want = gpu_layer_check.values_and_grads(jax, setup, gpu_layer_check.plain_fn(setup))
      r = gpu_layer_check.compare(jax, np, setup, use, want, case["dtype"])
      r["status"] = {"pass": "pass", "fail": "FAIL"}[r["status"]]
      if r["zero_reference"]:
        r["status"] = "FAIL"
      return r
    harness.CHILD.measure(row, deadline, check)


def timings(a, env, deadline):
  """Forward and forward+backward ms at enwik8's layer shapes (one GPU's share of the batch)."""
  tb, th, tm, tw, dh = (1, 2, 32, 64, 16) if a.small else (8, 8, 512, 8192, 64)
  block = 16 if a.small else 64  # configs/enwik8.py's attention.block (model.config's default)
  reps = 2 if a.small else 10
  tile, warps, stages = gpu_tiles.tiles(env["cc"], dh, jnp.bfloat16, block)
  alt = 1 if stages > 1 else 2
  g = jax.random.normal(jax.random.PRNGKey(9), (tb, th, tm, dh), jnp.float32)
  xs = {spans: inputs(tb, th, tm, tw, dh, jnp.bfloat16, spans, 0) for spans in ("all_S", "learned")}
  ref = lambda q, k, v, pe, z, pk, pv: banded_reference.banded_attention(q, k, v, pe, span_z=z,
                                                                         ramp=RAMP)
  jobs = [("pallas", "all_S", fused(tile, warps, stages, a.interpret), [tile, warps, stages]),
          ("pallas", "learned", fused(tile, warps, stages, a.interpret), [tile, warps, stages]),
          ("reference", "all_S", ref, None),
          ("cudnn_standin" if a.cudnn_standin else "cudnn", "dense", None, None),
          ("pallas", "learned", fused(tile, warps, alt, a.interpret), [tile, warps, alt]),
          ("pallas", "all_S", fused(tile, warps, alt, a.interpret), [tile, warps, alt])]
  if a.dry_run:  # interpret mode has no pipeline: the other depth would time the same thing
    jobs = jobs[:4]
  compiled = {}  # (path, tiles) -> (fwd, fwd+bwd): spans are values, so one compile serves both
  for path, spans, attn, tiles in jobs:
    row = {"kind": "time", "path": path, "spans": spans, "dtype": "bfloat16",
           "shape": {"B": tb, "H": th, "M": tm, "W": tw, "Dh": dh}, "tiles": tiles,
           "interpret": a.interpret if path == "pallas" else False,
           "shipped_tiles": tiles == [tile, warps, stages] if tiles else None}
    if path == "reference":
      row["note"] = "the XLA path computes the whole band whatever the spans: one row for both"
    if path.startswith("cudnn"):
      row["note"] = (f"plain attention, {tm} queries x {tw + tm} keys, not causal, no position "
                     "term: the same query and key counts" +
                     ("; STAND-IN: implementation='xla', not cuDNN" if a.cudnn_standin else ""))

    def time_path(path=path, spans=spans, attn=attn, tiles=tiles):
      if path.startswith("cudnn"):
        tr = lambda t: jnp.swapaxes(t, 1, 2)  # (B, H, T, D) -> (B, T, H, D)
        qkv = [tr(xs["all_S"][n]) for n in ("q", "k", "v")]
        fwd, bwd = cudnn_pair(jax.nn.dot_product_attention, a.cudnn_standin, tr(g))
        return harness.fwd_bwd_ms(fwd, qkv, bwd, qkv, reps)
      x = xs[spans]
      key = (path, tuple(tiles or ()))
      if key not in compiled:
        compiled[key] = (jax.jit(attn), jax.jit(jax.value_and_grad(
            lambda q, k, v, pe, z: jnp.sum(attn(q, k, v, pe, z, None, None).astype(
                jnp.float32) * g), argnums=(0, 1, 2, 3, 4))))
      fwd, bwd = compiled[key]
      return harness.fwd_bwd_ms(fwd, [x[n] for n in NAMES], bwd,
                                [x[n] for n in ("q", "k", "v", "pe", "z")], reps)
    harness.CHILD.measure(row, deadline, time_path)


def cudnn_pair(attention, standin: bool, g, **kw):
  """Jitted forward and value_and_grad of <out, g> of cuDNN's flash attention (`attention` is
  jax.nn.dot_product_attention; kw its mask or lengths), or of its XLA stand-in."""
  impl = "xla" if standin else "cudnn"
  f = lambda q, k, v: attention(q, k, v, implementation=impl, **kw)
  return jax.jit(f), jax.jit(jax.value_and_grad(
      lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) * g), argnums=(0, 1, 2)))


def main():
  harness.child_main("gpu_kernel_check", __doc__, {
      "kernel": correctness, "model": model_correctness, "timing": timings})


if __name__ == "__main__":
  main()

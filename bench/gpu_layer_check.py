"""Every attention implementation behind `model.attention.impl` against the plain definition
(span_lm/testing.py, run under jax at full float32 precision), at the layer: the output and the
gradients of every input and parameter (q/k/v/out projections, the cache, key_pe, spans,
persistent memory), float32 and bf16, fixed / adaptive / dynamic spans, persistent memory, head
dims 64 and 96. The `correctness` family of bench/gpu_run.py's suite preset runs `child_correctness`;
bench/gpu_kernel_check.py's layer check uses `case_setup`, `plain_fn`, `values_and_grads` and
`compare`.
"""
import time

from bench import harness
from span_lm import testing
from span_lm.model import config as model_config
from span_lm.model import plan as plan_lib
from span_lm.model.attention import SeqAttention
from span_lm.model.config import ModelConfig

# Worst |got - want| / max|want| per tensor that passes. float32 allows TF32-level rounding (XLA
# may run float32 dots on TF32 tensor cores); bf16 is compared with the float32 definition.
TOL = {"float32": 5e-3, "bfloat16": 5e-2}


def setup_jax(spec):
  """jax, on the CPU for a rehearsal's child."""
  import jax  # pylint: disable=g-import-not-at-top
  if spec.get("dry_run"):
    jax.config.update("jax_platforms", "cpu")
  return jax


def correctness_cases(dry: bool) -> list[dict]:
  """On a GPU every combination, most telling first (a budget cut drops the tail): bf16, then
  float32; head dim 64, then 96. The dry run covers each value once (head dims 16 and 24: a
  power of two and not, as 64 and 96); the interpreted kernel takes the first two only (slow)."""
  if dry:
    return [{"dtype": dt, "head_dim": hd, "span_mode": sm, "pers_mem": pm, "dry_all": a}
            for dt, hd, sm, pm, a in (("bfloat16", 16, "adaptive", False, True),
                                      ("float32", 16, "adaptive", True, True),
                                      ("float32", 16, "dynamic", False, False),
                                      ("float32", 24, "fixed", False, False))]
  cases = []
  for dtype in ("bfloat16", "float32"):
    for hd in (64, 96):
      for spans, pers in (("adaptive", False), ("dynamic", False), ("fixed", False),
                          ("adaptive", True)):
        cases.append({"dtype": dtype, "head_dim": hd, "span_mode": spans, "pers_mem": pers})
  return cases


def child_correctness(spec):
  """spec: cases, and pending [case index, impl name, attn_impl] pairs; case-major, so the plain
  definition is compiled once per case for every implementation."""
  jax = setup_jax(spec)
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  dry = spec["dry_run"]
  shape = (2, 2, 32, 64, 16) if dry else (4, 2, 128, 256, 64)  # heads, batch, block, S, tile
  by_case = {}
  for ci, name, use in spec["pending"]:
    by_case.setdefault(ci, []).append((name, use))
  for ci, impls in by_case.items():
    case = spec["cases"][ci]
    rows = [dict({k: v for k, v in case.items() if k != "dry_all"}, case_index=ci, impl=name,
                 attn_impl=use, backend=jax.default_backend(), tol=TOL[case["dtype"]])
            for name, use in impls]
    if time.time() > spec["deadline"]:
      for row in rows:
        harness.emit(dict(row, status="skipped", error="stage budget spent"))
      continue
    try:
      setup = case_setup(jax, jnp, np, case, [use for _, use in impls], *shape)
      want = values_and_grads(jax, setup, plain_fn(setup))
    except Exception as e:  # pylint: disable=broad-except
      for row in rows:
        harness.emit(dict(row, **harness.error_row(e)))
      continue
    for row, (_, use) in zip(rows, impls):
      t0 = time.time()
      try:
        row.update(compare(jax, np, setup, use, want, case["dtype"]))
      except Exception as e:  # pylint: disable=broad-except
        row.update(harness.error_row(e))
      row["seconds"] = time.time() - t0
      harness.emit(row)


def _case_cfg(case, use, nh, s, block):
  hd = case["head_dim"]
  return ModelConfig.from_config(dict(
      vocab_size=8, d_model=nh * hd, n_heads=nh, d_ff=4 * nh * hd, n_layers=1,
      pers_mem=block if case["pers_mem"] else 0, dtype=case["dtype"],
      span={"size": s, "mode": case["span_mode"], "ramp": max(8, s // 8)},
      attention={"impl": use, "block": block}, plan={"granularity": block}))


def case_setup(jax, jnp, np, case, uses, nh, b, m, s, block):
  """Inputs, parameters and plan of one case (the same for every implementation)."""
  cfg = err = None
  for use in uses:  # any accepted config builds the parameters (they do not depend on attn_impl)
    try:
      cfg = _case_cfg(case, use, nh, s, block)
      break
    except ValueError as e:
      err = e
  if cfg is None:
    raise err
  rng = np.random.default_rng(0)
  ratios = rng.uniform(0.05, 0.95, nh).astype(np.float32)
  ratios[0] = 0.1  # one short head: the plan groups heads by window
  if cfg.span.mode == "adaptive":
    plan = plan_lib.plan_from_ratios(cfg, [ratios])
  else:
    plan = plan_lib.full_plan(cfg)
  lp = plan.layers[0]
  hd = case["head_dim"]
  h = jnp.asarray(rng.standard_normal((b, m, cfg.d_model)), jnp.float32)
  cache = jnp.asarray(rng.standard_normal((b, lp.cache_len, cfg.d_model)), jnp.float32)
  key_pe = jnp.asarray(rng.standard_normal((hd, s)), jnp.float32)
  module = SeqAttention(cfg, lp)
  init = jax.jit(lambda k, h, c, pe: module.init(k, h, c, pe, False)["params"])  # eager: slow
  params = jax.tree.map(np.asarray, init(jax.random.key(0), h, cache, key_pe))
  if cfg.span.mode == "adaptive":
    params["span_ratio"] = ratios
  if cfg.span.mode == "dynamic":  # spans spread over the window, not at the init's 2 %
    params["span_predictor"]["bias"] = rng.normal(-1.0, 0.5, nh).astype(np.float32)
  ct = jnp.asarray(rng.standard_normal((b, m, cfg.d_model)), jnp.float32)
  return {"cfg": cfg, "lp": lp, "params": params, "inputs": (h, cache, key_pe), "ct": ct,
          "shape": {"batch": b, "block": m, "span": s, "heads": nh, "cache": lp.cache_len,
                    "groups": [[list(g), w] for g, w in lp.groups]}}


def plain_fn(setup):
  """The plain definition (span_lm/testing.py) under jax: float32, matmuls at HIGHEST."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  cfg = setup["cfg"]
  return lambda p, h, c, pe: testing.attention(cfg, p, pe, h, c, xp=jnp)


def values_and_grads(jax, setup, fn) -> dict:
  """The output and the gradients of <output, ct> for every parameter and input, by name."""
  ct = setup["ct"]

  def values_and_grads(p, h, c, pe):  # one compile: the output and its VJP
    out, vjp = jax.vjp(fn, p, h, c, pe)
    return out, vjp(ct)

  out, (gp, gh, gc, gpe) = jax.jit(values_and_grads)(setup["params"], *setup["inputs"])
  res = {"out": out}
  res.update({"d_" + "/".join(str(getattr(k, "key", k)) for k in path): g
              for path, g in jax.tree_util.tree_leaves_with_path(gp)})
  res.update(d_h=gh, d_cache=gc, d_key_pe=gpe)
  return res


def compare(jax, np, setup, use, want, dtype):
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  cfg = _case_cfg_like(setup["cfg"], use)
  module = SeqAttention(cfg, setup["lp"])
  t0 = time.perf_counter()
  got = values_and_grads(
      jax, setup, lambda p, h, c, pe: module.apply({"params": p}, h, c, pe, False)[0].astype(
          jnp.float32))
  run_s = time.perf_counter() - t0
  diffs, zero = {}, []
  for name, w in want.items():
    g = np.asarray(got[name], np.float64)
    w = np.asarray(w, np.float64)
    scale = float(np.max(np.abs(w)))
    if scale == 0.0:
      zero.append(name)
    err = float(np.max(np.abs(g - w))) / (scale or 1.0)
    diffs[name] = err if np.isfinite(err) else float("inf")
  worst = max(diffs, key=diffs.get)
  ok = all(v <= TOL[dtype] for v in diffs.values())
  return {"status": "pass" if ok else "fail", "diffs": diffs, "worst": worst,
          "worst_diff": diffs[worst], "zero_reference": zero, "run_seconds": run_s,
          "shape": setup["shape"]}


def _case_cfg_like(cfg, use):
  """cfg with another attention.impl, validated again (a refusal is this implementation's
  error)."""
  return model_config.updated(cfg, **{"attention.impl": use})



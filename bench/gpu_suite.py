"""GPU evidence in one command: environment, attention correctness, training speed and memory,
the reference PyTorch step and sampling speed, written to --out DIR as suite.json and suite.md.

  python bench/gpu_suite.py --out /tmp/gpu_suite            # a GPU machine: < 9 minutes, offline
  python bench/gpu_suite.py --dry_run --out /tmp/gpu_dry     # CPU rehearsal: tiny shapes, < 1 min

bench/README.md has the commands for a GPU machine without network and the folder it needs
(.gpu_carry, built by bench/gpu_prepare.sh); docs/benchmarks.md has what the numbers mean and the
results.

Stages, in priority order (each with a time budget; what a stage leaves unused passes on, what
does not fit is recorded as skipped with the reason, never silently dropped):
  env                 versions, device, memory, CUDA/cuDNN, measured matmul rates, TF32 or not
  correctness         each attention implementation (model.attention.impl; the Pallas kernel compiled,
                      not interpreted) against the plain definition of tests/reference_numpy.py,
                      run under jax at full float32 precision: output and the gradients of every input and parameter (q/k/v/out projections, the cache,
                      key_pe, spans, persistent memory), float32 and bf16, fixed / adaptive /
                      dynamic spans, persistent memory, head dims 64 and 96
  train_enwik8        configs/enwik8.py's full training step (optimizer included) at the paper's
                      per-GPU batch (64 streams over the reference's 8 GPUs: 8), bf16 and float32,
                      each implementation, spans short / mixed / all at S: ms/step, tokens/s, peak
                      memory, MFU from span_lm.tools.flops against the device's dense peak
  reference           the reference's PyTorch step on the same device (issue-8 and enwik8 shapes,
                      its own trimming), from a carried checkout (never committed: CC-BY-NC)
  train_issue8        span_lm's step on bench/train_step.py's shapes, side by side with the above
  train_enwik8_large  configs/enwik8_large.py (head dim 96) at its batch split (8 per GPU, 2 pieces)
  sampling            tokens/s of the cached (ring) decoder on the enwik8 model

Every stage runs in child processes of this script (`--child`), so a compile error, an
out-of-memory or a crash is one recorded row, the device is free between stages, and each
training child's peak memory is its own. With --dry_run everything runs on the CPU at tiny shapes
with the Pallas kernel in interpret mode, and the reference step is a recorded stand-in where
PyTorch or the reference checkout is absent (tests/test_gpu_suite.py runs it in CI).
"""
import _repo  # first: the checkout's span_lm (bench/_repo.py)
import argparse
import datetime
import json
import os
import subprocess
import sys
import time
import traceback

sys.path.insert(0, os.path.join(_repo.ROOT, "tests"))  # reference_numpy: the plain definition
import reference_numpy  # pylint: disable=g-import-not-at-top,wrong-import-position
from span_lm import config as config_lib  # pylint: disable=wrong-import-position
from span_lm import kernels  # pylint: disable=wrong-import-position
from span_lm.model import caches as caches_lib  # pylint: disable=wrong-import-position
from span_lm.model import plan as plan_lib  # pylint: disable=wrong-import-position
from span_lm.model.attention import SeqAttention  # pylint: disable=wrong-import-position
from span_lm.model import config as model_config  # pylint: disable=wrong-import-position
from span_lm.model.config import ModelConfig, Span  # pylint: disable=wrong-import-position
from span_lm.model.transformer import SpanTransformer  # pylint: disable=wrong-import-position
from span_lm.tools import chips  # pylint: disable=wrong-import-position
from span_lm.tools import flops as flops_lib  # pylint: disable=wrong-import-position
from span_lm.tools import sample  # pylint: disable=wrong-import-position
from span_lm.train import optimizer as optimizer_lib  # pylint: disable=wrong-import-position
from span_lm.train import steps as steps_lib  # pylint: disable=wrong-import-position

REPO = _repo.ROOT

# ------------------------------------------------------------------------------------------------
# The attention implementations behind model.attention.impl that this suite measures:
# name: (what it is, measured on GPU, measured in the CPU rehearsal).
IMPLS = {
    "reference": ("the readable jnp definition (plain autodiff)", True, True),
    "cpu": ("XLA:CPU's layouts and custom VJPs", False, True),
    "pallas": ("the fused Triton kernel, compiled", True, False),
    "pallas_interpret": ("the fused kernel, interpreted", False, True),
}
# ------------------------------------------------------------------------------------------------

REFERENCE_GPUS = 8  # the paper's enwik8 runs: a batch of 64 streams over 8 GPUs
STAGES = ("env", "correctness", "train_enwik8", "reference", "train_issue8",
          "train_enwik8_large", "sampling")
# Seconds per stage on a GPU (510 in all: a 10-minute command keeps ~90 s for pip and start-up).
BUDGET_S = {"env": 25, "correctness": 110, "train_enwik8": 170, "reference": 70,
            "train_issue8": 30, "train_enwik8_large": 70, "sampling": 35}
PLANS = ("short", "mixed", "all_S")  # in order of growing memory (a child's peak is cumulative)
ALL_PLANS = PLANS + ("learned",)  # learned: spans 3 tokens to 0.7 S per layer (bench/gpu_run.py)

# Worst |got - want| / max|want| per tensor that passes. float32 allows TF32-level rounding (XLA
# may run float32 dots on TF32 tensor cores); bf16 is compared with the float32 definition.
TOL = {"float32": 5e-3, "bfloat16": 5e-2}


def peak_tflops(device_kind: str) -> dict | None:
  """Dense peak TFLOP/s by dtype (bf16 tensor cores, float32 without, TF32): span_lm/tools/chips.py,
  the table the compile mode's rooflines use too."""
  return chips.peak_tflops(device_kind)


def accepted_impls() -> list[str]:
  """The attn_impl names span_lm accepts (span_lm.kernels.ATTN_IMPLS)."""
  return list(kernels.ATTN_IMPLS)


def resolve_impls(accepted, on_gpu: bool, only=None) -> dict:
  """{suite name: the attn_impl it runs as, or None with why} for this machine."""
  out = {}
  for name, (why, gpu, cpu) in IMPLS.items():
    if only and name not in only:
      continue
    if not (gpu if on_gpu else cpu):
      continue
    if name in accepted:
      out[name] = {"use": name, "why": why}
    else:
      out[name] = {"use": None, "why": f"span_lm accepts attn_impl in {accepted}"}
  return out


# ----------------------------------------------------------------------------- the child stages


def emit(row: dict) -> None:
  print("ROW " + json.dumps(row, default=str), flush=True)


def _error(e: BaseException) -> dict:
  msg = f"{type(e).__name__}: {e}"
  status = "oom" if ("RESOURCE_EXHAUSTED" in msg or "out of memory" in msg.lower()) else "error"
  return {"status": status, "error": msg[:2000], "trace": traceback.format_exc()[-3000:]}


def _setup_jax(spec):
  import jax  # pylint: disable=g-import-not-at-top
  if spec.get("dry_run"):
    jax.config.update("jax_platforms", "cpu")
  return jax


def child_env(spec):
  jax = _setup_jax(spec)
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import platform  # pylint: disable=g-import-not-at-top
  row = {"python": platform.python_version(), "jax": jax.__version__}
  for mod in ("jaxlib", "flax", "optax", "orbax.checkpoint", "ml_collections", "numpy"):
    try:
      row[mod] = __import__(mod, fromlist=["_"]).__version__
    except Exception as e:  # pylint: disable=broad-except
      row[mod] = f"missing ({type(e).__name__})"
  dev = jax.devices()[0]
  row.update(backend=jax.default_backend(), device_kind=dev.device_kind,
             device_count=jax.device_count(), platform_version=getattr(
                 dev.client, "platform_version", None))
  stats = dev.memory_stats() or {}
  row["memory_bytes"] = stats.get("bytes_limit")
  try:
    from jax._src.lib import cuda_versions  # pylint: disable=g-import-not-at-top
    if cuda_versions is None:
      raise ImportError("no CUDA plugin")
    for f in ("cuda_runtime_get_version", "cuda_driver_get_version", "cudnn_get_version",
              "cublas_get_version", "cusparse_get_version"):
      try:
        row[f.replace("_get_version", "")] = getattr(cuda_versions, f)()
      except Exception as e:  # pylint: disable=broad-except
        row[f.replace("_get_version", "")] = f"n/a ({type(e).__name__})"
  except Exception:  # pylint: disable=broad-except
    row["cuda"] = "n/a (no jax CUDA plugin)"
  try:
    row["environment_info"] = jax.print_environment_info(return_string=True)[-3000:]
  except Exception:  # pylint: disable=broad-except
    pass
  row["peak_table"] = peak_tflops(dev.device_kind)
  # Matmul rates as run here (float32 accumulation), and whether float32 dots round like TF32.
  n = 8192 if jax.default_backend() == "gpu" else 512
  for dt in ("bfloat16", "float32"):
    a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n)), dt)
    f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    f(a, a).block_until_ready()
    reps, best = 10, float("inf")
    for _ in range(3):
      t = time.perf_counter()
      for _ in range(reps):
        r = f(a, a)
      r.block_until_ready()
      best = min(best, (time.perf_counter() - t) / reps)
    row[f"matmul_tflops_{dt}"] = 2 * n**3 / best / 1e12
  x = jnp.asarray(np.random.default_rng(1).standard_normal((1024, 1024)), jnp.float32)
  lo = jax.jit(lambda a: a @ a)(x)
  hi = jax.jit(lambda a: jnp.dot(a, a, precision=jax.lax.Precision.HIGHEST))(x)
  row["float32_dot_rel_err_default_vs_highest"] = float(jnp.max(jnp.abs(lo - hi)) /
                                                        jnp.max(jnp.abs(hi)))
  row["matmul_precision_config"] = str(jax.config.jax_default_matmul_precision)
  row["accepted_impls"] = accepted_impls()
  row["status"] = "ok"
  emit(row)


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
  jax = _setup_jax(spec)
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
        emit(dict(row, status="skipped", error="stage budget spent"))
      continue
    try:
      setup = _case_setup(jax, jnp, np, case, [use for _, use in impls], *shape)
      want = _values_and_grads(jax, setup, _plain_fn(setup))
    except Exception as e:  # pylint: disable=broad-except
      for row in rows:
        emit(dict(row, **_error(e)))
      continue
    for row, (_, use) in zip(rows, impls):
      t0 = time.time()
      try:
        row.update(_compare(jax, np, setup, use, want, case["dtype"]))
      except Exception as e:  # pylint: disable=broad-except
        row.update(_error(e))
      row["seconds"] = time.time() - t0
      emit(row)


def _case_cfg(case, use, nh, s, block):
  hd = case["head_dim"]
  return ModelConfig.from_config(dict(
      vocab_size=8, d_model=nh * hd, n_heads=nh, d_ff=4 * nh * hd, span=s,
      span_mode=case["span_mode"], ramp=max(8, s // 8), pers_mem=block if case["pers_mem"] else 0,
      dtype=case["dtype"], attn_impl=use, attn_block=block, plan_granularity=block, n_layers=1))


def _case_setup(jax, jnp, np, case, uses, nh, b, m, s, block):
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


def _plain_fn(setup):
  """The plain definition (tests/reference_numpy.py) under jax: float32, matmuls at HIGHEST."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  cfg = setup["cfg"]
  return lambda p, h, c, pe: reference_numpy.attention(cfg, p, pe, h, c, xp=jnp)


def _values_and_grads(jax, setup, fn) -> dict:
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


def _compare(jax, np, setup, use, want, dtype):
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  cfg = _case_cfg_like(setup["cfg"], use)
  module = SeqAttention(cfg, setup["lp"])
  t0 = time.perf_counter()
  got = _values_and_grads(
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
  """cfg with another attn_impl, validated again (a refusal is this implementation's error)."""
  return model_config.updated(cfg, attn_impl=use)


def _span_ratios(cfg, plan_name: str):
  """z' per layer for a named plan (see docs/benchmarks.md, "GPU suite")."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  nh, s, r = cfg.n_heads, cfg.span.size, cfg.span.ramp
  short = np.full(nh, cfg.span.init, np.float32)  # the initial plan: z' at its init
  if plan_name == "short":
    return [short] * cfg.n_layers
  if plan_name == "all_S":
    return [np.ones(nh, np.float32)] * cfg.n_layers
  if plan_name == "learned":  # every layer's heads spread from 3 tokens to 0.7 S (gpu_run.py)
    return [np.linspace(3.0 / s, 0.7, nh).astype(np.float32)] * cfg.n_layers
  if plan_name == "issue8_short":  # bench/train_step.py's short case: span + ramp = 64 tokens
    return [np.full(nh, (64 - r) / s, np.float32)] * cfg.n_layers
  if plan_name == "mixed":  # most heads short; 2 long: S/8 in the lower layers, S in the upper
    out = []
    for i in range(cfg.n_layers):
      z = short.copy()
      long_z = 1.0 if i >= cfg.n_layers // 2 else max(s / 8 - r, 0) / s
      z[-min(2, nh):] = long_z
      out.append(z)
    return out
  raise ValueError(plan_name)


def enwik8_reference_cases(dry: bool, plans) -> list[dict]:
  """configs/enwik8.py's shapes (one of the paper's 8 GPUs' share of its batch; tiny when dry)
  with the span ratios of each named plan: the PyTorch reference's timing cases."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  run = config_lib.load_config("configs/enwik8.py")
  m = run.model
  e8 = {"layers": 1 if dry else m.n_layers, "d_model": 64 if dry else m.d_model,
        "heads": 4 if dry else m.n_heads, "d_ff": 128 if dry else m.d_ff,
        "span": 128 if dry else m.span.size,
        "batch": 2 if dry else run.data.batch // REFERENCE_GPUS,
        "block": 32 if dry else run.data.block, "dropout": m.dropout}
  shapes = ModelConfig(vocab_size=2, d_model=e8["d_model"], n_layers=e8["layers"],
                       n_heads=e8["heads"], span=Span(size=e8["span"], ramp=32, init=m.span.init))
  return [dict(e8, shapes="enwik8", plan=plan,
               ratios=[np.asarray(z).tolist() for z in _span_ratios(shapes, plan)])
          for plan in plans]


def _model_cfg(spec):
  """ModelConfig and run config of a training/sampling child: a config file with overrides, or
  bench/train_step.py's issue-8 shapes."""
  if spec.get("config"):
    run = config_lib.load_config(spec["config"])
    cfg = model_config.updated(ModelConfig.from_config(run.model, vocab_size=205),
                               dtype=spec["dtype"], attn_impl=spec["use"], **spec.get("model", {}))
    return cfg, run.optim
  cfg = ModelConfig.from_config(dict(spec["model"], dtype=spec["dtype"], attn_impl=spec["use"]))
  from configs import base  # pylint: disable=g-import-not-at-top
  optim = base.get_base_config().optim  # bench/train_step.py's: the reference's Adagrad
  optim.name, optim.lr, optim.grad_clip, optim.warmup = "adagrad", 0.07, 0.03, 200
  return cfg, optim


def child_train(spec):
  """spec: variants [{impl, use, dtype}], plans; one row per (variant, plan). A GPU run gives
  each variant its own child (its own peak memory); the dry run puts them in one."""
  jax = _setup_jax(spec)
  import gc  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  batch, block, split = spec["batch"], spec["block"], spec["batch_split"]
  kind = jax.devices()[0].device_kind
  peaks = peak_tflops(kind)
  inits = {}  # parameters depend on neither the plan nor attn_impl: one init per (spans, dtype)
  for var in spec["variants"]:
    rows = [{"label": spec["label"], "dtype": var["dtype"], "impl": var["impl"],
             "attn_impl": var["use"], "plan": plan_name, "batch": batch, "block": block,
             "batch_split": split, "device": kind}
            for plan_name in var.get("plans", spec["plans"])]
    try:
      base_cfg, optim = _model_cfg(dict(spec, **var))
      tx, _ = optimizer_lib.make_optimizer(optim)
    except Exception as e:  # pylint: disable=broad-except  # e.g. a config the impl refuses
      for row in rows:
        emit(dict(row, **_error(e)))
      continue
    for row in rows:
      plan_name = row["plan"]
      if time.time() + spec.get("row_estimate_s", 0) > spec["deadline"]:
        emit(dict(row, status="skipped", error="stage budget spent" if not spec.get(
            "row_estimate_s") else f"under the ~{spec['row_estimate_s']}s a row takes was left"))
        continue
      try:
        cfg = model_config.updated(base_cfg, span_mode="fixed" if plan_name == "fixed" else
                                  "adaptive")
        row.update(model={"n_layers": cfg.n_layers, "d_model": cfg.d_model,
                          "n_heads": cfg.n_heads, "head_dim": cfg.head_dim, "d_ff": cfg.d_ff,
                          "span": cfg.span.size, "dropout": cfg.dropout,
                          "attn_block": cfg.attention.block, "attn_tiles": cfg.attention.tiles})
        if cfg.attention.impl.startswith("pallas"):
          try:
            row["tiles"] = list(kernels.gpu_tiles(cfg, cfg.attention.impl, cfg.dtype))
          except Exception as e:  # pylint: disable=broad-except
            row["tiles"] = f"n/a ({type(e).__name__})"
        key = (cfg.span.mode, cfg.dtype)
        if key not in inits:  # parameters do not depend on the plan: init once
          full = plan_lib.full_plan(cfg)
          inits[key] = jax.tree.map(np.asarray, jax.jit(
              lambda cfg=cfg, full=full: steps_lib.init_state(cfg, tx, full, 1, 1, 0))())
        row.update(_time_step(jax, np, cfg, tx, inits[key], batch, block, split, plan_name,
                              spec))
        sec = row["seconds"]
        row["tokens_per_s"] = batch * block / sec
        row["model_tflops_per_s"] = row["flops"] / sec / 1e12
        peak = (peaks or {}).get(var["dtype"])
        row["mfu"] = row["model_tflops_per_s"] / peak if peak else None
        if var["dtype"] == "float32" and peaks and peaks.get("tf32"):
          row["mfu_tf32"] = row["model_tflops_per_s"] / peaks["tf32"]
        measured = spec.get("measured_tflops", {}).get(var["dtype"])
        row["of_measured_matmul"] = row["model_tflops_per_s"] / measured if measured else None
        row["status"] = "ok"
      except Exception as e:  # pylint: disable=broad-except
        row.update(_error(e))
      emit(row)
      gc.collect()


def _time_step(jax, np, cfg, tx, init, batch, block, split, plan_name, spec):
  params = init["params"]
  if cfg.span.mode == "adaptive":
    ratios = _span_ratios(cfg, plan_name)
    params = plan_lib.with_span_ratios(params, ratios)
    plan = plan_lib.plan_from_ratios(cfg, ratios)
  else:
    plan = plan_lib.full_plan(cfg)
  plan_lib.check_plan(cfg, params, plan)
  # the trainer's builder: its mesh (every device), state rule, batch sharding and checks
  compiler = steps_lib.build(cfg, tx, batch=batch, eval_batch=jax.device_count(),
                             batch_split=split, log=lambda _: None)
  layout = compiler.layout
  rng = np.random.default_rng(0)
  state = {"step": init["step"], "params": params, "opt_state": jax.jit(tx.init)(params),
           "rng": init["rng"],
           "caches": tuple(np.asarray(rng.standard_normal(c.shape), np.float32)
                           for c in caches_lib.init_caches(cfg, plan, batch)),
           "eval_caches": caches_lib.init_caches(cfg, plan, jax.device_count())}
  state = jax.device_put(state, layout.state_shardings(jax.eval_shape(lambda: state)))
  host = steps_lib.host_batch(rng.integers(0, cfg.vocab_size, (batch, block)),
                              rng.integers(0, cfg.vocab_size, (batch, block)), False)
  dev = layout.shard_batch(host)
  t0 = time.perf_counter()
  step = compiler.train(plan, state, dev)
  out = {"compile_seconds": time.perf_counter() - t0, "plan_keys": plan.attention_keys(),
         "plan_detail": plan.describe()}
  try:
    ma = step.memory_analysis()
    out["compiled_bytes"] = int(ma.temp_size_in_bytes + ma.argument_size_in_bytes +
                                ma.output_size_in_bytes - ma.alias_size_in_bytes)
  except Exception:  # pylint: disable=broad-except
    out["compiled_bytes"] = None
  for _ in range(spec["warmup"]):
    state, metrics = step(state, dev)
  jax.block_until_ready(state)
  times = []
  for _ in range(spec["reps"]):
    t = time.perf_counter()
    state, metrics = step(state, dev)
    jax.block_until_ready((state, metrics))
    times.append(time.perf_counter() - t)
  out["seconds"] = float(np.median(times))
  out["min_seconds"] = float(min(times))
  out["loss"] = float(metrics["loss"])
  out["flops"] = int(flops_lib.train_step_flops(cfg, plan, batch, block))
  stats = jax.devices()[0].memory_stats() or {}
  out["peak_bytes"] = stats.get("peak_bytes_in_use")
  return out


def child_sampling(spec):
  jax = _setup_jax(spec)
  import numpy as np  # pylint: disable=g-import-not-at-top
  cfg, _ = _model_cfg(spec)
  for plan_name in spec["plans"]:
    for batch in spec["batches"]:
      row = {"label": spec["label"], "plan": plan_name, "batch": batch, "dtype": spec["dtype"],
             "length": spec["length"], "device": jax.devices()[0].device_kind}
      if time.time() + spec.get("row_estimate_s", 0) > spec["deadline"]:
        emit(dict(row, status="skipped", error="stage budget spent"))
        continue
      try:
        c = model_config.updated(cfg, span_mode="adaptive", dropout=0.0)
        row["attn_impl"] = c.attention.impl
        ratios = _span_ratios(c, plan_name)
        plan = plan_lib.plan_from_ratios(c, ratios)
        model = SpanTransformer(c, plan)
        params = jax.jit(lambda k, model=model, c=c, plan=plan: model.init(
            k, np.zeros((1, 1), np.int32), caches_lib.init_caches(c, plan, 1))["params"])(
                jax.random.key(0))
        params = plan_lib.with_span_ratios(jax.tree.map(np.asarray, params), ratios)
        prompt = np.zeros((batch, 1), np.int32)
        t0 = time.perf_counter()
        sample.generate(c, params, plan, prompt, spec["length"], temperature=1.0)
        row["compile_seconds"] = time.perf_counter() - t0
        times = []
        for _ in range(spec["reps"]):
          t = time.perf_counter()
          sample.generate(c, params, plan, prompt, spec["length"], temperature=1.0)
          times.append(time.perf_counter() - t)
        row["seconds"] = float(np.median(times))
        row["tokens_per_s"] = spec["length"] * batch / row["seconds"]
        row["plan_keys"] = plan.attention_keys()
        row["status"] = "ok"
      except Exception as e:  # pylint: disable=broad-except
        row.update(_error(e))
      emit(row)


def child_reference(spec):
  """The reference's `_train_batch` (batch split 1) on the default torch device: zero grads,
  TransformerSeq over a block with its caches, NLL + span loss, backward, AdagradWithGradClip,
  clamp; the spans held where the case puts them (so its trimming stays put). A stand-in (a
  numpy loop, marked, never a reference number) where torch or the checkout is absent."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  ref = spec["reference_dir"]
  why = None
  if not ref or not os.path.isfile(os.path.join(ref, "models.py")):
    why = f"no reference checkout at {ref!r} (bench/gpu_prepare.sh exports one)"
  else:
    try:
      import torch  # pylint: disable=g-import-not-at-top,unused-import
    except ImportError:
      why = f"no torch in {sys.executable}"
  for case in spec["cases"]:
    row = dict(case, label=spec["label"])
    if time.time() > spec["deadline"]:
      emit(dict(row, status="skipped", error="stage budget spent"))
      continue
    if why is not None:
      if not spec["dry_run"]:
        emit(dict(row, status="error", error=why))
        continue
      a = np.ones((64, 64), np.float32)  # the stand-in: the timing harness over a numpy loop
      times = []
      for _ in range(spec["reps"]):
        t = time.perf_counter()
        for _ in range(case["layers"]):
          a = np.tanh(a @ a / 64)
        times.append(time.perf_counter() - t)
      sec = float(np.median(times))
      emit(dict(row, status="stand_in", stand_in=True, error=why, seconds=sec,
                tokens_per_s=case["batch"] * case["block"] / sec))
      continue
    try:
      row.update(_reference_step(ref, case, spec["reps"]))
      row["status"] = "ok"
    except (Exception, SystemExit) as e:  # pylint: disable=broad-except  # SystemExit: modified files
      row.update(_error(e))
    emit(row)


def _reference_step(reference_dir, case, reps, warmup=2):
  """bench/reference_step.py's step (the one bench/train_step.py times, its files' sha256 checked)
  with the case's shapes and per-head spans, on the GPU."""
  if os.path.dirname(os.path.abspath(__file__)) not in sys.path:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import reference_step  # pylint: disable=g-import-not-at-top
  return reference_step.measure_step(
      reference_dir, layers=case["layers"], heads=case["heads"], d_model=case["d_model"],
      d_ff=case["d_ff"], dropout=case["dropout"], span=case["span"], batch=case["batch"],
      block=case["block"], ratios=None if case["plan"] == "fixed" else case["ratios"],
      reps=reps, warmup=warmup)


KEYS = {"train": ("label", "impl", "dtype", "plan"), "reference": ("shapes", "plan"),
        "sampling": ("label", "plan", "batch")}


def _expected_rows(kind, spec) -> list[dict]:
  """The rows a child spec should report, by their identifying keys."""
  if kind == "train":
    return [{"label": spec["label"], "impl": v["impl"], "dtype": v["dtype"], "plan": p}
            for v in spec["variants"] for p in v.get("plans", spec["plans"])]
  if kind == "reference":
    return [{"shapes": c["shapes"], "plan": c["plan"]} for c in spec["cases"]]
  if kind == "sampling":
    return [{"label": spec["label"], "plan": p, "batch": b} for p in spec["plans"]
            for b in spec["batches"]]
  return []


CHILDREN = {"env": child_env, "correctness": child_correctness, "train": child_train,
            "reference": child_reference, "sampling": child_sampling}


# ------------------------------------------------------------------------------ the parent side


class Suite:
  """Runs the stages in order within the budget and rewrites suite.json / suite.md after each."""

  def __init__(self, args):
    self.args = args
    self.t0 = time.time()
    self.deadline = self.t0 + args.budget_s
    self.carry = 0.0
    import threading  # pylint: disable=g-import-not-at-top
    self.lock = threading.Lock()
    os.makedirs(args.out, exist_ok=True)
    self.log = open(os.path.join(args.out, "suite.log"), "w")  # pylint: disable=consider-using-with
    self.result = {"suite": "span_lm bench/gpu_suite.py", "schema": 1,
                   "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                   "dry_run": args.dry_run, "argv": sys.argv[1:], "budget_s": args.budget_s,
                   "stages": {}}

  # -- children
  def child(self, kind: str, spec: dict, timeout: float, python: str | None = None):
    """Runs one child; returns (rows, error or None). Rows printed before a crash or a kill
    are kept."""
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if self.args.dry_run:
      env["JAX_PLATFORMS"] = "cpu"
      env.pop("XLA_FLAGS", None)
    else:
      env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
      if self.args.cache_dir:
        env.setdefault("JAX_COMPILATION_CACHE_DIR", self.args.cache_dir)
        env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "2")
    spec = dict(spec, dry_run=self.args.dry_run)
    cmd = [python or sys.executable, os.path.abspath(__file__), "--child", kind,
           "--spec", json.dumps(spec)]
    self.log.write(f"\n=== {kind} {json.dumps(spec)[:400]} (timeout {timeout:.0f}s)\n")
    self.log.flush()
    rows, error = [], None
    timeout = max(timeout, 1.0)
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True, cwd=REPO,
                          env=env) as proc:
      import threading  # pylint: disable=g-import-not-at-top
      timer = threading.Timer(timeout, proc.kill)
      timer.start()
      try:
        for line in proc.stdout:
          if line.startswith("ROW "):
            rows.append(json.loads(line[4:]))
          else:
            self.log.write(line)
      finally:
        timer.cancel()
      rc = proc.wait()
    if rc:
      error = (f"child {kind} killed at its {timeout:.0f}s budget" if rc in (-9, 137) else
               f"child {kind} exited with {rc} (suite.log has its stderr)")
    self.log.flush()
    return rows, error

  # -- stages
  def stage(self, name: str, fn) -> None:
    budget = BUDGET_S[name] * self.args.budget_scale
    now = time.time()
    allowed = min(budget + self.carry, self.deadline - now)
    if self.args.jobs > 1 and name != "env":  # side by side: each may use what is left
      allowed = self.deadline - now
    entry = {"status": "skipped", "budget_s": round(allowed, 1), "rows": [], "errors": []}
    self.result["stages"][name] = entry
    if self.args.stages and name not in self.args.stages:
      entry["reason"] = "not in --stages"
    elif allowed < 3:
      entry["reason"] = f"the suite's {self.args.budget_s:.0f}s budget was spent"
    else:
      try:
        fn(entry, now + allowed)
        fails = [r for r in entry["rows"] if r.get("status") not in ("ok", "pass", "stand_in")]
        entry["status"] = "ok" if not entry["errors"] and not fails else "partial"
      except Exception as e:  # pylint: disable=broad-except
        entry["status"] = "error"
        entry["errors"].append(f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}")
    entry["seconds"] = round(time.time() - now, 1)
    if entry["status"] != "skipped":
      self.carry = max(0.0, allowed - entry["seconds"])
    print(f"[{time.time() - self.t0:5.0f}s] {name}: {entry['status']} in {entry['seconds']}s "
          f"({len(entry['rows'])} rows){' ' + entry.get('reason', '') if 'reason' in entry else ''}",
          flush=True)
    self.write()

  def run_children(self, entry, deadline, jobs):
    """jobs: (kind, spec, python) in priority order; each gets a fair share of what is left (up
    to 1.5x). Rows a child never reported (killed, crashed) are recorded with the reason."""
    for i, (kind, spec, python) in enumerate(jobs):
      left = deadline - time.time()
      if left < 2:
        for _, s, _ in jobs[i:]:
          for row in _expected_rows(kind, s):
            entry["rows"].append(dict(row, status="skipped", error="stage budget spent"))
        return
      timeout = min(left, 1.5 * left / (len(jobs) - i))
      rows, err = self.child(kind, dict(spec, deadline=time.time() + timeout * 0.8), timeout,
                             python)
      entry["rows"].extend(rows)
      if err:
        entry["errors"].append(err)
      got = [{k: r.get(k) for k in KEYS[kind]} for r in rows]
      for row in _expected_rows(kind, spec):
        if row not in got:
          entry["rows"].append(dict(row, status="timeout" if err and "killed at its" in err
                                    else "error", error=err or "the child did not report it"))

  def env_stage(self, entry, deadline):
    rows, err = self.child("env", {}, deadline - time.time())
    entry["rows"] = rows
    if err:
      entry["errors"].append(err)
    self.env = rows[0] if rows else {}
    accepted = self.env.get("accepted_impls") or accepted_impls()
    on_gpu = self.env.get("backend", "cpu") != "cpu" and not self.args.dry_run
    self.impls = resolve_impls(accepted, on_gpu, self.args.impls)
    self.result["impls"] = {"table": {k: v[0] for k, v in IMPLS.items()}, "accepted": accepted,
                            "resolved": self.impls}

  def runnable(self):
    return [(name, r["use"]) for name, r in self.impls.items() if r["use"]]

  def correctness_stage(self, entry, deadline):
    """Case-major in one child; a child that crashes (a kernel that kills the process) costs the
    pair in flight, recorded as its error, and a new child takes the rest."""
    dry = self.args.dry_run
    cases = correctness_cases(dry)
    slow = {"pallas_interpret"}  # the dry run interprets the kernel on a few cases only
    pending = [[ci, name, use] for ci, case in enumerate(cases) for name, use in self.runnable()
               if not (dry and name in slow and not case.get("dry_all"))]
    while pending:
      left = deadline - time.time()
      if left < 2:
        entry["errors"].append(f"{len(pending)} (case, impl) pairs skipped: stage budget spent")
        return
      rows, err = self.child("correctness", {"cases": cases, "pending": pending,
                                             "deadline": time.time() + left * 0.9}, left)
      entry["rows"].extend(rows)
      done = {(r["case_index"], r["impl"]) for r in rows}
      pending = [p for p in pending if (p[0], p[1]) not in done]
      if err:
        entry["errors"].append(err)
        if pending:  # the pair in flight: cut at the budget, or it took the child down
          ci, name, use = pending.pop(0)
          killed = "killed at its" in err
          entry["rows"].append(dict(
              {k: v for k, v in cases[ci].items() if k != "dry_all"}, case_index=ci, impl=name,
              attn_impl=use, tol=TOL[cases[ci]["dtype"]], status="timeout" if killed else "error",
              error=err if killed else f"the child died on this case: {err}"))

  def _train_jobs(self, label, plans):
    dry = self.args.dry_run
    measured = {dt: self.env.get(f"matmul_tflops_{dt}") for dt in ("bfloat16", "float32")}
    common = {"label": label, "reps": 1 if dry else 5, "warmup": 1 if dry else 2,
              "measured_tflops": measured, "plans": plans}
    if label == "issue8":
      common.update(model={"vocab_size": 205, "d_model": 64 if dry else 256, "n_layers": 1 if dry
                           else 4, "n_heads": 4, "d_ff": 128 if dry else 1024,
                           "span": 128 if dry else 1024, "ramp": 32,
                           "attn_block": 16 if dry else 64, "plan_granularity": 32 if dry else 64},
                    batch=2 if dry else 16, block=32 if dry else 128, batch_split=1)
    else:
      from span_lm import config as config_lib  # pylint: disable=g-import-not-at-top
      path = f"configs/{label}.py"
      run = config_lib.load_config(path)
      model = {}
      if dry:  # the config's structure at tiny shapes (enwik8_large keeps a non-power-of-2 head)
        hd = 24 if label == "enwik8_large" else 16
        model = {"n_layers": 1, "n_heads": 4, "d_model": 4 * hd, "d_ff": 8 * hd, "span": 128,
                 "attn_block": 16, "plan_granularity": 32, "plan_margin": 32}
      common.update(config=path, model=model, batch_split=run.optim.batch_split,
                    batch=2 * run.optim.batch_split if dry else run.data.batch // REFERENCE_GPUS,
                    block=32 if dry else run.data.block)
    first = ("pallas", "reference")  # the fastest path first: a budget cut drops the tail
    impls = sorted(self.runnable(), key=lambda nu: first.index(nu[0]) if nu[0] in first else 9)
    variants = [{"impl": name, "use": use, "dtype": dt} for dt in self.args.dtypes
                for name, use in impls]
    if dry:  # one child, one dtype per config; the interpreted kernel (slow to compile) has its
      # rehearsal in the correctness stage
      dt = "bfloat16" if label == "enwik8" else "float32"
      variants = [v for v in variants if v["dtype"] == dt and v["impl"] != "pallas_interpret"]
      return [("train", dict(common, variants=variants), None)]
    return [("train", dict(common, variants=[v]), None) for v in variants]

  def train_stage(self, label):
    def fn(entry, deadline):
      plans = ["issue8_short", "fixed"] if label == "issue8" else list(self.args.plans)
      if self.args.dry_run and label == "enwik8_large":
        plans = ["mixed"]  # enwik8 rehearses the three plans; this one its head dim and split
      self.run_children(entry, deadline, self._train_jobs(label, plans))
    return fn

  def reference_stage(self, entry, deadline):
    dry = self.args.dry_run
    cases = []
    i8 = {"layers": 1 if dry else 4, "d_model": 64 if dry else 256, "heads": 4,
          "d_ff": 128 if dry else 1024, "span": 128 if dry else 1024, "batch": 2 if dry else 16,
          "block": 32 if dry else 128, "dropout": 0.0}
    for plan in ("issue8_short", "fixed"):
      z = (64 - 32) / i8["span"]
      cases.append(dict(i8, shapes="issue8", plan=plan,
                        ratios=[[z] * i8["heads"]] * i8["layers"]))
    cases += enwik8_reference_cases(dry, self.args.plans)
    spec = {"label": "reference", "reference_dir": self.args.reference_dir, "cases": cases,
            "reps": 2 if dry else 5}
    self.run_children(entry, deadline, [("reference", spec, self.args.reference_python)])

  def sampling_stage(self, entry, deadline):
    dry = self.args.dry_run
    model = {"n_layers": 1, "n_heads": 4, "d_model": 64, "d_ff": 128, "span": 128,
             "plan_granularity": 32} if dry else {}
    spec = {"label": "enwik8", "config": "configs/enwik8.py", "model": model,
            "dtype": "float32", "impl": "default", "use": "auto",
            "plans": ["short", "all_S"], "batches": [2] if dry else [1, 8],
            "length": 8 if dry else 256,
            "reps": 1 if dry else 3}
    self.run_children(entry, deadline, [("sampling", spec, None)])

  def run(self):
    self.env, self.impls = {}, {}
    self.stage("env", self.env_stage)
    rest = [("correctness", self.correctness_stage),
            ("train_enwik8", self.train_stage("enwik8")),
            ("reference", self.reference_stage),
            ("train_issue8", self.train_stage("issue8")),
            ("train_enwik8_large", self.train_stage("enwik8_large")),
            ("sampling", self.sampling_stage)]
    if self.args.jobs > 1:  # the CPU rehearsal: stages side by side (one device: never on a GPU)
      from concurrent import futures  # pylint: disable=g-import-not-at-top
      with futures.ThreadPoolExecutor(self.args.jobs) as pool:
        for f in [pool.submit(self.stage, name, fn) for name, fn in rest]:
          f.result()
    else:
      for name, fn in rest:
        self.stage(name, fn)
    self.result["seconds"] = round(time.time() - self.t0, 1)
    self.write()
    self.log.close()
    return self.result

  # -- output
  def write(self):
    self.result["seconds"] = round(time.time() - self.t0, 1)
    st = self.result["stages"]
    self.result["stages"] = {k: st[k] for k in STAGES if k in st}
    with self.lock:
      for _ in range(20):  # a stage in another thread may be adding a key: then again
        try:
          text = json.dumps(self.result, indent=1, default=str)
          md = markdown(self.result)
          break
        except RuntimeError:
          time.sleep(0.05)
      with open(os.path.join(self.args.out, "suite.json"), "w") as f:
        f.write(text)
      with open(os.path.join(self.args.out, "suite.md"), "w") as f:
        f.write(md)


def _f(x, fmt="{:.3g}"):
  return "-" if x is None else fmt.format(x)


def _gib(x):
  return "-" if not x else f"{x / 2**30:.2f}"


DIFF_COLUMNS = (("out", "out"), ("q", "d_proj_query/kernel"), ("k", "d_proj_key/kernel"),
                ("v", "d_proj_val/kernel"), ("o", "d_proj_out/kernel"), ("pe", "d_key_pe"),
                ("h", "d_h"), ("cache", "d_cache"))


def _span_diff(d):
  keys = [k for k in d if "span" in k]
  return max((d[k] for k in keys), default=None)


def _pers_diff(d):
  keys = [k for k in d if "pers_" in k]
  return max((d[k] for k in keys), default=None)


def markdown(res: dict) -> str:
  st = res["stages"]
  env = (st.get("env", {}).get("rows") or [{}])[0]
  out = [f"# span_lm GPU suite{' (CPU dry run: tiny shapes, not GPU numbers)' if res['dry_run'] else ''}",
         "", f"`python bench/gpu_suite.py {' '.join(res['argv'])}`, started "
         f"{res['started_utc']}, {res.get('seconds', 0):.0f} s of a {res['budget_s']:.0f} s budget.",
         "", "| stage | status | seconds | rows | notes |", "|---|---|---|---|---|"]
  for name in STAGES:
    e = st.get(name)
    if e is None:
      out.append(f"| {name} | not reached | | | |")
      continue
    notes = "; ".join([e.get("reason", "")] + [x.splitlines()[0][:160] for x in e["errors"]])
    out.append(f"| {name} | {e['status']} | {e.get('seconds', '')} | {len(e['rows'])} | "
               f"{notes.strip('; ')} |")
  if env:
    out += ["", "## Environment", ""]
    keys = ("device_kind", "backend", "device_count", "memory_bytes", "python", "jax", "jaxlib",
            "flax", "optax", "orbax.checkpoint", "ml_collections", "numpy", "platform_version",
            "cuda_runtime", "cuda_driver", "cudnn", "cublas", "matmul_tflops_bfloat16",
            "matmul_tflops_float32", "float32_dot_rel_err_default_vs_highest", "peak_table")
    out += [f"- {k}: {env.get(k)}" for k in keys if k in env]
    imp = res.get("impls", {})
    out.append(f"- attn_impl accepted: {imp.get('accepted')}; measured here: " + ", ".join(
        f"{k} -> {v['use']}" if v["use"] else f"{k}: not run ({v['why']})"
        for k, v in imp.get("resolved", {}).items()))
  rows = st.get("correctness", {}).get("rows", [])
  if rows:
    out += ["", "## Correctness against the plain definition",
            "", "Worst |impl - definition| / max|definition| per tensor (bf16 against the float32 "
            "definition); q/k/v/o are the projection kernels' gradients, h and cache the "
            f"inputs'. Tolerance: {TOL}.", "",
            "| impl | dtype | spans | pers | head dim | status | " +
            " | ".join(c for c, _ in DIFF_COLUMNS) + " | spans' | pers' | worst |",
            "|" + "---|" * (9 + len(DIFF_COLUMNS))]
    for r in rows:
      d = r.get("diffs", {})
      cells = [_f(d.get(k)) for _, k in DIFF_COLUMNS] + [_f(_span_diff(d)), _f(_pers_diff(d))]
      worst = (f"{r['worst']} {r['worst_diff']:.3g}" if "worst" in r else
               (r.get("error", "") or "").splitlines()[0][:120] if r.get("error") else "")
      out.append(f"| {r['impl']} ({r['attn_impl']}) | {r['dtype']} | {r['span_mode']} | "
                 f"{'yes' if r['pers_mem'] else 'no'} | {r['head_dim']} | {r['status']} | " +
                 " | ".join(cells) + f" | {worst} |")
  ref_rows = st.get("reference", {}).get("rows", [])
  ref_tps = {(r.get("shapes"), r.get("plan")): r.get("tokens_per_s") for r in ref_rows
             if r.get("status") == "ok"}
  for name in ("train_enwik8", "train_issue8", "train_enwik8_large"):
    rows = st.get(name, {}).get("rows", [])
    if not rows:
      continue
    out += ["", f"## Training step: {name[6:]}", "",
            "| dtype | impl | plan | batch (split) | status | ms/step | tokens/s | peak GiB "
            "| compiled GiB | MFU | model TFLOP/s | vs reference tokens/s | compile s | keys/query |",
            "|" + "---|" * 14]
    for r in rows:
      shapes = "issue8" if name == "train_issue8" else name[6:]
      ref = ref_tps.get((shapes, r["plan"]))
      vs = (f"{r['tokens_per_s'] / ref:.2f}x" if ref and r.get("tokens_per_s") else "-")
      if r.get("status") != "ok":
        out.append(f"| {r['dtype']} | {r['impl']} ({r.get('attn_impl')}) | {r['plan']} | "
                   f"{r.get('batch')} ({r.get('batch_split')}) | {r.get('status')} | "
                   f"{(r.get('error') or '').splitlines()[0][:160] if r.get('error') else ''} |"
                   + " |" * 8)
        continue
      mfu = _f(r.get("mfu"), "{:.1%}") + (f" (TF32 {r['mfu_tf32']:.1%})"
                                          if r.get("mfu_tf32") else "")
      if r.get("mfu") is None and r.get("of_measured_matmul"):  # no data-sheet peak (CPU)
        mfu = f"{r['of_measured_matmul']:.1%} of measured matmul"
      out.append(f"| {r['dtype']} | {r['impl']} ({r['attn_impl']}) | {r['plan']} | "
                 f"{r['batch']} ({r['batch_split']}) | ok | {r['seconds'] * 1e3:.1f} | "
                 f"{r['tokens_per_s']:.0f} | {_gib(r.get('peak_bytes'))} | "
                 f"{_gib(r.get('compiled_bytes'))} | {mfu} | {r['model_tflops_per_s']:.3g} | "
                 f"{vs} | {r['compile_seconds']:.1f} | {r['plan_keys']} |")
  if ref_rows:
    out += ["", "## Reference (PyTorch) training step, same device", "",
            "| shapes | plan | batch | status | ms/step | tokens/s | peak GiB | device, torch "
            "| caches |", "|---|---|---|---|---|---|---|---|---|"]
    for r in ref_rows:
      if r.get("status") in ("ok", "stand_in"):
        note = (f"stand-in ({r.get('error')}): not a reference number"
                if r.get("stand_in") else f"{r.get('device')}, {r.get('torch')}")
        out.append(f"| {r['shapes']} | {r['plan']} | {r['batch']} | {r['status']} | "
                   f"{r['seconds'] * 1e3:.1f} | {r['tokens_per_s']:.0f} | "
                   f"{_gib(r.get('peak_bytes'))} | {note} | {r.get('cache_sizes', '')} |")
      else:
        out.append(f"| {r['shapes']} | {r['plan']} | {r.get('batch')} | {r.get('status')} | "
                   f"{(r.get('error') or '')[:160]} | | | | |")
  rows = st.get("sampling", {}).get("rows", [])
  if rows:
    out += ["", "## Sampling (ring key/value caches, one jitted scan)", "",
            "| model | plan | streams | tokens | status | tokens/s | compile s | keys/query |",
            "|---|---|---|---|---|---|---|---|"]
    for r in rows:
      if r.get("status") == "ok":
        out.append(f"| {r['label']} | {r['plan']} | {r['batch']} | {r['length']} | ok | "
                   f"{r['tokens_per_s']:.0f} | {r['compile_seconds']:.1f} | {r['plan_keys']} |")
      else:
        out.append(f"| {r['label']} | {r['plan']} | {r['batch']} | {r.get('length')} | "
                   f"{r.get('status')} | {(r.get('error') or '')[:160]} | | |")
  return "\n".join(out) + "\n"


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--out", help="folder for suite.json, suite.md and suite.log")
  p.add_argument("--dry_run", action="store_true",
                 help="CPU rehearsal: tiny shapes, Pallas interpreted, reference stand-in")
  p.add_argument("--budget_s", type=float, default=None,
                 help="the whole suite's seconds (default 510 on a GPU, 100 for the dry run)")
  p.add_argument("--stages", nargs="*", default=None, choices=STAGES,
                 help="run only these (the others are recorded as skipped); env always runs")
  p.add_argument("--impls", nargs="*", default=None, choices=sorted(IMPLS))
  p.add_argument("--dtypes", nargs="*", default=["bfloat16", "float32"])
  p.add_argument("--plans", nargs="*", default=list(PLANS), choices=ALL_PLANS)
  default_ref = os.path.join(REPO, ".gpu_carry", "adaptive-span")
  p.add_argument("--reference_dir", default=default_ref,
                 help="a checkout of facebookresearch/adaptive-span (bench/gpu_prepare.sh)")
  p.add_argument("--reference_python", default=sys.executable,
                 help="the interpreter with PyTorch for the reference stage")
  p.add_argument("--cache_dir", default="/tmp/span_lm_gpu_suite_jax_cache",
                 help="JAX's persistent compilation cache (GPU only; '' for none): a second run "
                      "on the same machine skips compiles")
  p.add_argument("--jobs", type=int, default=None,
                 help="stages run side by side after env (default: 2 for the dry run, 1 on a "
                      "GPU, where stages must not share the device)")
  p.add_argument("--child", default=None, choices=sorted(CHILDREN), help=argparse.SUPPRESS)
  p.add_argument("--spec", default=None, help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.child:
    CHILDREN[args.child](json.loads(args.spec))
    return
  if not args.out:
    p.error("--out DIR is required")
  if args.budget_s is None:
    args.budget_s = 100.0 if args.dry_run else float(sum(BUDGET_S.values()))
  args.budget_scale = args.budget_s / sum(BUDGET_S.values())
  if args.jobs is None:
    args.jobs = 2 if args.dry_run else 1
  if args.stages is not None:
    args.stages = set(args.stages) | {"env"}
  res = Suite(args).run()
  bad = {k: v["status"] for k, v in res["stages"].items() if v["status"] != "ok"}
  print(f"wrote {args.out}/suite.json and suite.md in {res['seconds']:.0f}s; "
        f"stages not ok: {bad or 'none'}")


if __name__ == "__main__":
  main()

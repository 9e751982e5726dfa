"""The GPU driver's step children (bench/gpu_run.py runs `python -m bench.gpu_steps --child KIND
--spec JSON`, one process each, so a crash or an out-of-memory is that child's rows): the device
and its measured matmul rates (`env`), span_lm's training step at named span plans (`train`),
the cached decoder (`sampling`), the PyTorch reference's step (`reference`), and each
implementation against the plain definition (`correctness`, bench/gpu_layer_check.py).
Rows go to stdout as `ROW {json}` as they complete (bench/harness.py).
"""
import argparse
import json
import os
import sys
import time

from bench import gpu_layer_check
from bench import harness
from span_lm import config as config_lib
from span_lm import kernels
from span_lm.kernels import chips
from span_lm.model import caches as caches_lib
from span_lm.model import config as model_config
from span_lm.model import costs as costs_lib
from span_lm.model import plan as plan_lib
from span_lm.model.config import ModelConfig, Span
from span_lm.model.transformer import SpanTransformer
from span_lm.tools import sample
from span_lm.train import optimizer as optimizer_lib
from span_lm.train import steps as steps_lib

REFERENCE_GPUS = 8  # the paper's enwik8 runs: a batch of 64 streams over 8 GPUs
setup_jax = gpu_layer_check.setup_jax


def child_env(spec):
  jax = setup_jax(spec)
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
  cuda = harness.cuda_versions(("cuda_runtime", "cuda_driver", "cudnn", "cublas", "cusparse"))
  row.update(cuda or {"cuda": "n/a (no jax CUDA plugin)"})
  try:
    row["environment_info"] = jax.print_environment_info(return_string=True)[-3000:]
  except Exception:  # pylint: disable=broad-except
    pass
  row["peak_table"] = chips.peak_tflops(dev.device_kind)
  # Matmul rates as run here (float32 accumulation), and whether float32 dots round like TF32.
  n = 8192 if jax.default_backend() == "gpu" else 512
  for dt in ("bfloat16", "float32"):
    a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n)), dt)
    row[f"matmul_tflops_{dt}"] = harness.matmul_gflops(a, reps=10) / 1e3
  x = jnp.asarray(np.random.default_rng(1).standard_normal((1024, 1024)), jnp.float32)
  lo = jax.jit(lambda a: a @ a)(x)
  hi = jax.jit(lambda a: jnp.dot(a, a, precision=jax.lax.Precision.HIGHEST))(x)
  row["float32_dot_rel_err_default_vs_highest"] = float(jnp.max(jnp.abs(lo - hi)) /
                                                        jnp.max(jnp.abs(hi)))
  row["matmul_precision_config"] = str(jax.config.jax_default_matmul_precision)
  row["accepted_impls"] = list(kernels.ATTN_IMPLS)
  row["status"] = "ok"
  harness.emit(row)



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
  """ModelConfig and optimizer of a training/sampling child: a config file, or bench/train_step.py's
  issue-8 shapes, with spec["model"]'s changes (fields and dotted section fields, e.g.
  'span.size') and spec's dtype and attention.impl."""
  changes = dict(spec.get("model", {}), dtype=spec["dtype"], **{"attention.impl": spec["use"]})
  if spec.get("config"):
    run = config_lib.load_config(spec["config"])
    return model_config.updated(ModelConfig.from_config(run.model, vocab_size=205),
                                **changes), run.optim
  cfg = model_config.updated(ModelConfig(vocab_size=205), **changes)
  from configs import base  # pylint: disable=g-import-not-at-top
  optim = base.get_base_config().optim  # bench/train_step.py's: the reference's Adagrad
  optim.name, optim.lr, optim.grad_clip, optim.warmup = "adagrad", 0.07, 0.03, 200
  return cfg, optim


def child_train(spec):
  """spec: variants [{impl, use, dtype}], plans; one row per (variant, plan). A GPU run gives
  each variant its own child (its own peak memory); the dry run puts them in one."""
  jax = setup_jax(spec)
  import gc  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  batch, block, split = spec["batch"], spec["block"], spec["batch_split"]
  kind = jax.devices()[0].device_kind
  peaks = chips.peak_tflops(kind)
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
        harness.emit(dict(row, **harness.error_row(e)))
      continue
    for row in rows:
      plan_name = row["plan"]
      if time.time() + spec.get("row_estimate_s", 0) > spec["deadline"]:
        harness.emit(dict(row, status="skipped", error="stage budget spent" if not spec.get(
            "row_estimate_s") else f"under the ~{spec['row_estimate_s']}s a row takes was left"))
        continue
      try:
        cfg = model_config.updated(
            base_cfg, **{"span.mode": "fixed" if plan_name == "fixed" else "adaptive"})
        row.update(model={"n_layers": cfg.n_layers, "d_model": cfg.d_model,
                          "n_heads": cfg.n_heads, "head_dim": cfg.head_dim, "d_ff": cfg.d_ff,
                          "span": cfg.span.size, "dropout": cfg.dropout,
                          "attn_block": cfg.attention.block, "attn_tiles": cfg.attention.tiles})
        if cfg.attention.impl.startswith("pallas"):
          try:
            row["tiles"] = list(kernels.gpu_tiles(cfg.attn_spec, cfg.attention.impl, cfg.dtype))
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
        measured = spec.get("measured_tflops", {}).get(var["dtype"])
        row.update(harness.roofline(row["flops"], sec, var["dtype"], peaks, measured))
        row["status"] = "ok"
      except Exception as e:  # pylint: disable=broad-except
        row.update(harness.error_row(e))
      harness.emit(row)
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
  compiler = steps_lib.build(cfg, tx, steps_lib.StepOptions(
      batch=batch, eval_batch=jax.device_count(), batch_split=split, log=lambda _: None))
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
         "plan_detail": plan.describe(), "compiled_bytes": harness.compiled_bytes(step)}
  state, metrics, times = harness.time_steps(step, state, dev, spec["reps"], spec["warmup"])
  out["seconds"] = float(np.median(times))
  out["min_seconds"] = float(min(times))
  out["loss"] = float(metrics["loss"])
  out["flops"] = int(costs_lib.train_step_flops(cfg, plan, batch, block))
  stats = jax.devices()[0].memory_stats() or {}
  out["peak_bytes"] = stats.get("peak_bytes_in_use")
  return out


def child_sampling(spec):
  jax = setup_jax(spec)
  import numpy as np  # pylint: disable=g-import-not-at-top
  cfg, _ = _model_cfg(spec)
  for plan_name in spec["plans"]:
    for batch in spec["batches"]:
      row = {"label": spec["label"], "plan": plan_name, "batch": batch, "dtype": spec["dtype"],
             "length": spec["length"], "device": jax.devices()[0].device_kind}
      if time.time() + spec.get("row_estimate_s", 0) > spec["deadline"]:
        harness.emit(dict(row, status="skipped", error="stage budget spent"))
        continue
      try:
        c = model_config.updated(cfg, dropout=0.0, **{"span.mode": "adaptive"})
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
        row["seconds"] = harness.median_s(lambda: sample.generate(
            c, params, plan, prompt, spec["length"], temperature=1.0), spec["reps"], warmup=0)
        row["tokens_per_s"] = spec["length"] * batch / row["seconds"]
        row["plan_keys"] = plan.attention_keys()
        row["status"] = "ok"
      except Exception as e:  # pylint: disable=broad-except
        row.update(harness.error_row(e))
      harness.emit(row)


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
      harness.emit(dict(row, status="skipped", error="stage budget spent"))
      continue
    if why is not None:
      if not spec["dry_run"]:
        harness.emit(dict(row, status="error", error=why))
        continue
      a = np.ones((64, 64), np.float32)  # the stand-in: the timing harness over a numpy loop
      times = []
      for _ in range(spec["reps"]):
        t = time.perf_counter()
        for _ in range(case["layers"]):
          a = np.tanh(a @ a / 64)
        times.append(time.perf_counter() - t)
      sec = float(np.median(times))
      harness.emit(dict(row, status="stand_in", stand_in=True, error=why, seconds=sec,
                tokens_per_s=case["batch"] * case["block"] / sec))
      continue
    try:
      row.update(_reference_step(ref, case, spec["reps"]))
      row["status"] = "ok"
    except (Exception, SystemExit) as e:  # pylint: disable=broad-except  # SystemExit: modified files
      row.update(harness.error_row(e))
    harness.emit(row)


def _reference_step(reference_dir, case, reps, warmup=2):
  """bench/reference_step.py's step (the one bench/train_step.py times, its files' sha256 checked)
  with the case's shapes and per-head spans, on the GPU."""
  from bench import reference_step  # pylint: disable=g-import-not-at-top
  return reference_step.measure_step(
      reference_dir, layers=case["layers"], heads=case["heads"], d_model=case["d_model"],
      d_ff=case["d_ff"], dropout=case["dropout"], span=case["span"], batch=case["batch"],
      block=case["block"], ratios=None if case["plan"] == "fixed" else case["ratios"],
      reps=reps, warmup=warmup)




CHILDREN = {"env": child_env, "correctness": gpu_layer_check.child_correctness,
            "train": child_train, "reference": child_reference, "sampling": child_sampling}


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--child", required=True, choices=sorted(CHILDREN))
  p.add_argument("--spec", required=True, help="the child's JSON spec (bench/gpu_families.py)")
  args = p.parse_args()
  CHILDREN[args.child](json.loads(args.spec))


if __name__ == "__main__":
  main()

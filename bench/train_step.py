"""The full training step (reference Adagrad, clipping, donated state) on the issue-8 shapes, as
achieved GFLOP/s against this machine's measured matmul peak and against the reference's time.

Shapes: 4 layers, D=256, 4 heads, FF 1024, block 128, batch 16, adaptive S=1024, vocab 205 (enwik8).
Cases:
  short   learned spans within 64 tokens (span + ramp), as after ~1000 steps of configs/tiny.py;
          reference: 0.37 s/step on the issue's CPU
  fixed   fixed span S=1024; reference: 1.24 s/step on the issue's CPU
"vs reference" divides those quoted times by ours, unless `--reference_dir` names a checkout of
facebookresearch/adaptive-span: then bench/reference_step.py times the reference's step on this
machine (run by `--reference_python`, an interpreter with PyTorch) before each case, and the
ratio is of the two medians measured side by side.
Each (case, devices) runs in its own process: `--devices N` splits the CPU host into N JAX devices
(config.dist.cpu_devices) and shards the batch over them, as `python main.py` does by default.
FLOPs per step are span_lm.model.costs.train_step_flops (equal to the dot instructions XLA compiles).

  python -m bench.train_step                                # short + fixed, 1 and 2 devices
  python -m bench.train_step --cases short --devices 2 --reps 20
  python -m bench.train_step --cases fixed --devices 1 --dtype bfloat16 --profile 20
      # and where the step's time goes, per XLA operation (bench/profile_step.py's summary)
  python -m bench.train_step --config configs/enwik8.py --devices 1 --dtype bfloat16 --batch 8
      # a paper config's model, block and optimizer (GPU: MFU against the bf16 matmul peak)
  ... --attn_impl pallas     # the same with the fused kernel (span_lm/kernels/span/pallas_gpu.py)
  python -m bench.train_step --dtype bfloat16 --devices 1 --reference_dir ~/src/adaptive-span \
      --reference_python ~/torch/bin/python --reps 20   # the reference timed in the same run

The peak is a 4096^3 (CPU: 2048^3) jitted matmul on the default device in --dtype with float32
accumulation, measured in the same run; "of peak" is the step's achieved FLOP rate over it (MFU).
"""
import argparse
import ast
import json
import os
import subprocess
import sys
import tempfile
import time

from bench import harness

# The quoted reference times, for its CPU (AVX512-BF16, ~200 GFLOP/s float32); on other
# machines time the reference itself (--reference_dir): on the 2-core AMX Xeon on 2026-11-24
# (commit bc06a85) it took 0.20-0.22 and 0.65-0.68 s (docs/benchmarks.md).
REFERENCE_S = {"short": 0.37, "fixed": 1.24}
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def matmul_peak(dtype: str = "float32", reps: int = 20) -> float:
  """GFLOP/s of a large jitted a @ b (float32 accumulation) on the default device; on CPU the
  whole host (one device, every core)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  n = 2048 if jax.default_backend() == "cpu" else 8192
  return harness.matmul_gflops(jnp.ones((n, n), dtype), reps, block_each=True)


def worker(spec: dict) -> dict:
  from span_lm.train import cpu_host  # pylint: disable=g-import-not-at-top
  if not spec["args"]["system_malloc"]:  # as main.py does on CPU hosts, before the backend starts
    cpu_host.keep_freed_memory()
  import jax  # pylint: disable=g-import-not-at-top
  if spec["devices"] > 1:  # CPU: split the host (an accelerator's devices are what they are)
    jax.config.update("jax_num_cpu_devices", spec["devices"])
  import numpy as np  # pylint: disable=g-import-not-at-top
  from span_lm.model import caches as caches_lib  # pylint: disable=g-import-not-at-top
  from span_lm.model import plan as plan_lib  # pylint: disable=g-import-not-at-top
  from span_lm.model import config as model_config  # pylint: disable=g-import-not-at-top
  from span_lm.model import costs as costs_lib  # pylint: disable=g-import-not-at-top
  from span_lm import kernels  # pylint: disable=g-import-not-at-top
  from span_lm.model.config import ModelConfig, Span  # pylint: disable=g-import-not-at-top
  from span_lm.train import optimizer as optimizer_lib  # pylint: disable=g-import-not-at-top
  from span_lm.train import steps as steps_lib  # pylint: disable=g-import-not-at-top
  from configs import base  # pylint: disable=g-import-not-at-top

  a = spec["args"]
  case = spec["case"]
  mode = "fixed" if case == "fixed" else "adaptive"
  if a["config"]:  # a run config's model, block, batch and optimizer
    from span_lm import config as config_lib  # pylint: disable=g-import-not-at-top
    run = config_lib.load_config(a["config"])
    cfg = model_config.updated(ModelConfig.from_config(run.model, vocab_size=205),
                               dtype=a["dtype"], **{"span.mode": mode,
                                                    "attention.impl": a["attn_impl"]})
    optim = run.optim
    batch, block = a["batch"] or run.data.batch, run.data.block
  else:
    cfg = ModelConfig(vocab_size=205, d_model=a["d_model"], n_layers=a["layers"],
                      n_heads=a["heads"], d_ff=a["d_ff"], dtype=a["dtype"],
                      span=Span(size=a["span"], mode=mode, ramp=32),
                      attention=kernels.Attention(impl=a["attn_impl"]))
    optim = base.get_base_config().optim
    optim.name, optim.lr, optim.grad_clip, optim.warmup = "adagrad", 0.07, 0.03, 200
    batch, block = a["batch"] or 16, a["block"]
  for kv in a["set"]:
    key, value = kv.split("=", 1)
    try:
      value = ast.literal_eval(value)
    except (ValueError, SyntaxError):
      pass  # a bare string
    cfg = model_config.updated(cfg, **{key: value})
  tx, _ = optimizer_lib.make_optimizer(optim)
  compiler = steps_lib.build(cfg, tx, steps_lib.StepOptions(batch=batch,
                                                            eval_batch=jax.device_count(),
                                                            log=lambda _: None))
  layout = compiler.layout

  # The plan first (from span ratios), then the state at that plan.
  full = plan_lib.full_plan(cfg)
  state = steps_lib.init_state(cfg, tx, full, 1, 1, 0)
  params = state["params"]
  if case == "short":
    z = (a["short_span"] - cfg.span.ramp) / cfg.span.size
    params = plan_lib.with_span_ratios(params, [np.full(cfg.n_heads, z, np.float32)] *
                                       cfg.n_layers)
  plan = plan_lib.plan_from_params(cfg, params)
  plan_lib.check_plan(cfg, params, plan)
  rng = np.random.default_rng(0)
  state = {"step": state["step"], "params": params, "opt_state": tx.init(params),
           "rng": state["rng"],
           "caches": tuple(np.asarray(rng.standard_normal(c.shape), np.float32)
                           for c in caches_lib.init_caches(cfg, plan, batch)),
           "eval_caches": caches_lib.init_caches(cfg, plan, jax.device_count())}
  state = jax.device_put(state, layout.state_shardings(jax.eval_shape(lambda: state)))
  host = steps_lib.host_batch(rng.integers(0, 205, (batch, block)),
                              rng.integers(0, 205, (batch, block)), False)
  dev = layout.shard_batch(host)
  t0 = time.perf_counter()
  step = compiler.train(plan, state, dev)
  compile_s = time.perf_counter() - t0
  if a["hlo"]:
    with open(a["hlo"], "w") as f:
      f.write(step.as_text())
  state, metrics, times = harness.time_steps(step, state, dev, a["reps"], warmup=3)
  if a["profile"]:  # where the step's time goes, per XLA operation (to stderr: the parent prints it)
    from bench import profile_step  # pylint: disable=g-import-not-at-top

    def one():
      nonlocal state
      st, met = step(state, dev)
      jax.block_until_ready((st, met))
      state = st
    print(profile_step.trace_summary(one, a["profile"]), file=sys.stderr, flush=True)
  sec = float(np.median(times))
  fl = costs_lib.train_step_flops(cfg, plan, batch, block)
  stats = jax.devices()[0].memory_stats() or {}
  import resource  # pylint: disable=g-import-not-at-top
  return {"max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
          "huge_pages": cpu_host.huge_pages_active(), "case": case,
          "devices": jax.device_count(), "device": jax.devices()[0].device_kind,
          "seconds": sec, "min_seconds": min(times),
          "peak_bytes": stats.get("peak_bytes_in_use"), "batch": batch, "block": block,
          "compile_seconds": compile_s, "flops": fl, "gflops_per_s": fl / sec / 1e9,
          "tokens_per_s": batch * block / sec, "plan": plan.describe()}


def run_reference(args, case: str) -> dict:
  """bench/reference_step.py for one case in its own process; prints its row."""
  cmd = [args.reference_python, "-m", "bench.reference_step",
         "--reference_dir", args.reference_dir, "--cases", case, "--reps", str(args.reps),
         "--short_span", str(args.short_span)]
  if not args.system_malloc:
    cmd.append("--keep_freed_memory")
  env = None  # the same malloc as span_lm's workers: huge pages unless --no_huge_pages
  from span_lm.train import cpu_host  # pylint: disable=g-import-not-at-top
  if args.huge_pages and cpu_host.cpu_only():
    env = cpu_host.huge_pages_env()
  with tempfile.NamedTemporaryFile(suffix=".json") as f:
    out = subprocess.run(cmd + ["--json", f.name], capture_output=True, text=True, cwd=REPO,
                         env=env)
    if out.returncode:
      raise SystemExit(out.stdout[-2000:] + out.stderr[-4000:])
    r = json.load(f)["rows"][0]
  print(f"| reference {case} (PyTorch {r['torch']}, float32) | - | {r['seconds']:.3f} | "
        f"{r['tokens_per_s']:.0f} | | | | 1.00x | - |", flush=True)
  return r


def main():
  from span_lm.train import cpu_host  # pylint: disable=g-import-not-at-top
  from span_lm import kernels  # pylint: disable=g-import-not-at-top
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--cases", nargs="+", default=["short", "fixed"], choices=sorted(REFERENCE_S))
  p.add_argument("--devices", type=int, nargs="+", default=[1, 2])
  harness.int_flags(p, layers=4, d_model=256, heads=4, d_ff=1024)
  p.add_argument("--span", type=int, default=1024)
  p.add_argument("--block", type=int, default=128)
  p.add_argument("--batch", type=int, default=0, help="0: 16, or the --config's data.batch")
  p.add_argument("--config", default="", help="take model/block/batch/optimizer from a run config")
  p.add_argument("--short_span", type=int, default=64, help="span + ramp of the short heads")
  p.add_argument("--dtype", default="float32")
  p.add_argument("--attn_impl", default="auto",
                 choices=list(kernels.ATTN_IMPLS) + list(kernels.ALIASES),
                 help="span_lm/kernels: auto picks by backend; pallas: the fused kernel (GPU)")
  p.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE",
                 help="model config overrides, e.g. attention.chunk=128 (values as Python literals)")
  cpu_host.add_flag(p)
  p.add_argument("--reps", type=int, default=10)
  p.add_argument("--profile", type=int, default=0, metavar="TOP",
                 help="also trace 3 steps and print the TOP operation kinds and operations")
  p.add_argument("--hlo", default="", help="write the compiled step's HLO here (one case)")
  p.add_argument("--reference_dir", default="",
                 help="a checkout of facebookresearch/adaptive-span: time its step in this run")
  p.add_argument("--reference_python", default=sys.executable,
                 help="the interpreter (with PyTorch) that runs bench/reference_step.py")
  p.add_argument("--json", default=None)
  p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.worker:
    print("RESULT " + json.dumps(worker(json.loads(args.worker))), flush=True)
    return

  if not args.reference_dir and not args.config:
    print("vs reference: against the times quoted for the issue's CPU "
          f"({REFERENCE_S['short']} / {REFERENCE_S['fixed']} s); --reference_dir times it here")
  peak = matmul_peak(args.dtype)
  print(f"{args.dtype} matmul peak (f32 accumulation, default device): {peak:.1f} GFLOP/s")
  print("| case | devices | s/step | tokens/s | GFLOP/step | GFLOP/s | of peak | vs reference "
        "tokens/s | compile s |")
  print("|---|---|---|---|---|---|---|---|---|")
  rows = []
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
  if args.huge_pages and cpu_host.cpu_only(env):  # as main.py on a CPU host (train/cpu_host.py)
    env = cpu_host.huge_pages_env(env) or env
  for case in args.cases:
    reference_s = None if args.config else REFERENCE_S[case]
    if args.reference_dir and not args.config:
      reference_s = run_reference(args, case)["seconds"]
    for n in args.devices:
      spec = {"case": case, "devices": n, "args": vars(args)}
      out = subprocess.run([sys.executable, "-m", "bench.train_step", "--worker",
                            json.dumps(spec)], env=env, capture_output=True, text=True, cwd=REPO)
      if out.returncode:
        raise SystemExit(out.stdout[-2000:] + out.stderr[-4000:])
      r = json.loads(out.stdout.split("RESULT ")[-1])
      if args.profile:
        print(out.stderr[out.stderr.find("traced operations"):], flush=True)
      r["peak_gflops_per_s"] = peak
      # The reference's times are for the default shapes only.
      r["reference_seconds"] = reference_s
      r["vs_reference"] = None if reference_s is None else reference_s / r["seconds"]
      vs = "-" if r["vs_reference"] is None else f"{r['vs_reference']:.2f}x"
      rows.append(r)
      if r["peak_bytes"]:
        print(f"  ({r['device']}: peak memory {r['peak_bytes'] / 2**30:.2f} GiB)")
      else:
        print(f"  (host: peak resident memory {r['max_rss_bytes'] / 2**30:.2f} GiB, huge pages "
              f"{'on' if r['huge_pages'] else 'off'})")
      print(f"| {case} | {r['devices']} | {r['seconds']:.3f} | {r['tokens_per_s']:.0f} | "
            f"{r['flops'] / 1e9:.1f} | {r['gflops_per_s']:.0f} | "
            f"{r['gflops_per_s'] / peak:.0%} | {vs} | "
            f"{r['compile_seconds']:.1f} |", flush=True)
  if args.json:
    harness.write_json(args.json, {"args": vars(args), "peak_gflops_per_s": peak, "rows": rows},
                       indent=2)


if __name__ == "__main__":
  main()

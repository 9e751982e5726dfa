"""Measured train-step time and peak memory versus the span limit S, fixed vs adaptive spans.

The paper's claim (Sec. 3): an adaptive-span model with S=8192 trains in about the time and memory
of a fixed-span model with S=2048. For each S and model this compiles the real training step
(span_lm.train.steps.train_step: reference Adagrad, donated state) for its span plan, runs one
warm-up step and times --reps more. Each case runs in a fresh subprocess so that the device's
peak_bytes_in_use (GPU/TPU) is that case's own; on CPU, where devices report no memory statistics,
the memory columns are XLA's compiled buffer sizes (temporaries + arguments + outputs - donated).
Beside the measurements: the analytic matmul FLOPs of the step and peak activation estimate
(span_lm/model/costs.py). Writes span_scaling.json and span_scaling.png into --out.

Adaptive spans (z in tokens per layer and head, capped at each S):
  --workdir RUN        from a checkpoint (its model shapes replace --layers/--d_model/...);
  --z_json FILE        a (layers, heads) JSON list;
  default              shaped like the paper's Fig. 4: in the top third of the layers one head at
                       z=4000, one at 1500, one at 500; every other head z=0 (span R).

  python -m bench.span_scaling                          # paper small model, S = 1024 ... 8192
  python -m bench.span_scaling --spans 256 512 --layers 2 --d_model 64 --heads 4 --d_ff 256 \\
      --block 64 --batch 2 --reps 1 --out /tmp/scaling    # smoke test, a minute on a CPU
"""
import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

from bench import harness


def default_z(layers: int, heads: int) -> list[list[float]]:
  z = np.zeros((layers, heads))
  for i in range(layers - max(1, layers // 3), layers):
    for h, v in enumerate((4000.0, 1500.0, 500.0)[:heads]):
      z[i, h] = v
  return z.tolist()


def checkpoint_z(workdir: str):
  """(ModelConfig, z tokens (layers, heads)) of the latest checkpoint in a run directory (its
  config in sections or, from an older run, flat: ModelConfig.from_config reads both)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  from span_lm.model import caches as caches_lib  # pylint: disable=g-import-not-at-top
  from span_lm.model import plan as plan_lib  # pylint: disable=g-import-not-at-top
  from span_lm.model.config import ModelConfig  # pylint: disable=g-import-not-at-top
  from span_lm.model.transformer import SpanTransformer  # pylint: disable=g-import-not-at-top
  from span_lm.train.checkpoint import Checkpointer  # pylint: disable=g-import-not-at-top
  with Checkpointer(os.path.join(workdir, "checkpoints"), max_to_keep=None) as ckpt:
    meta = ckpt.restore_meta()
    cfg = ModelConfig.from_config(meta["model_cfg"])
    if cfg.span.mode != "adaptive":
      raise ValueError(f"{workdir}: span.mode {cfg.span.mode!r} has no learned spans")
    shapes = jax.eval_shape(lambda: SpanTransformer(cfg).init(
        jax.random.key(0), jnp.zeros((1, 1), jnp.int32), caches_lib.init_caches(cfg, None, 1)))
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one),
                          shapes["params"])
    params = ckpt.restore_params(target)
  z = [np.asarray(r) * cfg.span.size for r in plan_lib.span_ratios(params)]
  return cfg, np.stack(z).tolist()


def run_case(case: dict) -> dict:
  """One (S, model) measurement; runs in its own process."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  from span_lm.model import plan as plan_lib  # pylint: disable=g-import-not-at-top
  from span_lm.model import config as model_config  # pylint: disable=g-import-not-at-top
  from span_lm.model import costs  # pylint: disable=g-import-not-at-top
  from span_lm.model.config import ModelConfig  # pylint: disable=g-import-not-at-top
  from span_lm.tools import flops  # pylint: disable=g-import-not-at-top
  from span_lm.train import steps as steps_lib  # pylint: disable=g-import-not-at-top
  s, kind = case["span"], case["kind"]
  model = dict(case["model"])  # fields and dotted section fields ('span.ramp')
  cfg = model_config.updated(ModelConfig(vocab_size=model.pop("vocab_size")), **model,
                             **{"span.size": s, "span.mode": kind, "span.loss": 0.0})
  tx = flops.default_optimizer()
  ratios = [np.minimum(np.asarray(z, np.float32), s) / s for z in case["z"]]
  plan = plan_lib.plan_from_ratios(cfg, ratios)
  state = jax.jit(lambda: steps_lib.init_state(cfg, tx, plan, case["batch"], 1, 0))()
  if kind == "adaptive":
    state["params"] = plan_lib.with_span_ratios(
        state["params"], [jnp.asarray(r, jnp.float32) for r in ratios])
  plan_lib.check_plan(cfg, state["params"], plan)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, cfg.vocab_size, (case["batch"], case["block"] + 1))
  batch = steps_lib.host_batch(tokens[:, :-1], tokens[:, 1:], False)
  # The step as a run compiles it (train.steps.build: mesh, shardings, donated state).
  compiler = steps_lib.build(cfg, tx, steps_lib.StepOptions(batch=case["batch"], eval_batch=1,
                                                            num_devices=1))
  t0 = time.perf_counter()
  compiled = compiler.train(plan, state, batch)
  compile_s = time.perf_counter() - t0
  state, m, times = harness.time_steps(compiled, state, batch, case["reps"], warmup=1)
  mem = harness.memory(compiled)
  stats = jax.devices()[0].memory_stats() or {}
  step_flops = costs.train_step_flops(cfg, plan, case["batch"], case["block"])
  sec = float(np.median(times))
  spans = plan_lib.needed_tokens(cfg, np.stack(plan_lib.span_ratios(state["params"]))) if (
      kind == "adaptive") else np.full((cfg.n_layers, cfg.n_heads), s)
  return {"span": s, "kind": kind, "step_seconds": sec, "step_seconds_all": times,
          "compile_seconds": compile_s, "avg_span": float(np.mean(spans)),
          "plan": plan.describe(), "attention_keys": plan.attention_keys(),
          "device_peak_bytes": stats.get("peak_bytes_in_use"),
          "xla_temp_bytes": mem["temp"], "xla_total_bytes": mem["total"],
          "tokens_per_second": case["batch"] * case["block"] / sec,
          "analytic_step_flops": step_flops, "achieved_tflops": step_flops / sec / 1e12,
          "analytic_peak_activation_bytes": costs.peak_activation_bytes(
              cfg, plan, case["batch"], case["block"]),
          "device": jax.devices()[0].device_kind, "loss": float(m["loss"])}


def plot(rows: list[dict], path: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
  for kind, marker in (("fixed", "o-"), ("adaptive", "s-")):
    ok = [r for r in rows if r["kind"] == kind and "error" not in r]
    if not ok:
      continue
    s = [r["span"] for r in ok]
    ax1.plot(s, [1000 * r["step_seconds"] for r in ok], marker, label=kind)
    ax2.plot(s, [(r["device_peak_bytes"] or r["xla_total_bytes"]) / 2**30 for r in ok], marker,
             label=kind)
  peak = "device peak" if any(r.get("device_peak_bytes") for r in rows) else "XLA buffers"
  ax1.set(ylabel="train step (ms)", title="step time")
  ax2.set(ylabel=f"memory (GiB, {peak})", title="memory")
  spans = sorted({r["span"] for r in rows})
  for ax in (ax1, ax2):
    ax.set_xscale("log", base=2)
    ax.set_xticks(spans, [str(x) for x in spans])
    ax.minorticks_off()
    ax.set_xlabel("span limit S")
    ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--spans", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
  p.add_argument("--kinds", nargs="+", default=["fixed", "adaptive"])
  harness.int_flags(p, layers=12, d_model=512, heads=8, d_ff=2048)
  p.add_argument("--vocab", type=int, default=205)
  p.add_argument("--block", type=int, default=512)
  p.add_argument("--batch", type=int, default=8, help="per device (the paper: 64 on 8 GPUs)")
  p.add_argument("--dtype", default="float32")
  p.add_argument("--remat", default="none")
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--workdir", default=None, help="adaptive spans from this run's checkpoint")
  p.add_argument("--z_json", default=None, help="adaptive spans: (layers, heads) z in tokens")
  p.add_argument("--timeout", type=int, default=1800, help="seconds per case")
  p.add_argument("--out", default="runs/span_scaling")
  p.add_argument("--case", default=None, help=argparse.SUPPRESS)  # internal: one case as JSON
  args = p.parse_args()
  if args.case:
    try:
      print("RESULT " + json.dumps(run_case(json.loads(args.case))), flush=True)
    except Exception as e:  # noqa: BLE001  # any failure (an OOM included) is that case's result
      print("RESULT " + json.dumps({"error": f"{type(e).__name__}: {str(e)[:300]}"}), flush=True)
    return

  model = {"vocab_size": args.vocab, "d_model": args.d_model, "n_layers": args.layers,
           "n_heads": args.heads, "d_ff": args.d_ff, "dtype": args.dtype, "remat": args.remat}
  if args.workdir:
    saved, z = checkpoint_z(args.workdir)
    model = {"vocab_size": saved.vocab_size, "d_model": saved.d_model,
             "n_layers": saved.n_layers, "n_heads": saved.n_heads, "d_ff": saved.d_ff,
             "span.ramp": saved.span.ramp, "pers_mem": saved.pers_mem, "dtype": args.dtype,
             "remat": args.remat}
    source = f"checkpoint {args.workdir} (S={saved.span.size})"
  elif args.z_json:
    with open(args.z_json) as f:
      z = json.load(f)
    source = args.z_json
  else:
    z = default_z(args.layers, args.heads)
    source = "default profile (top third of layers: heads at z=4000, 1500, 500; others 0)"
  os.makedirs(args.out, exist_ok=True)
  print(f"model {model}, block {args.block}, batch {args.batch}; adaptive spans: {source}")
  print("| S | model | avg span | step ms | compile s | peak memory GiB | XLA buffers GiB | "
        "analytic GFLOP/step | TFLOP/s |")
  print("|---|---|---|---|---|---|---|---|---|")
  rows = []
  for s in args.spans:
    for kind in args.kinds:
      case = {"span": s, "kind": kind, "model": model, "z": z, "batch": args.batch,
              "block": args.block, "reps": args.reps}
      cmd = [sys.executable, "-m", "bench.span_scaling", "--case", json.dumps(case)]
      try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                              check=False, cwd=harness.REPO)
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        row = json.loads(line[-1][7:]) if line else {
            "error": f"exit {proc.returncode}: {proc.stderr.strip()[-300:]}"}
      except subprocess.TimeoutExpired:
        row = {"error": f"timed out after {args.timeout}s"}
      row.update(span=s, kind=kind)
      rows.append(row)
      if "error" in row:
        print(f"| {s} | {kind} | | failed: {row['error']} |||||", flush=True)
        continue
      peak = row["device_peak_bytes"]
      print(f"| {s} | {kind} | {row['avg_span']:.0f} | {1000 * row['step_seconds']:.1f} | "
            f"{row['compile_seconds']:.1f} | {'-' if peak is None else f'{peak / 2**30:.2f}'} | "
            f"{row['xla_total_bytes'] / 2**30:.2f} | {row['analytic_step_flops'] / 1e9:.1f} | "
            f"{row['achieved_tflops']:.2f} |", flush=True)
  ok = [r for r in rows if "error" not in r]
  adaptive = [r for r in ok if r["kind"] == "adaptive"]
  if adaptive:  # the paper's comparison: the longest adaptive model against each fixed one
    a = max(adaptive, key=lambda r: r["span"])
    mem = lambda r: r["device_peak_bytes"] or r["xla_total_bytes"]
    for f in (r for r in ok if r["kind"] == "fixed"):
      print(f"adaptive S={a['span']} / fixed S={f['span']}: step time "
            f"{a['step_seconds'] / f['step_seconds']:.2f}x, memory {mem(a) / mem(f):.2f}x")
  json_path = os.path.join(args.out, "span_scaling.json")
  with open(json_path, "w") as f:
    json.dump({"args": vars(args), "model": model, "adaptive_spans": source, "rows": rows}, f,
              indent=1)
  png = os.path.join(args.out, "span_scaling.png")
  plot(rows, png)
  print(f"wrote {os.path.abspath(json_path)}\nwrote {os.path.abspath(png)}")


if __name__ == "__main__":
  main()

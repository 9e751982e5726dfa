"""Compiled memory estimate of one training step per device, for the paper's configs.

Lowers and compiles `steps.train_step` for abstract inputs (ShapeDtypeStructs: nothing is
allocated) with the per-device share of the batch, as the paper ran it: B / --devices sequences
per device (8 GPUs), split into the config's optim.batch_split pieces. The span plan is the
worst case by default (every head at the full span S, as a fixed-span model or fully grown
adaptive spans need); --plan=initial uses the plan at initialisation. The state is donated, so
peak = arguments + outputs - aliased + temporaries, XLA's own accounting of the compiled program
on the backend it runs on (CPU here unless a GPU is visible: treat CPU numbers as an estimate;
XLA:GPU fuses and schedules differently).

  python -m bench.memory_estimate                              # all paper configs, float32
  python -m bench.memory_estimate --configs=enwik8_large --dtype=bfloat16 --remat=layer
  python -m bench.memory_estimate --gpu_less=float32:none,float32:layer,bfloat16:layer
  python -m bench.memory_estimate --configs=enwik8_large --dtype=bfloat16 --topology=v5p:2x2x1

--topology compiles for one TPU chip without one (jax[tpu]'s libtpu; the compile mode,
span_lm/tools/compile.py, does the same for whole topologies and GPUs). Each row also gives
model/costs.py's analytic estimate for one batch piece beside XLA's temporaries, for the target
compiled for: the residuals JAX saves (what XLA:CPU keeps; peak within 1.35x at small sizes), or
on a TPU the two score bands XLA:TPU keeps of the reference attention (0.78-1.09x of the
compiled temporaries measured; tests/tools/test_tools.py, docs/benchmarks.md).

On CPU, XLA schedules a recomputed layer's forward pass early, so the compiled temp does not
shrink with model.remat='layer'; --gpu_less adds an estimate built from JAX's saved residuals
and one layer's compiled working set instead (gpu_less()), checked against the compiled figure
with remat='none'.
"""
import argparse
import contextlib
import functools
import json
import os
import time

import jax
import jax.numpy as jnp

from bench import harness
from span_lm import config as config_lib
from span_lm.model import caches as caches_lib
from span_lm.model import costs
from span_lm.model import plan as plan_lib
from span_lm.kernels import target
from span_lm.model.config import ModelConfig
from span_lm.train import optimizer as optimizer_lib
from span_lm.train import steps

PAPER_CONFIGS = ("enwik8_small", "enwik8", "enwik8_large", "text8", "text8_large",
                 "enwik8_pers_small", "enwik8_pers", "wiki103_pers")
# Vocabulary sizes of the prepared corpora (reference tokenisation, <eos> included); only the
# embedding/softmax sizes depend on them.
VOCAB = {"enwik8": 206, "text8": 28, "wikitext103": 267736}
GIB = 2.0 ** 30


def _config_file(name: str) -> str:
  """configs/NAME.py of this checkout, whatever the working directory."""
  return os.path.join(harness.REPO, "configs", f"{name}.py")


def _tpu_chip(topology: str):
  """The first chip of a TPU topology (libtpu, no TPU needed): a deviceless compile target."""
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  return topologies.get_topology_desc(topology_name=topology, platform="tpu").devices[0]


def estimate(name: str, devices: int = 8, dtype: str | None = None, remat: str | None = None,
             remat_policy: str | None = None, plan: str = "full", topology: str = "") -> dict:
  """Compiles one device's train step: on this host's backend, or with `topology` (e.g.
  'v5p:2x2x1') for one chip of that TPU topology, deviceless (jax[tpu] installed). Beside XLA's
  figures: the analytic estimate of model/costs.py for one batch piece (activation_bytes, the
  residuals JAX saves; peak_activation_bytes adds the widest group's score block and gradient)."""
  overrides = {}
  if dtype:
    overrides["model.dtype"] = dtype
  if remat:
    overrides["model.remat"] = remat
  if remat_policy:
    overrides["model.remat_policy"] = remat_policy
  config = config_lib.load_config(_config_file(name), overrides)
  cfg = ModelConfig.from_config(config.model, vocab_size=VOCAB[config.data.dataset])
  tx, _ = optimizer_lib.make_optimizer(config.optim)
  d = config.data
  batch, eval_batch = max(1, d.batch // devices), max(1, d.eval_batch // devices)
  span_plan = plan_lib.full_plan(cfg) if plan == "full" else plan_lib.initial_plan(cfg)
  chip = _tpu_chip(topology) if topology else None
  where = target.compiling_for("tpu") if chip else contextlib.nullcontext()
  piece = max(1, batch // config.optim.batch_split)
  with where:
    state = jax.eval_shape(functools.partial(steps.init_state, cfg, tx, span_plan, batch,
                                             eval_batch, config.seed))
    host_batch = {"x": jax.ShapeDtypeStruct((batch, d.block), jnp.int32),
                  "y": jax.ShapeDtypeStruct((batch, d.block), jnp.int32),
                  "reset": jax.ShapeDtypeStruct((), jnp.bool_)}
    t0 = time.perf_counter()
    # The step as a run compiles it (mesh, shardings, donation, the kernel's compiler options).
    compiler = steps.build(cfg, tx, steps.StepOptions(
        batch=batch, eval_batch=eval_batch, batch_split=config.optim.batch_split,
        num_devices=None if chip else 1, devices=[chip] if chip else None))
    compiled = compiler.train(span_plan, state, host_batch)
    secs = time.perf_counter() - t0
    kept = sum(costs.activation_bytes(cfg, span_plan, piece, d.block).values())
    peak_est = costs.peak_activation_bytes(cfg, span_plan, piece, d.block)
  mem = harness.memory(compiled)
  n_params = sum(x.size for x in jax.tree.leaves(state["params"]))
  arg, out, alias, temp = mem["argument"], mem["output"], mem["alias"], mem["temp"]
  backend = f"tpu {topology} (deviceless)" if chip else jax.default_backend()
  return {"config": name, "backend": backend, "dtype": cfg.dtype,
          "remat": cfg.remat if cfg.remat == "none" else f"{cfg.remat}/{cfg.remat_policy}",
          "plan": plan, "attention_keys": span_plan.attention_keys(),
          "params_M": n_params / 1e6, "batch_per_device": batch,
          "batch_split": config.optim.batch_split, "block": d.block, "span": cfg.context,
          "layers": cfg.n_layers, "d_model": cfg.d_model,
          "arguments_GiB": arg / GIB, "outputs_GiB": out / GIB, "aliased_GiB": alias / GIB,
          "temp_GiB": temp / GIB, "peak_GiB": mem["total"] / GIB,
          "estimate_activation_GiB": kept / GIB, "estimate_peak_activation_GiB": peak_est / GIB,
          "compile_s": secs}


def _residual_bytes(cfg, plan, params, caches, rows: int, block: int) -> int:
  """Bytes the forward pass of one batch piece keeps for the backward pass (JAX's own list of
  saved residuals, parameters and caches excluded: they are in the state already)."""
  from jax._src import ad_checkpoint  # pylint: disable=g-import-not-at-top
  from span_lm.model import build_model  # pylint: disable=g-import-not-at-top
  model = build_model(cfg, plan)
  x = jax.ShapeDtypeStruct((rows, block), jnp.int32)

  def loss(p, c, tokens):
    logp, _, aux = model.apply({"params": p}, tokens, c, train=True,
                               rngs={"dropout": jax.random.key(0)})
    return jnp.mean(logp) + aux["span_loss"]

  # saved_residuals traces with concrete-free avals.
  total = 0
  for aval, why in ad_checkpoint.saved_residuals(loss, params, caches, x):
    if "from the argument" in why:
      continue
    total += aval.size * aval.dtype.itemsize
  return total


def gpu_less(name: str, devices: int = 8, dtype: str | None = None, remat: str = "layer",
             remat_policy: str | None = None, plan: str = "full", full: dict | None = None) -> dict:
  """An estimate that does not rely on XLA:CPU's scheduling of the recomputation.

  XLA:CPU schedules a recomputed layer's forward early (nothing ties it to the backward pass),
  so its compiled temp does not shrink under remat. This adds up what a device must hold:
  the compiled step's arguments and outputs (state, batch), one gradient copy, the residuals JAX
  saves across the whole model for one batch piece (with the configured recomputation), and the
  working set of one layer's forward+backward (the compiled temp of a 1-layer model, no remat).
  With remat='none' it can be checked against the compiled figure. `full`: a compiled estimate()
  of the same config to take the state's size from (its dtype and remat do not matter: the
  state is float32 either way).
  """
  full = full or estimate(name, devices, dtype, remat, remat_policy, plan)
  overrides = {"model.n_layers": 1}
  if dtype:
    overrides["model.dtype"] = dtype
  one = _estimate_with(name, devices, dict(overrides, **{"model.remat": "none"}), plan)
  config = config_lib.load_config(_config_file(name), {k: v for k, v in (
      ("model.dtype", dtype), ("model.remat", remat), ("model.remat_policy", remat_policy)) if v})
  cfg = ModelConfig.from_config(config.model, vocab_size=VOCAB[config.data.dataset])
  span_plan = plan_lib.full_plan(cfg) if plan == "full" else plan_lib.initial_plan(cfg)
  rows = max(1, config.data.batch // devices) // config.optim.batch_split
  params = jax.eval_shape(lambda: build_params(cfg, span_plan))
  caches = caches_lib.init_caches(cfg, span_plan, rows)
  caches = jax.tree.map(lambda c: jax.ShapeDtypeStruct(c.shape, c.dtype), caches)
  resid = _residual_bytes(cfg, span_plan, params, caches, rows, config.data.block)
  grads = full["params_M"] * 1e6 * 4
  base = (full["arguments_GiB"] + full["outputs_GiB"] - full["aliased_GiB"]) * GIB
  peak = base + grads + resid + one["temp_GiB"] * GIB
  return dict(full, estimate="gpu_less", dtype=cfg.dtype,
              remat=cfg.remat if cfg.remat == "none" else f"{cfg.remat}/{cfg.remat_policy}",
              residuals_GiB=resid / GIB,
              layer_temp_GiB=one["temp_GiB"], estimated_peak_GiB=peak / GIB,
              compiled_peak_GiB=full["peak_GiB"])


def build_params(cfg, plan):
  from span_lm.model import build_model  # pylint: disable=g-import-not-at-top
  model = build_model(cfg, plan)
  return model.init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32),
                    caches_lib.init_caches(cfg, plan, 1))["params"]


def _estimate_with(name, devices, overrides, plan):
  orig = config_lib.load_config

  def load(path, ov=None):
    return orig(path, dict(ov or {}, **overrides))

  config_lib.load_config = load
  try:
    return estimate(name, devices, overrides.get("model.dtype"), overrides.get("model.remat"),
                    None, plan)
  finally:
    config_lib.load_config = orig


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--configs", default=",".join(PAPER_CONFIGS))
  p.add_argument("--devices", type=int, default=8, help="devices the batch is split over")
  p.add_argument("--dtype", default="", help="override model.dtype (float32 | bfloat16)")
  p.add_argument("--remat", default="", help="override model.remat (none | layer)")
  p.add_argument("--remat_policy", default="", help="override model.remat_policy")
  p.add_argument("--plan", default="full", choices=("full", "initial"))
  p.add_argument("--topology", default="",
                 help="compile for one chip of this TPU topology (e.g. v5p:2x2x1), deviceless: "
                      "needs jax[tpu] (libtpu), no TPU")
  p.add_argument("--json", default="", help="also append one JSON line per config here")
  p.add_argument("--gpu_less", default="",
                 help="dtype:remat,... e.g. float32:none,bfloat16:layer: add the estimate that "
                      "does not rely on XLA:CPU's schedule (see gpu_less())")
  args = p.parse_args()
  print("| config | dtype | remat | B/dev x split | M | S | params | args GiB | temp GiB | "
        "peak GiB | estimate: kept / peak GiB | compile s |")
  print("|---|---|---|---|---|---|---|---|---|---|---|---|")
  for name in args.configs.split(","):
    r = estimate(name, args.devices, args.dtype or None, args.remat or None,
                 args.remat_policy or None, args.plan, args.topology)
    print(f"| {r['config']} | {r['dtype']} | {r['remat']} | {r['batch_per_device']} x "
          f"{r['batch_split']} | {r['block']} | {r['span']} | {r['params_M']:.1f}M | "
          f"{r['arguments_GiB']:.2f} | {r['temp_GiB']:.2f} | {r['peak_GiB']:.2f} | "
          f"{r['estimate_activation_GiB']:.2f} / {r['estimate_peak_activation_GiB']:.2f} | "
          f"{r['compile_s']:.0f} |", flush=True)
    if args.json:
      with open(args.json, "a", encoding="utf-8") as f:
        f.write(json.dumps(r) + "\n")
    for variant in filter(None, args.gpu_less.split(",")):
      dtype, remat = variant.split(":")
      g = gpu_less(name, args.devices, dtype, remat, args.remat_policy or None, args.plan, full=r)
      print(f"|   gpu-less | {g['dtype']} | {g['remat']} | residuals {g['residuals_GiB']:.2f} GiB "
            f"+ one layer {g['layer_temp_GiB']:.2f} GiB | | | | | | "
            f"{g['estimated_peak_GiB']:.2f} | |", flush=True)
      if args.json:
        with open(args.json, "a", encoding="utf-8") as f:
          f.write(json.dumps(g) + "\n")


if __name__ == "__main__":
  main()

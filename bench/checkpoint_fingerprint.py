"""What checkpoint fingerprints cost (issue 54): fingerprinting a paper config's training state
against saving it, restoring it and one training step, on this host.

The state is the config's own (model, optimizer, batch, its caches at --plan), laid out as a run
lays it out over --devices CPU devices; its optimizer accumulators and caches are filled with
random values (a trained state's: zeros would compress to nothing and flatter the save). Times:
  fingerprint   span_lm.train.fingerprint.fingerprints(state): the first call (compiles one
                program per top-level entry of the state), the median of --reps later calls,
                and the first call after a span plan change (the caches' programs compile)
  save          Checkpointer.save until it returns (the blocking part: fingerprints and Orbax's
                copy to host) and until the write is committed (wait); fingerprints included
  restore       Checkpointer.restore (reads, then verifies every leaf)
  step          one training step of the config at --plan (--step; slow on a CPU: a paper config;
                --step_batch B times it at batch B and scales it linearly to the config's batch)
and the fingerprint's share of the time between two saves (train.checkpoint_every steps).

  python -m bench.checkpoint_fingerprint --config configs/enwik8.py --devices 2 --step \
      --step_batch 8
"""
import argparse
import json
import os
import shutil
import statistics
import tempfile
import time


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", default="configs/enwik8.py")
  p.add_argument("--plan", default="initial", choices=["initial", "full"],
                 help="the caches' length: a run's first plan, or every head at the full span")
  p.add_argument("--devices", type=int, default=2, help="CPU devices the host is split into")
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--vocab", type=int, default=205, help="enwik8's vocabulary")
  p.add_argument("--step", action="store_true", help="also time one training step")
  p.add_argument("--step_batch", type=int, default=0,
                 help="time the step at this batch and scale to the config's (0: its own)")
  p.add_argument("--dir", default="", help="where to save (default: a temporary directory)")
  p.add_argument("--json", default="", help="write the row here")
  a = p.parse_args()

  import jax  # pylint: disable=g-import-not-at-top
  if a.devices > 1:  # the CPU backend's device count (before any backend starts)
    jax.config.update("jax_num_cpu_devices", a.devices)
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from span_lm import config as config_lib  # pylint: disable=g-import-not-at-top
  from span_lm.model import plan as plan_lib  # pylint: disable=g-import-not-at-top
  from span_lm.model.config import ModelConfig  # pylint: disable=g-import-not-at-top
  from span_lm.train import checkpoint as ckpt_lib  # pylint: disable=g-import-not-at-top
  from span_lm.train import fingerprint  # pylint: disable=g-import-not-at-top
  from span_lm.train import optimizer as optimizer_lib  # pylint: disable=g-import-not-at-top
  from span_lm.train import sharding as sharding_lib  # pylint: disable=g-import-not-at-top
  from span_lm.train import steps as steps_lib  # pylint: disable=g-import-not-at-top

  run = config_lib.load_config(a.config)
  cfg = ModelConfig.from_config(run.model, vocab_size=a.vocab)
  tx, _ = optimizer_lib.make_optimizer(run.optim)
  plan = plan_lib.initial_plan(cfg) if a.plan == "initial" else plan_lib.full_plan(cfg)
  batch, eval_batch = run.data.batch, run.data.eval_batch
  layout = sharding_lib.Layout.make(run.dist.fsdp, jax.device_count())
  init = lambda: steps_lib.init_state(cfg, tx, plan, batch, eval_batch, 0)
  abstract = jax.eval_shape(init)
  shardings = layout.state_shardings(abstract)
  state = jax.jit(init, out_shardings=shardings)()

  def noisy(tree):  # a trained state's entropy in the accumulators and caches: one program
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    out = []
    for i, (path, x) in enumerate(flat):
      top = sharding_lib.path_str(path).split("/")[0]
      if top in ("opt_state", "caches", "eval_caches") and jax.dtypes.issubdtype(
          x.dtype, np.floating):
        x = jax.random.uniform(jax.random.fold_in(jax.random.key(0), i), x.shape, x.dtype)
      out.append(x)
    return jax.tree_util.tree_unflatten(treedef, out)
  state = jax.jit(noisy, out_shardings=shardings, donate_argnums=0)(state)
  jax.block_until_ready(state)
  leaves = jax.tree.leaves(state)
  nbytes = sum(x.size * x.dtype.itemsize for x in leaves)
  print(f"{a.config} state at the {a.plan} plan: {nbytes / 2**30:.3f} GiB in {len(leaves)} "
        f"leaves, {jax.device_count()} {jax.devices()[0].platform} devices", flush=True)

  t0 = time.perf_counter()
  fingerprint.fingerprints(state)
  first = time.perf_counter() - t0
  times = []
  for _ in range(a.reps):
    t0 = time.perf_counter()
    fingerprint.fingerprints(state)
    times.append(time.perf_counter() - t0)
  fp_s = statistics.median(times)
  print(f"fingerprint: first call {first:.3f} s (compiles), then median {fp_s:.3f} s "
        f"({nbytes / fp_s / 1e9:.2f} GB/s; min {min(times):.3f})", flush=True)

  # A new span plan changes the caches' shapes: their programs compile again, the rest do not.
  grown = {}
  for key in ("caches", "eval_caches"):
    grown[key] = tuple(jax.jit(lambda c=c: jnp.zeros((c.shape[0], c.shape[1] + 64) + c.shape[2:],
                                                     c.dtype), out_shardings=c.sharding)()
                       for c in state[key])
  t0 = time.perf_counter()
  fingerprint.fingerprints(dict(state, **grown))
  plan_change = time.perf_counter() - t0
  del grown
  print(f"fingerprint after a plan change (the caches' programs compile): {plan_change:.3f} s",
        flush=True)

  directory = a.dir or tempfile.mkdtemp(prefix="fp_bench_")
  saves = []
  try:
    with ckpt_lib.Checkpointer(os.path.join(directory, "ck"), max_to_keep=2) as ckpt:
      for i in range(2):  # the first save also compiles nothing new (fingerprints ran above)
        t0 = time.perf_counter()
        ckpt.save(1000 * (i + 1), state, {"step": 1000 * (i + 1)}, force=True)
        blocking = time.perf_counter() - t0
        ckpt.wait()
        saves.append((blocking, time.perf_counter() - t0))
      target = sharding_lib.with_shardings(abstract, shardings)
      t0 = time.perf_counter()
      restored, _ = ckpt.restore(target)
      jax.block_until_ready(restored)
      restore_s = time.perf_counter() - t0
    on_disk = sum(f.stat().st_size for f in __import__("pathlib").Path(
        directory, "ck", "2000").rglob("*") if f.is_file())
  finally:
    if not a.dir:
      shutil.rmtree(directory, ignore_errors=True)
  blocking, total = saves[-1]
  print(f"save: {blocking:.3f} s blocking, {total:.3f} s until committed "
        f"({on_disk / 2**30:.3f} GiB on disk); restore + verify {restore_s:.3f} s", flush=True)
  row = {"config": a.config, "plan": a.plan, "devices": jax.device_count(),
         "state_bytes": nbytes, "leaves": len(leaves), "fingerprint_first_s": first,
         "fingerprint_after_plan_change_s": plan_change,
         "fingerprint_s": fp_s, "save_blocking_s": blocking, "save_total_s": total,
         "restore_verify_s": restore_s, "checkpoint_bytes": on_disk,
         "checkpoint_every": run.train.checkpoint_every}

  if a.step:
    del restored, state
    b = a.step_batch or batch  # a paper config's batch may not fit a CPU host: scaled below
    compiler = steps_lib.build(cfg, tx, steps_lib.StepOptions(
        batch=b, eval_batch=jax.device_count(), num_devices=jax.device_count(),
        log=lambda _: None))
    init_b = lambda: steps_lib.init_state(cfg, tx, plan, b, jax.device_count(), 0)
    state_b = jax.jit(init_b, out_shardings=compiler.layout.state_shardings(
        jax.eval_shape(init_b)))()
    rng = np.random.default_rng(0)
    dev = compiler.layout.shard_batch(steps_lib.host_batch(
        rng.integers(0, a.vocab, (b, run.data.block)),
        rng.integers(0, a.vocab, (b, run.data.block)), False))
    t0 = time.perf_counter()
    step = compiler.train(plan, state_b, dev)
    compile_s = time.perf_counter() - t0
    steps = []
    for _ in range(2):
      t0 = time.perf_counter()
      state_b, metrics = step(state_b, dev)
      jax.block_until_ready((state_b, metrics))
      steps.append(time.perf_counter() - t0)
    step_s = min(steps) * batch / b
    between = step_s * run.train.checkpoint_every
    scaled = f", batch {b} x {batch // b}" if b != batch else ""
    print(f"train step: {step_s:.2f} s (batch {batch}{scaled}; compiled in {compile_s:.0f} s; "
          f"{[round(t, 2) for t in steps]}); between two saves (every "
          f"{run.train.checkpoint_every} steps) {between:.0f} s: fingerprints "
          f"{100 * fp_s / between:.2g} %, the whole save (blocking) "
          f"{100 * blocking / between:.2g} %", flush=True)
    row.update(step_s=step_s, step_batch=b, step_compile_s=compile_s,
               fingerprint_share=fp_s / between)
  if a.json:
    with open(a.json, "w") as f:
      json.dump(row, f, indent=1)
  print("ROW " + json.dumps(row))


if __name__ == "__main__":
  main()

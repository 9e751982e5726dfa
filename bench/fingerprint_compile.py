"""The checkpoint fingerprint program (span_lm/train/fingerprint.py) compiled deviceless for a
chip this host lacks, beside the state it reads (issue 54, item 5).

For each target the config's training state (its shapes, dtypes and the run's sharding over the
target's devices, the caches at --plan) is fingerprinted by the jitted programs a save runs (one
per top-level entry of the state);
XLA's cost analysis gives the bytes that program moves per device (TPUs; a GPU's deviceless
compile gives none), and the optimized HLO the bytes its entry instructions read and how many
read each leaf, set against the bytes of the state each device holds (one pass over the state
reads each byte once); then the HBM time those bytes take against the time between two saves at
the compile mode's roofline step time (docs/targets.json, or --step_s).

  .venv-tpu/bin/python -m bench.fingerprint_compile --config configs/enwik8.py \
      --targets h100:8 v5p:2x2x2
Needs the compile toolchains (pip install -e .[tpu-compile,gpu-compile]); each target compiles in
a child process, as the compile mode's do.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4,
          "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_SHAPE = re.compile(r"\b(pred|[suf]\d+|bf16)\[([\d,]*)\]")
_DEF = re.compile(r"^\s*(?:ROOT\s+)?(%[\w.\-]+)\s*=\s*(.*?)\s+([\w\-]+)\((.*)$")


def _size(type_text: str) -> int:
  total = 0
  for dtype, dims in _SHAPE.findall(type_text):
    n = 1
    for d in filter(None, dims.split(",")):
      n *= int(d)
    total += n * _BYTES.get(dtype, 4)
  return total


_FORWARD = ("copy-start", "copy-done", "copy", "bitcast", "get-tuple-element")


def entry_reads(hlo_text: str) -> tuple[int, dict]:
  """From the optimized HLO (for backends whose deviceless compile gives no cost analysis: GPUs):
  the bytes the entry computation's instructions read, each parameter (a leaf of the state) as
  often as instructions that compute with it take it, and how many take each parameter: one pass
  over the state reads each parameter once. Copies and bitcasts of a parameter (a TPU's prefetch
  into on-chip memory: copy-start, copy-done) forward it: the instruction that reads the copy
  reads the parameter."""
  lines = hlo_text.splitlines()
  start = next(i for i, l in enumerate(lines) if l.startswith("ENTRY"))
  sizes, readers, root, read = {}, {}, {}, 0
  for line in lines[start + 1:]:
    if line.startswith("}"):
      break
    m = _DEF.match(line)
    if not m:
      continue
    name, type_text, op, rest = m.groups()
    sizes[name] = _size(type_text)
    if op == "parameter":
      readers[name] = 0
      root[name] = name
      continue
    operands = re.findall(r"(%[\w.\-]+)", rest.split("),", 1)[0])
    if op in _FORWARD and operands:  # the same buffer, moved or viewed: whoever uses it reads
      root[name] = root.get(operands[0], name)
      if root[name] in readers or op in ("bitcast", "get-tuple-element"):
        continue
    for o in operands:
      r = root.get(o, o)
      if r in readers:
        readers[r] += 1
        read += sizes[r]
      else:
        read += sizes.get(o, 0)
  return read, readers


def child(config_path: str, target: str, plan_name: str) -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  from span_lm import config as config_lib  # pylint: disable=g-import-not-at-top
  from span_lm.model import plan as plan_lib  # pylint: disable=g-import-not-at-top
  from span_lm.model.config import ModelConfig  # pylint: disable=g-import-not-at-top
  from span_lm.kernels import chips  # pylint: disable=g-import-not-at-top
  from span_lm.tools import compile as compile_lib  # pylint: disable=g-import-not-at-top
  from span_lm.train import fingerprint  # pylint: disable=g-import-not-at-top
  from span_lm.train import optimizer as optimizer_lib  # pylint: disable=g-import-not-at-top
  from span_lm.train import sharding as sharding_lib  # pylint: disable=g-import-not-at-top
  from span_lm.train import steps as steps_lib  # pylint: disable=g-import-not-at-top

  config = config_lib.load_config(config_path)
  tgt = compile_lib.parse_target(target)
  chip = tgt.chip
  if chip.platform == "gpu":
    topo = topologies.get_topology_desc(platform="cuda", topology=tgt.topology,
                                        target_config=chips.gpu_target_config(chip))
  else:
    topo = topologies.get_topology_desc(topology_name=tgt.topology, platform="tpu")
  devices = list(topo.devices)
  per_chip = max(1, len(devices) // tgt.chips)
  vocab, _ = compile_lib._vocab(config)  # pylint: disable=protected-access
  cfg = ModelConfig.from_config(config.model, vocab_size=vocab)
  tx, _ = optimizer_lib.make_optimizer(config.optim)
  plan = plan_lib.full_plan(cfg) if plan_name == "full" else plan_lib.initial_plan(cfg)
  d = config.data
  layout = sharding_lib.Layout.make(config.dist.fsdp, devices=devices)
  abstract = jax.eval_shape(lambda: steps_lib.init_state(cfg, tx, plan, d.batch, d.eval_batch, 0))
  state = sharding_lib.with_shardings(abstract, layout.state_shardings(abstract))
  leaves = jax.tree.leaves(state)
  total = sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in leaves)
  per_device = sum(
      int(np.prod(x.sharding.shard_shape(x.shape))) * np.dtype(x.dtype).itemsize for x in leaves)
  # The programs a save runs: one per top-level entry of the state (fingerprint.fingerprints)
  compile_s, cost, read, readers, programs = 0.0, {}, 0, {}, {}
  for key in sorted(state):
    group = jax.tree.leaves(state[key])
    if not group:
      continue
    t0 = time.perf_counter()
    compiled = fingerprint._all_sums.lower(group).compile()  # pylint: disable=protected-access
    programs[key] = time.perf_counter() - t0
    compile_s += programs[key]
    for k, v in compile_lib._cost(compiled).items():  # pylint: disable=protected-access
      cost[k] = cost.get(k, 0.0) + v
    r, rd = entry_reads(compiled.as_text())
    read += r
    readers.update({f"{key}:{p}": n for p, n in rd.items()})
  bw = chip.hbm_bytes_per_s / per_chip
  hbm_bytes = cost.get("bytes") or read
  return {"target": target, "devices": len(devices), "device_kind": devices[0].device_kind,
          "plan": plan_name, "leaves": len(leaves), "state_bytes": total,
          "state_bytes_per_device": per_device, "xla_bytes": cost.get("bytes"),
          "xla_flops": cost.get("flops"), "compile_s": compile_s, "compile_s_by_entry": programs,
          "hlo_read_bytes": read,
          "parameters": len(readers), "parameters_read_once": sum(v == 1 for v in readers.values()),
          "hbm_s": hbm_bytes / bw, "hbm_bytes_per_s": bw,
          "checkpoint_every": config.train.checkpoint_every}


def step_seconds(config_path: str, target: str, plan_name: str) -> float | None:
  """The compile mode's roofline step time for the config and target (docs/targets.json)."""
  try:
    with open(os.path.join(REPO, "docs", "targets.json")) as f:
      rows = json.load(f)["rows"]
  except (OSError, ValueError, KeyError):
    return None
  for r in rows if isinstance(rows, list) else rows.values():
    if not isinstance(r, dict):
      continue
    if r.get("config") == config_path and r.get("target") == target:
      tr = (r.get("shipped") or {}).get("train") or {}
      rl = tr.get("roofline") or {}
      tps, tokens = rl.get("tokens_per_s"), tr.get("tokens")
      if tps and tokens:
        return tokens / tps
  return None


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", default="configs/enwik8.py")
  p.add_argument("--targets", nargs="+", default=["h100:8", "v5p:2x2x2"])
  p.add_argument("--plan", default="full", choices=["full", "initial"],
                 help="the caches' length (full: every head at the maximum span, the largest)")
  p.add_argument("--step_s", type=float, default=0.0,
                 help="seconds per training step (default: docs/targets.json's roofline)")
  p.add_argument("--child", default="", help=argparse.SUPPRESS)
  a = p.parse_args()
  if a.child:
    print("ROW " + json.dumps(child(a.config, a.child, a.plan)), flush=True)
    return
  from span_lm.tools import compile as compile_lib  # pylint: disable=g-import-not-at-top
  print("| config | target | plan | state per device | XLA bytes (cost analysis) | HLO reads | "
        "leaves read once | HBM time | step (roofline) | between saves | share |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|")
  for target in a.targets:
    platform = compile_lib.parse_target(target).chip.platform
    out = subprocess.run([sys.executable, "-m", "bench.fingerprint_compile", "--config",
                          a.config, "--plan", a.plan, "--child", target], cwd=REPO,
                         env=compile_lib.child_env(platform), capture_output=True, text=True)
    rows = [l for l in out.stdout.splitlines() if l.startswith("ROW ")]
    if out.returncode or not rows:
      print(f"| {a.config} | {target} | failed: {(out.stderr or out.stdout).strip()[-300:]} |")
      continue
    r = json.loads(rows[-1][4:])
    step = a.step_s or step_seconds(a.config, target, a.plan)
    between = step * r["checkpoint_every"] if step else None
    gib = lambda b: f"{b / 2**30:.3f} GiB"
    print(f"| {a.config} | {target} ({r['devices']} x {r['device_kind']}) | {r['plan']} | "
          f"{gib(r['state_bytes_per_device'])} | "
          + (f"{gib(r['xla_bytes'])} ({r['xla_bytes'] / r['state_bytes_per_device']:.3f}x) | "
             if r["xla_bytes"] else "none (GPU) | ")
          + f"{gib(r['hlo_read_bytes'])} ({r['hlo_read_bytes'] / r['state_bytes_per_device']:.3f}x)"
          f" | {r['parameters_read_once']} of {r['parameters']} | "
          f"{1e3 * r['hbm_s']:.2f} ms | "
          + (f"{1e3 * step:.1f} ms | {between:.1f} s | {100 * r['hbm_s'] / between:.2g} % |"
             if step else "? | ? | ? |"), flush=True)
    print("ROW " + json.dumps(dict(r, step_s=step)), file=sys.stderr, flush=True)


if __name__ == "__main__":
  main()

"""Where the compiled multi-device training step reduces gradients across devices (issue 26).

Each step is compiled the way the trainer compiles it (loop.Run's StepCompiler, abstract state:
nothing runs) on 2 of the 8 fake CPU devices, and its HLO text is read:
- batch_split > 1: no all-reduce inside the loop over the pieces, one float32 set after it
  (GSPMD alone all-reduces every piece's gradients inside the loop: batch_split reductions);
- bf16 models: the weight gradients cross devices in float32 and reach the float32 parameters
  without a bf16 rounding (a cast bf16 weight's gradient used to be rounded right after its
  all-reduce).
"""
import math
import re

import jax
import numpy as np
import pytest

import synthetic_run
from span_lm.model import plan as plan_lib
from span_lm.train import loop


def _compiled(tmp_path, overrides: dict, num_devices: int = 2):
  """(HLO text of the compiled train step, abstract state) for the tiny synthetic run."""
  config = synthetic_run.config_for(tmp_path, overrides)
  run = loop.Run(config, num_devices=num_devices)
  try:
    plan = plan_lib.initial_plan(run.model_cfg)
    _, abstract, _ = run.abstract_state(plan)
    b, m = config.data.batch, config.data.block
    batch = {"x": jax.ShapeDtypeStruct((b, m), np.int32),
             "y": jax.ShapeDtypeStruct((b, m), np.int32),
             "reset": jax.ShapeDtypeStruct((), np.bool_)}
    return run.compiler.train(plan, abstract, batch).as_text(), abstract
  finally:
    run.ckpt.close()


def _computations(text: str) -> dict:
  """Computation name -> its instruction lines."""
  comps, name = {}, None
  for line in text.splitlines():
    m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
    if m:
      name = m.group(1)
      comps[name] = []
    elif line.startswith("}"):
      name = None
    elif name:
      comps[name].append(line)
  return comps


_CALLS = re.compile(r"(?:calls|to_apply|body|condition|true_computation|false_computation)="
                    r"%([\w.\-]+)|branch_computations=\{([^}]*)\}")


def _reachable(comps: dict, roots) -> set:
  seen, todo = set(), list(roots)
  while todo:
    c = todo.pop()
    if c not in seen:
      seen.add(c)
      for line in comps.get(c, []):
        for m in _CALLS.finditer(line):
          todo.extend([m.group(1)] if m.group(1) else
                      [x.strip().lstrip("%") for x in m.group(2).split(",")])
  return seen


def _loop_computations(comps: dict) -> set:
  """Every computation a while loop's body runs (fusions, nested loops and calls included)."""
  bodies = [m.group(1) for lines in comps.values() for line in lines
            for m in [re.search(r" while\(.*body=%([\w.\-]+)", line)] if m]
  assert bodies, "no while loop in the step"
  return _reachable(comps, bodies)


_ALL_REDUCE = re.compile(r"^\s*(?:ROOT )?(%[\w.\-]+) = (.*?) all-reduce(?:-start)?\(")


def _all_reduces(comps: dict, names) -> list:
  """(instruction name, [(element type, element count)] of its result) per all-reduce."""
  out = []
  for n in names:
    for line in comps.get(n, []):
      m = _ALL_REDUCE.match(line)
      if m:
        arrays = [(t, math.prod(int(d) for d in dims.split(",") if d))
                  for t, dims in re.findall(r"(\w+)\[([\d,]*)\]", m.group(2))]
        out.append((m.group(1), arrays))
  return out


def _param_sizes(abstract) -> list:
  return sorted(math.prod(p.shape) for p in jax.tree.leaves(abstract["params"]))


@pytest.mark.slow
@pytest.mark.parametrize("dtype, extra", [("float32", {}), ("bfloat16", {"dist.fsdp": 2})],
                         ids=["float32", "bfloat16_fsdp"])
def test_batch_split_reduces_gradients_once_after_the_loop(tmp_path, dtype, extra):
  text, abstract = _compiled(tmp_path, dict({"optim.batch_split": 2, "model.dtype": dtype},
                                            **extra))
  comps = _computations(text)
  inside = _loop_computations(comps)
  assert not _all_reduces(comps, inside), "an all-reduce runs in every piece"
  reduces = _all_reduces(comps, set(comps) - inside)
  arrays = [a for _, arrs in reduces for a in arrs]
  assert arrays and all(t == "f32" for t, _ in arrays), arrays
  # One set per step: every parameter's gradient once, plus the loss (a scalar).
  assert sorted(n for _, n in arrays if n > 1) == _param_sizes(abstract)
  assert sum(n == 1 for _, n in arrays) == 1


@pytest.mark.slow
def test_bf16_weight_gradients_cross_devices_in_float32(tmp_path):
  """batch_split=1 (GSPMD's own reduction): every all-reduce is float32, and none of them is
  rounded to bf16 on its way to the float32 parameters."""
  text, abstract = _compiled(tmp_path, {"model.dtype": "bfloat16"})
  comps = _computations(text)
  entry = next(n for n in comps if re.search(rf"^ENTRY %?{re.escape(n)} ", text, re.M))
  reduces = _all_reduces(comps, comps)
  arrays = [a for _, arrs in reduces for a in arrs]
  assert arrays and all(t == "f32" for t, _ in arrays), arrays
  assert sum(n for _, n in arrays) >= sum(_param_sizes(abstract))
  # The values the all-reduces return (their tuple elements), and what reads them.
  reduced = {name for name, _ in reduces}
  for line in comps[entry]:
    m = re.match(r"^\s*(%[\w.\-]+) = \S+ get-tuple-element\((%[\w.\-]+)\)", line)
    if m and m.group(2) in reduced:
      reduced.add(m.group(1))
  readers = [line.strip() for line in comps[entry]
             if any(re.search(rf"{re.escape(r)}[,)]", line.split(" = ", 1)[-1]) for r in reduced)]
  assert len(readers) >= len(jax.tree.leaves(abstract["params"])), readers
  # bf16 readers with a parameter's shape (bf16 carried caches, zeroed when the reduced gradient
  # norm is not finite, are bf16 by design: model/caches.py)
  shapes = {",".join(map(str, p.shape)) for p in jax.tree.leaves(abstract["params"])}
  bf16 = [r[:160] for r in readers
          if (m := re.match(r"^(?:ROOT )?%[\w.\-]+ = bf16\[([\d,]*)\]", r)) and m.group(1) in shapes]
  assert not bf16, bf16

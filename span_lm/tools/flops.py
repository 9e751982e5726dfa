"""What XLA makes of the train step, beside span_lm's own counts: the `flops` mode's numbers.

`compile_train_step` compiles the real train step (as a run compiles it); `xla_costs` reads XLA's
cost and memory analyses of it and sums its matmuls (tools/hlo.py's hlo_dot_flops: dot
instructions, and on TPU the convolutions XLA writes them as), which equal 2 x model/costs.py's
matmul count exactly. `account` puts one (model, plan, shapes)'s counts (model/costs.py: per-token
MACs, train-step FLOPs, activation memory) beside XLA's. XLA's total `flops` also counts
elementwise work (softmax, masks, layer norms, the optimizer), a few percent above the matmul
count on tiny models (4-8% in tests/tools/test_tools.py), less as D grows.
"""
import dataclasses
import logging
from typing import Any

import jax
import jax.numpy as jnp

from span_lm.model import ARCHS
from span_lm.model import plan as plan_lib
from span_lm.model.config import ModelConfig
from span_lm.model.costs import (activation_bytes, forward_macs, param_bytes,
                                 peak_activation_bytes, per_token, per_token_generation,
                                 train_step_flops)
from span_lm.model.plan import SpanPlan
from span_lm.tools.hlo import hlo_dot_flops
from span_lm.train import optimizer as optimizer_lib
from span_lm.train import steps as steps_lib

# --------------------------------------------------------------------------------------------- XLA


def default_optimizer():
  """The reference Adagrad the configs train with (the optimizer only adds elementwise work)."""
  return optimizer_lib.make_optimizer(
      {"name": "adagrad", "lr": 0.07, "momentum": 0.0, "grad_clip": 0.03, "warmup": 100,
       "batch_split": 1})[0]


def compile_train_step(cfg: ModelConfig, plan: SpanPlan | None, batch: int, block: int,
                       tx=None, *, devices=None):
  """The train step as a run compiles it (train/steps.build: mesh, shardings, donated state, the
  attention kernel's compiler options), for abstract inputs: a fresh state without loss scaling
  and a (batch, block) batch. On one device, or over `devices` (e.g. a deviceless TPU chip's)."""
  plan = plan or plan_lib.full_plan(cfg)
  tx = tx or default_optimizer()
  state = jax.eval_shape(lambda: steps_lib.init_state(cfg, tx, plan, batch, 1, 0))
  tokens = jax.ShapeDtypeStruct((batch, block), jnp.int32)
  batch_spec = {"x": tokens, "y": tokens, "reset": jax.ShapeDtypeStruct((), jnp.bool_)}
  options = steps_lib.StepOptions(batch=batch, eval_batch=1, num_devices=None if devices else 1,
                                  devices=devices, log=logging.getLogger("span_lm").debug)
  compiler = steps_lib.build(cfg, tx, options)
  return compiler.train(plan, state, batch_spec)


def xla_costs(cfg: ModelConfig, plan: SpanPlan | None, batch: int, block: int,
              tx=None) -> dict[str, Any]:
  """Compiles the real train step (one device: compile_train_step) and reads XLA's analyses."""
  compiled = compile_train_step(cfg, plan, batch, block, tx)
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost  # older jax: one dict per module
  mem = compiled.memory_analysis()
  return {"flops": float(cost.get("flops", float("nan"))),
          "transcendentals": float(cost.get("transcendentals", 0.0)),
          "bytes_accessed": float(cost.get("bytes accessed", float("nan"))),
          "dot_flops": hlo_dot_flops(compiled.as_text()),
          "temp_bytes": int(mem.temp_size_in_bytes),
          "argument_bytes": int(mem.argument_size_in_bytes),
          "output_bytes": int(mem.output_size_in_bytes),
          "alias_bytes": int(mem.alias_size_in_bytes)}


# ------------------------------------------------------------------------------------------ report


def account(cfg: ModelConfig, plan: SpanPlan | None, batch: int, block: int,
            xla: bool = False, generation_plan: SpanPlan | None = None) -> dict[str, Any]:
  """Everything about one (model, plan, shapes): per-token MACs, train-step flops and memory.
  generation_plan: the plan `sample` decodes with (the tightest for the checkpoint's spans);
  default: `plan`."""
  plan = plan or plan_lib.full_plan(cfg)
  gen_plan = generation_plan or plan
  generates = ARCHS[cfg.arch].cache  # sample's ring decoder runs over the caches
  out = {"plan": plan.describe(), "attention_keys": plan.attention_keys(),
         "per_token_block": dataclasses.asdict(per_token(cfg, plan, block)),
         # arch='sparse' attends within its block, no cache: no one-token generation step
         "per_token_generation": (dataclasses.asdict(per_token_generation(cfg, gen_plan))
                                  if generates else None),
         "generation_plan": gen_plan.describe() if generates else None,
         "forward_macs": forward_macs(cfg, plan, block, batch),
         "train_step_flops": train_step_flops(cfg, plan, batch, block),
         "activation_bytes": activation_bytes(cfg, plan, batch, block),
         "peak_activation_bytes": peak_activation_bytes(cfg, plan, batch, block),
         "param_bytes": param_bytes(cfg), "batch": batch, "block": block}
  if xla:
    out["xla"] = xla_costs(cfg, plan, batch, block)
  return out

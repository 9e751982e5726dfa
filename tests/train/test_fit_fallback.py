"""The step compiler's memory fallback on a GPU target, for every architecture and every config.

When the device's capacity is known (a GPU run, the compile mode), a step that does not fit is
compiled again with the fused kernel (model/attention_rules.fit_fallback: the door's
kernels.fit_fallback under the model's rules). That applies only to the span model with
`attention.impl=auto`: for the sparse model (which has its own attention) the decision once built a fused config the config check refuses, so no sparse config compiled for an Ampere or
Hopper GPU. These tests need no CUDA toolchain: they ask the decision on a GPU target, and compile
a sparse step on the CPU's devices while tracing for an H100 with a capacity nothing fits in.
"""
import dataclasses
import importlib
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from span_lm import config as config_lib
from span_lm.model import attention_rules
from span_lm.kernels import target
from span_lm.model import plan as plan_lib
from span_lm.model.config import ModelConfig
from span_lm.data.sources import KNOWN_VOCAB
from span_lm.train import optimizer as optimizer_lib
from span_lm.train import steps as steps_lib

REPO = pathlib.Path(__file__).resolve().parents[2]
GPUS = [("gpu", 9.0), ("gpu", 8.0), ("gpu", 7.0)]  # H100, A100, V100 (no Triton)


def _specs():
  if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
  out = []
  for p in sorted((REPO / "configs").glob("*.py")):
    if p.stem in ("__init__", "base"):
      continue
    mod = importlib.import_module(f"configs.{p.stem}")
    if hasattr(mod, "get_config"):
      out += [f"configs/{p.stem}.py" + (f":{v}" if v else "")
              for v in [None, *getattr(mod, "VARIANTS", {})]]
  return out


SPECS = _specs()


def test_the_specs_include_both_architectures():
  archs = {config_lib.load_config(s).model.arch for s in SPECS}
  assert archs == {"span", "sparse"}


@pytest.mark.parametrize("spec", SPECS)
def test_fallback_is_a_config_that_runs_or_none(spec):
  """For every shipped config and variant, on every GPU generation: the fallback is None or a
  span model with the fused kernel that `check` accepts; never an error."""
  config = config_lib.load_config(spec)
  vocab = KNOWN_VOCAB.get(config.data.dataset, 256)
  cfg = ModelConfig.from_config(config.model, vocab_size=config.model.vocab_size or vocab)
  for platform, cc in GPUS:
    with target.compiling_for(platform, cc):
      alt = attention_rules.fit_fallback(cfg)
      if alt is None:
        continue
      assert cfg.arch == "span" and cfg.attention.impl == "auto" and cc >= 8.0, spec
      assert alt.attention.impl == "pallas" and alt.arch == "span"
      attention_rules.check(alt, block=config.data.block)  # raises where it cannot run


def _tiny(arch: str) -> ModelConfig:
  model = dict(vocab_size=17, d_model=32, n_heads=2, d_ff=64, n_layers=2)
  if arch == "sparse":
    model.update(arch="sparse", sparse=dict(context=64, stride=8, c=2, pattern="fixed"))
  else:
    model.update(span=dict(size=64, ramp=8), attention=dict(block=16),
                 plan=dict(granularity=16))
  return ModelConfig.from_config(model)


def test_span_auto_falls_back_to_the_kernel_on_triton_gpus_only():
  cfg = _tiny("span")
  with target.compiling_for("gpu", 9.0):
    assert attention_rules.fit_fallback(cfg).attention.impl == "pallas"
  with target.compiling_for("gpu", 7.0):
    assert attention_rules.fit_fallback(cfg) is None
  with target.compiling_for("gpu", 9.0):  # an explicit choice is the user's
    explicit = cfg.replace(attention=cfg.attention.replace(impl="reference"))
    assert attention_rules.fit_fallback(explicit) is None
    # sizes the kernel cannot tile: nothing to fall back to (not a config the check refuses)
    untileable = cfg.replace(pers_mem=5)
    assert attention_rules.fit_fallback(untileable) is None


def test_sparse_step_compiles_on_a_gpu_target_that_it_does_not_fit():
  """The step compiler as a GPU run builds it (capacity known, here 1 KiB so nothing fits): the
  sparse model's train step compiles with its own attention, no fallback tried. Its attention is
  the block-sparse GPU kernel interpreted ('auto' picks the compiled kernel for an sm_90 target,
  which this CPU host cannot compile; tests/kernels/test_pallas_gpu_sparse.py compiles it with
  ptxas)."""
  tiny = _tiny("sparse")
  cfg = dataclasses.replace(tiny, sparse=dataclasses.replace(tiny.sparse, impl="pallas_interpret"))
  opt = config_lib.load_config("configs/tiny.py").optim
  tx, _ = optimizer_lib.make_optimizer(opt)
  logged = []
  b, m = 2, 64
  with target.compiling_for("gpu", 9.0):
    compiler = steps_lib.build(cfg, tx, steps_lib.StepOptions(
        batch=b, eval_batch=b, num_devices=1, log=logged.append, capacity=1024))
    plan = plan_lib.initial_plan(cfg)
    state = jax.eval_shape(lambda: steps_lib.init_state(cfg, tx, plan, b, b, 0))
    sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt)
    batch = {"x": sds((b, m), jnp.int32), "y": sds((b, m), jnp.int32),
             "reset": sds((), jnp.bool_)}
    compiled = compiler.train(plan, state, batch)
  assert compiled is not None
  assert not any("instead" in line for line in logged), logged
  assert compiler.compilations[-1]["attention"] == "sparse pallas_interpret"  # what it runs
  assert np.isfinite(steps_lib.peak_bytes(compiled) or 0)

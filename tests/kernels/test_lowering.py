"""The span model's training gradient lowers for the chips we ship to (jax.export for 'cuda' and
'tpu', no device and no extra package needed), through the fused kernel of each chip (under
kernels.target.compiling_for: the Triton kernel on an H100, named explicitly since `auto` runs
it only where it was timed faster; the Mosaic kernel, `auto`'s choice on a TPU v5), for every
kernel variant:
float32/bfloat16, head size 64/96 (96 runs padded to 128 in the fused kernel), fixed/adaptive/
dynamic spans, with and without persistent memory and attention dropout.

Lowering catches what the Pallas->Triton lowering rejects (operand types, block shapes); what
only ptxas or libtpu can see (shared memory, registers, VMEM) is the compile mode's job:
`python main.py --config=... --config.mode=compile` (span_lm/tools/compile.py)."""
import dataclasses
import itertools

import jax
import jax.numpy as jnp
import pytest
from jax import export

from model_helpers import build, replaced
from span_lm import kernels
from span_lm.kernels import target
from span_lm.model import attention_rules
from span_lm.model import build_model
from span_lm.model import caches as caches_lib
from span_lm.model import plan as plan_lib

BLOCK = 64
# The fused kernels' Triton and Mosaic calls carry no export compatibility guarantee: we only
# lower them.
_KERNELS = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton"),
            export.DisabledSafetyCheck.custom_call("tpu_custom_call")]


def _grad_and_args(cfg):
  plan = plan_lib.full_plan(cfg)
  model = build_model(cfg, plan)

  def grad(params, x, caches, key):
    def loss(p):
      logp, _, aux = model.apply({"params": p}, x, caches, train=True, rngs={"dropout": key})
      return -jnp.mean(logp[..., 0]) + aux["span_loss"]
    return jax.grad(loss)(params)

  params = jax.eval_shape(lambda: model.init(
      jax.random.key(0), jnp.zeros((1, 1), jnp.int32), caches_lib.init_caches(cfg, plan, 1)))
  args = (params["params"], jax.ShapeDtypeStruct((2, 2 * BLOCK), jnp.int32),
          jax.eval_shape(lambda: caches_lib.init_caches(cfg, plan, 2)),
          jax.eval_shape(lambda: jax.random.key(1)))
  return grad, args


PLATFORMS = {"cuda": 9.0, "tpu": None}


@pytest.mark.slow
@pytest.mark.parametrize("platform,dtype,head_dim",
                         list(itertools.product(PLATFORMS, ("float32", "bfloat16"), (64, 96))))
def test_training_gradient_lowers_for_every_variant(platform, dtype, head_dim):
  failures, chosen = [], set()
  for mode, pers, drop in itertools.product(("fixed", "adaptive", "dynamic"), (0, 2 * BLOCK),
                                            (0.0, 0.1)):
    cfg = build({"vocab_size": 11, "d_model": 2 * head_dim, "n_layers": 1, "n_heads": 2,
                 "d_ff": 32, "span.size": 2 * BLOCK, "span.ramp": 16, "span.mode": mode,
                 "pers_mem": pers, "dropout": drop, "dtype": dtype, "attention.block": BLOCK,
                 "plan.granularity": BLOCK,
                 "attention.impl": "pallas" if platform == "cuda" else "auto"})
    grad, args = _grad_and_args(cfg)
    with target.compiling_for(platform, PLATFORMS[platform]):
      chosen.add(kernels.choose(cfg.attn_spec, 2 * BLOCK, 2 * BLOCK))
      try:
        exp = export.export(jax.jit(grad), platforms=(platform,),
                            disabled_checks=_KERNELS)(*args)
      except Exception as e:  # pylint: disable=broad-except
        failures.append(f"{mode} pers={pers} dropout={drop}: "
                        f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
        continue
    assert exp.platforms == (platform,)
  # The chip's own choice was exercised: the fused kernel on Hopper, the Mosaic kernel on TPU,
  # for every variant (persistent memory and dropout included).
  assert chosen == ({"pallas"} if platform == "cuda" else {"pallas_tpu"})
  assert not failures, "\n".join(failures)


def test_auto_follows_the_target_not_the_host():
  cfg = build({"vocab_size": 11, "d_model": 128, "n_heads": 2, "span.size": 128,
               "attention.block": 64, "plan.granularity": 64})
  assert jax.default_backend() == "cpu"
  assert kernels.choose(cfg.attn_spec, 64, 128) == "cpu"
  with target.compiling_for("cuda", 9.0):  # the fused kernel is untimed on a GPU: the XLA path
    assert kernels.choose(cfg.attn_spec, 64, 128) == "reference"
    assert "untimed" in kernels.why(cfg.attn_spec, 64, 128)
    assert attention_rules.fit_fallback(cfg).attention.impl == "pallas"  # where that does not fit
    fused = replaced(cfg, **{"attention.impl": "pallas"})
    assert kernels.choose(fused.attn_spec, 64, 128) == "pallas"
  with target.compiling_for("gpu", 7.0):  # V100: no Triton backend in Pallas
    assert kernels.choose(cfg.attn_spec, 64, 128) == "reference"
    assert attention_rules.fit_fallback(cfg) is None  # nothing to fall back to
  assert attention_rules.fit_fallback(cfg) is None  # the CPU
  with target.compiling_for("tpu", kind="TPU v5 lite"):  # keys lie positions last: 128 lanes
    assert kernels.choose(cfg.attn_spec, 128, 128) == "pallas_tpu"
    assert kernels.choose(cfg.attn_spec, 64, 128) == "reference"  # a block of 64 tokens
  with target.compiling_for("tpu", kind="TPU v4"):  # no strided rotate for the kernel's skew
    assert kernels.choose(cfg.attn_spec, 64, 128) == "reference"
  with target.compiling_for("tpu", kind="TPU v5"):  # the paper configs: dropout, all-attention
    paper = dataclasses.replace(cfg, dropout=0.1, pers_mem=128)
    assert kernels.choose(paper.attn_spec, 128, 128) == "pallas_tpu"
  assert target.name() == "cpu"

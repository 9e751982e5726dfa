"""XLA:TPU's cost of a model's training loss and gradients on one chip, compiled deviceless
(libtpu, no TPU): FLOPs, HBM bytes accessed and temporaries, with nothing of the step around it
(no optimizer, no sharding, no batch split). A quick probe for the traffic around the attention
kernel: one layer compiles in a minute or two where the whole step takes ten.

  JAX_PLATFORMS=cpu python -m bench.tpu_layer_cost --config=configs/enwik8_large.py --batch 4 \\
      --set model.dtype=bfloat16 model.n_layers=1

Needs: pip install "jax[tpu]==<jax version>". docs/kernels.md has what it measured.
"""
import argparse
import json
import os
import time

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax
import jax.numpy as jnp

from bench import harness
from span_lm import config as config_lib
from span_lm.kernels import chips
from span_lm.kernels import target as target_lib
from span_lm.model import caches as caches_lib
from span_lm.model.config import ModelConfig
from span_lm.model.transformer import SpanTransformer

TOPOLOGY = {"v5e": ("v5e:2x2", "TPU v5 lite"), "v5p": ("v5p:2x2x1", "TPU v5"),
            "v6e": ("v6e:2x2", "TPU v6 lite")}


def _value(text: str):
  for cast in (int, float):
    try:
      return cast(text)
    except ValueError:
      pass
  return text


def measure(cfg: ModelConfig, target: str, batch: int, block: int) -> dict:
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  topology, kind = TOPOLOGY[target]
  topo = topologies.get_topology_desc(topology_name=topology, platform="tpu")
  mesh = jax.sharding.Mesh(topo.devices[:1], ("x",))
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  model = SpanTransformer(cfg)
  sds = lambda t: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep), t)

  def loss(params, x, y, caches, rng):
    logp, new, aux = model.apply({"params": params}, x, caches, train=True,
                                 rngs={"dropout": rng})
    nll = -jnp.take_along_axis(logp, y[..., None], -1).mean()
    return nll + aux["span_loss"], new

  def step(params, x, y, caches, rng):
    (value, new), grads = jax.value_and_grad(loss, has_aux=True)(params, x, y, caches, rng)
    return value, grads, new

  with target_lib.compiling_for("tpu", None, kind):
    caches = jax.eval_shape(lambda: caches_lib.init_caches(cfg, None, batch))
    params = jax.eval_shape(lambda: model.init(
        jax.random.key(0), jnp.zeros((batch, block), jnp.int32),
        caches_lib.init_caches(cfg, None, batch))["params"])
    tokens = jax.ShapeDtypeStruct((batch, block), jnp.int32, sharding=rep)
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=rep)
    start = time.perf_counter()
    compiled = jax.jit(step, donate_argnums=(3,)).lower(
        sds(params), tokens, tokens, sds(caches), key).compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return {"flops": cost["flops"], "bytes": cost["bytes accessed"],
          "temp": harness.memory(compiled)["temp"], "compile_s": time.perf_counter() - start}


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--config", default="configs/enwik8_large.py")
  p.add_argument("--target", default="v5p", choices=sorted(TOPOLOGY))
  p.add_argument("--batch", type=int, default=4, help="sequences on the chip")
  p.add_argument("--set", nargs="*", default=["model.dtype=bfloat16", "model.n_layers=1"],
                 help="config overrides, key=value")
  args = p.parse_args()
  overrides = {k: _value(v) for k, v in (a.split("=", 1) for a in args.set)}
  config = config_lib.load_config(args.config, overrides)
  cfg = ModelConfig.from_config(config.model, vocab_size=256)
  r = measure(cfg, args.target, args.batch, config.data.block)
  chip = chips.get(args.target)
  r.update(matmul_ms=r["flops"] / chip.peak_flops[cfg.dtype] * 1e3,
           hbm_ms=r["bytes"] / chip.hbm_bytes_per_s * 1e3, config=args.config, set=args.set,
           batch=args.batch, target=args.target)
  print(json.dumps(r))


if __name__ == "__main__":
  main()

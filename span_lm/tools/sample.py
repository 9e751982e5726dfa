"""Sampling with key/value caches: the prompt in one block, then one token per step.

Every step runs the same SpanTransformer on a block of M = 1 token with the caches the previous
step returned, so the past is never recomputed through the layers. The caches hold projected keys
and values (kv_cache=True: exact at inference, the weights are fixed), so a step projects only
its own token, not the W cached states each window sees; after the prompt they are rings
(caches.to_ring), so a step writes one slot per layer instead of shifting every cache. The plan is the tightest exact plan for
the parameters (fixed and dynamic spans: the full span), with caches shaped by it; the whole
generation is one jitted scan.

Library: `generate(cfg, params, plan, prompt_ids, length, temperature=, top_k=, seed=)`.
CLI: `python main.py --config=... --config.workdir=RUN --config.mode=sample
--config.sample.prompt='The ' --config.sample.length=200 --config.sample.temperature=0.8
--config.sample.top_k=20 --config.sample.seed=0` (temperature 0: greedy).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np

from span_lm import config as config_lib
from span_lm.model import caches as caches_lib
from span_lm.model import plan as plan_lib
from span_lm.model.config import ModelConfig
from span_lm.model.plan import SpanPlan
from span_lm.model.transformer import SpanTransformer
from span_lm.tools import restore as restore_lib


def pick(logp_BxV, key, temperature, top_k, greedy: bool):
  """The next token: argmax when greedy, else a draw from softmax(logp / T) over the top k.

  temperature and top_k (0: all tokens) are traced, so changing them does not recompile.
  """
  if greedy:
    return jnp.argmax(logp_BxV, axis=-1).astype(jnp.int32)
  logits = logp_BxV / temperature
  v = logits.shape[-1]
  k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
  kth = jnp.take(jnp.sort(logits, axis=-1), v - k, axis=-1)[..., None]
  logits = jnp.where(logits < kth, -jnp.inf, logits)
  return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("cfg", "plan", "length", "greedy", "kv_cache",
                                             "ring"))
def _generate(params, prompt_BxP, key, temperature, top_k, *, cfg, plan, length, greedy,
              kv_cache=True, ring=True):
  model = SpanTransformer(cfg, plan, kv_cache=kv_cache)
  caches = caches_lib.init_caches(cfg, plan, prompt_BxP.shape[0], kv=kv_cache)
  logp, caches, _ = model.apply({"params": params}, prompt_BxP, caches, train=False)
  n_prompt = prompt_BxP.shape[1]
  # the ring decode (kernels.decode) takes no document ids: with doc_boundary, shift the caches
  ring = kv_cache and ring and cfg.doc_boundary < 0
  if ring:  # one slot written per token, instead of every cache shifted by one
    caches = caches_lib.to_ring(caches, n_prompt, cfg.n_heads)

  def step(carry, xs):
    caches, logp_BxV = carry
    key, pos = xs
    tok = pick(logp_BxV, key, temperature, top_k, greedy)
    logp, caches, _ = model.apply({"params": params}, tok[:, None], caches, train=False,
                                  ring_pos=pos if ring else None)
    return (caches, logp[:, -1]), tok

  positions = n_prompt + jnp.arange(length, dtype=jnp.int32)
  _, toks = jax.lax.scan(step, (caches, logp[:, -1]), (jax.random.split(key, length), positions))
  return toks.T  # B x length


def check_args(length, temperature, top_k, vocab_size: int) -> None:
  def bad(field, value, why):
    raise ValueError(f"config.sample.{field}={value!r}: {why}")

  if isinstance(length, bool) or not isinstance(length, int) or length < 1:
    bad("length", length, "must be an integer >= 1")
  if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not (
      temperature >= 0):
    bad("temperature", temperature, "must be a number >= 0 (0: greedy)")
  if isinstance(top_k, bool) or not isinstance(top_k, int) or not 0 <= top_k <= vocab_size:
    bad("top_k", top_k, f"must be an integer in [0, {vocab_size}] (0: no restriction)")


def generate(cfg: ModelConfig, params, plan: SpanPlan | None, prompt_ids, length: int, *,
             temperature: float = 1.0, top_k: int = 0, seed: int = 0,
             kv_cache: bool = True, ring: bool = True) -> np.ndarray:
  """`length` new token ids after `prompt_ids` (1-D, at least one token; or (B, P) for B streams).

  The prompt starts from zero caches, as a stream does in training and evaluation.
  kv_cache=False caches hidden states and re-projects them every token (as training does);
  ring=False shifts the key/value caches by one token per step instead of writing one ring slot
  (the same tokens; kept for benchmarks and tests).
  """
  plan = plan or plan_lib.full_plan(cfg)
  check_args(length, temperature, top_k, cfg.vocab_size)
  prompt = np.asarray(prompt_ids, np.int32)
  squeeze = prompt.ndim == 1
  prompt = prompt[None] if squeeze else prompt
  if prompt.shape[-1] < 1:
    raise ValueError("the prompt needs at least one token (e.g. <eos>, the start of a line)")
  plan_lib.check_plan(cfg, params, plan)
  toks = _generate(params, jnp.asarray(prompt), jax.random.key(seed),
                   jnp.float32(max(temperature, 1e-6)), jnp.int32(top_k), cfg=cfg, plan=plan,
                   length=length, greedy=temperature == 0, kv_cache=kv_cache, ring=ring)
  toks = np.asarray(toks)
  return toks[0] if squeeze else toks


def sample(config) -> dict:
  """The `sample` mode: text from the checkpoint in config.workdir, printed and returned.
  config: a RunConfig (a ConfigDict is checked first)."""
  config = config_lib.checked(config)
  s = config.sample
  r = restore_lib.restore(config, restore_lib.tools_field(config, "step"))
  check_args(s.length, s.temperature, s.top_k, r.model_cfg.vocab_size)
  prompt = r.codec.encode(s.prompt) if s.prompt else np.zeros(0, np.int32)
  if not len(prompt):  # start as a new line does
    prompt = np.asarray([r.codec.eos if r.codec.eos is not None else 0], np.int32)
  ids = generate(r.model_cfg, r.params, r.tight_plan, prompt, s.length,
                 temperature=s.temperature, top_k=s.top_k, seed=s.seed)
  text = r.codec.decode(ids)
  print(f"checkpoint step {r.step}, temperature {s.temperature}, top_k {s.top_k or 'all'}, "
        f"seed {s.seed}:")
  print(f"{s.prompt}{text}")
  return {"prompt": s.prompt, "text": text, "ids": ids.tolist(), "step": r.step}

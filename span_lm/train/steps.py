"""Pure train and eval steps, and their compilation per span plan.

The training state is a plain dict pytree (what Orbax saves):
  step (int32), params, opt_state, rng (uint32 key data), caches (tuple per layer, (B, L_l, D)),
  eval_caches (the validation stream's caches, carried across periodic evaluations).
The span plan is static: each plan is its own compiled program, cached by `StepCompiler`, which
logs every compilation with its wall time so the cost of a plan change is visible.
"""
import dataclasses
import functools
import logging
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from span_lm import kernels
from span_lm.kernels.span import autotune
from span_lm.model import build_model
from span_lm.model.archs import ARCHS
from span_lm.model import attention_rules
from span_lm.model import caches as caches_lib
from span_lm.model import plan as plan_lib
from span_lm.model import spans as spans_lib
from span_lm.model.config import ModelConfig
from span_lm.model.plan import SpanPlan
from span_lm.train import loss_scale as loss_scale_lib
from span_lm.train import optimizer as optimizer_lib
from span_lm.train import sharding as sharding_lib

State = dict[str, Any]


def nll(logp_BxMxV, y_BxM, w_BxM=None):
  """(sum of -log p(y), number of scored tokens)."""
  ll = jnp.take_along_axis(logp_BxMxV, y_BxM[..., None].astype(jnp.int32), axis=-1)[..., 0]
  if w_BxM is None:
    return -jnp.sum(ll), jnp.asarray(ll.size, jnp.float32)
  w = w_BxM.astype(jnp.float32)
  return -jnp.sum(ll * w), jnp.sum(w)


def init_state(cfg: ModelConfig, tx: optax.GradientTransformation, plan: SpanPlan, batch: int,
               eval_batch: int, seed: int, loss_scale: float | None = None) -> State:
  """A fresh training state (call under jax.jit with out_shardings for sharded init).
  loss_scale: the initial scale of dynamic loss scaling (train/loss_scale.py), which then lives
  in state['loss_scale']; None: no scaling, and no such entry."""
  key = jax.random.key(seed)
  init_key, rng = jax.random.split(key)
  model = build_model(cfg, plan)
  tokens = jnp.zeros((1, 1), jnp.int32)
  params = model.init(init_key, tokens, caches_lib.init_caches(cfg, plan, 1))["params"]
  state = {
      "step": jnp.zeros((), jnp.int32),
      "params": params,
      "opt_state": tx.init(params),
      "rng": jax.random.key_data(rng),
      "caches": caches_lib.init_caches(cfg, plan, batch),
      "eval_caches": caches_lib.init_caches(cfg, plan, eval_batch),
  }
  if loss_scale is not None:
    state["loss_scale"] = loss_scale_lib.init(loss_scale)
  return state


def _zero_if(caches, reset):
  """A select, not a product: caches a non-finite step filled with NaN or inf come back 0."""
  return tuple(jnp.where(reset, jnp.zeros((), c.dtype), c) for c in caches)


def _split(x, k, contiguous: bool = False):
  """(B, ...) -> (k, B/k, ...): piece j takes rows j::k, so that each piece of a batch sharded
  over devices spans all of them; or, contiguous (x is one device's rows), rows j*B/k onwards:
  a reshape, where the strided split copies every carried cache on the way in and out."""
  b = x.shape[0]
  if contiguous:
    return x.reshape(k, b // k, *x.shape[1:])
  return x.reshape(b // k, k, *x.shape[1:]).swapaxes(0, 1)


def _merge(x, contiguous: bool = False):
  k, bk = x.shape[:2]
  if contiguous:
    return x.reshape(k * bk, *x.shape[2:])
  return x.swapaxes(0, 1).reshape(k * bk, *x.shape[2:])


def _plan_covers(cfg: ModelConfig, plan: SpanPlan, params) -> jax.Array | None:
  """Whether every head's window covers its span plus ramp (plan.needed_tokens, in float32 as the
  host computes it), or None for fixed spans. The host reads span ratios late, so a step may be
  dispatched with a plan the spans have outgrown; such a step must not be applied."""
  if cfg.spans != "adaptive":
    return None
  ok = jnp.asarray(True)
  for lp, z in zip(plan.layers, plan_lib.span_ratio_leaves(params), strict=True):
    need = plan_lib.needed_tokens(cfg, z, xp=jnp)
    ok &= jnp.all(need <= jnp.asarray(lp.head_windows(cfg.n_heads), jnp.int32))
  return ok


def _per_device_split(mesh, batch_axes, rows: int, batch_split: int) -> tuple | None:
  """The mesh's batch axes (a tuple) when gradient accumulation runs per device (`_local_grads`),
  else None: one device, batch_split 1 (one reduction per step already), or fewer rows per device
  than pieces (each device's rows must split into batch_split equal pieces)."""
  if mesh is None or batch_split == 1 or batch_axes is None:
    return None
  axes = (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes)
  n = int(np.prod([mesh.shape[a] for a in axes]))
  if n == 1 or rows % (n * batch_split):
    if n > 1:
      logging.warning("batch_split=%d: %d rows over %d devices do not split per device; the "
                      "gradients cross the devices in every piece (choose a batch that is a "
                      "multiple of devices x batch_split)", batch_split, rows, n)
    return None
  return axes


def _whole_batch_span_stats(aux, cfg: ModelConfig):
  """Dynamic spans depend on the tokens: their statistics over the whole batch's dyn_spans, as
  one piece would report them."""
  stats = [spans_lib.span_stats(z, cfg) for z in aux["dyn_spans"]]
  return dict(aux, span_avg=jnp.stack([avg for avg, _ in stats]),
              span_max=jnp.stack([mx for _, mx in stats]))


def _local_grads(grad_fn, params, x, y, caches, step_key, *, mesh, axes: tuple, batch_split: int):
  """Gradient accumulation over batch_split pieces per device, reduced once after the loop.

  Under GSPMD the partitioner all-reduces each piece's gradients inside the scan (batch_split
  reductions per step); here each device accumulates the float32 gradients of its own rows over
  the pieces (a shard_map over the batch axes) and they cross the network once, as a float32
  pmean. Local losses are means over local tokens, equal in count on every device, so their
  pmean is the global mean. Parameters enter replicated (in_specs P()): FSDP-sharded ones are
  gathered once at the entry. Dropout: each device folds its index along the batch axes into the
  pieces' keys, so with batch_split > 1 on several devices the masks depend on the device count
  (as they depend on batch_split); single-device and batch_split=1 runs are unaffected.
  Returns grads, loss, new caches (rows sharded), aux (dyn_spans rows sharded; the per-token
  span statistics are left to the caller, which recomputes them over the whole batch).
  """
  rows, rep = P(axes), P()

  def local(params, x, y, caches, key_data):
    key = jax.random.fold_in(jax.random.wrap_key_data(key_data), jax.lax.axis_index(axes))
    xs, ys = _split(x, batch_split, True), _split(y, batch_split, True)
    cs = tuple(_split(c, batch_split, True) for c in caches)
    keys = jax.random.split(key, batch_split)

    def piece(acc, inp):
      x, y, c, key = inp
      (_, (loss, nc, aux)), g = grad_fn(params, x, y, c, key)
      acc = jax.tree.map(lambda a, b: a + b.astype(jnp.float32) / batch_split, acc, g)
      return acc, (loss, nc, aux)

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    acc, (losses, ncs, auxes) = jax.lax.scan(piece, zeros, (xs, ys, cs, keys))
    grads = jax.lax.pmean(acc, axes)  # the step's one gradient reduction, in float32
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
    loss = jax.lax.pmean(jnp.mean(losses), axes)
    new_caches = tuple(_merge(c, True) for c in ncs)
    by_rows = {}
    if "dyn_spans" in auxes:  # token-dependent: rows stay sharded, span loss a mean over tokens
      by_rows["dyn_spans"] = tuple(_merge(a, True) for a in auxes.pop("dyn_spans"))
      span_loss = jax.lax.pmean(jnp.mean(auxes.pop("span_loss")), axes)
      for k in ("span_avg", "span_max"):
        auxes.pop(k)
      replicated_aux = dict(jax.tree.map(lambda a: a[0], auxes), span_loss=span_loss)
    else:  # fixed/adaptive span statistics: parameter-only, the same on every device
      replicated_aux = jax.tree.map(lambda a: a[0], auxes)
    return grads, loss, new_caches, replicated_aux, by_rows

  # check_vma=False: with it, autodiff of the replicated params inside the body would psum
  # their gradients in every piece, the very reduction this moves out of the loop.
  grads, loss, new_caches, aux, by_rows = jax.shard_map(
      local, mesh=mesh, in_specs=(rep, rows, rows, rows, rep),
      out_specs=(rep, rep, rows, rep, rows), check_vma=False)(
          params, x, y, caches, jax.random.key_data(step_key))
  return grads, loss, new_caches, dict(aux, **by_rows)


def train_step(state: State, batch: dict[str, jax.Array], *, cfg: ModelConfig, plan: SpanPlan,
               tx: optax.GradientTransformation, batch_split: int = 1, debug_nan_at_step: int = 0,
               mesh=None, batch_axes=None, loss_scale_period: int = 2000):
  """One update: loss = mean NLL + span loss, reference gradient accumulation over batch_split.

  batch: x, y (B, M) int; reset () bool: the stream restarts after this block, so the carried
  caches are zeroed on the way out (the reference zeroes them between the two blocks).
  A non-finite loss or gradient never reaches the parameters: the step keeps the old params and
  optimizer state, zeroes the caches (as a stream restart) and reports metrics['skipped'] = 1; the
  host decides whether that stops the run. A select on device, so no host sync is added.
  Adaptive spans: a step whose plan no longer covers the spans it starts from changes nothing at
  all (step, params, optimizer state, caches) and reports metrics['short'] = 1; the host widens
  the plan and replays it, so attention is never truncated although ratios are read late.
  debug_nan_at_step (testing aid): step number (1-based) whose loss is made NaN; 0: off.
  mesh, batch_axes: the mesh and its axes the batch is sharded over; with several devices and
  batch_split > 1 the accumulation runs per device and reduces once (`_local_grads`).
  Dynamic loss scaling (state['loss_scale'] present, train/loss_scale.py): the loss is
  multiplied by the scale before the gradient and each piece's float32 gradients by its inverse
  right after its backward pass (before the accumulation sum, the cross-device mean and the
  optimizer's clip). An attempt whose loss is finite and whose gradients are not (an overflow)
  is thrown away -- params, optimizer state, caches, step and data untouched -- and the same
  batch (same dropout key) is tried again at once at half the scale, in a while loop on the
  device, until the gradients are finite or the scale is loss_scale.MIN_SCALE; the scale doubles
  after loss_scale_period finite steps. Only a non-finite loss, or gradients still non-finite
  at the minimum scale, reach the non-finite handling above (and train.nonfinite). metrics
  gain loss_scale (after the step), scale_skips (attempts this step threw away) and
  loss_scale_skips (all attempts thrown away so far, the state's count).
  Returns the new state and metrics (sums, so averages over steps and hosts are exact).
  """
  model = build_model(cfg, plan)
  caches = state["caches"]
  rng = jax.random.wrap_key_data(state["rng"])
  step_rng = jax.random.fold_in(rng, state["step"])

  ls = state.get("loss_scale")
  params = state["params"]
  gradients = functools.partial(_gradients_at, model=model, state=state, batch=batch,
                                step_rng=step_rng, cfg=cfg, batch_split=batch_split, mesh=mesh,
                                batch_axes=batch_axes, debug_nan_at_step=debug_nan_at_step)

  if ls is None:
    grads, loss, new_caches, aux = gradients(None)
  else:
    grads, loss, new_caches, aux, scale_used, retries = _retry_overflows(gradients, ls["scale"])

  updates, opt_state = tx.update(grads, state["opt_state"], params)
  new_params = optimizer_lib.clamp_spans(optax.apply_updates(params, updates))
  grad_norm = optax.tree.norm(grads)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  covered = _plan_covers(cfg, plan, params)
  apply = finite if covered is None else finite & covered
  keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(apply, a, b), new, old)
  opt_state = keep(opt_state, state["opt_state"])
  new_caches = _zero_if(new_caches, batch["reset"] | ~finite)
  new_step = state["step"] + 1
  if covered is not None:  # a refused step changes nothing: the host replays it on a wider plan
    new_caches = tuple(jnp.where(covered, a, b) for a, b in zip(new_caches, caches))
    new_step = state["step"] + covered.astype(state["step"].dtype)
  params = keep(new_params, params)
  new_state = dict(state, step=new_step, params=params, opt_state=opt_state, caches=new_caches)
  metrics = {
      "loss": loss,
      "skipped": (~finite).astype(jnp.int32),
      "span_loss": aux["span_loss"],
      "span_avg": aux["span_avg"],
      "span_max": aux["span_max"],
      "grad_norm": grad_norm,
  }
  if ls is not None:
    _next_loss_scale(ls, scale_used, retries, finite, covered, loss_scale_period, new_state,
                     metrics)
  if covered is not None:
    metrics["short"] = (~covered).astype(jnp.int32)
  if cfg.spans == "adaptive":
    # Post-update z' per layer: the host re-derives the span plan from these.
    metrics["span_ratio"] = jnp.stack(plan_lib.span_ratio_leaves(params))
  return new_state, metrics


def _gradients_at(scale, *, model, state: State, batch, step_rng, cfg: ModelConfig,
                  batch_split: int, mesh, batch_axes, debug_nan_at_step: int):
  """(grads, loss, new caches, aux) of the batch; scale: the loss scale (None: unscaled)."""
  params, caches = state["params"], state["caches"]

  def loss_fn(params, x, y, caches, key):
    logp, new_caches, aux = model.apply({"params": params}, x, caches, train=True,
                                        rngs={"dropout": key})
    total, count = nll(logp, y)
    loss = total / count
    if debug_nan_at_step:
      loss = loss * jnp.where(state["step"] + 1 == debug_nan_at_step, jnp.nan, 1.0)
    objective = loss + aux["span_loss"]
    if scale is not None:  # float32; the cotangents below are this much larger
      objective = objective * scale
    return objective, (loss, new_caches, aux)

  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
  if scale is not None:  # unscale each piece's float32 gradients at once (exact: 2^-k)
    scaled_grad_fn = grad_fn

    def grad_fn(*args):
      out, g = scaled_grad_fn(*args)
      return out, jax.tree.map(lambda a: a * (1.0 / scale).astype(a.dtype), g)

  return _gradients(grad_fn, params, batch, caches, step_rng, cfg=cfg, batch_split=batch_split,
                    mesh=mesh, batch_axes=batch_axes)


def _next_loss_scale(ls, scale_used, retries, finite, covered, loss_scale_period: int,
                     new_state: dict, metrics: dict):
  """The loss scale after this step (kept where the plan refused it) into new_state, and its
  metrics."""
  new_ls = loss_scale_lib.after_step(ls, scale_used, retries, finite, loss_scale_period)
  if covered is not None:  # refused: replayed later, from the same scale
    new_ls = jax.tree.map(lambda a, b: jnp.where(covered, a, b), new_ls, ls)
  new_state["loss_scale"] = new_ls
  metrics["loss_scale"] = new_ls["scale"]
  metrics["scale_skips"] = retries
  metrics["loss_scale_skips"] = new_ls["skips"]


def _retry_overflows(gradients, scale0):
  """gradients(scale) at scale0, then again at half the scale while the last attempt
  overflowed (loss_scale.overflowed) and the scale is above MIN_SCALE. One attempt in the
  common case: a while loop whose body is the whole forward and backward pass, run once more
  per overflow. Returns (grads, loss, new caches, aux, the scale of the last attempt, the number
  of attempts thrown away)."""
  shapes = jax.eval_shape(gradients, scale0)
  zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)

  def again(carry):
    tries, scale, (grads, loss, _, _) = carry
    return (tries == 0) | (loss_scale_lib.overflowed(loss, grads)
                           & (scale > loss_scale_lib.MIN_SCALE))

  def attempt(carry):
    tries, scale, _ = carry
    scale = jnp.where(tries == 0, scale, scale * 0.5)
    return tries + 1, scale, gradients(scale)

  tries, scale, out = jax.lax.while_loop(
      again, attempt, (jnp.zeros((), jnp.int32), jnp.asarray(scale0, jnp.float32), zeros))
  return (*out, scale, tries - 1)


def _gradients(grad_fn, params, batch, caches, step_rng, *, cfg, batch_split, mesh, batch_axes):
  """(grads, loss, new caches, aux) of a batch in batch_split pieces (reference gradient
  accumulation), per device when it can be (`_local_grads`)."""
  axes = _per_device_split(mesh, batch_axes, batch["x"].shape[0], batch_split)
  if batch_split == 1:
    (_, (loss, new_caches, aux)), grads = grad_fn(params, batch["x"], batch["y"], caches, step_rng)
  elif axes is not None:
    grads, loss, new_caches, aux = _local_grads(
        grad_fn, params, batch["x"], batch["y"], caches, step_rng, mesh=mesh, axes=axes,
        batch_split=batch_split)
    if "dyn_spans" in aux:
      aux = _whole_batch_span_stats(aux, cfg)
  else:
    one = mesh is None or mesh.devices.size == 1  # else pieces must span the devices
    xs, ys = _split(batch["x"], batch_split, one), _split(batch["y"], batch_split, one)
    cs = tuple(_split(c, batch_split, one) for c in caches)
    keys = jax.random.split(step_rng, batch_split)

    def piece(acc, inp):
      x, y, c, key = inp
      (_, (loss, nc, aux)), g = grad_fn(params, x, y, c, key)
      acc = jax.tree.map(lambda a, b: a + b / batch_split, acc, g)
      return acc, (loss, nc, aux)

    zeros = jax.tree.map(jnp.zeros_like, params)
    grads, (losses, ncs, auxes) = jax.lax.scan(piece, zeros, (xs, ys, cs, keys))
    loss = jnp.mean(losses)
    new_caches = tuple(_merge(c, one) for c in ncs)
    aux = jax.tree.map(lambda a: a[0], auxes)  # fixed/adaptive span statistics: piece-free
    if "dyn_spans" in auxes:
      # Dynamic spans depend on the tokens: report them over the whole batch, as one piece would.
      aux["dyn_spans"] = tuple(_merge(a, one) for a in auxes["dyn_spans"])
      aux["span_loss"] = jnp.mean(auxes["span_loss"])
      aux = _whole_batch_span_stats(aux, cfg)
  return grads, loss, new_caches, aux


def eval_step(params, caches, batch: dict[str, jax.Array], *, cfg: ModelConfig, plan: SpanPlan,
              kv_cache: bool = False):
  """Scores one block with carried caches: (nll_sum, count, new_caches, span stats).
  kv_cache: the caches hold projected keys/values (caches.init_caches(..., kv=True))."""
  model = build_model(cfg, plan, kv_cache=kv_cache)
  logp, new_caches, aux = model.apply({"params": params}, batch["x"], caches, train=False)
  total, count = nll(logp, batch["y"], batch.get("w"))
  return ({"nll_sum": total, "count": count, "span_avg": aux["span_avg"]},
          _zero_if(new_caches, batch["reset"]))


def peak_bytes(compiled) -> int | None:
  """A compiled step's peak device memory (XLA's memory analysis; None where it has none)."""
  m = compiled.memory_analysis()
  if m is None:
    return None
  size = lambda k: int(getattr(m, f"{k}_size_in_bytes", 0) or 0)
  peak = int(getattr(m, "peak_memory_in_bytes", 0) or 0)
  return peak or size("argument") + size("output") - size("alias") + size("temp")


def _attention(cfg: ModelConfig) -> str:
  """The attention the model's layers run (the span door's, or 'sparse <impl>')."""
  return ARCHS[cfg.arch].attention(cfg)[0]


class StepCompiler:
  """Compiles the train/eval steps once per (plan, shapes) and records each compilation.
  Built by `build` (the one constructor the loop, the compile mode and the benchmarks call).

  capacity: device memory in bytes (None: unchecked). A step that `auto` gave the XLA attention
  and that does not fit in it is compiled again with the fused kernel
  (model/attention_rules.fit_fallback), and the log says so."""

  def __init__(self, cfg: ModelConfig, tx, layout: sharding_lib.Layout, batch_split: int = 1,
               log: Callable[[str], None] | None = None, debug_nan_at_step: int = 0,
               capacity: int | None = None, loss_scale_period: int = 2000):
    self.cfg, self.tx, self.layout, self.mesh = cfg, tx, layout, layout.mesh
    self.capacity = capacity
    self._fallen_back = None  # the config a step that did not fit was compiled with
    self.loss_scale_period = loss_scale_period  # used when the state has a loss scale
    self.debug_nan_at_step = debug_nan_at_step
    self._batch_sharding = layout.rows
    self._replicated = layout.replicated
    self.batch_split = batch_split
    self._cache: dict = {}
    self.compilations: list[dict[str, Any]] = []
    self._log = log or logging.info

  def _lower_compile(self, cfg, fn, args, in_shardings, out_shardings, donate):
    with jax.set_mesh(self.mesh):  # the fused attention kernel shards itself over it
      lowered = jax.jit(fn, in_shardings=in_shardings, out_shardings=out_shardings,
                        donate_argnums=donate).lower(*args)
      options = kernels.compiler_options(cfg.attn_spec)
      try:
        return lowered.compile(compiler_options=options or None)
      except Exception as e:  # pylint: disable=broad-except
        if not options or not any(k in str(e) for k in options):
          raise
        self._log(f"this jaxlib does not take {options} ({str(e).splitlines()[0][:120]}); "
                  "compiling without")
        return lowered.compile()

  def _compile(self, kind, plan, make_fn, args, in_shardings, out_shardings, donate):
    """make_fn(cfg): the step function of a model config."""
    leaves, treedef = jax.tree.flatten(args)
    key = (kind, plan, treedef, tuple((a.shape, str(a.dtype)) for a in leaves))
    if key in self._cache:
      return self._cache[key]
    t0 = time.perf_counter()
    cfg = self._fallen_back or self.cfg  # once a step did not fit, later plans start there
    compiled = self._lower_compile(cfg, make_fn(cfg), args, in_shardings, out_shardings, donate)
    alt = attention_rules.fit_fallback(cfg) if self.capacity else None
    peak = peak_bytes(compiled) if alt is not None else None
    if peak is not None and peak > self.capacity:
      self._log(f"attention: the {kind} step with {_attention(cfg)} attention needs "
                f"{peak / 2**30:.2f} GiB per device of {self.capacity / 2**30:.2f}: compiling it "
                f"with attention.impl={alt.attention.impl!r} instead")
      cfg = self._fallen_back = alt
      compiled = self._lower_compile(cfg, make_fn(cfg), args, in_shardings, out_shardings,
                                     donate)
    secs = time.perf_counter() - t0
    self.compilations.append({"kind": kind, "seconds": secs, "plan": plan.describe(),
                              "attention": _attention(cfg)})
    self._log(f"compiled {kind} step #{len(self.compilations)} in {secs:.1f}s "
              f"(keys per token, all heads and layers: {plan.attention_keys()}; attention "
              f"{_attention(cfg)})")
    self._cache[key] = compiled
    return compiled

  def train(self, plan: SpanPlan, state: State, batch):
    fn = lambda cfg: functools.partial(train_step, cfg=cfg, plan=plan, tx=self.tx,
                                       batch_split=self.batch_split,
                                       debug_nan_at_step=self.debug_nan_at_step, mesh=self.mesh,
                                       batch_axes=self.layout.batch_axes,
                                       loss_scale_period=self.loss_scale_period)
    st_sh = self.layout.state_shardings(state)
    b_sh = {"x": self._batch_sharding, "y": self._batch_sharding, "reset": self._replicated}
    return self._compile("train", plan, fn, (state, batch), (st_sh, b_sh),
                         (st_sh, self._replicated), (0,))

  def eval(self, plan: SpanPlan, params, caches, batch, kv_cache: bool = False):
    fn = lambda cfg: functools.partial(eval_step, cfg=cfg, plan=plan, kv_cache=kv_cache)
    p_sh = jax.tree.map(lambda _: self._replicated, params)
    c_sh = tuple(self._batch_sharding for _ in caches)
    b_sh = {k: (self._replicated if k == "reset" else self._batch_sharding) for k in batch}
    return self._compile("eval_kv" if kv_cache else "eval", plan, fn, (params, caches, batch),
                         (p_sh, c_sh, b_sh),
                         (self._replicated, c_sh), (1,))


@dataclasses.dataclass(frozen=True)
class StepOptions:
  """How a run's steps are laid out and compiled, besides the model and the optimizer: what
  `build` reads (the loop fills it from the run config, the compile mode and benchmarks by hand).

  devices: lay the mesh over these (a deviceless topology's), else the first num_devices (all).
  whole_pieces: each batch_split piece must split over the devices (sharding.Layout).
  tune_block: resolve attention.tiles='tune' by timing the kernel at this block length and this
  run's rows per device (kernels/span/autotune.py); None: the config as it is.
  capacity: one device's memory in bytes (StepCompiler's fit rule); None: unchecked."""
  batch: int
  eval_batch: int
  batch_split: int = 1
  fsdp: int = 1
  num_devices: int | None = None
  devices: Any = None
  processes: int = 1
  whole_pieces: bool = False
  tune_block: int | None = None
  log: Callable[[str], None] | None = None
  capacity: int | None = None
  debug_nan_at_step: int = 0
  loss_scale_period: int = 2000


def build(cfg: ModelConfig, tx, options: StepOptions) -> StepCompiler:
  """The mesh, state rule and batch sharding (sharding.Layout) and the step compiler of a run:
  the one way the loop, the compile mode and the benchmarks build a step, so they compile the
  same thing. Refuses batches that do not split over the devices and processes.
  The compiler's `cfg` is the model config as resolved, its `layout` the arrays' layout."""
  o = options
  layout = sharding_lib.Layout.make(o.fsdp, o.num_devices, o.devices)
  layout.check_batches(o.batch, o.eval_batch, o.batch_split, o.processes, o.whole_pieces)
  if o.tune_block is not None:
    spec = autotune.resolve(cfg.attn_spec, batch=o.batch // layout.num_devices // o.batch_split,
                            m=o.tune_block, echo=o.log or logging.info)
    cfg = cfg if spec.attention == cfg.attention else cfg.replace(attention=spec.attention)
  return StepCompiler(cfg, tx, layout, batch_split=o.batch_split, log=o.log,
                      debug_nan_at_step=o.debug_nan_at_step, capacity=o.capacity,
                      loss_scale_period=o.loss_scale_period)


def host_batch(x: np.ndarray, y: np.ndarray, reset: bool, w: np.ndarray | None = None):
  b = {"x": np.asarray(x, np.int32), "y": np.asarray(y, np.int32), "reset": np.asarray(reset)}
  if w is not None:
    b["w"] = np.asarray(w, np.float32)
  return b

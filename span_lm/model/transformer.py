"""The sequential (post-LN) span Transformer of the adaptive-span paper, with all-attention layers.

Parameter tree and its one-to-one map onto the reference state_dict (facebookresearch/adaptive-span;
keys carry a `module.` prefix in its checkpoints; torch Linear weights are (out, in), so every
`kernel` here is the transposed `weight`):

  in_emb.embedding (V, D)                       <- in_emb.weight (V, D)
  key_pe (Dh, S)                                <- key_pe (1, Dh, S)[0]
  layers_i.attn.proj_query.kernel (D, D)        <- layers.i.attn.proj_query.weight.T
  layers_i.attn.proj_key/proj_val/proj_out      <- layers.i.attn.proj_key/proj_val/proj_out.weight.T
  layers_i.attn.span_ratio (H,)                 <- layers.i.attn.attn.adaptive_span._mask.current_val
                                                   (H, 1, 1); its buffer mask_template (S) is
                                                   recomputed, not stored
  layers_i.attn.pers_key (H, Dh, N)             <- layers.i.attn.attn.persistent_memory.key
  layers_i.attn.pers_val (H, N, Dh)             <- layers.i.attn.attn.persistent_memory.val
  layers_i.norm1.scale / .bias (D,)             <- layers.i.norm1.weight / .bias
  layers_i.ff.fc1.kernel (D, F) / .bias (F,)    <- layers.i.ff.fc1.weight.T / .bias
  layers_i.ff.fc2.kernel (F, D) / .bias (D,)    <- layers.i.ff.fc2.weight.T / .bias
  layers_i.norm2.scale / .bias (D,)             <- layers.i.norm2.weight / .bias
  out_emb.kernel (D, V) / .bias (V,)            <- out_emb.weight.T / out_emb.bias
  layers_i.attn.span_predictor.{kernel,bias}    (dynamic span only; no reference counterpart)

Persistent-memory layers (pers_mem > 0) have no ff and no norm2, as in the reference.
With adapt_io, in_emb and out_emb are the adaptive input / adaptive softmax of adaptive_io.py
(its docstring maps their parameters); the output stays log-probabilities over the vocabulary.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp

from span_lm.model import adaptive_io
from span_lm.kernels import matmul
from span_lm.model import plan as plan_lib
from span_lm.model.attention import SeqAttention, torch_bias_init, torch_linear_init
from span_lm.model.config import ModelConfig
from span_lm.model.plan import LayerPlan, SpanPlan


class FeedForward(nn.Module):
  cfg: ModelConfig

  @nn.compact
  def __call__(self, h, train: bool):
    cfg = self.cfg
    dt = jnp.dtype(cfg.dtype)
    y = matmul.Dense(cfg.d_ff, torch_linear_init(), torch_bias_init(cfg.d_model), dt,
                        name="fc1")(h)
    y = nn.Dropout(cfg.dropout)(nn.relu(y), deterministic=not train)
    return matmul.Dense(cfg.d_model, torch_linear_init(), torch_bias_init(cfg.d_ff), dt,
                           name="fc2")(y)


class SeqLayer(nn.Module):
  """h = LN1(h + attn(h, cache)); out = LN2(h + ff(h)) (no ff/LN2 with persistent memory)."""
  cfg: ModelConfig
  plan: LayerPlan
  kv_cache: bool = False

  @nn.compact
  def __call__(self, h, cache, key_pe, train: bool, ring_pos=None, docs=None):
    cfg = self.cfg
    attn_out, aux = SeqAttention(cfg, self.plan, self.kv_cache, name="attn")(h, cache, key_pe,
                                                                            train, ring_pos, docs)
    h = nn.LayerNorm(epsilon=1e-5, name="norm1")(h + attn_out)
    if cfg.pers_mem == 0:
      h = nn.LayerNorm(epsilon=1e-5, name="norm2")(h + FeedForward(cfg, name="ff")(h, train))
    return h, aux


def _doc_ids(cfg: ModelConfig, plan, tokens_BxM, caches, ring_pos):
  """With model.doc_boundary: (the layers' caches, docs = (ids of the block's queries (B, M), of
  cache + block rows), the next document-id cache); else (caches, None, None). Checks the
  caches' count (and the document-id cache's shape)."""
  docs = new_doc_cache = None
  if cfg.doc_boundary >= 0:
    if ring_pos is not None:
      raise ValueError("model.doc_boundary: one-token ring decoding (kernels.decode) takes no "
                       "document ids; decode with ring=False (tools/sample.py does)")
    if len(caches) != cfg.n_layers + 1:
      raise ValueError(f"got {len(caches)} caches for {cfg.n_layers} layers and the document "
                       "ids (model.doc_boundary: caches.init_caches adds them)")
    caches, doc_cache = tuple(caches[:-1]), caches[-1]
    want_len = max(lp.cache_len for lp in plan.layers)
    if doc_cache.shape != (tokens_BxM.shape[0], want_len):
      raise ValueError(f"document-id cache of shape {doc_cache.shape}, the plan wants "
                       f"{(tokens_BxM.shape[0], want_len)} (caches.resize_caches)")
    # the block's ids: 1 continues the newest cached document, each boundary token opens the
    # next id (the boundary belongs to the document it starts); cached ids are 0 or 1
    starts = (tokens_BxM == cfg.doc_boundary).astype(jnp.int32)
    q_ids = 1 + jnp.cumsum(starts, axis=1)
    all_ids = jnp.concatenate([doc_cache.astype(jnp.int32), q_ids], axis=1)
    docs = (q_ids, all_ids)
    tail = all_ids[:, all_ids.shape[1] - want_len:]
    new_doc_cache = (tail == q_ids[:, -1:]).astype(jnp.int32)  # rebased: the newest doc is 1
  elif len(caches) != cfg.n_layers:
    raise ValueError(f"got {len(caches)} caches for {cfg.n_layers} layers")
  return caches, docs, new_doc_cache


def _check_cache(i: int, cache, lp, cfg: ModelConfig, batch: int, width: int, kv_cache: bool,
                 ring_pos):
  """Layer i's cache against the plan: (B, L, width), or ring keys and values (B, H, L, Dh)."""
  if ring_pos is not None:
    want = (batch, cfg.n_heads, lp.cache_len, cfg.head_dim)
    got = [tuple(getattr(x, "shape", ())) for x in cache] if isinstance(cache, tuple) else [
        tuple(cache.shape)]
    if got != [want, want]:
      raise ValueError(f"layer {i}: ring cache of shapes {got}, the plan wants keys and "
                       f"values of {want} (caches.to_ring)")
  elif cache.shape[1] != lp.cache_len or cache.shape[2] != width:
    raise ValueError(f"layer {i}: cache of shape {cache.shape[1:]}, the plan wants "
                     f"({lp.cache_len}, {width}); fit it with caches.resize_caches "
                     f"(kv_cache={kv_cache})")


def _next_cache(cache, new, lp, cfg: ModelConfig, ring_pos):
  """A layer's cache for the next block: the newest lp.cache_len states (or keys|values), or
  with ring_pos this token's keys|values written into their ring slot."""
  if ring_pos is not None:  # this token's keys|values into its slot, head-major
    slot = jnp.asarray(ring_pos, jnp.int32) % lp.cache_len
    zero = jnp.zeros((), jnp.int32)
    new = new.reshape(new.shape[0], 1, 2, cfg.n_heads, cfg.head_dim).transpose(2, 0, 3, 1, 4)
    return tuple(jax.lax.dynamic_update_slice(r, n.astype(r.dtype), (zero, zero, slot, zero))
                 for r, n in zip(cache, new))
  both = jnp.concatenate([cache, new.astype(cache.dtype)], axis=1)
  return jax.lax.stop_gradient(both[:, both.shape[1] - lp.cache_len:])


def _layers_aux(cfg: ModelConfig, auxes):
  """The layers' span losses summed, their span statistics (and spans) stacked."""
  out_aux = {
      "span_loss": sum(a["span_loss"] for a in auxes),
      "span_avg": jnp.stack([a["span_avg"] for a in auxes]),
      "span_max": jnp.stack([a["span_max"] for a in auxes]),
  }
  if cfg.span.mode == "adaptive":
    out_aux["span_z"] = jnp.stack([a["span_z"] for a in auxes])
  if cfg.span.mode == "dynamic":
    out_aux["dyn_spans"] = tuple(a["dyn_spans"] for a in auxes)
  return out_aux


class SpanTransformer(nn.Module):
  """apply(tokens_BxM, caches, train) -> (logprobs_BxMxV, new_caches, aux).

  `caches` holds, per layer, the layer *inputs* of previous blocks, (B, L_l, D) with L_l fixed by
  the plan (caches.init_caches / caches.resize_caches); with cfg.doc_boundary set, one more entry
  last: the document ids of the newest max(L_l) positions (model/caches.py), from which and the
  block's tokens each layer's attention gets its segment ids (a query sees its own document). With kv_cache=True (inference only) it holds
  their projected keys and values instead, (B, L_l, 2D) (caches.init_caches(..., kv=True)): the
  same numbers, since the weights do not change, without re-projecting L_l states per block
  (training must re-project: the reference's keys of cached states use the current weights and
  pass gradients to them). `aux` has the span loss (to be added to the
  training loss only), per-layer span_avg / span_max in tokens, span_z (n_layers, H) for adaptive
  spans and dyn_spans (per layer (B, M, H)) for dynamic spans.
  """
  cfg: ModelConfig
  plan: SpanPlan | None = None
  kv_cache: bool = False

  @nn.compact
  def __call__(self, tokens_BxM, caches, train: bool = False, ring_pos=None):
    """ring_pos: decoding one token with kv_cache=True over ring caches (caches.to_ring): the
    token's position in its stream; each layer's cache gets its keys|values in slot
    ring_pos mod L instead of being shifted (nothing else is copied)."""
    cfg = self.cfg
    plan = self.plan or plan_lib.full_plan(cfg)
    if self.kv_cache and train:
      raise ValueError("kv_cache=True is for inference: training re-projects the cached states "
                       "with the current weights, as the reference does")
    caches, docs, new_doc_cache = _doc_ids(cfg, plan, tokens_BxM, caches, ring_pos)
    tables = None
    if cfg.adapt_io.enabled:
      h, tables = adaptive_io.AdaptiveInput(cfg, name="in_emb")(tokens_BxM)
    else:
      h = nn.Embed(cfg.vocab_size, cfg.d_model, embedding_init=nn.initializers.normal(1.0),
                   name="in_emb")(tokens_BxM)
    h = nn.Dropout(cfg.emb_dropout)(h, deterministic=not train)
    key_pe = self.param("key_pe", nn.initializers.normal(1.0), (cfg.head_dim, cfg.span.size))

    layer_cls = SeqLayer
    if cfg.remat == "layer":
      layer_cls = nn.remat(SeqLayer, static_argnums=(4,),
                           policy=getattr(jax.checkpoint_policies, cfg.remat_policy))
    new_caches, auxes = [], []
    width = 2 * cfg.d_model if self.kv_cache else cfg.d_model
    for i, (cache, lp) in enumerate(zip(caches, plan.layers)):
      _check_cache(i, cache, lp, cfg, tokens_BxM.shape[0], width, self.kv_cache, ring_pos)
      h_in = h
      h, aux = layer_cls(cfg, lp, self.kv_cache, name=f"layers_{i}")(
          h, cache, key_pe, train, ring_pos, docs)
      new = aux.pop("kv") if self.kv_cache else h_in
      new_caches.append(_next_cache(cache, new, lp, cfg, ring_pos))
      auxes.append(aux)
    if docs is not None:
      new_caches.append(new_doc_cache)
    h = nn.Dropout(cfg.emb_dropout)(h, deterministic=not train)
    if cfg.adapt_io.enabled:
      logp = adaptive_io.AdaptiveLogSoftmax(cfg, name="out_emb")(
          h, tables if cfg.adapt_io.tied else None)
    else:
      logits = matmul.Dense(cfg.vocab_size, torch_linear_init(), torch_bias_init(cfg.d_model),
                               cfg.dtype, name="out_emb")(h)
      logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)

    return logp, tuple(new_caches), _layers_aux(cfg, auxes)


# ---- its record in model/archs.py ----------------------------------------------------------------


def build(cfg: ModelConfig, plan: SpanPlan, kv_cache: bool) -> SpanTransformer:
  return SpanTransformer(cfg, plan, kv_cache=kv_cache)


def attention_choice(cfg, m=None, w=None) -> tuple[str, str]:
  """(what the door runs for m queries and windows up to w, why): kernels.select's choice."""
  from span_lm import kernels  # pylint: disable=g-import-not-at-top
  return kernels.choose(cfg.attn_spec, m, w), kernels.why(cfg.attn_spec, m, w)

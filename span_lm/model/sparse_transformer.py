"""The Sparse Transformer (Child et al. 2019, Sec. 5) as a drop-in sequence model for the trainer.

apply(tokens_BxM, caches, train) -> (logprobs_BxMxV, caches, aux), the SpanTransformer signature.
It attends within the block only (M <= sparse.context = n): `caches` are unused placeholders
(one state per layer, plan.full_plan; Orbax cannot save empty arrays) passed through unchanged;
aux has span_loss 0 and span_avg / span_max = M per layer, so the loop's metrics keep a meaning
("the context each layer sees").

Architecture options (config.model.sparse, see model/config.py Sparse):
  prenorm           eqs. 9-14: H += a + b, a = drop(attn(norm H)), b = drop(ff(norm(H + a))),
                     y = softmax(norm(H_N) W_out); False: post-LN blocks (the original Transformer).
  act               GELU as the paper, x * sigmoid(1.702 x); or ReLU.
  init_scale        weights N(0, 0.125 / sqrt(d_in)), biases 0, W_p and W_2 times 1/sqrt(2N),
                     token embedding N(0, 0.125 / sqrt(d)), position tables
                     N(0, 0.125 / sqrt(d n_emb)),
                     W_out zero (Sec. 6); False drops only the 1/sqrt(2N).
  pos               attn: one table per coordinate of a width-l matrix (row, column; text);
                     data: one per coordinate of data_shape (images: row, column, channel).
  scan_layers       one nn.scan over the blocks (a group of scan_period blocks per step, their
                     parameters stacked under 'layers'): a 128-layer model compiles one group.
                     The same function as the unrolled 'layers_{i}' (tests/model/test_sparse*).
  model.remat='layer' each residual block is recomputed in the backward pass (jax.checkpoint)
                     under remat_policy: nothing_saveable keeps only block inputs (Sec. 5.4).
  dtype='bfloat16'   matmuls and attention in bf16; params, layer-norm statistics and softmax in
                     float32 (V100s have no bf16: dtype=float16 with loss scaling).
  stream_dtype      the residual stream (and what the layer norms return): float32, or
                     'compute' = dtype, the paper's half-precision activations (Sec. 5.6).
Dropout sits only at the end of each residual branch and on the embeddings (Sec. 5.4).
"""
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from span_lm.model import config as model_config
from span_lm.model import sparse
from span_lm.model.config import ModelConfig

def _init(cfg: ModelConfig, fan_in: int, residual_out: bool = False):
  std = 0.125 / math.sqrt(fan_in)
  if residual_out and cfg.sparse.init_scale:
    std /= math.sqrt(2 * cfg.n_layers)
  return nn.initializers.normal(std)


def _dense(cfg, features, fan_in, name, residual_out=False):
  return nn.Dense(features, kernel_init=_init(cfg, fan_in, residual_out),
                  bias_init=nn.initializers.zeros, dtype=jnp.dtype(cfg.dtype), name=name)


def position_sizes(cfg: ModelConfig) -> list[int]:
  """The factorized position embedding's tables: position p has coordinates
  np.unravel_index(p, sizes), one table per coordinate (attn: row p // l and column p % l of a
  width-l matrix; data: the data's own axes)."""
  if cfg.sparse.pos == "attn":
    return [-(-cfg.sparse.context // cfg.sparse.stride), cfg.sparse.stride]
  if cfg.sparse.pos == "data":
    return list(cfg.sparse.data_shape)
  return []


class _HeadsDense(nn.Module):
  """nn.Dense's parameters ('kernel' d_in x H*dh, 'bias') applied as an einsum straight to or
  from the heads' layout (B, H, M, dh): the head transposes fold into the matmuls instead of
  copying the activations through HBM."""
  cfg: ModelConfig
  heads: int
  head_dim: int
  d_model: int
  to_heads: bool  # True: BxMxD -> BxHxMxdh; False: BxHxMxdh -> BxMxD
  residual_out: bool = False
  order: tuple[int, ...] | None = None  # the heads' order in the activations (None: as stored)

  @nn.compact
  def __call__(self, x):
    cfg, h, dh, d = self.cfg, self.heads, self.head_dim, self.d_model
    d_in, d_out = (d, h * dh) if self.to_heads else (h * dh, d)
    kernel = self.param("kernel", _init(cfg, d_in, self.residual_out), (d_in, d_out))
    bias = self.param("bias", nn.initializers.zeros, (d_out,))
    dt = jnp.dtype(cfg.dtype)
    x, kernel, bias = x.astype(dt), kernel.astype(dt), bias.astype(dt)
    # Permuting the weights' head axis (d x H x dh) costs nothing per token; none when in order.
    order = slice(None) if self.order is None else np.asarray(self.order)
    if self.to_heads:
      y = jnp.einsum("bmd,dhk->bhmk", x, kernel.reshape(d, h, dh)[:, order])
      return y + bias.reshape(h, dh)[order].reshape(1, h, 1, dh)
    return jnp.einsum("bhmk,hkd->bmd", x, kernel.reshape(h, dh, d)[order]) + bias.reshape(1, 1, d)


class SparseAttention(nn.Module):
  """attention(X) = W_p attend(X, A) with the layer's factorized head patterns (eqs. 5-8)."""
  cfg: ModelConfig
  layer: int

  @nn.compact
  def __call__(self, x_BxMxD):
    cfg = self.cfg
    d = x_BxMxD.shape[-1]
    h, dk, dv = cfg.n_heads, cfg.d_qk // cfg.n_heads, cfg.head_dim
    pattern = sparse.layer_heads(cfg.sparse.pattern, cfg.sparse.combine, h, self.layer,
                                 cfg.sparse.stride, cfg.sparse.c, cfg.sparse.distinct)
    # Heads computed grouped by pattern (the parameters keep head h where it is): a kernel
    # makes one call per run of equal heads (kernels/sparse/splash_sparse.py `runs`).
    order = sparse.grouped_order(pattern)
    pattern = tuple(pattern[i] for i in order)
    order = None if order == tuple(range(h)) else order  # no gather of the weights
    heads = lambda name, dh: _HeadsDense(cfg, h, dh, d, True, order=order, name=name)(x_BxMxD)
    q_BxHxMxK = heads("query", dk) * (1.0 / math.sqrt(dk))
    k_BxHxMxK = heads("key", dk)
    v_BxHxMxE = heads("value", dv)
    o_BxHxMxE = sparse.attention(q_BxHxMxK, k_BxHxMxK, v_BxHxMxE, pattern, cfg.sparse.impl)
    return _HeadsDense(cfg, h, dv, d, False, residual_out=True, order=order,
                       name="proj")(o_BxHxMxE)


class FeedForward(nn.Module):
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x):
    cfg = self.cfg
    y = _dense(cfg, cfg.d_ff, cfg.d_model, "fc1")(x)
    y = y * jax.nn.sigmoid(1.702 * y) if cfg.sparse.act == "gelu" else jax.nn.relu(y)
    return _dense(cfg, cfg.d_model, cfg.d_ff, "fc2", residual_out=True)(y)


def stream_dtype(cfg: ModelConfig):
  """The residual stream's dtype (sparse.stream_dtype)."""
  return jnp.dtype(cfg.dtype if cfg.sparse.stream_dtype == "compute" else jnp.float32)


class ResBlock(nn.Module):
  """One residual block; the residual stream h_BxMxD is in stream_dtype(cfg) (float32 by
  default) and so is what the block returns."""
  cfg: ModelConfig
  layer: int

  @nn.compact
  def __call__(self, h, train: bool):
    cfg = self.cfg
    dt, st = jnp.dtype(cfg.dtype), stream_dtype(cfg)
    norm = lambda name: nn.LayerNorm(epsilon=1e-5, dtype=st, name=name)  # statistics in float32
    drop = lambda y: nn.Dropout(cfg.dropout)(y.astype(st), deterministic=not train)
    attn = SparseAttention(cfg, self.layer, name="attn")
    ff = FeedForward(cfg, name="ff")
    if cfg.sparse.prenorm:
      a = drop(attn(norm("norm1")(h).astype(dt)))
      b = drop(ff(norm("norm2")(h + a).astype(dt)))
      return h + a + b
    h = norm("norm1")(h + drop(attn(h.astype(dt))))
    return norm("norm2")(h + drop(ff(h.astype(dt))))


class _BlockGroup(nn.Module):
  """scan_period consecutive blocks (layers 0..p-1 of the period: their head patterns), one
  step of the layer scan."""
  cfg: ModelConfig
  block_cls: type
  train: bool

  @nn.compact
  def __call__(self, h, _):
    for j in range(self.cfg.sparse.scan_period):
      h = self.block_cls(self.cfg, j, name=f"block_{j}")(h, self.train)
    return h, None


class SparseTransformer(nn.Module):
  """apply(tokens_BxM, caches, train) -> (logprobs_BxMxV, caches, aux); see the module docstring.

  `plan` is accepted for the trainer's uniform interface; the model ignores it.
  """
  cfg: ModelConfig
  plan: object = None

  @nn.compact
  def __call__(self, tokens_BxM, caches, train: bool = False):
    cfg = self.cfg
    m = tokens_BxM.shape[1]
    if len(caches) != cfg.n_layers:
      raise ValueError(f"got {len(caches)} caches for {cfg.n_layers} layers")
    if any(c.shape[1] > 1 for c in caches):
      raise ValueError("arch='sparse' keeps no hidden states: caches must be placeholders of "
                       "length <= 1 (caches.init_caches with plan.full_plan)")
    if m > cfg.sparse.context:
      raise ValueError(f"a block of {m} tokens exceeds the context config.model.sparse.context="
                       f"{cfg.sparse.context}")
    d = cfg.d_model
    h = nn.Embed(cfg.vocab_size, d, embedding_init=nn.initializers.normal(0.125 / math.sqrt(d)),
                 name="in_emb")(tokens_BxM)
    sizes = position_sizes(cfg)
    for j, size in enumerate(sizes):
      table = self.param(f"pos_emb_{j}", nn.initializers.normal(0.125 / math.sqrt(d * len(sizes))),
                         (size, d))
      # Row-major coordinates as a broadcast of the table over the other axes, not a gather of
      # positions: it fuses into the sum, and its gradient is a reduction, not a scatter-add.
      axis = [size if i == j else 1 for i in range(len(sizes))]
      table = jnp.broadcast_to(table.reshape(*axis, d), (*sizes, d)).reshape(-1, d)
      h = h + table[:m][None]
    h = nn.Dropout(cfg.emb_dropout)(h, deterministic=not train).astype(stream_dtype(cfg))

    block_cls = ResBlock
    if cfg.remat == "layer":
      policy = getattr(jax.checkpoint_policies, cfg.remat_policy)
      # under a scan, CSE cannot merge recomputation into the forward pass (jax.checkpoint)
      block_cls = nn.remat(ResBlock, static_argnums=(2,), policy=policy,
                           prevent_cse=not cfg.sparse.scan_layers)
    if cfg.sparse.scan_layers:
      scanned = nn.scan(_BlockGroup, variable_axes={"params": 0},
                        split_rngs={"params": True, "dropout": True},
                        length=cfg.n_layers // cfg.sparse.scan_period)
      h, _ = scanned(cfg, block_cls, train, name=model_config.SCANNED_LAYERS)(h, None)
    else:
      for i in range(cfg.n_layers):
        h = block_cls(cfg, i, name=f"layers_{i}")(h, train)
    if cfg.sparse.prenorm:
      h = nn.LayerNorm(epsilon=1e-5, dtype=jnp.float32, name="norm_out")(h)
    logits = nn.Dense(cfg.vocab_size, use_bias=False, kernel_init=nn.initializers.zeros,
                      dtype=jnp.dtype(cfg.dtype), name="out_emb")(h.astype(jnp.dtype(cfg.dtype)))
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    context = jnp.full((cfg.n_layers,), m, jnp.float32)
    aux = {"span_loss": jnp.zeros((), jnp.float32), "span_avg": context, "span_max": context}
    return logp, tuple(caches), aux


# ---- its record in model/archs.py ----------------------------------------------------------------


def build(cfg: ModelConfig, plan, kv_cache: bool) -> SparseTransformer:
  if kv_cache:
    raise ValueError("kv_cache applies to the span Transformer only (the sparse one has no cache)")
  return SparseTransformer(cfg, plan)


def attention_choice(cfg, m=None, w=None) -> tuple[str, str]:
  """kernels/sparse/door.py's choice for the first block's head patterns (every block's heads
  have the same sizes, and the table's misfits depend on sizes only), named 'sparse <impl>'."""
  del w
  from span_lm.kernels.sparse import door as sparse_door  # pylint: disable=g-import-not-at-top
  sp = cfg.sparse
  heads = sparse.layer_heads(sp.pattern, sp.combine, cfg.n_heads, 0, sp.stride, sp.c,
                             sp.distinct)
  name, why = sparse_door.choose(sparse.door_spec(sp.impl, heads, m or sp.context,
                                                  cfg.d_qk // cfg.n_heads))
  return f"sparse {name}", why

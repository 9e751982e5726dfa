"""An independent float64 numpy implementation of the span Transformer forward pass.

Written from the model equations (docs/reference_semantics.md, "The model", "The soft span mask",
"Persistent memory") and NOT from the Flax code, so that the two can check each other. It is
deliberately naive: dense attention over the whole concat(cache, block) with an explicit
distance mask, no skew, no trimming, no head groups. Every array is float64.

It is the project's one plain definition of attention: `attention(..., xp=jax.numpy)` runs the
same lines under jax (float32, matmuls at HIGHEST precision, differentiable), which is how
bench/gpu_layer_check.py and bench/gpu_kernel_check.py compare every implementation's output and
gradients on a GPU. tests/test_gpu_suite.py checks that the two runs agree. It lives in the
package (not tests/) because bench uses it too; tests/reference_numpy.py is its old name.

Parameters use the same nested-dict tree as the Flax model (kernels are (in, out)):

  in_emb/embedding (V, D); key_pe (Dh, S);
  layers_i/attn/proj_query|proj_key|proj_val|proj_out/kernel (D, D);
  layers_i/attn/span_ratio (H,)                             adaptive only (z')
  layers_i/attn/span_predictor/kernel (D, H), bias (H,)     dynamic only
  layers_i/attn/pers_key (H, Dh, N), pers_val (H, N, Dh)    when N > 0
  layers_i/norm1/scale|bias (D,);
  layers_i/ff/fc1/kernel (D, F), bias (F,); fc2/kernel (F, D), bias (D,)   only when N == 0
  layers_i/norm2/scale|bias (D,)                            only when N == 0
  out_emb/kernel (D, V), bias (V,)

Conventions: a query at absolute position t (in concat(cache, block)) attends the keys at
distance d = t - p in [1, S] (strictly before it). key_pe column S - d holds distance d (column
S - 1 is the previous token). The soft mask is m(d) = clip((R + z - (d - 1)) / R, 0, 1).
"""
from typing import Any, Mapping

import numpy as np

LN_EPS = 1e-5
RENORM_EPS = 1e-8


def einsum(spec, a, b, xp=np):
  """np.einsum, or jax.numpy's at full float32 precision (no TF32 or bf16 passes on a GPU)."""
  if xp is np:
    return np.einsum(spec, a, b)
  return xp.einsum(spec, a, b, precision="highest")


def to_float64(tree: Any) -> Any:
  """Recursively converts a nested mapping of arrays to float64 numpy arrays (plain dicts)."""
  if isinstance(tree, Mapping):
    return {k: to_float64(v) for k, v in tree.items()}
  return np.asarray(tree, dtype=np.float64)


def layer_norm(x, scale, bias, eps=LN_EPS):
  mu = x.mean(axis=-1, keepdims=True)
  var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)  # biased variance
  return (x - mu) / np.sqrt(var + eps) * scale + bias


def soft_mask(z, distance, ramp, xp=np):
  """m(d) = clip((R + z - (d - 1)) / R, 0, 1); distance 1 is the previous token."""
  return xp.clip((ramp + z - (distance - 1.0)) / ramp, 0.0, 1.0)


def clamp_slope(x):
  """d clip(x, 0, 1) / dx as the reference's torch.clamp defines it: 1 on the closed interval."""
  return ((x >= 0.0) & (x <= 1.0)).astype(np.float64)


def banded_attention(q, k, v, pe, z, ramp, pers_k=None, pers_v=None, ct=None, pe_ahead=None,
                     z_ahead=None, q_seg=None, kv_seg=None):
  """One head group's attention over the W distances before each query (and the A after), from
  the equations.

  q (B, H, M, Dh); k, v (B, H, W + M + A, Dh): query i is row W + i; it sees row t behind at
  distance d = W + i - t in [1, W] (mask x = d - 1), and ahead at distance a = t - (W + i) + 1
  in [1, A] (mask x = a); pe (Dh, W), column W - d for distance d; pe_ahead (Dh, A), column
  a - 1 for distance a (None: causal, A = 0); z, z_ahead spans in tokens, broadcastable to
  (B, H, M), or None (fixed; z_ahead None: z on both sides); pers_k (H, Dh, N), pers_v (H, N, Dh)
  already scaled; q_seg (B, M), kv_seg (B, T) segment ids: a query sees only rows of its own
  nonzero segment, and a query of segment 0 gives zeros. Returns out (B, H, M, Dh) and, given ct
  (like out), d sum(out * ct) / dz (B, H, M) (both sides' spans are z when z_ahead is None) with
  the clamp's derivative as torch.clamp's (`clamp_slope`).
  """
  q, k, v, pe = (np.asarray(a, np.float64) for a in (q, k, v, pe))
  b, h, m, dh = q.shape
  w = pe.shape[-1]
  a_len = 0 if pe_ahead is None else pe_ahead.shape[-1]
  t = w + m + a_len
  behind, ahead, x, pe_k = _band(pe, pe_ahead, w, m, a_len)
  allowed = np.broadcast_to(behind | ahead, (b, 1, m, t))
  if q_seg is not None:
    q_seg, kv_seg = np.asarray(q_seg), np.asarray(kv_seg)
    same = (q_seg[:, :, None] == kv_seg[:, None, :]) & (kv_seg[:, None, :] != 0)  # B M T
    allowed = allowed & same[:, None]
  logits = np.einsum("bhmd,bhtd->bhmt", q, k) + np.einsum("bhmd,dmt->bhmt", q, pe_k)
  logits = np.where(allowed, logits, -np.inf) / np.sqrt(dh)
  n = 0 if pers_k is None else pers_k.shape[-1]
  if n:
    logits = np.concatenate([logits, np.einsum("bhmd,hdn->bhmn", q, pers_k) / np.sqrt(dh)], -1)
  with np.errstate(invalid="ignore"):  # a row with nothing allowed: nan, zeroed below
    e = softmax(logits)
  e = np.nan_to_num(e, nan=0.0)
  e_ctx, e_pers = e[..., :t], e[..., t:]
  if z is None:
    a, tot, u = e, None, None
  else:
    a, tot, u = _banded_mask(e_ctx, e_pers, z, z_ahead, ramp, x, ahead, allowed)
  out = np.einsum("bhmt,bhtd->bhmd", a[..., :t], v)
  if n:
    out = out + np.einsum("bhmn,hnd->bhmd", a[..., t:], pers_v)
  if q_seg is not None:
    out = np.where((q_seg != 0)[:, None, :, None], out, 0.0)
  if ct is None or z is None:
    return out, None
  return out, _banded_span_grad(ct, q_seg, v, pers_v, a, e_ctx, tot, u, allowed, ramp)


def _band(pe, pe_ahead, w, m, a_len):
  """Which rows each query sees behind and ahead, the soft mask's x there, and the position
  embedding of each (query, row) pair, (Dh, M, T)."""
  t = w + m + a_len
  rel = np.arange(t)[None, :] - (w + np.arange(m))[:, None]  # row - query's row, (M, T)
  behind = (rel <= -1) & (rel >= -w)
  ahead = (rel >= 0) & (rel <= a_len - 1)
  x = np.where(behind, -rel - 1, rel + 1).astype(np.float64)  # the mask's x
  cols = np.where(behind, np.clip(w + rel, 0, w - 1), 0)
  pe_k = pe[:, cols]  # (Dh, M, T)
  if a_len:
    pe_k = np.where(ahead[None], np.asarray(pe_ahead, np.float64)[:, np.clip(rel, 0, a_len - 1)],
                    pe_k)
  return behind, ahead, x, pe_k


def _banded_mask(e_ctx, e_pers, z, z_ahead, ramp, x, ahead, allowed):
  """The softmax weights under the soft span mask, renormalised: the weights, their normaliser
  and the mask's argument u (before the clamp), which the span gradient needs."""
  b, h, m = e_ctx.shape[:3]
  z = np.broadcast_to(np.asarray(z, np.float64), (b, h, m))
  zz = z[..., None]
  if z_ahead is not None:
    za = np.broadcast_to(np.asarray(z_ahead, np.float64), (b, h, m))[..., None]
    zz = np.where(ahead, za, zz)
  u = (ramp + zz - x) / ramp
  tot = (e_ctx * np.clip(u, 0.0, 1.0) * allowed).sum(-1, keepdims=True)
  tot = tot + e_pers.sum(-1, keepdims=True) + RENORM_EPS
  a = np.concatenate([e_ctx * np.clip(u, 0.0, 1.0) * allowed, e_pers], -1) / tot
  return a, tot, u


def _banded_span_grad(ct, q_seg, v, pers_v, a, e_ctx, tot, u, allowed, ramp):
  """d sum(out * ct) / dz (B, H, M), through the renormalised soft mask."""
  t = e_ctx.shape[-1]
  ct = np.asarray(ct, np.float64)
  if q_seg is not None:
    ct = np.where((q_seg != 0)[:, None, :, None], ct, 0.0)
  g_a = np.einsum("bhmd,bhtd->bhmt", ct, v)
  if a.shape[-1] > t:  # persistent memory
    g_a = np.concatenate([g_a, np.einsum("bhmd,hnd->bhmn", ct, pers_v)], -1)
  delta = (g_a * a).sum(-1, keepdims=True)
  d_mask = e_ctx / tot * (g_a[..., :t] - delta)  # a = e m / (sum e m + sum e_pers + eps)
  return (d_mask * clamp_slope(u) * allowed).sum(-1) / ramp


def sigmoid(x, xp=np):
  return 1.0 / (1.0 + xp.exp(-x))


def softmax(x, axis=-1, xp=np):
  """Softmax tolerant of -inf entries (rows must hold at least one finite entry)."""
  m = xp.max(x, axis=axis, keepdims=True)
  e = xp.exp(x - m)
  return e / e.sum(axis=axis, keepdims=True)


def log_softmax(x, axis=-1):
  m = np.max(x, axis=axis, keepdims=True)
  y = x - m
  return y - np.log(np.exp(y).sum(axis=axis, keepdims=True))


def span_values(cfg, attn_params, h, xp=np):
  """The span z used by the mask: None (fixed), (H,) (adaptive) or (B, M, H) (dynamic)."""
  s = float(cfg.span.size)
  if cfg.span.mode == "fixed":
    return None
  if cfg.span.mode == "adaptive":
    return s * attn_params["span_ratio"]
  if cfg.span.mode == "dynamic":
    sp = attn_params["span_predictor"]
    return s * sigmoid(einsum("bmd,dh->bmh", h, sp["kernel"], xp) + sp["bias"][None, None], xp)
  raise ValueError(f"unknown span_mode {cfg.span.mode!r}")


def attention(cfg, attn_params, key_pe, h, cache, return_weights=False, xp=np):
  """One multi-head attention sublayer (without residual / norm).

  Args:
    cfg: a ModelConfig-like object (span, ramp, n_heads, span_mode, pers_mem).
    attn_params: the layer's 'attn' parameter dict (float64).
    key_pe: (Dh, S).
    h: (B, M, D) layer input (the queries).
    cache: (B, L, D) hidden states of the previous positions (any L >= 0).
    return_weights: also return the attention weights.
    xp: numpy (float64 as given), or jax.numpy to run the same definition under jax.

  Returns:
    out (B, M, D), and if return_weights a dict with 'context' (B, H, M, L + M) and
    'persistent' (B, H, M, N) (None when N == 0).
  """
  b, m, d_model = h.shape
  length = cache.shape[1]
  n_heads = cfg.n_heads
  dh = d_model // n_heads

  x = xp.concatenate([cache, h], axis=1)  # (B, L + M, D)
  proj = lambda a, name: einsum("btd,de->bte", a, attn_params[name]["kernel"], xp)
  q = proj(h, "proj_query").reshape(b, m, n_heads, dh)
  k = proj(x, "proj_key").reshape(b, length + m, n_heads, dh)
  v = proj(x, "proj_val").reshape(b, length + m, n_heads, dh)
  dist, allowed, logits = _span_logits(q, k, key_pe, cfg.span.size, length, xp)
  mask = _span_mask(cfg, attn_params, h, dist, allowed, xp)
  out, a_ctx, a_pers = _mix(q, v, logits, mask, attn_params, cfg.pers_mem, xp)
  out = proj(out.reshape(b, m, d_model), "proj_out")
  if return_weights:
    return out, {"context": a_ctx, "persistent": a_pers}
  return out


def _span_logits(q, k, key_pe, s, length, xp):
  """Content plus position logits of each query against the S positions before it (-inf
  elsewhere), with the distances (M, L + M) and where they are allowed."""
  m = q.shape[1]
  qpos = length + np.arange(m)
  kpos = np.arange(length + m)
  dist = qpos[:, None] - kpos[None, :]  # (M, L + M)
  allowed = (dist >= 1) & (dist <= s)
  pe_idx = np.clip(s - dist, 0, s - 1)
  pe = key_pe[:, pe_idx]  # (Dh, M, L + M); only read where allowed

  content = einsum("bmhe,bphe->bhmp", q, k, xp)
  position = einsum("bmhe,emp->bhmp", q, pe, xp)
  logits = xp.where(allowed[None, None], content + position, -np.inf)  # (B, H, M, P)
  return dist, allowed, logits


def _span_mask(cfg, attn_params, h, dist, allowed, xp):
  """The soft span mask (B or 1, H, M, P), zero outside the allowed distances; None (fixed)."""
  ramp = float(cfg.span.ramp)
  z = span_values(cfg, attn_params, h, xp)
  if z is None:
    mask = None
  elif z.ndim == 1:  # adaptive: (H,)
    mask = soft_mask(z[None, :, None, None], dist[None, None].astype(np.float64), ramp, xp)
  else:  # dynamic: (B, M, H)
    z_bhm = z.transpose(0, 2, 1)[..., None]  # (B, H, M, 1)
    mask = soft_mask(z_bhm, dist[None, None].astype(np.float64), ramp, xp)
  if mask is not None:
    mask = mask * allowed[None, None]
  return mask


def _mix(q, v, logits, mask, attn_params, n_pers, xp):
  """The heads' outputs (B, M, H, Dh) and weights: the softmax over the context (joint with the
  N persistent vectors when there are any), times the mask and renormalised."""
  p = logits.shape[-1]  # L + M
  dh = q.shape[-1]
  scale = np.sqrt(dh)
  if n_pers > 0:
    pk = attn_params["pers_key"] * np.sqrt(dh)  # (H, Dh, N)
    pv = attn_params["pers_val"] * np.sqrt(n_pers)  # (H, N, Dh)
    pers_logits = einsum("bmhe,hen->bhmn", q, pk, xp)
    joint = softmax(xp.concatenate([logits, pers_logits], axis=-1) / scale, xp=xp)
    a_ctx, a_pers = joint[..., :p], joint[..., p:]
    if mask is not None:
      a_ctx = a_ctx * mask
      tot = a_ctx.sum(-1, keepdims=True) + a_pers.sum(-1, keepdims=True) + RENORM_EPS
      a_ctx, a_pers = a_ctx / tot, a_pers / tot
    out = einsum("bhmp,bphe->bmhe", a_ctx, v, xp) + einsum("bhmn,hne->bmhe", a_pers, pv, xp)
  else:
    a_ctx = softmax(logits / scale, xp=xp)
    a_pers = None
    if mask is not None:
      a_ctx = a_ctx * mask
      a_ctx = a_ctx / (a_ctx.sum(-1, keepdims=True) + RENORM_EPS)
    out = einsum("bhmp,bphe->bmhe", a_ctx, v, xp)
  return out, a_ctx, a_pers


def forward(cfg, params, tokens, caches, return_weights=False):
  """The whole model.

  Args:
    cfg: ModelConfig.
    params: nested dict (converted to float64 here).
    tokens: int (B, M).
    caches: sequence of n_layers arrays (B, L_l, D).
    return_weights: also return per-layer attention weights in aux['weights'].

  Returns:
    (logp (B, M, V), new_caches tuple, aux dict) with aux keys 'span_loss', and per mode
    'span_z' (adaptive: (n_layers, H) = S z'), 'span_avg'/'span_max' (adaptive),
    'dyn_spans' (dynamic: tuple of (B, M, H)).
  """
  params = to_float64(params)
  tokens = np.asarray(tokens)
  s = float(cfg.span.size)
  h = params["in_emb"]["embedding"][tokens]  # (B, M, D)
  new_caches = []
  span_loss = 0.0
  span_z, dyn_spans, weights = [], [], []
  for i in range(cfg.n_layers):
    lp = params[f"layers_{i}"]
    cache = np.asarray(caches[i], dtype=np.float64)
    length = cache.shape[1]
    full = np.concatenate([cache, h], axis=1)
    new_caches.append(full[:, full.shape[1] - length :])

    if cfg.span.mode == "adaptive":
      zr = lp["attn"]["span_ratio"]
      span_loss += cfg.span.loss * s * zr.mean()
      span_z.append(s * zr)
    elif cfg.span.mode == "dynamic":
      zt = span_values(cfg, lp["attn"], h)
      span_loss += cfg.span.loss * s * (zt / s).mean()
      dyn_spans.append(zt)

    res = attention(cfg, lp["attn"], params["key_pe"], h, cache, return_weights)
    if return_weights:
      res, w = res
      weights.append(w)
    h = _residual_block(cfg, lp, h, res)

  logits = h @ params["out_emb"]["kernel"] + params["out_emb"]["bias"]
  aux = _span_aux(cfg, span_loss, span_z, dyn_spans)
  if return_weights:
    aux["weights"] = weights
  return log_softmax(logits), tuple(new_caches), aux


def _residual_block(cfg, lp, h, res):
  """The layer after its attention: residual and norm, then (without persistent memory) the
  feed-forward with its own residual and norm."""
  h = layer_norm(h + res, lp["norm1"]["scale"], lp["norm1"]["bias"])
  if cfg.pers_mem == 0:
    ff = lp["ff"]
    hid = np.maximum(h @ ff["fc1"]["kernel"] + ff["fc1"]["bias"], 0.0)
    h = layer_norm(h + hid @ ff["fc2"]["kernel"] + ff["fc2"]["bias"],
                   lp["norm2"]["scale"], lp["norm2"]["bias"])
  return h


def _span_aux(cfg, span_loss, span_z, dyn_spans):
  """forward's aux dict from the per-layer spans (see forward)."""
  s = float(cfg.span.size)
  aux = {"span_loss": np.float64(span_loss)}
  if cfg.span.mode == "adaptive":
    z = np.stack(span_z) / s  # (n_layers, H) = z'
    aux["span_z"] = s * z
    aux["span_avg"] = np.clip(np.ceil(z.mean(-1) * s) + cfg.span.ramp, 0, s)
    aux["span_max"] = np.clip(np.ceil(z.max(-1) * s) + cfg.span.ramp, 0, s)
  if cfg.span.mode == "dynamic":
    aux["dyn_spans"] = tuple(dyn_spans)
  return aux


def param_shapes(cfg):
  """The parameter tree's shapes, as the spec describes it (nested dict of tuples)."""
  v, d, h, f, s, n = (cfg.vocab_size, cfg.d_model, cfg.n_heads, cfg.d_ff, cfg.span.size,
                      cfg.pers_mem)
  dh = d // h
  tree = {"in_emb": {"embedding": (v, d)}, "key_pe": (dh, s),
          "out_emb": {"kernel": (d, v), "bias": (v,)}}
  for i in range(cfg.n_layers):
    attn = {name: {"kernel": (d, d)} for name in
            ("proj_query", "proj_key", "proj_val", "proj_out")}
    if cfg.span.mode == "adaptive":
      attn["span_ratio"] = (h,)
    if cfg.span.mode == "dynamic":
      attn["span_predictor"] = {"kernel": (d, h), "bias": (h,)}
    if n > 0:
      attn["pers_key"] = (h, dh, n)
      attn["pers_val"] = (h, n, dh)
    layer = {"attn": attn, "norm1": {"scale": (d,), "bias": (d,)}}
    if n == 0:
      layer["ff"] = {"fc1": {"kernel": (d, f), "bias": (f,)},
                     "fc2": {"kernel": (f, d), "bias": (d,)}}
      layer["norm2"] = {"scale": (d,), "bias": (d,)}
    tree[f"layers_{i}"] = layer
  return tree


def random_params(cfg, rng, span_ratio_range=(0.05, 0.95)):
  """Random float64 parameters with non-trivial values everywhere (for equality tests)."""
  shapes = param_shapes(cfg)
  d, dh, n = cfg.d_model, cfg.d_model // cfg.n_heads, cfg.pers_mem

  def fill(path, shape):
    name = path[-1]
    parent = path[-2] if len(path) > 1 else ""
    if name == "embedding" or name == "key_pe":
      return rng.normal(size=shape)
    if name == "span_ratio":
      return rng.uniform(*span_ratio_range, size=shape)
    if name == "pers_key":
      return rng.normal(size=shape) / np.sqrt(dh)
    if name == "pers_val":
      return rng.normal(size=shape) / np.sqrt(n)
    if name == "scale":
      return 1.0 + 0.2 * rng.normal(size=shape)
    if parent == "span_predictor" and name == "kernel":
      return 0.5 * rng.normal(size=shape)
    if parent == "span_predictor" and name == "bias":
      return rng.normal(size=shape) - 1.0
    if name == "kernel":
      return rng.normal(size=shape) / np.sqrt(shape[0])
    if name == "bias":
      return 0.2 * rng.normal(size=shape)
    raise KeyError(path)

  def walk(tree, path):
    if isinstance(tree, dict):
      return {k: walk(v, path + (k,)) for k, v in tree.items()}
    return fill(path, tree)

  del d
  return walk(shapes, ())

"""A span_lm export read with numpy and safetensors only: the format, as a program.

  python examples/read_safetensors.py EXPORT_DIR "some text"

EXPORT_DIR is what `python main.py --config.workdir=RUN --config.mode=export
--config.export_to=EXPORT_DIR` wrote: model.safetensors (the parameters, named as the table in
span_lm/tools/safetensors_format.py says) and config.json (the model's sizes, its vocabulary,
its learned spans). This script turns the text into token ids with config.json's vocabulary,
runs the span model's forward pass in float64 numpy from a stream's start (each layer's cache is
S zero vectors, as span_lm's evaluation begins) and prints the log-probability of every next
token and the bits per token. It covers the span architecture with fixed or adaptive spans and
persistent memory; other models (adaptive input/softmax, dynamic spans, document boundaries,
the Sparse Transformer) are refused in one line. tests/tools/test_safetensors.py checks its
numbers against span_lm's own to 1e-5.

The model (post-LayerNorm, Sukhbaatar et al. 2019), per layer i, for the block h (M, D) after
the cache c (L, D): x = [c; h]; q = h Wq, k = x Wk, v = x Wv split into H heads of Dh; a query
at position t sees keys at distances d = t - p in [1, S] with logits (q.k + q.key_pe[:, S - d])
/ sqrt(Dh); softmax, then (adaptive) times the soft mask clip((R + z - (d - 1)) / R, 0, 1) with
z = S clip(span_ratio, 0, 1), renormalised (+1e-8); persistent memory joins the softmax with
pers_key * sqrt(Dh) and pers_val * sqrt(N); h = LN1(h + attn Wo); without it
h = LN2(h + relu(h W1 + b1) W2 + b2); finally log_softmax(h Wout + bout). Kernels are (in, out).
"""
import json
import os
import sys

import numpy as np
from safetensors.numpy import load_file

EOS = "<eos>"
LN_EPS = 1e-5


def load(directory):
  """(config.json as a dict, {name: float64 array}), refusing what this reader cannot run."""
  with open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
    config = json.load(f)
  m = config["model"]
  unsupported = [why for bad, why in [
      (config.get("architecture") != "span", f"architecture {config.get('architecture')!r}"),
      (m["span"]["mode"] not in ("fixed", "adaptive"), f"span mode {m['span']['mode']!r}"),
      (m["adapt_io"]["enabled"], "adaptive input/softmax"),
      (m.get("doc_boundary", -1) >= 0, "document boundaries")] if bad]
  if unsupported:
    raise SystemExit(f"error: this reader runs span models with fixed or adaptive spans; "
                     f"{directory} has {', '.join(unsupported)}")
  tensors = {k: np.asarray(v).astype(np.float64) for k, v in
             load_file(os.path.join(directory, "model.safetensors")).items()}
  for name, shape in expected_shapes(m).items():
    if name not in tensors or tensors[name].shape != shape:
      got = tensors[name].shape if name in tensors else "missing"
      raise SystemExit(f"error: tensor {name}: {got}, config.json's model needs {shape}")
  return config, tensors


def expected_shapes(m):
  """The tensor names and shapes config.json's model implies (the table, as code)."""
  v, d, n_heads, f, s, n = (m["vocab_size"], m["d_model"], m["n_heads"], m["d_ff"],
                            m["span"]["size"], m["pers_mem"])
  dh = d // n_heads
  out = {"key_pe": (dh, s), "in_emb.embedding": (v, d), "out_emb.kernel": (d, v),
         "out_emb.bias": (v,)}
  for i in range(m["n_layers"]):
    p = f"layers.{i}."
    for proj in ("proj_query", "proj_key", "proj_val", "proj_out"):
      out[f"{p}attn.{proj}.kernel"] = (d, d)
    if m["span"]["mode"] == "adaptive":
      out[p + "attn.span_ratio"] = (n_heads,)
    if n:
      out[p + "attn.pers_key"], out[p + "attn.pers_val"] = (n_heads, dh, n), (n_heads, n, dh)
    out[p + "norm1.scale"] = out[p + "norm1.bias"] = (d,)
    if not n:
      out[p + "ff.fc1.kernel"], out[p + "ff.fc1.bias"] = (d, f), (f,)
      out[p + "ff.fc2.kernel"], out[p + "ff.fc2.bias"] = (f, d), (d,)
      out[p + "norm2.scale"] = out[p + "norm2.bias"] = (d,)
  return out


def encode(vocabulary, text):
  """Token ids of `text` under config.json's vocabulary (its "encoding" says how)."""
  ids = {t: i for i, t in enumerate(vocabulary["tokens"])}
  kind = vocabulary["kind"]
  if kind == "bytes":
    units = [EOS if b == 10 and "10" not in ids else str(b) for b in text.encode("utf-8")]
  elif kind == "chars":
    units = [EOS if c == "\n" else "_" if c == " " else c for c in text]
  else:
    units = [w for line in text.split("\n") for w in line.split() + [EOS]][:-1]
  missing = sorted({u for u in units if u not in ids})
  if missing:
    raise SystemExit(f"error: the vocabulary has no token for {missing[:10]}")
  return np.asarray([ids[u] for u in units], np.int64)


def layer_norm(x, scale, bias):
  mu = x.mean(-1, keepdims=True)
  return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + LN_EPS) * scale + bias


def softmax(x):
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def attention(m, t, i, h, cache):
  """Layer i's attention for the block h (M, D) after cache (L, D)."""
  p = f"layers.{i}.attn."
  n_heads, s, ramp, n = m["n_heads"], m["span"]["size"], m["span"]["ramp"], m["pers_mem"]
  length, (mlen, d) = cache.shape[0], h.shape
  dh = d // n_heads
  x = np.concatenate([cache, h])
  q = (h @ t[p + "proj_query.kernel"]).reshape(mlen, n_heads, dh)
  k = (x @ t[p + "proj_key.kernel"]).reshape(length + mlen, n_heads, dh)
  v = (x @ t[p + "proj_val.kernel"]).reshape(length + mlen, n_heads, dh)
  dist = (length + np.arange(mlen))[:, None] - np.arange(length + mlen)[None, :]  # (M, L + M)
  seen = (dist >= 1) & (dist <= s)
  pe = t["key_pe"][:, np.clip(s - dist, 0, s - 1)]  # (Dh, M, L + M): column S - d
  logits = np.einsum("mhe,phe->hmp", q, k) + np.einsum("mhe,emp->hmp", q, pe)
  logits = np.where(seen, logits, -np.inf) / np.sqrt(dh)
  if n:
    pers = np.einsum("mhe,hen->hmn", q, t[p + "pers_key"] * np.sqrt(dh)) / np.sqrt(dh)
    logits = np.concatenate([logits, pers], -1)
  a = softmax(logits)
  ctx, a_pers = a[..., :length + mlen], a[..., length + mlen:]
  if m["span"]["mode"] == "adaptive":
    z = s * np.clip(t[p + "span_ratio"], 0.0, 1.0)[:, None, None]  # (H, 1, 1) tokens
    ctx = ctx * np.clip((ramp + z - (dist - 1.0)) / ramp, 0.0, 1.0) * seen
    total = ctx.sum(-1, keepdims=True) + a_pers.sum(-1, keepdims=True) + 1e-8
    ctx, a_pers = ctx / total, a_pers / total
  out = np.einsum("hmp,phe->mhe", ctx, v)
  if n:
    out = out + np.einsum("hmn,hne->mhe", a_pers, t[p + "pers_val"] * np.sqrt(n))
  return out.reshape(mlen, d) @ t[p + "proj_out.kernel"]


def log_probs(directory, text):
  """(token ids (M,), log-probabilities (M, V) of the token after each) for `text`, from the
  start of a stream."""
  config, t = load(directory)
  m = config["model"]
  ids = encode(config["vocabulary"], text)
  h = t["in_emb.embedding"][ids]
  for i in range(m["n_layers"]):
    p = f"layers.{i}."
    cache = np.zeros((m["span"]["size"], m["d_model"]))  # a stream's start: S zero states
    h = layer_norm(h + attention(m, t, i, h, cache), t[p + "norm1.scale"], t[p + "norm1.bias"])
    if not m["pers_mem"]:
      ff = np.maximum(h @ t[p + "ff.fc1.kernel"] + t[p + "ff.fc1.bias"], 0.0)
      h = layer_norm(h + ff @ t[p + "ff.fc2.kernel"] + t[p + "ff.fc2.bias"],
                     t[p + "norm2.scale"], t[p + "norm2.bias"])
  logits = h @ t["out_emb.kernel"] + t["out_emb.bias"]
  logits = logits - logits.max(-1, keepdims=True)
  return ids, logits - np.log(np.exp(logits).sum(-1, keepdims=True))


def main(argv):
  if len(argv) != 3:
    raise SystemExit(f"usage: python {argv[0]} EXPORT_DIR TEXT")
  ids, logp = log_probs(argv[1], argv[2])
  if len(ids) < 2:
    raise SystemExit("error: give at least two tokens of text")
  nll = -logp[np.arange(len(ids) - 1), ids[1:]]
  for j, (tok, lp) in enumerate(zip(ids[1:], -nll)):
    print(f"{j + 1:5d} token {int(tok):6d}  log p {lp:9.4f}")
  print(f"bits per token over {len(nll)} tokens: {nll.mean() / np.log(2):.4f}")


if __name__ == "__main__":
  main(sys.argv)

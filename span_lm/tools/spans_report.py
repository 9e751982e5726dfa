"""Seeing the spans: per-head tables and Figure 4, their history, and Figure 5 for dynamic spans.

Two words, as span_lm.layers uses them: a head's *span* is z = z' S tokens, what it learned; its
*window* is min(S, ceil(z) + R), the distances its soft mask reaches: what the plan must cover
and what the reference (and the paper's Figures 4 and 5) report as its "span", so a head that
learned nothing (z = 0) has the ramp R as its window, as the paper's lowest layers do.
`python main.py --config=... --config.workdir=RUN --config.mode=spans` prints the windows and
spans and writes PNGs into RUN: spans_heads.png (Fig. 4, windows; adaptive), span_history.png
(windows over training, from metrics.jsonl's span_avg / span_max) and dynamic_spans.png (Fig. 5,
windows z_t + R; dynamic, over config.tools.text or the start of the valid split).
"""
import os

import jax
import jax.numpy as jnp
import numpy as np

from span_lm import config as config_lib
from span_lm.model import caches as caches_lib
from span_lm.model import plan as plan_lib
from span_lm.model.config import ModelConfig
from span_lm.model.transformer import SpanTransformer
from span_lm.tools import restore as restore_lib
from span_lm.train import metrics as metrics_lib


def _plt():
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt


def _save(fig, path: str) -> str:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=100)
  _plt().close(fig)
  return path


def head_windows(cfg: ModelConfig, params) -> np.ndarray:
  """(layers, heads) windows in tokens, min(S, ceil(z' S) + R), of an adaptive model."""
  if cfg.spans != "adaptive":
    raise ValueError(f"per-head learned spans exist for span.mode='adaptive', not "
                     f"{cfg.spans!r}")
  return np.stack([plan_lib.needed_tokens(cfg, z) for z in plan_lib.span_ratios(params)])


def head_spans(cfg: ModelConfig, params) -> np.ndarray:
  """(layers, heads) learned spans z = z' S in tokens (z' clipped to [0, 1]), of an adaptive
  model: the number span_lm.layers.learned_spans reports for the drop-in layer."""
  if cfg.spans != "adaptive":
    raise ValueError(f"per-head learned spans exist for span.mode='adaptive', not "
                     f"{cfg.spans!r}")
  return np.stack([np.clip(np.asarray(z, np.float32), 0.0, 1.0) * np.float32(cfg.span.size)
                   for z in plan_lib.span_ratios(params)])


def windows_table(windows_LxH: np.ndarray, plan=None) -> str:
  """Markdown table: one row per layer, the windows (ceil(z) + R) of its heads, their mean and
  max, its plan."""
  n_heads = windows_LxH.shape[1]
  head = ["layer"] + [f"h{h}" for h in range(n_heads)] + ["mean", "max"]
  if plan is not None:
    head += ["plan windows (heads:window)", "cache"]
  lines = ["windows ceil(z) + R (tokens; the distances each head's mask reaches):",
           "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for i, row in enumerate(windows_LxH):
    cells = [str(i)] + [str(int(s)) for s in row] + [f"{row.mean():.0f}", str(int(row.max()))]
    if plan is not None:
      lp = plan.layers[i]
      cells += [" ".join(f"{list(h)}:{w}" for h, w in lp.groups), str(lp.cache_len)]
    lines.append("| " + " | ".join(cells) + " |")
  lines.append(f"average window over all heads: {windows_LxH.mean():.1f} tokens")
  return "\n".join(lines)


def spans_table(spans_LxH: np.ndarray) -> str:
  """Markdown table: one row per layer, the learned spans z (tokens) of its heads."""
  n_heads = spans_LxH.shape[1]
  head = ["layer"] + [f"h{h}" for h in range(n_heads)]
  lines = ["learned spans z (tokens):", "| " + " | ".join(head) + " |",
           "|" + "---|" * len(head)]
  for i, row in enumerate(spans_LxH):
    lines.append("| " + " | ".join([str(i)] + [f"{s:.1f}" for s in row]) + " |")
  return "\n".join(lines)


def plot_head_windows(windows_LxH: np.ndarray, path: str, span_limit: int, ramp: int):
  """Figure 4: every head's window ceil(z) + R (log scale; the paper's "span"), grouped by
  layer. Returns (path, figure)."""
  plt = _plt()
  n_layers, n_heads = windows_LxH.shape
  fig, ax = plt.subplots(figsize=(max(6, 0.9 * n_layers + 2), 4))
  width = 0.8 / n_heads
  for h in range(n_heads):
    ax.bar(np.arange(n_layers) + (h - (n_heads - 1) / 2) * width, windows_LxH[:, h], width,
           label=f"head {h}", color=f"C{h % 10}")
  ax.axhline(span_limit, color="k", ls="--", lw=1, label=f"S = {span_limit}")
  ax.axhline(ramp, color="gray", ls=":", lw=1, label=f"R = {ramp}")
  ax.set(yscale="log", xlabel="layer", ylabel="window ceil(z) + R (tokens, log scale)",
         title="window of every head (Fig. 4)", ylim=(max(1, ramp / 2), span_limit * 1.5))
  ax.set_xticks(range(n_layers))
  ax.legend(fontsize=7, ncol=2)
  fig.tight_layout()
  return _save(fig, path), fig


def window_history(workdir: str):
  """(steps, average window (n, layers), largest window (n, layers)) from the run's training
  metrics (metrics.jsonl's span_avg and span_max: ceil(z) + R, capped at S)."""
  recs = [r for r in metrics_lib.read_metrics(workdir)
          if r.get("split") == "train" and "span_avg" in r]
  if not recs:
    return None
  by_step = {r["step"]: r for r in recs}  # a resumed run may log a step twice: keep the last
  steps = sorted(by_step)
  return (np.asarray(steps), np.asarray([by_step[s]["span_avg"] for s in steps], float),
          np.asarray([by_step[s]["span_max"] for s in steps], float))


def plot_window_history(history, path: str, span_limit: int):
  """Average (solid) and largest (dashed) window of each layer over training. (path, figure)."""
  plt = _plt()
  steps, avg, mx = history
  fig, ax = plt.subplots(figsize=(7, 4))
  for i in range(avg.shape[1]):
    ax.plot(steps, avg[:, i], "-", color=f"C{i % 10}", label=f"layer {i} avg")
    ax.plot(steps, mx[:, i], "--", color=f"C{i % 10}", lw=0.8)
  ax.set(yscale="log", xlabel="training step", ylabel="window ceil(z) + R (tokens; dashed: max)",
         title="windows over training", ylim=(None, span_limit * 1.5))
  ax.legend(fontsize=7, ncol=2)
  fig.tight_layout()
  return _save(fig, path), fig


def dynamic_windows(cfg: ModelConfig, params, plan, ids: np.ndarray, block: int) -> np.ndarray:
  """Average dynamic window over layers and heads, min(S, z_t + R), at each position of `ids`.

  The text runs as one stream in blocks of `block` tokens with carried caches (zeros before it),
  as in evaluation, so position t sees the t previous tokens of the text.
  """
  if cfg.spans != "dynamic":
    raise ValueError(f"dynamic spans need span.mode='dynamic', not {cfg.spans!r}")
  model = SpanTransformer(cfg, plan)

  @jax.jit
  def step(params, caches, x):
    _, caches, aux = model.apply({"params": params}, x, caches, train=False)
    z = jnp.stack(aux["dyn_spans"])  # L B M H
    return caches, jnp.mean(z, axis=(0, 3))[0]

  caches = caches_lib.init_caches(cfg, plan, 1)
  out = []
  for start in range(0, len(ids), block):
    x = jnp.asarray(ids[start:start + block], jnp.int32)[None]
    caches, z = step(params, caches, x)
    out.append(np.asarray(z))
  return np.minimum(cfg.span.size, np.concatenate(out) + cfg.span.ramp)


def plot_dynamic_windows(labels: list[str], windows_T: np.ndarray, path: str,
                         per_row: int = 64):
  """Figure 5: average dynamic window z_t + R against position, the characters drawn under it."""
  plt = _plt()
  n_rows = max(1, -(-len(labels) // per_row))
  fig, axes = plt.subplots(n_rows, 1, figsize=(max(8, per_row * 0.16), 2.2 * n_rows),
                           squeeze=False)
  top = float(np.max(windows_T)) * 1.1
  for r, ax in enumerate(axes[:, 0]):
    sl = slice(r * per_row, (r + 1) * per_row)
    x = np.arange(len(labels))[sl]
    ax.plot(x, windows_T[sl], "-o", ms=2)
    ax.set_xticks(x, labels[sl], fontsize=8, family="monospace")
    ax.set_xlim(r * per_row - 0.5, (r + 1) * per_row - 0.5)
    ax.set_ylim(0, top)
    ax.set_ylabel("average window")
  axes[0, 0].set_title("dynamic window z_t + R averaged over layers and heads (Fig. 5)")
  axes[-1, 0].set_xlabel("input text (position)")
  fig.tight_layout()
  return _save(fig, path), fig


def report(config) -> dict:
  """The `spans` mode: table and plots for the checkpoint in config.workdir; returns paths.
  config: a RunConfig (a ConfigDict is checked first)."""
  config = config_lib.checked(config)
  r = restore_lib.restore(config, restore_lib.tools_field(config, "step"))
  cfg = r.model_cfg
  out = {"step": r.step, "plots": {}}
  print(f"checkpoint step {r.step} in {config.workdir} ({cfg.spans} span, S={cfg.context}, "
        f"R={cfg.span.ramp})")
  print(f"span plan: {r.plan.describe()}")
  if cfg.spans == "adaptive":
    windows = head_windows(cfg, r.params)
    out["windows"] = windows.tolist()
    out["spans"] = head_spans(cfg, r.params).tolist()
    print(windows_table(windows, r.plan))
    print(spans_table(np.asarray(out["spans"])))
    out["plots"]["heads"], _ = plot_head_windows(
        windows, restore_lib.out_path(config, "spans_heads.png"), cfg.span.size, cfg.span.ramp)
  history = window_history(config.workdir)
  if history is not None:
    out["plots"]["history"], _ = plot_window_history(
        history, restore_lib.out_path(config, "span_history.png"), cfg.context)
  if cfg.spans == "dynamic":
    text = restore_lib.tools_field(config, "text")
    ids = (r.codec.encode(text) if text else np.asarray(r.splits.valid[:256], np.int32))
    windows_T = dynamic_windows(cfg, r.params, r.tight_plan, ids, config.data.block)
    out["dynamic_windows"] = windows_T.tolist()
    print(f"dynamic window z_t + R over {len(ids)} tokens: mean {windows_T.mean():.1f}, "
          f"min {windows_T.min():.1f}, max {windows_T.max():.1f}")
    out["plots"]["dynamic"], _ = plot_dynamic_windows(
        [r.codec.label(i) for i in ids], windows_T,
        restore_lib.out_path(config, "dynamic_spans.png"))
  for name, path in out["plots"].items():
    print(f"wrote {name} plot: {path}")
  return out

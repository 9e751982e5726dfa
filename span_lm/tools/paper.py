"""The paper's #FLOPS (Table 1) and Figure 3 (centre and right), recounted, and ours beside them.

The paper's convention, recovered from its own numbers (every row of Table 1 matches it within 3%):
multiply-adds per predicted token = L (4 D^2 + 2 D F) + L * 2 D * span, i.e. the q/k/v/o projections
once per token, the feed-forward, and per head span * (Dh for q.k + Dh for a.v); no position scores,
no output layer. T12/T64 have no cache and recompute their 512-token context for each prediction
(x 512). Two facts from the text check it too: the feed-forward is 62% of a fixed S=256 model and
attention (projections included) 82% at S=8192.

One printed number does not follow from the model it describes: the large adaptive model
(24 layers, D=768, F=4096; 209M parameters need F=4096) would count 217M, while 179M is what
12 L D^2 + attention gives, i.e. F = 4D = 3072. We report both.

Ours (`costs.per_token`) differ from the paper's convention for reasons of implementation:
  * chunked bands: each query computes W + C content scores and W + C value products, with C the
    smallest divisor of the block M that is >= W (C = 512 for a window of 320 at M = 512);
  * relative position scores, W * Dh per head, which the paper leaves out;
  * the cache holds hidden states, so each block re-projects keys/values of the W cached rows:
    (W + M) / M * 2 D^2 per token (17x for a fixed S=8192 model at M=512). Generation (`sample`)
    caches projected keys and values in rings instead: 2 D^2 per token, with content and value
    products over each layer's whole ring and position scores over all S (costs.generation_macs);
  * windows are multiples of 64 covering span + ramp, and only an average span is given here, so
    every head is assumed to have it (real spans vary; use a checkpoint for the exact count).
"""
import dataclasses
import math
import os

from span_lm.model import costs as costs_lib
from span_lm.model import plan as plan_lib
from span_lm.model.config import ModelConfig, Span

TEXT8_VOCAB = 28  # a-z, '_' and <eos>
EVAL_BLOCK = 512  # the paper's (and reference's) block


@dataclasses.dataclass(frozen=True)
class PaperRow:
  """One row of Table 1 (text8), with the architecture the text gives for it."""
  name: str
  n_layers: int
  d_model: int
  d_ff: int
  n_heads: int
  avg_span: int
  params: str  # as printed
  flops: float  # "#FLOPS" as printed
  context: int = 0  # > 0: no cache; the context is recomputed for every prediction
  span_limit: int = 0  # S of the adaptive models


TABLE1 = (
    PaperRow("T12 (Al-Rfou et al.)", 12, 512, 2048, 8, 512, "44M", 22e9, context=512),
    PaperRow("Adaptive-Span small (S=8192)", 12, 512, 2048, 8, 314, "38M", 42e6, span_limit=8192),
    PaperRow("T64 (Al-Rfou et al.)", 64, 512, 2048, 8, 512, "235M", 120e9, context=512),
    PaperRow("T-XL 24 layers (Dai et al.)", 24, 1024, 3072, 16, 3800, "277M", 438e6),
    PaperRow("Adaptive-Span large (S=8192)", 24, 768, 4096, 8, 245, "209M", 179e6, span_limit=8192),
)

# Figure 3 (text8, small models): the average spans the text states for the adaptive models
# (S=8192: Table 1; S=1024: Table 3). The fixed models' span is S.
FIGURE3_SPANS = (256, 512, 1024, 2048, 4096, 8192)
FIGURE3_ADAPTIVE_AVG = {1024: 123, 8192: 314}
SMALL = TABLE1[1]


def paper_macs(n_layers: int, d_model: int, d_ff: int, span: float, context: int = 0) -> float:
  """The paper's convention: L (4 D^2 + 2 D F) + L 2 D span, times the context without a cache."""
  per = n_layers * (4 * d_model**2 + 2 * d_model * d_ff) + n_layers * 2 * d_model * span
  return per * context if context else per


def paper_split(n_layers, d_model, d_ff, span) -> dict:
  """Shares of the paper's count: feed-forward, attention layer (projections included)."""
  ff = n_layers * 2 * d_model * d_ff
  total = paper_macs(n_layers, d_model, d_ff, span)
  return {"ff": ff / total, "attention_layer": 1 - ff / total, "total": total}


def uniform_model(row: PaperRow, span_limit: int, avg_span: int | None):
  """Our ModelConfig for a paper model and a plan with every head at `avg_span` (None: fixed)."""
  mode = "fixed" if avg_span is None else "adaptive"
  cfg = ModelConfig(vocab_size=TEXT8_VOCAB, d_model=row.d_model, n_layers=row.n_layers,
                    n_heads=row.n_heads, d_ff=row.d_ff, span=Span(size=span_limit, mode=mode))
  if avg_span is None:
    return cfg, plan_lib.full_plan(cfg)
  g = cfg.plan.granularity
  window = min(span_limit, max(g, math.ceil(avg_span / g) * g))
  lp = plan_lib.layer_plan_from_windows(cfg, [window] * cfg.n_heads)
  return cfg, plan_lib.SpanPlan((lp,) * cfg.n_layers)


def table1(block: int = EVAL_BLOCK) -> list[dict]:
  """Table 1's #FLOPS: as printed, recounted by the paper's convention, and ours (adaptive rows)."""
  rows = []
  for r in TABLE1:
    recount = paper_macs(r.n_layers, r.d_model, r.d_ff, r.context or r.avg_span, r.context)
    row = {"model": r.name, "avg_span": r.avg_span, "params": r.params, "paper": r.flops,
           "recount": recount, "recount_over_paper": recount / r.flops}
    if r.span_limit:
      cfg, plan = uniform_model(r, r.span_limit, r.avg_span)
      row["ours_block"] = costs_lib.per_token(cfg, plan, block).total
      row["ours_generation"] = costs_lib.per_token_generation(cfg, plan).total  # sample's
      row["params_ours"] = costs_lib.param_bytes(cfg) / 4
      if r.d_ff != 4 * r.d_model:  # the large model: the printed number assumes F = 4D
        row["recount_f_4d"] = paper_macs(r.n_layers, r.d_model, 4 * r.d_model, r.avg_span)
    rows.append(row)
  return rows


def format_table1(rows: list[dict], block: int = EVAL_BLOCK) -> str:
  g = lambda x: "-" if x is None else (f"{x / 1e9:.1f}G" if x >= 1e9 else f"{x / 1e6:.1f}M")
  head = ("| model | avg span | #params (paper / ours) | #FLOPS paper | paper's convention | "
          f"ours, blocks of {block} | ours, generation |")
  lines = [head, "|---|---|---|---|---|---|---|"]
  for r in rows:
    recount = g(r["recount"])
    if "recount_f_4d" in r:
      recount += f" ({g(r['recount_f_4d'])} with F = 4D)"
    params = r["params"] + (f" / {r['params_ours'] / 1e6:.1f}M" if "params_ours" in r else "")
    lines.append(f"| {r['model']} | {r['avg_span']} | {params} | {g(r['paper'])} | {recount} | "
                 f"{g(r.get('ours_block'))} | {g(r.get('ours_generation'))} |")
  return "\n".join(lines)


def figure3_data(adaptive_avg: dict[int, float] | None = None, block: int = EVAL_BLOCK) -> dict:
  """Average span and MACs per token versus S for the small models, fixed and adaptive."""
  adaptive_avg = dict(FIGURE3_ADAPTIVE_AVG if adaptive_avg is None else adaptive_avg)
  r = SMALL
  out = {"spans": list(FIGURE3_SPANS), "fixed_paper": [], "fixed_ours": [],
         "adaptive_spans": sorted(adaptive_avg), "adaptive_avg": [], "adaptive_paper": [],
         "adaptive_ours": []}
  for s in FIGURE3_SPANS:
    out["fixed_paper"].append(paper_macs(r.n_layers, r.d_model, r.d_ff, s))
    cfg, plan = uniform_model(r, s, None)
    out["fixed_ours"].append(costs_lib.per_token(cfg, plan, block).total)
  for s in out["adaptive_spans"]:
    a = adaptive_avg[s]
    out["adaptive_avg"].append(a)
    out["adaptive_paper"].append(paper_macs(r.n_layers, r.d_model, r.d_ff, a))
    cfg, plan = uniform_model(r, s, int(a))
    out["adaptive_ours"].append(costs_lib.per_token(cfg, plan, block).total)
  return out


def plot_figure3(data: dict, path: str):
  """Figure 3 centre (average span vs S) and right (MFLOPs per token vs S) as a PNG."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
  s, sa = data["spans"], data["adaptive_spans"]
  ax1.plot(s, s, "o-", label="fixed")
  ax1.plot(sa, data["adaptive_avg"], "s-", label="adaptive (spans from the text)")
  ax1.set(yscale="log", xlabel="span limit S", ylabel="average span",
          title="average span (Fig. 3 centre)")
  ax1.legend()
  m = lambda v: [x / 1e6 for x in v]
  ax2.plot(s, m(data["fixed_paper"]), "o-", color="C0", label="fixed, paper's count")
  ax2.plot(s, m(data["fixed_ours"]), "o--", color="C0", label="fixed, ours")
  ax2.plot(sa, m(data["adaptive_paper"]), "s-", color="C1", label="adaptive, paper's count")
  ax2.plot(sa, m(data["adaptive_ours"]), "s--", color="C1", label="adaptive, ours")
  ax2.set(xlabel="span limit S", ylabel="million multiply-adds per token",
          title=f"inference cost, blocks of {EVAL_BLOCK} (Fig. 3 right)")
  ax2.legend(fontsize=8)
  for ax in (ax1, ax2):
    ax.set_xscale("log", base=2)
    ax.set_xticks(s, [str(x) for x in s])
    ax.minorticks_off()
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return fig


def claims() -> list[str]:
  """The text's numeric claims about FLOPs, recomputed with the paper's convention and ours."""
  r = SMALL
  f256 = paper_split(r.n_layers, r.d_model, r.d_ff, 256)
  f8k = paper_split(r.n_layers, r.d_model, r.d_ff, 8192)
  ad = paper_macs(r.n_layers, r.d_model, r.d_ff, FIGURE3_ADAPTIVE_AVG[8192])
  cfg_f, plan_f = uniform_model(r, 8192, None)
  cfg_a, plan_a = uniform_model(r, 8192, FIGURE3_ADAPTIVE_AVG[8192])
  ours_f = costs_lib.per_token(cfg_f, plan_f, EVAL_BLOCK).total
  ours_a = costs_lib.per_token(cfg_a, plan_a, EVAL_BLOCK).total
  attention = (f"attention-layer share (projections included) at S=8192: paper 82%, recount "
               f"{f8k['attention_layer']:.1%}")
  saving = (f"adaptive vs fixed at S=8192: paper 'up to 70%' fewer, recount "
            f"{1 - ad / f8k['total']:.1%} fewer ({ad / 1e6:.1f}M vs {f8k['total'] / 1e6:.1f}M); "
            f"ours (blocks of {EVAL_BLOCK}) {1 - ours_a / ours_f:.1%} fewer ({ours_a / 1e6:.1f}M "
            f"vs {ours_f / 1e6:.1f}M)")
  return [f"feed-forward share of a fixed S=256 model: paper 62%, recount {f256['ff']:.1%}",
          attention, saving]


def report(out_dir: str, adaptive_avg: dict[int, float] | None = None) -> tuple[str, str]:
  """Text of the Table 1 / Figure 3 reproduction, and the path of the Figure 3 PNG."""
  data = figure3_data(adaptive_avg)
  path = os.path.join(out_dir, "paper_figure3.png")
  plot_figure3(data, path)
  head = "| S | avg span fixed / adaptive | paper's MACs fixed / adaptive | ours fixed / adaptive |"
  rows = [head, "|---|---|---|---|"]
  for i, s in enumerate(data["spans"]):
    j = data["adaptive_spans"].index(s) if s in data["adaptive_spans"] else None
    ad = {k: "-" if j is None else f"{data[k][j] / 1e6:.1f}M"
          for k in ("adaptive_paper", "adaptive_ours")}
    avg = "-" if j is None else f"{data['adaptive_avg'][j]:g}"
    rows.append(f"| {s} | {s} / {avg} | {data['fixed_paper'][i] / 1e6:.1f}M / "
                f"{ad['adaptive_paper']} | {data['fixed_ours'][i] / 1e6:.1f}M / "
                f"{ad['adaptive_ours']} |")
  text = "\n".join(["Table 1 (#FLOPS = multiply-adds per predicted token):",
                    format_table1(table1()), "", "Figure 3 (small models, text8):"] + rows
                   + [""] + claims())
  return text, path


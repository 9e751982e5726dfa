"""Span-plan changes (= recompilations) over a long run, for plan_growth settings, by replaying span
trajectories through the real SpanPlanner (no model: the planner only sees z').

Trajectories are simulated, shaped like the paper's 12-layer enwik8 model (S=8192, 8 heads, R=32;
Fig. 4: in the top third of the layers one head ends near 4000 tokens, one near 1500, one near 500,
the rest at the ramp). Each head follows z(t) = z_end (1 - exp(-t / tau)), tau drawn in
[10k, 100k] steps, plus Ornstein-Uhlenbeck noise (a few tokens per step, the size of an Adagrad
step on z' x S), clipped to [0, S] as the reference clamps z'. Real runs log the same count as
`plan_changes` in metrics.jsonl.

  python -m bench.plan_changes                         # 200k steps, growth 1.0 / 1.25 / 1.5
  python -m bench.plan_changes --steps 600000 --growth 1.25
"""
import argparse

import numpy as np

from span_lm import kernels
from span_lm.model import plan as plan_lib
from span_lm.train import planner as planner_lib
from span_lm.model import config as model_config
from span_lm.model.config import ModelConfig, Span


def trajectories(cfg: ModelConfig, steps: int, noise: float, seed: int) -> np.ndarray:
  """(steps, layers, heads) z' values."""
  rng = np.random.default_rng(seed)
  nl, nh, s = cfg.n_layers, cfg.n_heads, cfg.span.size
  z_end = np.zeros((nl, nh))
  for layer in range(nl - max(1, nl // 3), nl):
    z_end[layer, :3] = (4000.0, 1500.0, 500.0)[:min(3, nh)]
  tau = rng.uniform(10_000, 100_000, (nl, nh))
  t = np.arange(1, steps + 1, dtype=np.float64)[:, None, None]
  mean = z_end * (1.0 - np.exp(-t / tau))
  # OU noise: x' = x - theta x + sigma eps, stationary std sigma / sqrt(2 theta).
  theta = 0.01
  x = np.zeros((nl, nh))
  out = np.empty((steps, nl, nh), np.float32)
  eps = rng.standard_normal((steps, nl, nh)) * noise
  for i in range(steps):
    x += -theta * x + eps[i]
    out[i] = np.clip(mean[i] + x, 0.0, s) / s
  return out


def count_changes(cfg: ModelConfig, z: np.ndarray) -> dict:
  planner = planner_lib.SpanPlanner(cfg)
  change_steps = []
  keys = []
  for i in range(z.shape[0]):
    if planner.update(list(z[i]), i + 1):
      change_steps.append(i + 1)
    if i % 1000 == 0:
      keys.append(planner.plan.attention_keys())
  steps = np.asarray(change_steps)
  per_k = np.bincount(steps // 1000, minlength=z.shape[0] // 1000 + 1) if len(steps) else [0]
  tight = [plan_lib.plan_from_ratios(cfg, list(z[i])).attention_keys()
           for i in range(0, z.shape[0], 1000)]
  return {"changes": len(change_steps), "max_per_1000_steps": int(np.max(per_k)),
          "first_changes": change_steps[:8],
          "mean_keys_over_tight": float(np.mean(np.asarray(keys) / np.asarray(tight)))}


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--steps", type=int, default=200_000)
  p.add_argument("--growth", type=float, nargs="+", default=[1.0, 1.25, 1.5])
  p.add_argument("--noise", type=float, default=2.0, help="OU noise per step, tokens")
  p.add_argument("--layers", type=int, default=12)
  p.add_argument("--heads", type=int, default=8)
  p.add_argument("--span", type=int, default=8192)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--attn_impl", default="auto", choices=kernels.ATTN_IMPLS,
                 help="pallas: the fused kernel's plans (one window per layer, spans at run time)")
  args = p.parse_args()
  base = ModelConfig(vocab_size=256, d_model=512, n_layers=args.layers, n_heads=args.heads,
                     d_ff=2048, span=Span(size=args.span, ramp=32),
                     attention=kernels.Attention(impl=args.attn_impl))
  z = trajectories(base, args.steps, args.noise, args.seed)
  print(f"{args.steps} steps, {args.layers} layers x {args.heads} heads, S={args.span}; "
        f"granularity {base.plan.granularity}, shrink patience {base.plan.shrink_patience}")
  print("| plan_growth | plan changes | per 1000 steps: mean / max | attention keys vs tightest |")
  print("|---|---|---|---|")
  for g in args.growth:
    r = count_changes(model_config.updated(base, **{"plan.growth": g}), z)
    print(f"| {g} | {r['changes']} | {r['changes'] / (args.steps / 1000):.2f} / "
          f"{r['max_per_1000_steps']} | {r['mean_keys_over_tight']:.2f}x |", flush=True)


if __name__ == "__main__":
  main()

"""Bits per byte at a chosen minimum context (Sparse Transformer Table 3).

A model trained on windows of n = config.data.block tokens scores a split with overlapping
windows: window w reads tokens [s_w, s_w + n) and predicts the next token at each of them; the
prediction at offset k sees k + 1 tokens. Only predictions with k + 1 >= min_context are scored
(except in the first window, where the split itself is shorter), so windows advance by
n - min_context + 1 tokens: min_context=1 is plain non-overlapping blocks, larger values cost more
windows (the paper's 12,160 of 12,288 is ~95x the work of min_context=1). Every target of the split
is scored exactly once. Windows start from fresh caches: meant for models without carried state
(arch='sparse'); a span model would be scored without its cache.

  python -m span_lm.train.min_context --config=configs/enwik8_sparse_fixed.py \
      --workdir=runs/sparse --min_context=6144 --min_context=12160 [--split=test]
"""
import argparse
from typing import Callable, Iterator

import jax
import numpy as np

from span_lm import config as config_lib
from span_lm.model import caches as caches_lib
from span_lm.train import run as run_lib
from span_lm.train import steps as steps_lib
from span_lm.train.metrics import LN2


def windows(n_tokens: int, context: int, min_context: int) -> Iterator[tuple[int, int]]:
  """(start, first scored offset k) of each window over a split of n_tokens tokens.

  Targets are tokens 1 .. n_tokens - 1; window (s, k0) scores targets s + k + 1, k0 <= k < context.
  """
  if not 1 <= min_context <= context:
    raise ValueError(f"min_context={min_context} must be in [1, context={context}]")
  if n_tokens < 2:
    return
  last_start = max(0, n_tokens - 1 - context)
  yield 0, 0
  nxt = min(context, n_tokens - 1) + 1  # next unscored target
  while nxt <= n_tokens - 1:
    s = min(nxt - min_context, last_start)
    yield s, nxt - s - 1
    nxt = s + context + 1


def score(score_fn: Callable, data: np.ndarray, context: int, min_context: int,
          batch: int) -> dict:
  """Sums score_fn(x, y, w) -> (nll_sum, count) over the windows, `batch` windows per call."""
  data = np.asarray(data)
  wins = list(windows(len(data), context, min_context))
  total = count = 0.0
  pending = []
  for i in range(0, len(wins), batch):
    x = np.zeros((batch, context), np.int32)
    y = np.zeros_like(x)
    w = np.zeros(x.shape, np.float32)
    for row, (s, k0) in enumerate(wins[i:i + batch]):
      m = min(context, len(data) - 1 - s)
      x[row, :m] = data[s:s + m]
      y[row, :m] = data[s + 1:s + m + 1]
      w[row, k0:m] = 1.0
    pending.append(score_fn(x, y, w))
  for nll_sum, c in jax.device_get(pending):
    total += float(nll_sum)
    count += float(c)
  loss = total / max(count, 1.0)
  return {"loss": loss, "bpc": loss / LN2, "tokens": int(count), "windows": len(wins),
          "min_context": min_context, "context": context}


def evaluate_min_context(config, min_contexts, split: str = "test", step: int | None = None):
  """Restores config.workdir's checkpoint and scores `split` at each minimum context."""
  run = run_lib.Run(config)
  try:
    params, plan, meta = run.restore_params(step)
    cfg, b = run.model_cfg, config.data.eval_batch

    def score_fn(x, y, w):
      caches = tuple(jax.device_put(c, run.cache_sharding)  # fresh per window (donated)
                     for c in caches_lib.init_caches(cfg, plan, b))
      dev = run.put_batch(steps_lib.host_batch(x, y, False, w))
      out, _ = run.compiler.eval(plan, params, caches, dev)(params, caches, dev)
      return out["nll_sum"], out["count"]

    data = run.splits.split(split)
    results = []
    for m in min_contexts:
      res = dict(score(score_fn, data, config.data.block, m, b), step=meta["step"], split=split)
      print(f"{split} at min context {m}: bpc {res['bpc']:.4f} over {res['tokens']:,} tokens "
            f"({res['windows']:,} windows of {config.data.block})", flush=True)
      results.append(res)
    return results
  finally:
    run.ckpt.close()


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--config", required=True, help="file.py[:variants]")
  p.add_argument("--workdir", required=True)
  p.add_argument("--min_context", type=int, action="append", required=True)
  p.add_argument("--split", default="test", choices=("valid", "test"))
  p.add_argument("--step", type=int, default=None)
  args = p.parse_args(argv)
  config = config_lib.load_config(args.config, {"workdir": args.workdir, "mode": "eval"})
  for r in evaluate_min_context(config, args.min_context, args.split, args.step):
    print(r)


if __name__ == "__main__":
  main()

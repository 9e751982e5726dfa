"""Evaluation: a split scored in blocks with carried caches, as training sees its data.

The loop's periodic validation and its full evaluation at the end, and the `eval` mode
(loop.evaluate), score through `evaluate_stream`. `run` is a run.Run (its compiler, layout and
splits).
"""
import math
from typing import Any

import jax
import numpy as np

from span_lm.data import batching
from span_lm.model import ARCHS
from span_lm.model import caches as caches_lib
from span_lm.train import metrics as metrics_lib
from span_lm.train import pending as pending_lib
from span_lm.train import steps as steps_lib
from span_lm.train.metrics import LN2, MetricWriter

# Evaluation blocks dispatched ahead of the host before it waits (as training steps)
MAX_IN_FLIGHT = pending_lib.MAX_IN_FLIGHT
_echo = metrics_lib.say

# ---- a split in blocks ---------------------------------------------------------------------------


def evaluate_stream(run, params, plan, split: np.ndarray, batch: int, *, caches=None,
                    batcher=None, n_blocks: int | None = None, drop_last: bool = False,
                    kv_cache: bool | None = None, desc: str | None = None):
  """Scores blocks of a split with carried caches; returns (bpc-ready dict, caches).

  kv_cache (None: whenever the caches start fresh, for the span Transformer): cache projected
  keys/values instead of hidden states, so a block does not re-project the cached states (the
  same numbers: the weights are fixed here). Caches passed in are hidden states (the periodic
  validation's, kept in the training state). desc: show a progress bar with this name.
  """
  cfg, d = run.model_cfg, run.config.data
  if kv_cache is None:
    kv_cache = caches is None and ARCHS[cfg.arch].cache
  if run.fsdp > 1:  # the eval step takes replicated parameters: gather them once
    params = jax.device_put(params, run.replicated)
  if caches is None:
    caches = tuple(jax.device_put(c, run.cache_sharding)
                   for c in caches_lib.init_caches(cfg, plan, batch, kv=kv_cache))
  total = count = 0.0
  pending = []
  if batcher is not None:  # periodic validation: a stream iterator like training
    blocks = (next(batcher) for _ in range(n_blocks))
    make = lambda blk: steps_lib.host_batch(blk.x, blk.y, blk.reset)
  else:
    blocks = batching.eval_blocks(split, batch, d.block, drop_last=drop_last,
                                  process_index=run.process_index,
                                  process_count=run.process_count, align=d.align)
    make = lambda blk: steps_lib.host_batch(blk.x, blk.y, False, blk.weights)
    stream_len = len(split) // batch // d.align * d.align
    n_blocks = sum(1 for _ in batching.eval_positions(stream_len, d.block, drop_last))
  bar = metrics_lib.progress(n_blocks, desc=desc, leave=False) if desc else None
  for blk in blocks:
    hb = make(blk)
    if "w" not in hb:
      hb["w"] = np.ones_like(hb["x"], np.float32)
    dev = run.put_batch(hb)
    fn = run.compiler.eval(plan, params, caches, dev, kv_cache=kv_cache)
    out, caches = fn(params, caches, dev)
    pending.append(out)
    if len(pending) > MAX_IN_FLIGHT:
      jax.block_until_ready(pending[-MAX_IN_FLIGHT - 1])
    if bar is not None:
      bar.update(1)
  if bar is not None:
    bar.close()
  for out in jax.device_get(pending):
    total += float(out["nll_sum"])
    count += float(out["count"])
  loss = total / max(count, 1.0)
  return {"loss": loss, "bpc": loss / LN2, "ppl": math.exp(min(loss, 50.0)),
          "tokens": int(count)}, caches


# ---- a checkpoint on valid and test --------------------------------------------------------------


def evaluate_checkpoint(run, step: int | None) -> dict[str, Any]:
  """valid and test in full from checkpoint `step` (None: the newest readable), params only."""
  config = run.config
  if run.ckpt.latest_step() is None:
    raise FileNotFoundError(f"no checkpoint in {run.ckpt.directory} to evaluate")
  params, plan, meta = run.restore_params(step)
  out = {"step": meta["step"]}
  writer = MetricWriter(run.workdir, tensorboard=False)
  for name in ("valid", "test"):
    res, _ = evaluate_stream(run, params, plan, run.splits.split(name), config.data.eval_batch,
                             drop_last=config.train.eval_drop_last, desc=f"eval {name}")
    out[name] = res
    writer.write(meta["step"], f"eval_{name}", res)
    _echo(f"eval step {meta['step']} {name}: bpc {res['bpc']:.4f} ppl {res['ppl']:.3f} over "
          f"{res['tokens']:,} tokens")
  writer.close()
  return out

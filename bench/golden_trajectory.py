"""Golden trajectories from the reference itself: the numbers tests/test_golden_trajectory.py
trains span_lm against, so "spans learn as the reference's do" is checked in CI without torch.

Runs facebookresearch/adaptive-span's own code (an unmodified checkout at 27b815f, checked by
file hashes; never copied into span_lm, which is CC-BY-NC): `models.TransformerSeq` wrapped in
`DataParallel` as its main.py does, `utils.get_optimizer_and_scheduler` (AdagradWithGradClip, the
LambdaLR warmup), `trainer.train_iteration` one batch at a time, from zero caches. Writes numbers
only, under tests/fixtures/golden/:
  reference_init.pt   the initial parameters (the adaptive model's DataParallel state_dict),
                      written by torch.save (zip format); the fixed model uses the same tensors
                      without the span parameters, the persistent-memory model the same
                      attention, norm1 and embeddings plus its own memory (in the npz)
  trajectories.npz    the token stream (B rows, reference batching), and per case and step:
                      the NLL, the span loss, the learning rate, every z' after the step's clamp,
                      each layer's cache length; in float32, again in float64 (the same initial
                      values), and in float32 from weights one ulp off (--nudges runs): the
                      largest difference of each rerun from the float32 run per step is the
                      reference's own rounding spread (`<case>/<quantity>_spread`)
  torch_files/        small full checkpoints as the reference's save_checkpoint writes them
                      (iter_no, module.-prefixed model, optimizer, logger, scheduler_iter), after
                      a few steps, in torch's zip format and its legacy format, with their
                      values in expected.npz (tests/tools/test_import.py)
Cases (2 layers, D=64, 4 heads, S=256, ramp 32, block 64, batch 4, Adagrad lr 0.07, clip 0.03,
warmup 20, no dropout; tokens are bytes of enwik8's head, ids in order of first appearance):
  fixed     fixed span 256, feed-forward 64
  adaptive  adaptive span from z' = 0, span loss 2e-6, adapt_span_cache (trimmed caches)
  pers      adaptive span + 16 persistent memory vectors per head, no feed-forward

  python -m bench.golden_trajectory --reference_dir /tmp/adaptive-span     # an env with torch

The tokens are the first bytes of the enwik8 head packaged in span_lm/data/demo (read here
with the standard library, so the torch environment needs none of span_lm's dependencies);
--data reads another raw file instead.
"""
import argparse
import collections
import json
import os
import sys

import numpy as np

from bench import reference_step

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SHAPES = dict(layers=2, d_model=64, heads=4, d_ff=64, span=256, ramp=32, block=64, batch=4,
              pers_mem=16, span_loss=2e-6, lr=0.07, grad_clip=0.03, warmup=20)
CASES = ("fixed", "adaptive", "pers")


DEMO_XZ = os.path.join(REPO, "span_lm", "data", "demo", "enwik8_head.xz")


def head_bytes(path: str | None, n: int) -> bytes:
  """The first n bytes of a raw file, or of the packaged enwik8 head (path None)."""
  if path is None:
    import lzma  # pylint: disable=g-import-not-at-top
    with lzma.open(DEMO_XZ, "rb") as f:
      return f.read(n)
  with open(path, "rb") as f:
    return f.read(n)


def tokens_from(path: str | None, batch: int, length: int) -> tuple[np.ndarray, int]:
  """(batch, length) ids of the file's first bytes (path None: the packaged enwik8 head),
  reference batching (contiguous rows), ids in order of first appearance (the reference's
  vocabulary order; newline is just one more id)."""
  raw = np.frombuffer(head_bytes(path, batch * length), np.uint8)
  ids = {}
  for b in raw.tolist():
    ids.setdefault(b, len(ids))
  return np.asarray([ids[b] for b in raw.tolist()], np.uint8).reshape(batch, length), len(ids)


def build(torch, models, case: str, vocab: int):
  s = SHAPES
  return torch.nn.DataParallel(models.TransformerSeq(
      vocab_size=vocab, hidden_size=s["d_model"], nb_heads=s["heads"], nb_layers=s["layers"],
      attn_span=s["span"], emb_dropout=0.0, adapt_io_params={"adapt_io_enabled": False},
      inner_hidden_size=s["d_ff"], dropout=0.0,
      adapt_span_params={"adapt_span_enabled": case != "fixed", "adapt_span_loss": s["span_loss"],
                         "adapt_span_ramp": s["ramp"], "adapt_span_init": 0.0,
                         "adapt_span_cache": True},
      pers_mem_params={"pers_mem_size": s["pers_mem"] if case == "pers" else 0}))


def nudge(torch, sd, seed: int):
  """Every float32 weight moved by one ulp up or down at random (span parameters and buffers kept):
  a float32 rounding difference, as a reimplementation's other summation order makes."""
  g = torch.Generator().manual_seed(seed)
  out = collections.OrderedDict()
  for k, v in sd.items():
    if v.is_floating_point() and "_mask." not in k:
      up = torch.rand(v.shape, generator=g) < 0.5
      v = torch.where(up, torch.nextafter(v, torch.full_like(v, float("inf"))),
                      torch.nextafter(v, torch.full_like(v, float("-inf"))))
    out[k] = v
  return out


def run(torch, refmods, case: str, init_sd, tokens: np.ndarray, steps: int, dtype) -> dict:
  """The reference's training loop (main.py's, one batch per iteration) from init_sd."""
  models, utils, trainer = refmods
  s = SHAPES
  model = build(torch, models, case, int(tokens.max()) + 1)
  own = model.state_dict()
  missing = [k for k in own if k not in init_sd]
  sd = collections.OrderedDict((k, init_sd[k] if k in init_sd else own[k]) for k in own)
  model.load_state_dict(sd)
  model = model.to(dtype)
  optimizer, scheduler = utils.get_optimizer_and_scheduler(
      model=model, optim_params={"optim": "adagrad", "lr": s["lr"], "momentum": 0.0,
                                 "grad_clip": s["grad_clip"], "lr_warmup": s["warmup"]})
  data = torch.from_numpy(tokens.astype(np.int64))
  layers = model.module.layers
  adaptive = case != "fixed"
  h_cache = [torch.zeros(data.size(0), l.attn.attn.get_cache_size(), s["d_model"], dtype=dtype)
             for l in layers]
  pos = 0
  out = collections.defaultdict(list)
  for _ in range(steps):
    cache_len = [l.attn.attn.get_cache_size() for l in layers]
    span_loss = (sum(l.attn.attn.adaptive_span.get_loss() for l in layers).item()
                 if adaptive else 0.0)
    loss, pos, h_cache = trainer.train_iteration(model, optimizer, scheduler, data, 1,
                                                 s["block"], False, pos, h_cache, 1)
    if pos == 0 or pos < s["block"]:
      raise AssertionError("the stream restarted: make the token stream longer")
    out["loss"].append(loss)
    out["span_loss"].append(span_loss)
    out["lr"].append(optimizer.param_groups[0]["lr"])
    out["cache_len"].append(cache_len)
    if adaptive:
      # pylint: disable-next=protected-access
      z = [l.attn.attn.adaptive_span._mask.current_val for l in layers]
      out["span_ratio"].append([np.array(v.detach(), np.float64).reshape(-1) for v in z])
  res = {k: np.asarray(v, np.float64) for k, v in out.items()}
  res["missing_from_init"] = missing
  return res


def save_checkpoint_files(torch, refmods, tokens, out_dir: str) -> None:
  """Tiny checkpoints written as the reference's save_checkpoint writes them, zip and legacy."""
  models, utils, trainer = refmods
  os.makedirs(out_dir, exist_ok=True)
  expected = {}
  for case in ("adaptive", "pers"):
    torch.manual_seed(1)
    s = dict(SHAPES)
    SHAPES.update(layers=1, d_model=16, heads=2, d_ff=24, span=64, ramp=8, block=16, pers_mem=4)
    try:
      model = build(torch, models, case, int(tokens.max()) + 1)
      optimizer, scheduler = utils.get_optimizer_and_scheduler(
          model=model, optim_params={"optim": "adagrad", "lr": 0.07, "momentum": 0.0,
                                     "grad_clip": 0.03, "lr_warmup": 4})
      data = torch.from_numpy(tokens.astype(np.int64))
      h = [torch.zeros(data.size(0), l.attn.attn.get_cache_size(), 16)
           for l in model.module.layers]
      pos = 0
      logger = utils.Logger("bpc")
      for it in range(3):
        loss, pos, h = trainer.train_iteration(model, optimizer, scheduler, data, 1, 16, False,
                                               pos, h, 1)
        logger.log_iter(it, 1, loss, loss, 1.0, model)
    finally:
      SHAPES.clear()
      SHAPES.update(s)
    path = os.path.join(out_dir, f"{case}_zip.pt")
    utils.save_checkpoint(path, 2, model, optimizer, scheduler, logger)  # torch.save's default
    state = torch.load(path, weights_only=False)
    torch.save(state, os.path.join(out_dir, f"{case}_legacy.pt"),
               _use_new_zipfile_serialization=False)
    for k, v in state["model"].items():
      expected[f"{case}/model/{k}"] = v.numpy()
    for i, st in state["optimizer"]["state"].items():
      expected[f"{case}/optimizer/{i}/sum"] = st["sum"].numpy()
      expected[f"{case}/optimizer/{i}/step"] = np.asarray(float(st["step"]))
    expected[f"{case}/iter_no"] = np.asarray(state["iter_no"])
    expected[f"{case}/scheduler_iter"] = np.asarray(state["scheduler_iter"])
    expected[f"{case}/logger"] = np.asarray(json.dumps(state["logger"]))
  np.savez_compressed(os.path.join(out_dir, "expected.npz"), **expected)


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--reference_dir", required=True,
                 help="an unmodified checkout of facebookresearch/adaptive-span (27b815f)")
  p.add_argument("--data", default=None,
                 help="a raw byte file (default: span_lm/data/demo's head of enwik8)")
  p.add_argument("--out", default=os.path.join(REPO, "tests", "fixtures", "golden"))
  p.add_argument("--steps", type=int, default=60)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--nudges", type=int, default=4,
                 help="float32 reruns from weights one ulp off, beside float64, for the spread")
  args = p.parse_args()
  reference_step.check_reference(args.reference_dir, tuple(reference_step.REFERENCE_SHA256))
  sys.path.insert(0, os.path.abspath(args.reference_dir))
  import torch  # pylint: disable=g-import-not-at-top
  import models  # pylint: disable=g-import-not-at-top
  import trainer  # pylint: disable=g-import-not-at-top
  import utils  # pylint: disable=g-import-not-at-top
  refmods = (models, utils, trainer)
  torch.set_num_threads(1)  # reproducible summation order
  length = (args.steps + 2) * SHAPES["block"]
  tokens, vocab = tokens_from(args.data, SHAPES["batch"], length)

  torch.manual_seed(args.seed)
  init = build(torch, models, "adaptive", vocab).state_dict()
  torch.manual_seed(args.seed + 1)
  pers = build(torch, models, "pers", vocab).state_dict()
  pers_own = {k: v for k, v in pers.items() if "persistent_memory" in k}
  os.makedirs(args.out, exist_ok=True)
  torch.save(init, os.path.join(args.out, "reference_init.pt"))

  fixture = {"tokens": tokens, "shapes": np.asarray(json.dumps(SHAPES)),
             "steps": np.asarray(args.steps)}
  for k, v in pers_own.items():
    fixture[f"pers_init/{k}"] = v.numpy()
  fixture["spread_variants"] = np.asarray(
      ["float64"] + [f"float32, weights nudged by one ulp (seed {i})" for i in range(args.nudges)])
  for case in CASES:
    sd = dict(init, **pers_own) if case == "pers" else init
    r32 = run(torch, refmods, case, sd, tokens, args.steps, torch.float32)
    r64 = run(torch, refmods, case, sd, tokens, args.steps, torch.float64)
    variants = [r64] + [run(torch, refmods, case, nudge(torch, sd, 100 + i), tokens, args.steps,
                            torch.float32) for i in range(args.nudges)]
    print(f"{case}: initialised from the fixture except {r32['missing_from_init']}")
    for k in r32:
      if k == "missing_from_init":
        continue
      fixture[f"{case}/{k}"] = r32[k]
      fixture[f"{case}/{k}_f64"] = r64[k]
      if k != "cache_len":  # per variant and step: the largest difference over the elements
        fixture[f"{case}/{k}_spread"] = np.stack([
            np.abs(v[k] - r32[k]).reshape(args.steps, -1).max(axis=1) for v in variants])
    spread = fixture[f"{case}/loss_spread"]
    print(f"{case}: loss {r32['loss'][0]:.4f} -> {r32['loss'][-1]:.4f}; |d loss| float64 step 1 "
          f"{spread[0, 0]:.2e}, max {spread[0].max():.2e}; all variants step 1 "
          f"{spread[:, 0].max():.2e}, first step over 1e-4: "
          f"{[int(np.argmax(v > 1e-4)) + 1 if (v > 1e-4).any() else None for v in spread]}")
    if "span_ratio" in r32:
      ds = np.abs(r32["span_ratio"] - r64["span_ratio"]) * SHAPES["span"]
      last = np.round(r32["span_ratio"][-1] * SHAPES["span"], 1).tolist()
      print(f"{case}: spans (tokens) after the last step {last};"
            f" |d span| f32 vs f64 step 1 {ds[0].max():.2e}, max {ds.max():.2e}; cache lengths "
            f"{r32['cache_len'][-1].astype(int).tolist()}")
  np.savez_compressed(os.path.join(args.out, "trajectories.npz"), **fixture)
  save_checkpoint_files(torch, refmods, tokens[:, :400] % 16,  # a 16-token vocabulary: KBs
                        os.path.join(args.out, "torch_files"))
  for root, _, files in os.walk(args.out):
    for f in sorted(files):
      print(f"{os.path.join(root, f)}: {os.path.getsize(os.path.join(root, f)):,} bytes")


if __name__ == "__main__":
  main()

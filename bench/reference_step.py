"""The reference's training step (facebookresearch/adaptive-span, PyTorch) on the issue-8 shapes,
timed on this machine, so that span_lm's speed-ups are ratios measured side by side rather than
against times quoted for another CPU.

Needs PyTorch and an unmodified checkout of the reference at 27b815f (its models.py,
adaptive_span.py, adagrad_with_grad_clip.py, persistent_memory.py, adaptive_io.py), neither of which
span_lm ships. Those files' sha256 are checked against REFERENCE_SHA256 below before anything is
timed, so a ratio quoted against "the reference" is against its own code:

  pip install torch  # in any environment; span_lm itself is not imported here
  python -m bench.reference_step --reference_dir ~/src/adaptive-span --cases short fixed --reps 20
  python -m bench.train_step --reference_dir ~/src/adaptive-span \
      --reference_python ~/torch/bin/python
      # span_lm and the reference alternating in one run ("vs reference" from the measured times)

The step is the reference trainer's `_train_batch` for a batch split of 1: zero the gradients, run
`TransformerSeq` over a (B, M) block with the per-layer hidden-state caches, NLL plus the span
loss, backward, its Adagrad with per-tensor step-size clipping, clamp the span parameters.
Shapes as bench/train_step.py: 4 layers, D=256, 4 heads, FF 1024, block 128, batch 16, S=1024,
ramp 32, vocab 205, dropout 0, float32 (the reference has no mixed precision).

Two settings make the comparison fair (the first on by default; the second follows span_lm's):
- Denormals flushed to zero (`torch.set_flush_denormal(True)`), as XLA:CPU runs: with random
  caches the reference's fixed-span backward produces denormal floats, and PyTorch, which keeps
  them by default, then took 3.0-5.6 s per step instead of 0.80-0.92 s on the 2-core CPU
  (`--keep_denormals` to see it).
- glibc malloc as span_lm's run uses it: `bench/train_step.py` runs this script with span_lm's
  workers' environment (GLIBC_TUNABLES=glibc.malloc.hugetlb=1 unless --no_huge_pages; the
  reference measured no different with it) and passes --keep_freed_memory on when it is set.
Device: CUDA when torch has it (span_lm's step then runs on that GPU too), else the CPU;
`--device` picks one.
Cases:
  short  adaptive span, every z' at (64 - R) / S (span + ramp = 64, `--short_span`): the
         reference trims each layer to 64 keys and a 128-state cache, as after ~1000 steps of
         the tiny run
  fixed  fixed span S=1024 (no span parameters, 1024-state caches)
"""

import argparse
import hashlib
import json
import os
import statistics
import sys
import time


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# sha256 of the files the reference's model and optimizer import, at facebookresearch/adaptive-span
# 27b815f (its last commit).
REFERENCE_SHA256 = {
    "models.py": "4b01248b5c32e369d6b83c79617834102eb8867bf7c28bc7c250f733be619eb5",
    "adaptive_span.py": "94d8ab52f88b879272f7975dd079fabf932ca314bbdbbaf38730c85db68d5280",
    "adagrad_with_grad_clip.py": "ff346e62d51933775e281857d2634f3f51c9172cf615deeef36bb3af8a6cbea2",
    "persistent_memory.py": "988b780106e6fb03091dc1af94ae559310fbe18c959a855a8375c350e9d958ee",
    "adaptive_io.py": "15dc896d303609d66633cbc4d0afb74fd8405c6fbd338bb8d0de491da7e305bc",
    # its trainer and optimizer factory (bench/golden_trajectory.py runs them)
    "trainer.py": "6ba154689bc98cc1ea59c51d488ae2d839e813534f9977763353ba5aa8d0a421",
    "utils.py": "75777c92ce788bfb90dd393805915372a392ab7335924f3f268a26740bca9689",
}
MODEL_FILES = ("models.py", "adaptive_span.py", "adagrad_with_grad_clip.py", "persistent_memory.py",
               "adaptive_io.py")


def check_reference(reference_dir: str, files=MODEL_FILES) -> None:
  """Exits with one line unless reference_dir holds the reference's own files (27b815f)."""
  if not os.path.isfile(os.path.join(reference_dir, "models.py")):
    raise SystemExit(f"--reference_dir {reference_dir!r} has no models.py: "
                     "it must be a checkout of facebookresearch/adaptive-span")
  for name in files:
    path = os.path.join(reference_dir, name)
    digest = None
    if os.path.isfile(path):
      with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    if digest != REFERENCE_SHA256[name]:
      what = "missing" if digest is None else f"modified (sha256 {digest[:12]}...)"
      raise SystemExit(f"--reference_dir {reference_dir!r}: {name} is {what}; the comparison needs "
                       "an unmodified checkout of facebookresearch/adaptive-span at 27b815f")


def measure_step(reference_dir: str, *, layers: int = 4, heads: int = 4, d_model: int = 256,
                 d_ff: int = 1024, dropout: float = 0.0, span: int = 1024, ramp: int = 32,
                 ratios=None, batch: int = 16, block: int = 128, reps: int = 10, warmup: int = 3,
                 seed: int = 0, flush_denormal: bool = True, device: str = "auto") -> dict:
  """Median and fastest seconds per training step of the reference model on `device` (auto: CUDA
  when torch has it, else the CPU). ratios: None for a fixed span, else per layer the per-head span parameters z
  (span fractions) at which the adaptive spans are held after each step, so that the cache
  trimming stays put. bench/gpu_steps.py times the reference through this function too."""
  check_reference(reference_dir)
  sys.path.insert(0, os.path.abspath(reference_dir))
  import torch  # pylint: disable=g-import-not-at-top
  import torch.nn.functional as F  # pylint: disable=g-import-not-at-top
  from adagrad_with_grad_clip import AdagradWithGradClip  # pylint: disable=g-import-not-at-top
  from models import TransformerSeq  # pylint: disable=g-import-not-at-top

  if device == "auto":
    device = "cuda" if torch.cuda.is_available() else "cpu"
  dev = torch.device(device)
  torch.manual_seed(seed)
  torch.set_flush_denormal(flush_denormal)
  adaptive = ratios is not None
  model = TransformerSeq(
      vocab_size=205, hidden_size=d_model, nb_heads=heads, nb_layers=layers, attn_span=span,
      emb_dropout=0.0, adapt_io_params={"adapt_io_enabled": False}, inner_hidden_size=d_ff,
      dropout=dropout,
      adapt_span_params={"adapt_span_enabled": adaptive, "adapt_span_loss": 2e-6,
                         "adapt_span_ramp": ramp, "adapt_span_init": 0.0,
                         "adapt_span_cache": True},
      pers_mem_params={"pers_mem_size": 0}).to(dev)

  def hold_spans():  # the case's spans (and so the trimming) where the case puts them
    with torch.no_grad():
      for layer, z in zip(model.layers, ratios):
        layer.attn.attn.adaptive_span._mask.current_val.copy_(
            torch.tensor(z, dtype=torch.float32).view(heads, 1, 1))

  if adaptive:
    hold_spans()
  model.train()
  optimizer = AdagradWithGradClip(model.parameters(), lr=0.07, grad_clip=0.03)
  x = torch.randint(0, 205, (batch, block), device=dev)
  y = torch.randint(0, 205, (batch, block), device=dev)
  caches = [torch.randn(batch, layer.attn.attn.get_cache_size(), d_model, device=dev)
            for layer in model.layers]
  sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

  def step(caches):
    optimizer.zero_grad()
    out, caches, _ = model(x, caches)
    loss = F.nll_loss(out.view(-1, out.size(-1)), y.view(-1))
    if adaptive:
      loss = loss + sum(layer.attn.attn.adaptive_span.get_loss() for layer in model.layers)
    loss.backward()
    optimizer.step()
    if adaptive:
      for layer in model.layers:
        layer.attn.attn.adaptive_span.clamp_param()
      hold_spans()
    return caches, loss

  if dev.type == "cuda":
    torch.cuda.reset_peak_memory_stats()
  for _ in range(warmup):
    caches, loss = step(caches)
  sync()
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    caches, loss = step(caches)
    sync()
    times.append(time.perf_counter() - t)
  sec = statistics.median(times)
  return {"seconds": sec, "min_seconds": min(times), "tokens_per_s": batch * block / sec,
          "loss": float(loss.item()), "cache_sizes": [layer.attn.attn.get_cache_size()
                                                      for layer in model.layers],
          "torch": torch.__version__, "threads": torch.get_num_threads(),
          "flush_denormal": flush_denormal,
          "device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu",
          "tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32),
          "peak_bytes": torch.cuda.max_memory_allocated() if dev.type == "cuda" else None}


def measure(reference_dir: str, case: str, reps: int, short_span: int = 64,
            flush_denormal: bool = True, **shapes) -> dict:
  """The issue-8 cases: 'short' (every head's span + ramp = short_span) or 'fixed' (S=1024)."""
  span, ramp, layers, heads = (shapes.get(k, d) for k, d in
                               (("span", 1024), ("ramp", 32), ("layers", 4), ("heads", 4)))
  ratios = None if case == "fixed" else [[(short_span - ramp) / span] * heads] * layers
  return dict(measure_step(reference_dir, ratios=ratios, reps=reps, flush_denormal=flush_denormal,
                           **shapes), case=case)


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--reference_dir", required=True,
                 help="a checkout of facebookresearch/adaptive-span")
  p.add_argument("--cases", nargs="+", default=["short", "fixed"], choices=["short", "fixed"])
  p.add_argument("--reps", type=int, default=10)
  p.add_argument("--short_span", type=int, default=64,
                 help="span + ramp of every head in the short case (1024: all spans long)")
  p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
  p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                 help="auto: CUDA when torch has it, else the CPU")
  p.add_argument("--keep_denormals", action="store_true",
                 help="PyTorch's default: denormal floats computed in full (slow on x86)")
  p.add_argument("--keep_freed_memory", dest="system_malloc", action="store_false",
                 help="span_lm/train/cpu_host.py's malloc settings (default: glibc's own)")
  p.add_argument("--system_malloc", dest="system_malloc", action="store_true", default=True,
                 help="glibc malloc as it is (the default)")
  p.add_argument("--json", default=None)
  args = p.parse_args()
  if not args.system_malloc:  # before torch allocates anything
    from span_lm.train import cpu_host  # pylint: disable=g-import-not-at-top
    cpu_host.keep_freed_memory()
  check_reference(args.reference_dir)
  if args.threads:
    import torch  # pylint: disable=g-import-not-at-top
    torch.set_num_threads(args.threads)
  rows = []
  print("| case | s/step (median) | fastest | tokens/s | caches | torch, threads |")
  print("|---|---|---|---|---|---|")
  for case in args.cases:
    r = measure(args.reference_dir, case, args.reps, short_span=args.short_span,
                flush_denormal=not args.keep_denormals, device=args.device)
    rows.append(r)
    print(f"| reference {case} | {r['seconds']:.3f} | {r['min_seconds']:.3f} | "
          f"{r['tokens_per_s']:.0f} | {r['cache_sizes']} | {r['torch']}, {r['threads']} |",
          flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
  main()

"""Runs the reference's own main.py (facebookresearch/adaptive-span, unmodified, 27b815f) on a CPU,
for side-by-side runs with span_lm (docs/fidelity.md): the yardstick and its full evaluation.

The reference needs CUDA (`utils.set_up_env` asserts it); this runner replaces only that function,
so the model, data, optimizer, trainer and checkpoints are the reference's own code, on the CPU.
It also writes the enwik8-head splits in the reference's text format (prep_enwik8.py: one byte
value per token, newline bytes as line breaks, which its data.py turns into `<eos>`).

  # the reference's input files for configs/tiny.py's splits of the packaged enwik8 head
  # (span_lm/data/demo: the first 4,154,000 bytes of enwik8)
  python -m bench.reference_main --prepare_head demo --data_dir /tmp/ref_tiny_data
  # the yardstick (1,250 steps = 5 iterations of 250 batches, validation every 250), with a
  # Python that has torch and an unmodified checkout of the reference at 27b815f
  /tmp/refvenv/bin/python -m bench.reference_main --reference_dir /tmp/adaptive-span -- \\
      --data /tmp/ref_tiny_data --nlayers 4 --hid-sz 256 --inner-hid-sz 1024 --nheads 4 \\
      --attn-span 1024 --block-sz 128 --batch-sz 16 --lr 0.07 --momentum 0 --dropout 0 \\
      --optim adagrad --lr-warmup 200 --grad-clip 0.03 --nbatches 250 --niter 5 \\
      --adapt-span --adapt-span-loss 0.000002 --adapt-span-cache --checkpoint /tmp/ref_tiny.pt
  # its full evaluation (8 streams), as the reference's README does it
  ... the same arguments with --batch-sz 8 --full-eval-mode
"""
import argparse
import os
import sys

from bench import reference_step

MAIN_SHA256 = {  # main.py and what it imports beyond reference_step's files, at 27b815f
    "main.py": "87e81edee6ee0de77401450569d8612f7d0e468c97b0e8c5720c38a92aa80da4",
    "config.py": "d05eacb7559cf5e56ddc29c34aea94c60945e289603c3ceaec1932676a7aae38",
    "data.py": "e53a4dff96245cf1c4a88b71183053b03950b841a8764aaef6ee6724b8a92964",
}


def prepare_head(path: str, split_bytes, data_dir: str) -> None:
  """train/valid/test.txt as prep_enwik8.py writes them, for the byte ranges of configs/tiny.py.
  path 'demo': the enwik8 head packaged in span_lm/data/demo (read with the standard library)."""
  if path == "demo":
    import lzma  # pylint: disable=g-import-not-at-top
    demo = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "span_lm",
                        "data", "demo", "enwik8_head.xz")
    with lzma.open(demo, "rb") as f:
      raw = f.read()
  else:
    with open(path, "rb") as f:
      raw = f.read()
  a, b = split_bytes
  os.makedirs(data_dir, exist_ok=True)
  for name, part in (("train", raw[:a]), ("valid", raw[a:b]), ("test", raw[b:])):
    text = " ".join(str(c) if c != 10 else "\n" for c in part)
    with open(os.path.join(data_dir, f"{name}.txt"), "w") as f:
      f.write(text)
    print(f"{name}.txt: {len(part):,} bytes")


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--reference_dir", default="")
  p.add_argument("--seed", type=int, default=None,
                 help="torch.manual_seed before anything runs (default: torch's own fixed seed)")
  p.add_argument("--prepare_head", default="",
                 help="a raw byte file, or 'demo' for span_lm/data/demo's head of enwik8: write "
                      "the reference's text files and stop")
  p.add_argument("--split_bytes", type=int, nargs=2, default=(3_654_000, 3_904_000))
  p.add_argument("--data_dir", default="")
  p.add_argument("rest", nargs=argparse.REMAINDER, help="-- then the reference main.py's flags")
  args = p.parse_args()
  if args.prepare_head:
    prepare_head(args.prepare_head, args.split_bytes, args.data_dir)
    return
  reference_step.check_reference(args.reference_dir, tuple(reference_step.REFERENCE_SHA256))
  for name, digest in MAIN_SHA256.items():
    reference_step.REFERENCE_SHA256[name] = digest
  reference_step.check_reference(args.reference_dir, tuple(MAIN_SHA256))
  # torch >= 2.6 loads weights only by default; the reference (2020) pickles its corpus object.
  os.environ.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
  sys.path.insert(0, os.path.abspath(args.reference_dir))
  import torch  # pylint: disable=g-import-not-at-top
  import main as reference  # pylint: disable=g-import-not-at-top
  import config  # pylint: disable=g-import-not-at-top

  def set_up_env_cpu(env_params):
    assert not env_params["distributed"], "this runner is for one CPU process"
    env_params["device"] = torch.device("cpu")

  reference.set_up_env = set_up_env_cpu
  if args.seed is not None:
    torch.manual_seed(args.seed)
  rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
  reference.launch(**reference.get_params(params_config=config.PARAMS_CONFIG, args=rest))


if __name__ == "__main__":
  main()

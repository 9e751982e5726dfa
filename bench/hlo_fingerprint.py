"""Fingerprints of the compiled CPU training step, to show that a refactoring left it the same program.

Compiles bench/train_step.py's step (StepCompiler, reference Adagrad, donated state) of a source
tree for the short-span, fixed-span and all-long cases, strips the HLO of everything that names
rather than computes (metadata, the module name, instruction and computation names, renumbered in
order of appearance) and prints one sha256 per case. `--out DIR` also writes the stripped texts,
so two trees' dumps can be diffed:

  python -m bench.hlo_fingerprint --tree /tmp/before --out /tmp/hlo_before
  python -m bench.hlo_fingerprint --out /tmp/hlo_after
  diff -r /tmp/hlo_before /tmp/hlo_after && echo identical

Shapes are the issue-8 ones by default (4 layers, D=256, S=1024, block 128, batch 16); smaller
`--layers/--batch` keep the same code paths (they depend on the block, the windows and the dtype).
"""
import argparse
import hashlib
import os
import re
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = {"short": ["--cases", "short"], "fixed": ["--cases", "fixed"],
         "all_long": ["--cases", "short", "--short_span", "1024"]}


def strip(text: str) -> str:
  """HLO text without names, metadata or locations; equal programs give equal strings."""
  # The source tables (file and function names, locations, stack frames) metadata points into.
  text = re.sub(r"^(FileNames|FunctionNames|FileLocations|StackFrames)$\n(^\d+ .*\n)*", "", text,
                flags=re.M)
  text = re.sub(r",?\s*metadata=\{[^}]*\}", "", text)
  text = re.sub(r"^HloModule [^,\s]+", "HloModule m", text, flags=re.M)
  text = re.sub(r'op_name="[^"]*"', "", text)
  names: dict[str, str] = {}
  text = re.sub(r"%[\w.\-]+", lambda m: names.setdefault(m.group(0), f"%v{len(names)}"), text)
  return "\n".join(line.rstrip() for line in text.splitlines() if line.strip()) + "\n"


def train_step_command(tree: str) -> list[str]:
  """How `tree` runs bench/train_step.py: as a module where bench/ is a package, as a file in a
  tree from before (its bench/_repo.py puts the root first)."""
  if os.path.isfile(os.path.join(tree, "bench", "__init__.py")):
    return ["-m", "bench.train_step"]
  return [os.path.join(tree, "bench", "train_step.py")]


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--tree", default=REPO, help="the source tree whose step is compiled")
  p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
  p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
  p.add_argument("--devices", type=int, nargs="+", default=[1, 2])
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--batch", type=int, default=4)
  p.add_argument("--out", default="", help="write the stripped HLO texts to this folder")
  p.add_argument("--restrip", nargs=2, metavar=("IN", "OUT"),
                 help="only strip the .hlo files of folder IN again into OUT")
  args = p.parse_args()
  if args.restrip:
    os.makedirs(args.restrip[1], exist_ok=True)
    for name in sorted(os.listdir(args.restrip[0])):
      text = strip(open(os.path.join(args.restrip[0], name)).read())
      with open(os.path.join(args.restrip[1], name), "w") as g:
        g.write(text)
      print(f"{name[:-4]} {hashlib.sha256(text.encode()).hexdigest()[:16]} "
            f"{text.count(chr(10))} lines")
    return
  if args.out:
    os.makedirs(args.out, exist_ok=True)
  env = dict(os.environ, PYTHONPATH=args.tree)
  env.pop("XLA_FLAGS", None)
  for case in args.cases:
    for dtype in args.dtypes:
      for n in args.devices:
        with tempfile.NamedTemporaryFile(suffix=".hlo") as f:
          cmd = [sys.executable, *train_step_command(args.tree), *CASES[case],
                 "--devices", str(n), "--dtype", dtype, "--layers", str(args.layers),
                 "--batch", str(args.batch), "--reps", "1", "--hlo", f.name]
          out = subprocess.run(cmd, env=env, cwd=args.tree, capture_output=True, text=True)
          if out.returncode:
            raise SystemExit(out.stdout[-2000:] + out.stderr[-4000:])
          text = strip(open(f.name).read())
        name = f"{case}_{dtype}_{n}dev"
        if args.out:
          with open(os.path.join(args.out, name + ".hlo"), "w") as g:
            g.write(text)
        print(f"{name} {hashlib.sha256(text.encode()).hexdigest()[:16]} "
              f"{text.count(chr(10))} lines", flush=True)


if __name__ == "__main__":
  main()

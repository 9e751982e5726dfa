"""The walk of a run config from main.py to the train step, measured in a source tree.

  python -m bench.config_walk --tree /tmp/before
  python -m bench.config_walk --tree .

Runs `main.py --config=configs/tiny.py:smoke` (0 training steps would build no step: 1 step, on
the CPU, in a scratch workdir; --mode=flops: the flops tool, which compiles the train step) in a child process under a profile hook and records every call of
a function of TREE's span_lm (or main.py) that receives the run config or a part of it (a
ml_collections ConfigDict, a RunConfig or one of its sections; not the ModelConfig the model
reads, whose methods the model calls throughout) as an argument (a method of the config itself,
handed it as `self`, is the config's own behaviour, not a hand-off, and is not counted),
until the train step's builder (span_lm/train/steps.py's `build`) is entered. The walk is the
sequence of files of those calls, consecutive repeats merged. Printed: the walk, the files it
enters, its climbs (steps to a file the walk had already left: the config going back up to a
module it passed), how often it enters span_lm/config.py, how many times ModelConfig is
constructed (__post_init__) on the way, and the functions still handed the ConfigDict once the
checked RunConfig exists (none: the ConfigDict stops at the command line's edge).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

_CHILD = r"""
import os, sys, json
tree, out = sys.argv[1], sys.argv[2]
sys.argv = ["main.py", "--config=configs/tiny.py:smoke", "--config.workdir=" + sys.argv[3],
            "--config.train.steps=1", "--config.train.tensorboard=False",
            "--config.dist.cpu_huge_pages=False", "--config.data.path=" + sys.argv[4],
            "--config.mode=" + sys.argv[5]]
sys.path.insert(0, tree)
import ml_collections
walk, posts = [], [0]
pkg = os.path.join(tree, "span_lm") + os.sep
main_py = os.path.join(tree, "main.py")

def kind(x):
  if isinstance(x, (ml_collections.ConfigDict, ml_collections.FrozenConfigDict)):
    return "ConfigDict"
  mod = type(x).__module__ or ""
  return type(x).__name__ if mod == "span_lm.run_config" else None

class Done(Exception):
  pass

def hook(frame, event, arg):
  if event != "call":
    return
  f = frame.f_code.co_filename
  if not (f.startswith(pkg) or f == main_py):
    return
  rel = os.path.relpath(f, tree)
  name = frame.f_code.co_name
  if rel == os.path.join("span_lm", "train", "steps.py") and name == "build":
    walk.append((rel, name, ""))
    raise Done()
  if rel == os.path.join("span_lm", "model", "config.py") and name == "__post_init__" and (
      type(frame.f_locals.get("self")).__name__ == "ModelConfig"):
    posts[0] += 1
  code = frame.f_code
  names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
  args = [frame.f_locals.get(v) for v in names if v not in ("self", "cls")]
  kinds = sorted({k for k in map(kind, args) if k})
  if kinds:
    walk.append((rel, name, ",".join(kinds)))

sys.setprofile(hook)
try:
  import runpy
  runpy.run_path(main_py, run_name="__main__")
except Done:
  pass
except SystemExit:
  pass
finally:
  sys.setprofile(None)
json.dump({"walk": walk, "model_configs": posts[0]}, open(out, "w"))
"""


def summary(walk: list[tuple[str, str, str]]) -> dict:
  files = []
  for f, _, _ in walk:
    if not files or files[-1] != f:
      files.append(f)
  seen, climbs = set(), 0
  for i, f in enumerate(files):
    if f in seen:
      climbs += 1
    seen.add(f)
  typed = next((i for i, (_, _, k) in enumerate(walk) if "RunConfig" in k.split(",")), None)
  late = None if typed is None else [f"{f}:{n}" for f, n, k in walk[typed:]
                                     if "ConfigDict" in k.split(",")]
  return {"path": files, "files": len(seen), "climbs": climbs,
          "enters_config_py": files.count(os.path.join("span_lm", "config.py")),
          "reached_build": bool(walk) and walk[-1][1] == "build",
          "configdict_after_runconfig": late}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--tree", default=".")
  p.add_argument("--data", default=None, help="a raw text file (default: the packaged head)")
  p.add_argument("--mode", default="train", help="train, or flops (it compiles the train step)")
  p.add_argument("--json", default=None, help="write the result here")
  args = p.parse_args(argv)
  tree = os.path.abspath(args.tree)
  with tempfile.TemporaryDirectory() as tmp:
    data = args.data
    if data is None:
      data = os.path.join(tmp, "head.bin")
      env = dict(os.environ, PYTHONPATH=tree)
      subprocess.run([sys.executable, "-c", "import sys; from span_lm.data import demo; "
                      "open(sys.argv[1], 'wb').write(demo.read_bytes()[:400000])", data],
                     check=True, cwd=tree, env=env)
    out = os.path.join(tmp, "walk.json")
    env = dict(os.environ, PYTHONPATH=tree, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", _CHILD, tree, out, os.path.join(tmp, "run"),
                           data, args.mode], cwd=tree, env=env, capture_output=True, text=True)
    if not os.path.exists(out):
      sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
      return 1
    raw = json.load(open(out))
  result = {**summary([tuple(x) for x in raw["walk"]]), "model_configs": raw["model_configs"]}
  late = result["configdict_after_runconfig"]
  print(" -> ".join(result["path"]))
  print(f"files entered {result['files']}, climbs back up {result['climbs']}, enters "
        f"span_lm/config.py {result['enters_config_py']} times, ModelConfig built "
        f"{result['model_configs']} times, reached steps.build: {result['reached_build']}; "
        f"functions given the ConfigDict after the RunConfig exists: "
        f"{'no RunConfig' if late is None else late or 'none'}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())

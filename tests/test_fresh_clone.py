"""A fresh clone just works: the README's demo command, then its eval command, in a clone of this
repository made in an empty folder (committed files only, nothing beside it, nothing installed).

This is what a new user does after `pip install -r requirements.txt`; it fails if the demo needs a
file that is not committed (data beside the checkout, an untracked module) or if the README's
commands drift from what runs. The only change to the README's commands is a short run.
"""
import ast
import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
STEPS = 4


def readme_commands():
  """The README's demo (the first `python main.py` line) and its eval (`--config.mode=eval`)."""
  lines = [l.strip() for l in (REPO / "README.md").read_text().splitlines()]
  runs = [l for l in lines if l.startswith("python main.py ")]
  demo = runs[0]
  evals = [l for l in runs if l.startswith(demo + " ") and l.endswith("--config.mode=eval")]
  assert evals, f"the README has no eval command for its demo ({demo})"
  return shlex.split(demo), shlex.split(evals[0])


def _flag(cmd, name):
  return next(a.split("=", 1)[1] for a in cmd if a.startswith(f"--config.{name}="))


@pytest.mark.slow
def test_fresh_clone_runs_the_readme_demo_and_eval(tmp_path_factory):
  if shutil.which("git") is None or not (REPO / ".git").exists():
    pytest.skip("needs git and a git checkout")
  demo, evaluate = readme_commands()
  assert demo[:2] == ["python", "main.py"], demo
  clone = tmp_path_factory.mktemp("empty") / "clone"  # nothing beside it: no ../shared
  subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(REPO), str(clone)], check=True,
                 capture_output=True, timeout=120)
  assert sorted(p.name for p in clone.parent.iterdir()) == ["clone"]
  # A new user's environment: no test settings, an empty home (no compilation cache, no config).
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("XLA_", "JAX_", "PYTHON", "SPAN_LM"))}
  env.update(HOME=str(tmp_path_factory.mktemp("home")), JAX_PLATFORMS="cpu", MPLBACKEND="Agg")

  def run(cmd):
    proc = subprocess.run([sys.executable] + cmd[1:], cwd=clone, env=env, capture_output=True,
                          text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "../shared" not in proc.stdout + proc.stderr
    return proc.stdout

  where = subprocess.run([sys.executable, "-c", "import span_lm; print(span_lm.__file__)"],
                         cwd=clone, env=env, capture_output=True, text=True, check=True).stdout
  assert pathlib.Path(where.strip()).is_relative_to(clone), where  # the clone's code runs

  out = run(demo + [f"--config.train.steps={STEPS}", "--config.train.log_every=2"])
  workdir = clone / _flag(demo, "workdir")
  assert re.search(rf"step +{STEPS} \| loss [0-9.]+ bpc [0-9.]+", out), out
  assert "full valid: bpc" in out and "full test: bpc" in out, out
  assert json.loads((workdir / "config.json").read_text())["data"]["dataset"] == "enwik8_head"
  assert (workdir / "checkpoints" / str(STEPS)).is_dir()

  out = run(evaluate)
  assert f"eval step {STEPS} valid: bpc" in out and f"eval step {STEPS} test: bpc" in out, out
  rows = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
  kinds = {(r.get("split") or r.get("kind"), r.get("step")) for r in rows}
  assert ("eval_test", STEPS) in kinds and ("train", STEPS) in kinds, kinds


# ------------------------------------------------------------------ bench scripts from a checkout


def _env_without_span_lm():
  """Interpreter flags and environment in which only this venv's site-packages are importable: no
  .pth files (-S: an editable install of span_lm is a .pth finder), no checkout on sys.path."""
  import site  # pylint: disable=g-import-not-at-top
  env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "JAX_", "XLA_"))}
  env.update(PYTHONPATH=os.pathsep.join(site.getsitepackages()), JAX_PLATFORMS="cpu")
  return [sys.executable, "-S"], env


def test_bench_script_runs_from_a_checkout_without_install():
  """`python -m bench.X` from the root of a checkout that was never `pip install -e .`d (issue 26
  item 7): the root on sys.path is the one -m puts there, no shim of bench's own."""
  python, env = _env_without_span_lm()
  probe = subprocess.run(python + ["-c", "import span_lm"], cwd="/", env=env,
                         capture_output=True, text=True, check=False)
  if probe.returncode == 0:
    pytest.skip("span_lm is installed in site-packages itself: nothing to hide it from")
  proc = subprocess.run(python + ["-m", "bench.plan_changes", "--help"], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=300, check=False)
  assert proc.returncode == 0 and "usage" in proc.stdout, proc.stderr[-3000:]


def test_bench_is_a_package_that_reaches_into_neither_sys_path_nor_tests():
  """bench/ scripts import each other as `bench.X` and span_lm as installed or from the root
  (issue 46): none edits sys.path (but to load the PyTorch reference's own files from its
  checkout) or imports a module of tests/."""
  assert (REPO / "bench" / "__init__.py").is_file()
  test_modules = {p.stem for p in (REPO / "tests").rglob("*.py")} - {"__init__", "conftest"}
  bad = []
  for path in sorted((REPO / "bench").glob("*.py")):
    tree = ast.parse(path.read_text(), str(path))
    for n in ast.walk(tree):
      names = ([a.name for a in n.names] if isinstance(n, ast.Import) else
               [n.module or ""] if isinstance(n, ast.ImportFrom) and not n.level else [])
      bad += [f"{path.name} imports {m}" for m in names
              if m.split(".")[0] in test_modules | {"_repo", "tests"}]
      if (isinstance(n, ast.Call) and ast.unparse(n.func).startswith("sys.path.")
          and "reference_dir" not in ast.unparse(n)):
        bad.append(f"{path.name}: {ast.unparse(n)}")
  assert not bad, bad

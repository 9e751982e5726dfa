"""config.model in sections: runs written before them still load, old names are refused in one
line naming the new place, and the schema stays small (issue: ModelConfig in sections).

The upgrade shim's own tests: they keep the old flat names (`span_mode`, `attn_impl`, ...) on
purpose, as old run directories, checkpoints and command lines hold them; every other test names
the sections (tests/model_helpers.py refuses the old names)."""
import dataclasses
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from model_helpers import make_cfg, make_flat_cfg, replace_flat, replaced
from span_lm import config as config_lib
from span_lm import run_dir
from span_lm.model import config as model_config
from span_lm.model.config import ModelConfig

REPO = pathlib.Path(__file__).resolve().parents[1]
OLD_RUN = REPO / "tests" / "fixtures" / "old_run"  # written by span_lm at 377930c (flat fields)
# The command that wrote it, in today's names (tests/fixtures/old_run/README.md).
SHAPES = ["--config.model.d_model=16", "--config.model.d_ff=32", "--config.model.n_heads=2",
          "--config.model.span.size=64", "--config.model.span.ramp=16", "--config.data.block=32",
          "--config.data.batch=4", "--config.data.eval_batch=4", "--config.train.checkpoint_every=2",
          "--config.train.eval_every=2", "--config.train.eval_batches=1",
          "--config.train.log_every=1", "--config.train.full_eval_at_end=False",
          "--config.train.tensorboard=False", "--config.train.compilation_cache=",
          "--config.dist.cpu_devices=2"]


def _main(*args, cwd=REPO):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  return subprocess.run([sys.executable, str(REPO / "main.py"), *args], cwd=cwd, env=env,
                        capture_output=True, text=True, timeout=600)


def _old_run(tmp_path):
  work = tmp_path / "old_run"
  shutil.copytree(OLD_RUN, work, ignore=shutil.ignore_patterns("README.md", "expected.json"))
  return work


def test_the_fixture_is_in_the_old_flat_layout():
  saved = json.loads((OLD_RUN / "config.json").read_text())["model"]
  assert model_config.is_flat(saved) and saved["span"] == 64 and saved["span_mode"] == "adaptive"


@pytest.mark.slow
def test_an_old_run_resumes_to_the_numbers_the_old_code_gave(tmp_path):
  """Its flat config.json and checkpoint metadata load; the run resumes from step 2 and step 3's
  losses equal what span_lm printed before the sections (tests/fixtures/old_run/expected.json)."""
  work = _old_run(tmp_path)
  proc = _main("--config=configs/tiny.py:smoke", f"--config.workdir={work}",
               "--config.train.steps=3", *SHAPES)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = [json.loads(l) for l in (work / "metrics.jsonl").read_text().splitlines()]
  got = {(r["step"], r["split"]): r["loss"] for r in rows}
  want = json.loads((OLD_RUN / "expected.json").read_text())
  # Equal here to the last bit; 1e-4 leaves room for another CPU's vectorisation while a field
  # lost in the upgrade is caught (span.ramp 32 instead of the run's 16 moves it by 1e-3).
  assert got[(3, "train")] == pytest.approx(want["step3_train_loss"], rel=1e-4, abs=0)
  assert got[(3, "valid")] == pytest.approx(want["step3_valid_loss"], rel=1e-4, abs=0)
  # Step 2 predates fingerprints: restored unverified, said once; step 3, saved now, has them.
  assert proc.stdout.count("has no fingerprints") == 1 and (
      f"checkpoint step 2 in {work / 'checkpoints'} has no fingerprints: saved before they "
      "existed; it is not verified") in proc.stdout, proc.stdout[-3000:]
  meta3 = json.loads((work / "checkpoints" / "3" / "meta" / "metadata").read_text())
  assert meta3["fingerprints"]["algorithm"] == "wsum32x2-fmix32"
  assert "params/in_emb/embedding" in meta3["fingerprints"]["leaves"]
  assert "fingerprints" not in json.loads(
      (work / "checkpoints" / "2" / "meta" / "metadata").read_text())  # never rewritten


def test_an_old_run_directory_is_read_in_sections(tmp_path, capsys):
  config = run_dir.load_saved(str(_old_run(tmp_path)))
  m = config.model
  assert (m.span.size, m.span.mode, m.span.ramp, m.attention.impl) == (64, "adaptive", 16, "auto")
  assert "span_mode" not in m and "attn_impl" not in m
  assert "predates" not in capsys.readouterr().err  # every old field found its place
  config_lib.validate(config)  # no unknown field left behind


def test_an_old_run_is_inspected_with_its_saved_config(tmp_path):
  proc = _main(f"--config.workdir={_old_run(tmp_path)}", "--config.mode=sample",
               "--config.sample.length=4", "--config.sample.temperature=0")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "checkpoint step 2" in proc.stdout
  assert proc.stdout.count("has no fingerprints: saved before they existed; it is not "
                           "verified") == 1, proc.stdout


def test_an_old_run_is_verified_as_saved_before_fingerprints(tmp_path):
  """verify reads every array of a checkpoint without fingerprints, says it cannot check it,
  and exits 0: nothing is known to be damaged."""
  proc = _main(f"--config.workdir={_old_run(tmp_path)}", "--config.mode=verify")
  assert proc.returncode == 0, proc.stderr[-3000:]
  row = [l for l in proc.stdout.splitlines() if l.split()[:1] == ["2"]]
  assert len(row) == 1 and "saved before fingerprints: not verified (" in row[0], proc.stdout
  assert "1 checkpoints: 1 saved before fingerprints" in proc.stdout


def test_a_checkpoint_of_another_model_is_refused_by_its_new_names(tmp_path):
  work = _old_run(tmp_path)
  proc = _main("--config=configs/tiny.py:smoke", f"--config.workdir={work}",
               "--config.train.steps=3", *SHAPES[:3], "--config.model.span.size=128",
               *SHAPES[4:])
  assert proc.returncode == 1
  assert "trained with a different model" in proc.stderr and "span.size: checkpoint 64, " \
      "config 128" in proc.stderr


@pytest.mark.parametrize("flag, new", [
    ("--config.model.span_mode=fixed", "config.model.span.mode"),
    ("--config.model.span=512", "config.model.span.size"),
    ("--config.model.attn_impl=cpu", "config.model.attention.impl"),
    ("--config.model.plan_growth=2.0", "config.model.plan.growth"),
    ("--config.model.adapt_io=True", "config.model.adapt_io.enabled"),
    ("--config.model.sparse_stride=64", "config.model.sparse.stride"),
])
def test_an_old_override_is_one_line_naming_the_new_place(flag, new, tmp_path):
  proc = _main("--config=configs/tiny.py", f"--config.workdir={tmp_path / 'w'}", flag)
  assert proc.returncode == 1
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and new in lines[0] and flag.split("=")[0] in lines[0], proc.stderr
  assert not (tmp_path / "w").exists()  # refused before anything starts


def test_load_config_refuses_an_old_override_by_name():
  with pytest.raises(ValueError, match=r"config.model.ramp is now config.model.span.ramp"):
    config_lib.load_config(str(REPO / "configs" / "tiny.py"), {"model.ramp": 8})


def test_a_config_file_with_old_fields_is_refused_naming_the_new_places(tmp_path):
  f = tmp_path / "old_style.py"
  f.write_text("from span_lm import config\n\ndef get_config():\n  c = config.base_config()\n"
               "  c.model.span_mode = 'fixed'\n  c.model.attn_block = 32\n  return c\n")
  config = config_lib.load_config(str(f))
  config.unlock()
  config.workdir = str(tmp_path / "w")
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.validate(config)
  assert "attn_block is now model.attention.block" in str(e.value)
  assert "span_mode is now model.span.mode" in str(e.value)


def test_flat_and_sectioned_configs_are_the_same_model():
  flat = {"vocab_size": 7, "span": 96, "span_mode": "dynamic", "ramp": 8, "span_loss": 0.0,
          "plan_margin": 0, "attn_impl": "reference", "adapt_io": False, "d_model": 32}
  cfg = ModelConfig.from_config(flat)
  assert cfg == ModelConfig(vocab_size=7, d_model=32,
                            span=model_config.Span(size=96, mode="dynamic", ramp=8, loss=0.0),
                            plan=model_config.Plan(margin=0),
                            attention=model_config.kernels.Attention(impl="reference"))
  # The sparse model's old `span` was its context length.
  sparse = ModelConfig.from_config({"vocab_size": 7, "arch": "sparse", "span": 48,
                                    "sparse_stride": 8, "sparse_c": 2, "scan_layers": True,
                                    "n_layers": 2})
  assert sparse.sparse.context == 48 and sparse.sparse.scan_layers
  assert (sparse.context, sparse.spans) == (48, "fixed")  # what plans, counts and reports see
  # and what its checkpoints record, as when the sparse config carried a fixed span of n
  assert model_config.saved(sparse)["span"] == {**dataclasses.asdict(model_config.Span()),
                                                "size": 48, "mode": "fixed", "loss": 0.0}


def test_the_test_helpers_take_the_old_names_only_for_the_shim():
  """make_flat_cfg / replace_flat (this file's) build through the shim what make_cfg / replaced
  build from the sections; make_cfg and replaced refuse the old names, naming the new ones."""
  assert make_flat_cfg() == make_cfg()
  assert make_flat_cfg(span=32, span_mode="adaptive", attn_impl="reference", plan_growth=2.0) == (
      make_cfg(**{"span.size": 32, "span.mode": "adaptive", "attention.impl": "reference",
                  "plan.growth": 2.0}))
  assert make_flat_cfg(arch="sparse", span=64, sparse_stride=8, sparse_c=2, span_loss=0.0) == (
      make_cfg(arch="sparse", **{"sparse.context": 64, "sparse.stride": 8, "sparse.c": 2,
                                 "span.loss": 0.0}))
  cfg = make_cfg()
  assert replace_flat(cfg, span_mode="dynamic", attn_chunk=8) == (
      replaced(cfg, **{"span.mode": "dynamic", "attention.chunk": 8}))
  with pytest.raises(TypeError, match=r"'span_mode' -> 'span\.mode'"):
    make_cfg(span_mode="fixed")
  with pytest.raises(TypeError, match=r"'attn_impl' -> 'attention\.impl'"):
    replaced(cfg, attn_impl="cpu")


def test_each_section_names_its_bad_field():
  with pytest.raises(ValueError, match=r"config.model.span.ramp=0"):
    model_config.Span(ramp=0)
  with pytest.raises(ValueError, match=r"config.model.plan.growth=9"):
    model_config.Plan(growth=9)
  with pytest.raises(ValueError, match=r"config.model.attention.impl='triton'"):
    model_config.kernels.Attention(impl="triton")
  with pytest.raises(ValueError, match=r"config.model.sparse.c=0"):
    model_config.Sparse(c=0)
  with pytest.raises(ValueError, match=r"config.model.adapt_io.cutoffs"):
    model_config.AdaptIO(cutoffs=(5, 3))
  with pytest.raises(ValueError, match=r"config.model.span has unknown fields \['mode_'\]"):
    ModelConfig.from_config({"vocab_size": 3, "span": {"mode_": "fixed"}})


def test_the_schema_stays_small():
  """ModelConfig's top level: at most 20 fields, the rest in sections that validate themselves."""
  fields = dataclasses.fields(ModelConfig)
  assert len(fields) <= 20, [f.name for f in fields]
  for name, section in model_config.SECTIONS.items():
    assert isinstance(getattr(ModelConfig(vocab_size=2), name), section)
  hash(ModelConfig(vocab_size=2))  # a jit static argument


def test_a_config_file_that_sets_a_section_is_one_line(tmp_path):
  """`c.model.span = 512` (S before the sections) in a user's config file: ml_collections refuses
  to replace a section with a number; the user gets one line naming model.span.size."""
  f = tmp_path / "old_span.py"
  f.write_text("from span_lm import config\n\ndef get_config():\n  c = config.base_config()\n"
               "  c.model.span = 512\n  return c\n")
  proc = _main(f"--config={f}", f"--config.workdir={tmp_path / 'w'}")
  assert proc.returncode == 1
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and "config.model.span.size" in lines[0], proc.stderr

"""bench/gpu_suite.py's CPU rehearsal (--dry_run), so the GPU command never rots between the rare
GPU machines: every stage runs, the JSON and markdown cover it, and the correctness rows compared
real numbers (finite, below tolerance, against a definition that is itself checked here)."""
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

import jax
import jax.numpy as jnp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "bench"))
sys.path.insert(0, os.path.join(REPO, "tests"))
import gpu_suite  # pylint: disable=g-import-not-at-top,wrong-import-position
import reference_numpy  # pylint: disable=g-import-not-at-top,wrong-import-position

OK = ("ok", "pass", "stand_in")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
  out = tmp_path_factory.mktemp("gpu_dry")
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  # A generous budget: CI's shared cores must not turn a slow stage into a skipped one.
  proc = subprocess.run(
      [sys.executable, os.path.join(REPO, "bench", "gpu_suite.py"), "--dry_run", "--out",
       str(out), "--budget_s", "900", "--reference_dir", str(out / "no-reference-here")],
      capture_output=True, text=True, cwd=REPO, env=env, timeout=1200)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  with open(out / "suite.json") as f:
    res = json.load(f)
  with open(out / "suite.md") as f:
    md = f.read()
  return res, md


def _refused_before_compiling(row):
  """A configuration an implementation declines up front (the kernel's head-size limit)."""
  return row["status"] == "error" and row.get("error", "").startswith("ValueError: config.model")


def test_every_stage_ran_and_every_row_succeeded(dry_run):
  res, md = dry_run
  assert res["dry_run"] and list(res["stages"]) == list(gpu_suite.STAGES)
  for name, stage in res["stages"].items():
    assert stage["status"] in ("ok", "partial"), (name, stage)
    assert stage["rows"], name
    bad = [r for r in stage["rows"] if r["status"] not in OK and not _refused_before_compiling(r)]
    assert not bad, (name, bad)
    assert not stage["errors"], (name, stage["errors"])
    assert f"| {name} | {stage['status']} |" in md
  for header in ("## Environment", "## Correctness", "## Training step: enwik8",
                 "## Training step: issue8", "## Training step: enwik8_large",
                 "## Reference (PyTorch)", "## Sampling"):
    assert header in md


def test_correctness_rows_compared_every_gradient(dry_run):
  res, _ = dry_run
  rows = res["stages"]["correctness"]["rows"]
  resolved = res["impls"]["resolved"]
  measured = {name for name, r in resolved.items() if r["use"]}
  assert {"pallas_interpret"} < measured  # the kernel's path, and at least one jnp path
  assert not [r for r in rows if r["status"] == "fail"]
  passed = [r for r in rows if r["status"] == "pass"]
  assert {r["impl"] for r in passed} == measured
  assert {(r["dtype"], r["span_mode"], r["pers_mem"]) for r in passed} >= {
      ("bfloat16", "adaptive", False), ("float32", "adaptive", True),
      ("float32", "dynamic", False), ("float32", "fixed", False)}
  for r in passed:
    d = r["diffs"]
    must = ["out", "d_proj_query/kernel", "d_proj_key/kernel", "d_proj_val/kernel",
            "d_proj_out/kernel", "d_key_pe", "d_h", "d_cache"]
    must += {"adaptive": ["d_span_ratio"], "dynamic": ["d_span_predictor/kernel",
                                                       "d_span_predictor/bias"],
             "fixed": []}[r["span_mode"]]
    must += ["d_pers_key", "d_pers_val"] if r["pers_mem"] else []
    assert set(must) <= set(d), (r["impl"], sorted(d))
    assert not set(must) & set(r["zero_reference"])  # a zero reference would compare nothing
    for name in must:
      assert math.isfinite(d[name]) and d[name] <= r["tol"], (r["impl"], name, d[name])
    if r["dtype"] == "float32":  # on the CPU float32 agrees far below the GPU's TF32 tolerance
      assert r["worst_diff"] < 1e-4, r


def test_training_reference_and_sampling_rows(dry_run):
  res, md = dry_run
  st = res["stages"]
  train = [r for r in st["train_enwik8"]["rows"] if r["status"] == "ok"]
  keys = {r["plan"]: r["plan_keys"] for r in train}
  assert keys["short"] < keys["mixed"] < keys["all_S"]  # the plans do what their names say
  for name in ("train_enwik8", "train_issue8", "train_enwik8_large"):
    for r in st[name]["rows"]:
      if r["status"] == "ok":
        assert r["seconds"] > 0 and r["tokens_per_s"] > 0 and r["flops"] > 0
        assert math.isfinite(r["loss"])
  assert {r["plan"] for r in st["train_issue8"]["rows"] if r["status"] == "ok"} == {
      "issue8_short", "fixed"}
  large = [r for r in st["train_enwik8_large"]["rows"] if r["status"] == "ok"]
  assert large and all(r["batch_split"] == 2 for r in large)
  ref = st["reference"]["rows"]
  assert {(r["shapes"], r["plan"]) for r in ref} == {
      ("issue8", "issue8_short"), ("issue8", "fixed"), ("enwik8", "short"), ("enwik8", "mixed"),
      ("enwik8", "all_S")}
  for r in ref:  # no checkout here: a stand-in, marked as one and never shown as the reference
    assert r["status"] == "stand_in" and r["stand_in"] and r["seconds"] > 0
  assert "stand-in" in md and "not a reference number" in md
  samp = st["sampling"]["rows"]
  assert samp and all(r["status"] == "ok" and r["tokens_per_s"] > 0 for r in samp)


def test_impl_names_resolve_on_trees_before_and_after_the_one_door():
  old = gpu_suite.resolve_impls(["xla", "pallas", "pallas_interpret"], on_gpu=True)
  assert old["reference"]["use"] == "xla" and old["pallas"]["use"] == "pallas"
  assert "pallas_interpret" not in old and "cpu" not in old  # not measured on a GPU
  cpu = gpu_suite.resolve_impls(["xla", "pallas", "pallas_interpret"], on_gpu=False)
  assert cpu["reference"]["use"] == "xla" and cpu["cpu"]["use"] is None  # measured once
  assert cpu["pallas_interpret"]["use"] == "pallas_interpret"
  new = gpu_suite.resolve_impls(["auto", "reference", "cpu", "pallas", "pallas_interpret"],
                                on_gpu=False)
  assert {k: v["use"] for k, v in new.items()} == {
      "reference": "reference", "cpu": "cpu", "pallas_interpret": "pallas_interpret"}


@pytest.mark.parametrize("mode,pers", [("adaptive", 0), ("dynamic", 0), ("fixed", 4),
                                       ("adaptive", 4)])
def test_plain_definition_equals_the_float64_numpy_model(mode, pers):
  """The suite's yardstick against tests/reference_numpy.py (independent, float64)."""
  from span_lm.model.config import ModelConfig  # pylint: disable=g-import-not-at-top
  cfg = ModelConfig(vocab_size=8, d_model=16, n_heads=2, d_ff=32, span=24, ramp=4,
                    span_mode=mode, pers_mem=pers, n_layers=1)
  rng = np.random.default_rng(3)
  p = {n: {"kernel": rng.standard_normal((16, 16)) / 4} for n in
       ("proj_query", "proj_key", "proj_val", "proj_out")}
  p["span_ratio"] = rng.uniform(0.1, 0.9, 2)
  p["span_predictor"] = {"kernel": rng.standard_normal((16, 2)) / 4,
                         "bias": rng.standard_normal(2)}
  if pers:
    p["pers_key"] = rng.standard_normal((2, 8, pers)) / 3
    p["pers_val"] = rng.standard_normal((2, pers, 8)) / 2
  key_pe = rng.standard_normal((8, 24))
  h, cache = rng.standard_normal((2, 6, 16)), rng.standard_normal((2, 24, 16))
  want = reference_numpy.attention(cfg, p, key_pe, h, cache)
  as32 = lambda t: jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), t)
  got = gpu_suite.plain_attention(cfg, as32(p), as32(key_pe), as32(h), as32(cache))
  np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)


def test_gpu_kernel_check_rehearses_on_the_cpu(tmp_path):
  """bench/gpu_kernel_check.py (the two-minute kernel check for a lent GPU) runs end to end in
  interpret mode: every case compared every gradient and passed, and the pipelined variant ran."""
  out = tmp_path / "k.json"
  r = subprocess.run([sys.executable, "bench/gpu_kernel_check.py", "--interpret", "--small",
                      "--no_timing", "--out", str(out)], cwd=REPO, capture_output=True, text=True,
                     timeout=900, check=False)
  assert r.returncode == 0, r.stderr[-2000:]
  rows = [x for x in json.loads(out.read_text()) if "check" in x]
  shipped = [x for x in rows if x["variant"] == "shipped"]
  assert len(shipped) == 6 and all(x["status"] == "pass" for x in shipped), rows
  assert all({"q", "k", "v", "pe"} <= set(x) for x in shipped)
  assert [x["stages"] for x in rows if x["variant"] == "pipelined"] == [2]

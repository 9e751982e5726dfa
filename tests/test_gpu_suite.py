"""bench/gpu_run.py's CPU rehearsal (--dry_run), so the device command never rots between the rare
GPU machines: every family runs at tiny shapes (the kernel interpreted, stand-ins marked), each
row reaches rows.jsonl, the report covers it, and the correctness rows compared real numbers
(every gradient, finite, below tolerance, against a definition that is itself checked here)."""
import math
import os
import subprocess
import sys

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from bench import gpu_families
from bench import gpu_layer_check
from bench import gpu_run
from span_lm import testing as reference_numpy

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

OK = ("ok", "pass", "stand_in")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
  out = tmp_path_factory.mktemp("gpu_dry")
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  # The generous default budget (900 s): CI's shared cores must not turn a slow family into a
  # skipped one. No .gpu_carry here: the reference family is its marked stand-in.
  proc = subprocess.run([sys.executable, "-m", "bench.gpu_run", "--dry_run", "--out", str(out)], capture_output=True, text=True, cwd=REPO, env=env,
                        timeout=1200)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  rows = gpu_run.read_rows(str(out / "rows.jsonl"))
  with open(out / "report.md") as f:
    md = f.read()
  return rows, md, out


def _family(rows, name):
  return [r for r in rows if r.get("family") == name and r.get("kind") != "family"]


def test_every_family_ran_and_every_row_succeeded(dry_run):
  rows, md, _ = dry_run
  assert rows[0]["kind"] == "run" and rows[0]["dry_run"] and rows[-1]["kind"] == "done"
  fams = {r["name"]: r for r in rows if r.get("kind") == "family"}
  assert list(gpu_run.FAMILIES) == sorted(fams, key=gpu_run.FAMILIES.index)
  for name in gpu_run.FAMILIES:
    assert fams[name]["status"] == "ok", fams[name]
    data = _family(rows, name)
    assert data and fams[name]["rows"] == len(data), name
    bad = [r for r in data if r.get("status", "ok") not in OK]
    assert not bad, (name, bad)
    assert f"| {name} | ok" in md
  assert "cut short" not in md
  for header in ("## Kernel correctness", "## Attention layer, learned plan",
                 "## Attention timings", "## Encoder correctness", "## Encoder attention timings", "## Training step: configs/enwik8.py",
                 "## Training step: configs/enwik8_large.py", "## Reference (PyTorch)",
                 "## Sampling", "## Sparse Transformer kernel correctness",
                 "## Sparse Transformer attention"):
    assert header in md


def test_kernel_rows_compared_every_gradient(dry_run):
  rows, _, _ = dry_run
  checks = [r for r in rows if r.get("kind") == "check"]
  assert checks and all(r["status"] == "pass" and r["interpret"] for r in checks)
  seen = set()
  for r in checks:
    must = ["out", "q", "k", "v", "pe"] + (["z"] if r["spans"] != "fixed" else []) + (
        ["pk", "pv"] if r["pers"] else [])
    assert set(must) <= set(r["diffs"]), r
    assert not r["zero_reference"]
    for name in must:
      assert math.isfinite(r["diffs"][name]) and r["diffs"][name] <= r["tol"], (r["case"], name)
    if r["dtype"] == "float32":  # on the CPU float32 agrees far below the GPU's TF32 tolerance
      assert r["worst_diff"] < 1e-4, r
    seen |= {r["dtype"], r["head_dim"], r["spans"]} | ({"pers"} if r["pers"] else set()) | (
        {"dropout"} if r["dropout"] else set())
  # the rehearsal covers every kind of variant the GPU run checks (head dims 16/24 for 64/96)
  assert seen >= {"bfloat16", "float32", 16, 24, "fixed", "adaptive", "dynamic", "pers",
                  "dropout"}
  model = [r for r in rows if r.get("kind") == "model_check"]
  assert model and all(r["status"] == "pass" for r in model)
  for r in model:
    must = ["out", "d_proj_query/kernel", "d_proj_key/kernel", "d_proj_val/kernel",
            "d_proj_out/kernel", "d_key_pe", "d_h", "d_cache", "d_span_ratio"] + (
                ["d_pers_key", "d_pers_val"] if r["pers_mem"] else [])
    assert set(must) <= set(r["diffs"]) and not set(must) & set(r["zero_reference"])
    windows = [w for _, w in r["shape"]["groups"]]
    assert max(windows) <= r["shape"]["span"] and min(windows) < r["shape"]["span"]  # < S


def test_timing_rows_and_the_marked_cudnn_stand_in(dry_run):
  rows, md, _ = dry_run
  times = {(r["path"], r["spans"]): r for r in rows if r.get("kind") == "time"}
  assert set(times) >= {("pallas", "all_S"), ("pallas", "learned"), ("reference", "all_S"),
                        ("cudnn_standin", "dense")}
  assert ("cudnn", "dense") not in times  # never shown as cuDNN on the CPU
  for r in times.values():
    assert r["status"] == "ok" and r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0
  assert times[("pallas", "all_S")]["tiles"] and "STAND-IN" in md


def test_encoder_rows_compared_every_gradient_and_timed_every_path(dry_run):
  """The encoder family: the kernel's bidirectional segmented path against the layer's dense
  definition (every gradient, the spans ahead learned apart, padding rows exactly 0), and
  timings of the kernel, the XLA path and cuDNN's marked stand-in."""
  rows, md, _ = dry_run
  checks = [r for r in rows if r.get("kind") == "encoder_check"]
  assert checks and all(r["status"] == "pass" and r["interpret"] for r in checks)
  assert {r["dtype"] for r in checks} == {"bfloat16", "float32"} and any(r["apart"]
                                                                        for r in checks)
  for r in checks:
    must = ["out", "query", "key", "value", "span_ratio", "pos_back", "pos_ahead"] + (
        ["span_ratio_ahead"] if r["apart"] else [])
    assert set(must) <= set(r["diffs"]) and not r["zero_reference"], r
    assert all(math.isfinite(r["diffs"][n]) and r["diffs"][n] <= r["tol"] for n in must), r
    assert r["padding_out"] == 0.0
  times = {(r["path"], r["spans"]): r for r in rows if r.get("kind") == "encoder_time"}
  assert set(times) == {("pallas_interpret", "learned"), ("pallas_interpret", "all_S"),
                        ("reference", "learned"), ("cudnn_standin_mask", "dense"),
                        ("cudnn_standin_lengths", "dense")}
  for r in times.values():
    assert r["status"] == "ok" and r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0
    assert r["shape"]["ahead"] == r["shape"]["max_span"] - 1 and r["shape"]["padding"] > 0
  [job] = gpu_families.run_jobs("encoder", dry=False)
  assert job.module == "bench.gpu_encoder" and job.spec is None  # on a GPU: the real thing


def test_sparse_rows_compared_every_gradient_and_timed_every_path(dry_run):
  """The sparse family: the block-sparse kernel against the dense masked reference (every
  pattern kind it covers, both dtypes, every gradient), the kernel against the jnp path and
  (dense heads) against cuDNN's marked stand-in, and timings of the four paths."""
  rows, md, _ = dry_run
  checks = [r for r in rows if r.get("kind") == "sparse_check"]
  assert checks and all(r["status"] == "pass" and r["interpret"] for r in checks)
  assert {r["dtype"] for r in checks} == {"bfloat16", "float32"}
  assert {r["case"] for r in checks} >= {"fixed/merged", "fixed/split", "fixed/A2_alone",
                                         "strided/merged"}
  for r in checks:
    assert set(r["diffs"]) == {"out", "q", "k", "v"}, r
    assert all(math.isfinite(x) and x <= r["tol"] for x in r["diffs"].values()), r
  pairs = [r for r in rows if r.get("kind") == "sparse_pair"]
  assert [r["paths"] for r in pairs] == [["pallas_interpret", "jnp"],
                                         ["pallas_interpret_dense", "cudnn_standin_dense"]]
  assert all(r["status"] == "pass" for r in pairs), pairs
  times = {r["path"]: r for r in rows if r.get("kind") == "sparse_time"}
  assert set(times) == {"pallas_interpret", "jnp", "cudnn_standin_dense",
                        "pallas_interpret_dense"}
  for r in times.values():
    assert r["status"] == "ok" and r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0
  assert "STAND-IN" in times["cudnn_standin_dense"]["note"]
  [job] = gpu_families.run_jobs("sparse", dry=False)
  assert job.module == "bench.gpu_sparse" and job.spec is None  # on a GPU: the real thing


def test_training_reference_and_sampling_rows(dry_run):
  rows, md, _ = dry_run
  train = _family(rows, "train_enwik8")
  keys = {r["plan"]: r["plan_keys"] for r in train if r["impl"] == "reference"}
  assert keys["learned"] < keys["all_S"]  # the plans do what their names say
  assert {(r["impl"], r["plan"]) for r in train} >= {("reference", "learned"),
                                                     ("reference", "all_S")}
  # on a GPU both impls at both plans, learned first (what a cut keeps decides most)
  [job] = gpu_families.run_jobs("train_enwik8", dry=False)
  spec = job.spec
  assert job.child == "train" and spec["batch"] == 8 and spec["block"] == 512
  assert [(v["impl"], v["use"], v["dtype"], v["plans"]) for v in spec["variants"]] == [
      ("pallas", "pallas", "bfloat16", ["learned"]), ("reference", "reference", "bfloat16",
                                                      ["learned"]),
      ("pallas", "pallas", "bfloat16", ["all_S"]), ("reference", "reference", "bfloat16",
                                                    ["all_S"])]
  for name in ("train_enwik8", "train_enwik8_large"):
    for r in _family(rows, name):
      assert r["dtype"] == "bfloat16" and r["seconds"] > 0 and r["tokens_per_s"] > 0
      assert r["flops"] > 0 and math.isfinite(r["loss"])
  large = _family(rows, "train_enwik8_large")
  assert large and all(r["batch_split"] == 2 for r in large)
  ref = _family(rows, "reference")
  assert {(r["shapes"], r["plan"]) for r in ref} == {("enwik8", "learned"), ("enwik8", "all_S")}
  for r in ref:  # no checkout here: a stand-in, marked as one and never shown as the reference
    assert r["status"] == "stand_in" and r["stand_in"] and r["seconds"] > 0
  assert "not a reference number" in md and "(stand-in)" in md
  samp = _family(rows, "sampling")
  assert {r["plan"] for r in samp} == {"learned", "all_S"}
  assert all(r["tokens_per_s"] > 0 for r in samp)


def test_a_cut_row_file_still_renders(dry_run, tmp_path):
  """A run killed mid-family keeps its rows: --md renders what finished, marked as cut."""
  _, _, out = dry_run
  lines = (out / "rows.jsonl").read_text().splitlines()
  first = next(i for i, l in enumerate(lines) if '"kind": "check"' in l)
  cut = tmp_path / "rows.jsonl"
  cut.write_text("\n".join(lines[:first + 1]) + "\n" + lines[first + 1][:25])
  r = subprocess.run([sys.executable, "-m", "bench.gpu_run", "--md", str(cut)], capture_output=True, text=True, cwd=REPO, timeout=120,
                     check=False)
  assert r.returncode == 0, r.stderr[-2000:]
  md = (tmp_path / "report.md").read_text()
  assert "cut short" in md and "## Kernel correctness" in md and md in r.stdout


def test_impl_names_are_span_lms_own():
  """The driver measures span_lm.kernels.IMPLS's names (no list of its own): on a GPU the readable
  definition and the compiled GPU kernel; in the rehearsal the CPU layout and the kernel
  interpreted; a name the device's span_lm does not accept is listed, not run."""
  from span_lm import kernels  # pylint: disable=g-import-not-at-top
  gpu = gpu_families.measured_impls(on_gpu=True)
  assert set(gpu) <= set(kernels.IMPLS)
  assert {k: v["use"] for k, v in gpu.items()} == {"reference": "reference", "pallas": "pallas"}
  cpu = gpu_families.measured_impls(on_gpu=False)
  assert {k: v["use"] for k, v in cpu.items()} == {
      "reference": "reference", "cpu": "cpu", "pallas_interpret": "pallas_interpret"}
  missing = gpu_families.measured_impls(True, ["auto", "reference"])
  assert missing["reference"]["use"] == "reference" and missing["pallas"]["use"] is None
  assert gpu_families.gpu_kernel(dry=False) == "pallas"
  assert gpu_families.gpu_kernel(dry=True) == "pallas_interpret"


@pytest.mark.slow
def test_the_suite_preset_rehearses_env_and_correctness(tmp_path):
  """`--preset suite` (the longer suite, once its own driver): the env family feeds the later
  ones the implementations to measure, and each is compared with the plain definition."""
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  proc = subprocess.run([sys.executable, "-m", "bench.gpu_run", "--dry_run", "--preset", "suite",
                         "--families", "correctness", "--budget_s", "600", "--out", str(tmp_path)],
                        capture_output=True, text=True, cwd=REPO, env=env, timeout=900)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  rows = gpu_run.read_rows(str(tmp_path / "rows.jsonl"))
  fams = {r["name"]: r for r in rows if r.get("kind") == "family"}
  assert set(fams) == {"env", "correctness"} and all(f["status"] == "ok" for f in fams.values())
  env_row = next(r for r in rows if r.get("family") == "env" and r.get("kind") == "env")
  assert env_row["matmul_tflops_float32"] > 0
  checks = [r for r in rows if r.get("family") == "correctness" and "case_index" in r]
  assert {r["impl"] for r in checks} == {"reference", "cpu", "pallas_interpret"}
  for r in checks:
    assert r["status"] == "pass" and r["worst_diff"] <= r["tol"] and not r["zero_reference"], r
  md = (tmp_path / "report.md").read_text()
  assert "## Environment" in md and "## Correctness against the plain definition" in md


@pytest.mark.slow
@pytest.mark.parametrize("mode,pers", [("adaptive", 0), ("dynamic", 0), ("fixed", 4),
                                       ("adaptive", 4)])
def test_plain_definition_under_jax_equals_the_float64_numpy_model(mode, pers):
  """The checks' yardstick: span_lm/testing.py's attention run under jax in float32 (what
  gpu_layer_check and gpu_kernel_check differentiate) against the same lines in float64 numpy."""
  from span_lm.model.config import ModelConfig, Span  # pylint: disable=g-import-not-at-top
  cfg = ModelConfig(vocab_size=8, d_model=16, n_heads=2, d_ff=32, pers_mem=pers, n_layers=1,
                    span=Span(size=24, ramp=4, mode=mode))
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
  setup = {"cfg": cfg}
  plain = gpu_layer_check.plain_fn(setup)
  got = plain(as32(p), as32(h), as32(cache), as32(key_pe))
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)
  grads = jax.grad(lambda *a: jnp.sum(plain(*a) ** 2), argnums=(0, 1, 2, 3))(
      as32(p), as32(h), as32(cache), as32(key_pe))
  assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))

"""The training system end to end: resume, sharding, batch_split, evaluation, errors, the CLI.

CPU with 8 fake devices (conftest). Tiny models on the synthetic task, whose small splits make
the training streams wrap every few steps; only the CLI test reads the packaged enwik8 head
(span_lm/data/demo).
One adaptive run (the module fixture `run_a`) is shared by the resume, plan-change, evaluation
and mismatch tests, since compilation dominates the cost of every run here.
"""
import os
import pathlib
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

import synthetic_run
from model_helpers import replaced
from span_lm import config as config_lib
from span_lm.data import batching, sources
from span_lm.model import plan as plan_lib
from span_lm.model.config import ModelConfig
from span_lm.train import checkpoint as ckpt_lib
from span_lm.train import evaluation, loop, steps
from span_lm.train import run as run_lib
from span_lm.train.metrics import read_metrics

REPO = pathlib.Path(__file__).resolve().parents[2]

K = 6  # the resume test's checkpoint step; the run trains 2K steps
# Synthetic splits of 640/480/480 tokens: 8 training streams of 80 tokens, so with blocks of 16
# the walk restarts at a random offset (and zeroes the caches) after every 4th step.
TRAIN_TOKENS, VALID_TOKENS = 640, 480

TINY = dict(synthetic_run.SMALL, **{
    "model.span.mode": "adaptive",
    "train.steps": 2 * K,
    "train.eval_every": K,
    "train.checkpoint_every": K,
})

# Spans that shrink fast: z' starts at 0.9 (window 64), a span penalty that dominates its
# gradient and an unclipped, high learning rate. The 48-token window suffices from step 4; with
# patience 3 the planner adopts it at step 7, so the pending shrink crosses the step-K checkpoint.
SHRINKING = {
    "model.span.init": 0.9,
    "model.span.loss": 0.05,
    "model.plan.shrink_patience": 3,
    "model.plan.growth": 1.0,  # no headroom: the shrink is to the tight 48-token window
    "optim.lr": 0.1,
    "optim.grad_clip": 0.0,
}


# For the equality tests: Adagrad's first step moves every weight by +-lr whatever the size of its
# gradient, so the rounding noise of a gradient that is zero in exact arithmetic (key_pe at
# distances the span mask removes) becomes a difference of lr. SGD keeps updates linear in it.
LINEAR_UPDATES = {"optim.name": "sgd", "optim.lr": 0.1}


def _config(workdir, *overrides: dict):
  ov = dict(TINY, workdir=str(workdir))
  for o in overrides:
    ov.update(o)
  return config_lib.load_config("configs/tiny.py:smoke", ov)


def _leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


def _assert_bit_identical(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(_leaves(a), _leaves(b)):
    assert x.dtype == y.dtype and x.shape == y.shape
    assert x.tobytes() == y.tobytes()


def _assert_close(a, b, rtol=1e-5, atol=1e-6):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(_leaves(a), _leaves(b)):
    np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)


def _lines(workdir, split):
  return {r["step"]: r for r in read_metrics(str(workdir)) if r["split"] == split}


_DETERMINISTIC = ("loss", "bpc", "lr", "grad_norm", "span_loss", "span_avg", "span_max",
                  "plan_changes")


def _deterministic(line):
  return {k: line[k] for k in _DETERMINISTIC if k in line}


@pytest.fixture
def no_compilation(monkeypatch):
  """Fails the test if anything reaches XLA compilation."""
  def refuse(*args, **kwargs):
    raise AssertionError("a step was compiled before the error was raised")
  monkeypatch.setattr(steps.StepCompiler, "_compile", refuse)


@pytest.fixture(scope="module")
def run_a(tmp_path_factory):
  """2K steps straight through, adaptive spans that shrink, dropout on: (config, train() result)."""
  workdir = tmp_path_factory.mktemp("run_a")
  config = _config(workdir, SHRINKING)
  return config, loop.train(config)


# --------------------------------------------------------------------------------------- resume


@pytest.mark.slow
def test_resume_is_bit_identical(run_a, tmp_path):
  config_a, result_a = run_a
  config_b = _config(tmp_path / "b", SHRINKING, {"train.steps": K})
  loop.train(config_b)
  with ckpt_lib.Checkpointer(tmp_path / "b" / "checkpoints") as ckpt:
    assert ckpt.all_steps() == [K]
    meta = ckpt.restore_meta(K)
  # The checkpoint sits past a stream restart, mid-walk, with a shrink pending.
  assert meta["data"]["train"]["restarts"] >= 1 and meta["data"]["train"]["pos"] > 0
  assert meta["planner"]["shrink_since"] is not None and meta["planner"]["changes"] == 0

  config_b.train.steps = 2 * K
  result_b = loop.train(config_b)  # resumes from step K

  assert result_b["step"] == result_a["step"] == 2 * K
  assert result_b["plan"] == result_a["plan"]
  _assert_bit_identical(result_b["state"], result_a["state"])  # params, opt state, rng, caches
  train_a, train_b = _lines(config_a.workdir, "train"), _lines(config_b.workdir, "train")
  assert sorted(train_a) == sorted(train_b) == list(range(1, 2 * K + 1))
  for step in train_a:
    assert _deterministic(train_b[step]) == _deterministic(train_a[step]), step
  for split in ("valid", "full_valid", "full_test"):
    a, b = _lines(config_a.workdir, split), _lines(config_b.workdir, split)
    assert a[2 * K] == b[2 * K], split
  assert _lines(config_a.workdir, "valid")[K] == _lines(config_b.workdir, "valid")[K]

  # Run A saved step K asynchronously and trained on (its state buffers donated to the next
  # step): that checkpoint still equals the one run B wrote as its last act.
  states = []
  for config in (config_a, config_b):
    run = loop.Run(config)
    try:
      states.append(run.restore(K)[0])
    finally:
      run.ckpt.close()
  _assert_bit_identical(states[0], states[1])


# ------------------------------------------------------------------------------------ span plan


def test_span_plan_changes_during_training(run_a):
  config, result = run_a
  run_cfg = ModelConfig.from_config(config.model, vocab_size=config.data.synthetic_vocab)
  initial = plan_lib.initial_plan(run_cfg)
  plan, state = result["plan"], result["state"]
  assert plan != initial
  assert result["plan_changes"] >= 1 and result["step"] == 2 * K
  train = _lines(config.workdir, "train")
  changed = [s for s in sorted(train) if train[s]["plan_changes"] > 0]
  assert changed and changed[0] < 2 * K, "the plan must change while training still runs"
  assert all(np.isfinite(train[s]["loss"]) for s in train)
  assert train[2 * K]["compilations"] > train[changed[0]]["compilations"]  # the new plan ran
  # The caches were resized to the new plan and the plan is exact for the final parameters.
  for caches, batch in ((state["caches"], config.data.batch),
                        (state["eval_caches"], config.data.eval_batch)):
    assert [c.shape for c in caches] == [(batch, lp.cache_len, run_cfg.d_model)
                                         for lp in plan.layers]
  assert any(lp.cache_len < run_cfg.span.size for lp in plan.layers)
  plan_lib.check_plan(run_cfg, state["params"], plan)
  assert plan_lib.plan_from_params(run_cfg, state["params"]).attention_keys() <= plan.attention_keys()


# ------------------------------------------------------------------------------- step equality


def _train_steps(config, n_steps=2, num_devices=None, init=None):
  """Runs the compiled train step n_steps times from a fresh state (or the host state `init`).

  Returns (mesh, initial host state, [(state, metrics)] on the host after each step).
  """
  run = loop.Run(config, num_devices=num_devices)
  try:
    d = config.data
    plan = plan_lib.initial_plan(run.model_cfg)
    if init is None:
      state = run.init_state(plan)
      init = jax.device_get(state)
    else:  # the same values laid out on this run's mesh (saves compiling the init again)
      state = jax.device_put(init, run.abstract_state(plan)[2])
    data = batching.StreamIterator(run.splits.train, d.batch, d.block, seed=config.seed)
    out = []
    for _ in range(n_steps):
      blk = next(data)
      batch = run.put_batch(steps.host_batch(blk.x, blk.y, blk.reset))
      state, metrics = run.compiler.train(plan, state, batch)(state, batch)
      out.append(jax.device_get((state, metrics)))
    return run.mesh, init, out
  finally:
    run.ckpt.close()


def test_eight_devices_equal_one(tmp_path):
  config = _config(tmp_path, LINEAR_UPDATES)
  mesh8, init, eight = _train_steps(config)
  mesh1, _, one = _train_steps(config, num_devices=1, init=init)
  assert mesh8.devices.size == 8 and mesh1.devices.size == 1
  for (s8, m8), (s1, m1) in zip(eight, one):
    np.testing.assert_allclose(m8["loss"], m1["loss"], rtol=1e-6)
    _assert_close(m8, m1)
    _assert_close(s8["params"], s1["params"])
    _assert_close(s8["opt_state"], s1["opt_state"])
    _assert_close(s8["caches"], s1["caches"])
    assert s8["step"] == s1["step"]


@pytest.mark.parametrize("span_mode", ["adaptive", "dynamic"])
def test_batch_split_equals_one_batch(tmp_path, span_mode):
  # Dropout off: the pieces draw different dropout masks than the whole batch.
  common = dict(LINEAR_UPDATES, **{"model.dropout": 0.0, "model.span.mode": span_mode})
  _, init, whole = _train_steps(_config(tmp_path / "whole", common))
  _, _, split = _train_steps(_config(tmp_path / "split", common, {"optim.batch_split": 2}),
                             init=init)
  for (sw, mw), (ss, ms) in zip(whole, split):
    np.testing.assert_allclose(ms["loss"], mw["loss"], rtol=1e-6)
    _assert_close(ms, mw, atol=0)  # span statistics of the whole batch, not of one piece
    _assert_close(ss["params"], sw["params"])
    _assert_close(ss["opt_state"], sw["opt_state"])
    for cw, cs in zip(sw["caches"], ss["caches"]):  # the same rows in the same order
      assert cw.shape == cs.shape
      for row in range(cw.shape[0]):
        np.testing.assert_allclose(cs[row], cw[row], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("span_mode, extra", [("adaptive", {}), ("dynamic", {}),
                                              ("adaptive", {"dist.fsdp": 2})],
                         ids=["adaptive", "dynamic", "fsdp"])
def test_per_device_batch_split_equals_one_device(tmp_path, span_mode, extra):
  """batch_split=2 on 2 devices accumulates per device and reduces once (steps._local_grads;
  tests/train/test_steps_hlo.py checks the program): without dropout, the same step as on one
  device, span statistics of the whole batch and caches in row order included."""
  common = dict(LINEAR_UPDATES, **{"model.dropout": 0.0, "model.span.mode": span_mode,
                                   "optim.batch_split": 2})
  _, init, one = _train_steps(_config(tmp_path / "one", common), num_devices=1)
  mesh2, _, two = _train_steps(_config(tmp_path / "two", common, extra), num_devices=2,
                               init=init)
  assert mesh2.devices.size == 2 and mesh2.axis_names == (
      ("data", "fsdp") if extra else ("data",))
  for (s2, m2), (s1, m1) in zip(two, one):
    np.testing.assert_allclose(m2["loss"], m1["loss"], rtol=1e-6)
    _assert_close(m2, m1)
    _assert_close(s2["params"], s1["params"])
    _assert_close(s2["opt_state"], s1["opt_state"])
    _assert_close(s2["caches"], s1["caches"])
    assert s2["step"] == s1["step"]


# ------------------------------------------------------------------------------------ evaluation


def test_evaluate_checkpoint(run_a, tmp_path):
  config_a, _ = run_a
  workdir = tmp_path / "run"
  shutil.copytree(config_a.workdir, workdir)
  config = _config(workdir, SHRINKING)
  splits = sources.load_splits(config.data)
  assert (len(splits.train), len(splits.valid), len(splits.test)) == (
      TRAIN_TOKENS, VALID_TOKENS, VALID_TOKENS)
  d = config.data

  out = loop.evaluate(config)
  assert out["step"] == 2 * K
  for name in ("valid", "test"):
    res = out[name]
    assert np.isfinite(res["bpc"]) and res["bpc"] > 0
    assert res["tokens"] == sum(b.n_tokens for b in batching.eval_blocks(
        splits.split(name), d.eval_batch, d.block))
  # Every target of each 60-token stream is scored once: 8 * 59, the partial last block included.
  assert out["valid"]["tokens"] == 8 * 59
  # The same parameters, plan and walk as the full evaluation at the end of training.
  full = _lines(workdir, "full_valid")[2 * K]
  np.testing.assert_allclose(out["valid"]["bpc"], full["bpc"], rtol=1e-6)
  assert out["valid"]["tokens"] == full["tokens"]
  for name in ("valid", "test"):
    line = _lines(workdir, f"eval_{name}")[2 * K]
    assert line["tokens"] == out[name]["tokens"] and line["bpc"] == pytest.approx(out[name]["bpc"])

  config.train.eval_drop_last = True
  dropped = loop.evaluate(config)
  for name in ("valid", "test"):
    assert dropped[name]["tokens"] == sum(b.n_tokens for b in batching.eval_blocks(
        splits.split(name), d.eval_batch, d.block, drop_last=True))
    assert np.isfinite(dropped[name]["bpc"])
  # The reference's loop over 60-token streams reads the whole blocks at 0, 16 and 32 only.
  assert dropped["valid"]["tokens"] == 8 * 3 * 16


# ---------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize("field,value,message", [
    ("data.block", 0, "config.data.block=0"),
    ("data.batch", 12, "config.data.batch=12"),  # not divisible by the 8 devices
    ("optim.lr", 0.0, "config.optim.lr=0.0"),
    ("model.n_heads", 3, "config.model.n_heads=3"),
])
def test_bad_value_is_rejected_before_compiling(tmp_path, no_compilation, field, value, message):
  config = _config(tmp_path / "run", {field: value})
  with pytest.raises(ValueError, match=message.replace(".", r"\.")):
    loop.train(config)
  assert not (tmp_path / "run").exists()


def test_missing_data_file(tmp_path, no_compilation):
  missing = tmp_path / "nowhere" / "enwik8_head.bin"
  config = _config(tmp_path / "run", {"data.dataset": "file", "data.path": str(missing)})
  with pytest.raises(FileNotFoundError, match=r"config\.data\.path") as e:
    loop.train(config)
  assert isinstance(e.value, ValueError) and "no such file" in str(e.value)
  config = _config(tmp_path / "run", {"data.dataset": "file", "data.path": None})
  with pytest.raises(ValueError, match=r"config\.data\.path"):
    loop.train(config)


def _snapshot(directory):
  return {str(p.relative_to(directory)): (p.is_dir(), p.stat().st_size if p.is_file() else 0,
                                          p.stat().st_mtime_ns)
          for p in pathlib.Path(directory).rglob("*")}


def test_resume_with_another_model_is_refused(run_a, tmp_path, no_compilation):
  config_a, _ = run_a
  workdir = tmp_path / "run"
  shutil.copytree(config_a.workdir, workdir)
  before = _snapshot(workdir / "checkpoints")
  config = _config(workdir, SHRINKING, {"model.d_model": 48})
  with pytest.raises(ValueError, match="different model") as e:
    loop.train(config)
  assert "d_model: checkpoint 32, config 48" in str(e.value)
  with pytest.raises(ValueError, match="different model"):
    loop.evaluate(config)
  assert _snapshot(workdir / "checkpoints") == before


def test_evaluate_empty_workdir(tmp_path, no_compilation):
  with pytest.raises(FileNotFoundError, match="no checkpoint"):
    loop.evaluate(_config(tmp_path / "empty"))


# ------------------------------------------------------------------------------------------- CLI


@pytest.mark.slow
def test_main_trains_and_evaluates(enwik8_head, tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=8")
  base = [sys.executable, "main.py", "--config=configs/tiny.py:smoke",
          f"--config.workdir={tmp_path}", f"--config.data.path={enwik8_head}"]

  def main(*flags, command=base):
    proc = subprocess.run(command + list(flags), cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=400, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout

  out = main("--config.train.steps=4", "--config.train.log_every=2",
             "--config.model.d_model=32")
  assert "full test: bpc" in out and "full valid: bpc" in out
  assert sorted(_lines(tmp_path, "train")) == [2, 4]
  # The run directory alone: its config.json (d_model=32, the data path) stands in for --config.
  out = main("--config.mode=eval", "--config.data.eval_batch=16",
             command=[sys.executable, "main.py", f"--config.workdir={tmp_path}"])
  assert "eval step 4 valid: bpc" in out and "eval step 4 test: bpc" in out
  assert sorted(_lines(tmp_path, "eval_test")) == [4]
  # With --config and the same workdir the saved config wins too: no d_model override needed.
  out = main("--config.mode=eval")
  assert "eval step 4 test: bpc" in out and "different model" not in out


def test_full_evaluation_with_kv_caches_equals_hidden_state_caches(run_a):
  """The full evaluation caches projected keys/values (no re-projection of cached states per
  block); it scores exactly what hidden-state caches score."""
  config, _ = run_a
  run = loop.Run(config)
  try:
    state, meta = run.restore()
    plan = plan_lib.plan_from_json(meta["planner"]["plan"])
    res = {}
    for kv in (True, False):
      res[kv], caches = evaluation.evaluate_stream(run, state["params"], plan,
                                                   run.splits.valid, config.data.eval_batch,
                                                   kv_cache=kv)
      assert caches[0].shape[-1] == (2 if kv else 1) * run.model_cfg.d_model
    kinds = [c["kind"] for c in run.compiler.compilations]
  finally:
    run.ckpt.close()
  assert res[True]["tokens"] == res[False]["tokens"] > 0
  np.testing.assert_allclose(res[True]["bpc"], res[False]["bpc"], rtol=1e-6)
  assert "eval_kv" in kinds and "eval" in kinds


# ------------------------------------------------------- adaptive spans: no per-step host reads


GROWING = {"optim.name": "adagrad", "optim.lr": 0.05, "optim.grad_clip": 0.0,
           "model.span.init": 0.1, "model.span.loss": 0.0, "model.plan.growth": 1.0,
           "model.dropout": 0.0, "train.steps": 12, "train.eval_every": 6,
           "train.checkpoint_every": 6, "train.full_eval_at_end": False}


@pytest.mark.slow
def test_adaptive_steps_read_from_the_device_only_on_log_eval_checkpoint_steps(tmp_path, capsys):
  """Span ratios and non-finite flags are read late: between logging/eval/checkpoint steps the
  loop copies nothing device-to-host (explicit copies refused too). A step dispatched on a plan
  the spans outgrew in the meantime is a no-op and is replayed: the run equals one that reads
  every step (log_every=1, the host updating the plan before each step) bit for bit."""
  lagged = _config(tmp_path / "lagged", GROWING, {"train.log_every": 6})
  with jax.transfer_guard_device_to_host("disallow_explicit"):
    result = loop.train(lagged)
  out = capsys.readouterr().out
  assert "spans outgrew the plan before the host read them" in out and "replaying" in out
  # the line says what a newcomer asks: was anything lost, why did the bar step back and slow down
  assert "they are recomputed on the wider plan with nothing lost or logged twice; the progress " \
      "bar steps back, and steps are slower now" in out
  every = loop.train(_config(tmp_path / "every", GROWING, {"train.log_every": 1}))
  assert "outgrew" not in capsys.readouterr().out  # read after each step: never refused
  assert result["step"] == every["step"] == 12 and result["plan"] == every["plan"]
  assert result["plan_changes"] >= 1
  _assert_bit_identical(result["state"], every["state"])
  cfg = ModelConfig.from_config(lagged.model, vocab_size=lagged.data.synthetic_vocab)
  plan_lib.check_plan(cfg, result["state"]["params"], result["plan"])
  rows = [(r["step"], r["split"]) for r in read_metrics(str(tmp_path / "lagged"))]
  assert len(rows) == len(set(rows)) and [s for s, sp in rows if sp == "train"] == [6, 12]


def test_a_step_that_does_not_fit_is_compiled_again_with_the_fallback(tmp_path, monkeypatch,
                                                                       capsys):
  """StepCompiler's fit rule: a step whose compiled peak exceeds the device's memory is compiled
  again with attention_rules.fit_fallback's implementation (on a GPU: `auto`'s XLA path -> the fused
  kernel), which the log names, and trains; with memory to spare nothing is recompiled."""
  from span_lm.model import attention_rules  # pylint: disable=g-import-not-at-top
  from span_lm.train import sharding as sharding_lib  # pylint: disable=g-import-not-at-top
  asked = []

  def fallback(cfg):  # on this CPU: cpu -> reference, the same maths
    asked.append(cfg.attention.impl)
    return replaced(cfg, **{"attention.impl": "reference"}) if cfg.attention.impl == "cpu" else None

  monkeypatch.setattr(attention_rules, "fit_fallback", fallback)
  for capacity, recompiled in ((1, True), (1 << 40, False)):
    monkeypatch.setattr(run_lib, "_device_memory", lambda c=capacity: c)
    work = tmp_path / str(capacity)
    config = _config(work, {"model.attention.impl": "cpu"})
    run = loop.Run(config)
    try:
      plan = plan_lib.initial_plan(run.model_cfg)
      _, abstract, shardings = run.abstract_state(plan)
      state = sharding_lib.with_shardings(abstract, shardings)
      d = config.data
      batch = {k: jax.ShapeDtypeStruct((d.eval_batch, d.block), np.int32,
                                       sharding=run.batch_sharding) for k in ("x", "y")}
      batch["reset"] = jax.ShapeDtypeStruct((), np.bool_, sharding=run.replicated)
      run.compiler.eval(plan, state["params"], state["eval_caches"], batch)  # the cheaper step
      if recompiled:  # a plan change: the next step starts from the fallback, no wasted compile
        full = plan_lib.full_plan(run.model_cfg)
        _, abstract, shardings = run.abstract_state(full)
        wide = sharding_lib.with_shardings(abstract, shardings)
        run.compiler.eval(full, wide["params"], wide["eval_caches"], batch)
    finally:
      if run.ckpt:
        run.ckpt.close()
    said = capsys.readouterr().out
    assert run.compiler.compilations[-1]["attention"] == ("reference" if recompiled else "cpu")
    assert ("compiling it with attention.impl='reference' instead" in said) == recompiled, said
  assert asked == ["cpu", "reference", "cpu"]  # the full plan's step went to the fallback first

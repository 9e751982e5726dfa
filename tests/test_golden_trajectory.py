"""span_lm trains as the reference does: golden trajectories from facebookresearch/adaptive-span.

tests/fixtures/golden/ holds numbers the reference's own code produced (bench/golden_trajectory.py;
docs/fidelity.md): its initial parameters (a real torch.save file), a token stream, and per step
the NLL, span loss, learning rate and every span parameter, in float32 and in float64. Here the
initial parameters go through span_lm's importer, and span_lm's real train step, reference Adagrad
with warmup and span planner train on the same blocks. Each step must stay within TOLERANCE_FACTOR
times the reference's own rounding spread: the largest difference from its float32 run of its
float64 run and of float32 reruns from weights one ulp off (the running maximum up to that step,
with a floor of a few float32 ulps). The tolerance is measured, not guessed: Adagrad amplifies
rounding (its first steps are lr * sign(g)), so after 15-40 steps the reference's own reruns
differ by 1e-4..3e-2 in the loss, and from there on only that envelope is checked. Spans start
at z' = 0, on the ramp's ends, so the soft mask's derivative there decides the first step
(torch.clamp passes the gradient at both ends; a 1/2 there moves spans by ~0.9 tokens at step 1,
against a spread of ~1e-7).
"""
import collections
import functools
import json
import pathlib

import jax
import ml_collections
import numpy as np
import pytest

from span_lm.model import caches as caches_lib
from span_lm.model import plan as plan_lib
from span_lm.model.config import ModelConfig, Span
from span_lm.tools import reference_checkpoint as rc
from span_lm.train import optimizer as optimizer_lib
from span_lm.train import planner as planner_lib
from span_lm.train import steps as steps_lib

GOLDEN = pathlib.Path(__file__).resolve().parent / "fixtures" / "golden"
TOLERANCE_FACTOR = 10.0
# Floors on the per-step tolerance (absolute): float32 rounding of a ~4.7 nat loss is ~5e-7;
# of z' in [0, 1] ~6e-8 (1.5e-5 tokens at S=256).
FLOOR = {"loss": 2e-6, "span_loss": 1e-9, "span_ratio": 1e-7}


@functools.cache
def fixture():
  f = np.load(GOLDEN / "trajectories.npz")
  return {k: f[k] for k in f.files}


def model_cfg(case: str, vocab: int) -> ModelConfig:
  s = json.loads(str(fixture()["shapes"]))
  span = Span(size=s["span"], mode="fixed" if case == "fixed" else "adaptive", ramp=s["ramp"],
              init=0.0, loss=s["span_loss"], cache=True)
  return ModelConfig(vocab_size=vocab, d_model=s["d_model"], n_layers=s["layers"],
                     n_heads=s["heads"], d_ff=s["d_ff"], span=span,
                     pers_mem=s["pers_mem"] if case == "pers" else 0, dropout=0.0,
                     emb_dropout=0.0)


def imported_params(case: str, cfg: ModelConfig):
  """The reference's initial tensors, through span_lm's importer (torch-free reader)."""
  sd, _, _ = rc.read(GOLDEN / "reference_init.pt")
  pool = dict(sd)
  pool.update({k[len("pers_init/module."):]: v for k, v in fixture().items()
               if k.startswith("pers_init/")})
  # The case's own state_dict, in the reference's order (as its model would save it).
  sd = collections.OrderedDict((e.key, pool[e.key]) for e in rc.reference_entries(cfg)
                               if e.key in pool)
  rc.check_fits(sd, cfg)
  return rc.to_span_lm(sd, cfg)


def span_lm_trajectory(case: str) -> dict[str, np.ndarray]:
  fx = fixture()
  s = json.loads(str(fx["shapes"]))
  tokens = fx["tokens"].astype(np.int32)
  cfg = model_cfg(case, int(tokens.max()) + 1)
  tx, schedule = optimizer_lib.make_optimizer(ml_collections.ConfigDict(
      {"name": "adagrad", "lr": s["lr"], "grad_clip": s["grad_clip"], "warmup": s["warmup"]}))
  planner = planner_lib.SpanPlanner(cfg)
  params = jax.tree.map(jax.numpy.asarray, imported_params(case, cfg))
  plan_lib.check_plan(cfg, params, planner.plan)
  batch_size, block = tokens.shape[0], s["block"]
  state = {"step": jax.numpy.zeros((), jax.numpy.int32), "params": params,
           "opt_state": tx.init(params), "rng": jax.random.key_data(jax.random.key(0)),
           "caches": caches_lib.init_caches(cfg, planner.plan, batch_size),
           "eval_caches": caches_lib.init_caches(cfg, planner.plan, batch_size)}
  compiled = {}
  out = collections.defaultdict(list)
  for k in range(int(fx["steps"])):
    x = tokens[:, k * block:(k + 1) * block]
    y = tokens[:, k * block + 1:(k + 1) * block + 1]
    if planner.plan not in compiled:
      compiled[planner.plan] = jax.jit(functools.partial(
          steps_lib.train_step, cfg=cfg, plan=planner.plan, tx=tx))
    state, m = compiled[planner.plan](state, steps_lib.host_batch(x, y, False))
    m = jax.device_get(m)
    out["loss"].append(float(m["loss"]))
    out["span_loss"].append(float(m["span_loss"]))
    out["lr"].append(float(schedule(k)))
    if "span_ratio" in m:
      ratios = np.asarray(m["span_ratio"], np.float64).reshape(cfg.n_layers, cfg.n_heads)
      out["span_ratio"].append(ratios)
      if planner.update(list(ratios), k + 1):  # as span_lm's loop: re-plan, refit the caches
        state = dict(state, caches=caches_lib.resize_caches(state["caches"], cfg, planner.plan))
  out = {k: np.asarray(v) for k, v in out.items()}
  out["plans"] = len(compiled)
  return out


def check_within_spread(case: str, got: dict) -> list[str]:
  """Per step and quantity: |span_lm - reference f32| <= factor * running max of the spread."""
  fx = fixture()
  failures = []
  for name in ("loss", "span_loss", "span_ratio"):
    if f"{case}/{name}" not in fx or name not in got:
      continue
    ref = fx[f"{case}/{name}"]
    ref = ref.reshape(len(ref), -1)
    spread = fx[f"{case}/{name}_spread"].max(axis=0)  # over the reruns (float64, nudged float32)
    tol = TOLERANCE_FACTOR * np.maximum(np.maximum.accumulate(spread), FLOOR[name])
    diff = np.abs(got[name].reshape(ref.shape) - ref).max(axis=1)
    bad = np.nonzero(diff > tol)[0]
    if bad.size:
      k = bad[0]
      failures.append(f"{case} {name}: step {k + 1} differs from the reference by {diff[k]:.3g} "
                      f"(tolerance {tol[k]:.3g} = {TOLERANCE_FACTOR} x its own rounding spread); "
                      f"{bad.size} steps out of tolerance")
  return failures


@pytest.mark.slow
@pytest.mark.parametrize("case", ["fixed", "adaptive", "pers"])
def test_trajectory_matches_the_reference(case):
  fx = fixture()
  got = span_lm_trajectory(case)
  np.testing.assert_allclose(got["lr"], fx[f"{case}/lr"], rtol=2e-7, atol=0)  # float32 schedule
  failures = check_within_spread(case, got)
  assert not failures, "\n".join(failures)
  if case != "fixed":  # the spans moved (the test is not vacuous) and stayed within [0, 1]
    assert np.ptp(fx[f"{case}/span_ratio"], axis=0).max() * 256 > 2.0
    assert got["span_ratio"].min() >= 0.0 and got["span_ratio"].max() <= 1.0


def test_tolerance_is_tight_at_the_start():
  """The first steps are compared at float32 precision: a step's worth of error cannot hide."""
  fx = fixture()
  for case in ("adaptive", "pers"):
    d = np.abs(fx[f"{case}/span_ratio"][0] - fx[f"{case}/span_ratio_f64"][0]).max()
    assert d * 256 < 1e-4, (case, d)  # tokens; one warmup step of lr 0.0035 moves 0.9 tokens
    d = np.abs(fx[f"{case}/loss"][:5] - fx[f"{case}/loss_f64"][:5]).max()
    assert d < 1e-5, (case, d)

"""The tiny synthetic run that the training, distributed and fault tests build on, and the worker
process they start (`python tests/synthetic_run.py JSON`: train the config given as overrides).
Nothing here imports JAX at module level: worker processes import it before JAX.

Synthetic splits of 640/480/480 tokens: 8 training streams of 80 tokens, so with blocks of 16 the
walk restarts at a random offset (and zeroes the caches) after every 4th step.
"""
import json
import os
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
TESTS = pathlib.Path(__file__).resolve().parent

SMALL = {
    "model.d_model": 32,
    "model.n_layers": 2,
    "model.n_heads": 2,
    "model.d_ff": 64,
    "model.span.size": 64,
    "model.span.ramp": 8,
    "model.plan.granularity": 16,
    "model.plan.margin": 0,  # cache length = the largest window: a shrink resizes the caches
    "model.dropout": 0.1,
    "data.dataset": "synthetic",
    "data.path": None,
    "data.split_bytes": (),
    "data.split_fractions": (0.4, 0.3, 0.3),
    "data.synthetic_length": 1600,
    "data.synthetic_distance": 8,
    "data.synthetic_vocab": 16,
    "data.block": 16,
    "data.batch": 8,
    "data.eval_batch": 8,
    "optim.warmup": 0,
    "train.log_every": 1,
    "train.tensorboard": False,
}

# SGD keeps the updates linear in the gradient, so all-reduce rounding stays at rounding size.
TINY = dict(SMALL, **{
    "optim.name": "sgd",
    "optim.lr": 0.1,
    "train.steps": 6,
    "train.eval_every": 3,
    "train.checkpoint_every": 3,
    "train.compilation_cache": "",
})


def config_for(workdir, *overrides: dict):
  from span_lm import config as config_lib  # pylint: disable=g-import-not-at-top
  ov = dict(TINY, workdir=str(workdir))
  for o in overrides:
    ov.update(o)
  return config_lib.load_config("configs/tiny.py:smoke", ov)


def worker_command(overrides: dict) -> list:
  return [sys.executable, str(pathlib.Path(__file__).resolve()), json.dumps(overrides)]


def worker_env(devices: int) -> dict:
  env = dict(os.environ)
  env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(TESTS), env.get("PYTHONPATH", "")])
  return env


def train_losses(workdir) -> dict:
  from span_lm.train.metrics import read_metrics  # pylint: disable=g-import-not-at-top
  return {r["step"]: r["loss"] for r in read_metrics(str(workdir)) if r["split"] == "train"}


def _worker():
  """Trains the config given as JSON overrides; prints a RESULT line."""
  sys.path.insert(0, str(REPO))
  from jax import monitoring  # pylint: disable=g-import-not-at-top
  cache_hits = [0]

  def count(event, **kw):
    del kw
    if event == "/jax/compilation_cache/cache_hits":
      cache_hits[0] += 1

  monitoring.register_event_listener(count)
  from span_lm import config as config_lib  # pylint: disable=g-import-not-at-top
  from span_lm.train import loop  # pylint: disable=g-import-not-at-top
  overrides = {k: tuple(v) if isinstance(v, list) else v for k, v in json.loads(sys.argv[1]).items()}
  cfg = config_lib.load_config(overrides.pop("config", "configs/tiny.py:smoke"), overrides)
  out = loop.train(cfg)
  import jax  # pylint: disable=g-import-not-at-top
  print("RESULT " + json.dumps({"step": out["step"], "preempted": out["preempted"],
                                "skipped": out["skipped"], "devices": jax.device_count(),
                                "cache_hits": cache_hits[0]}),
        flush=True)


if __name__ == "__main__":
  _worker()

"""A run you can watch, profile and trust (issue 45): the run directory's lock, the profiler flag,
throughput and MFU, Weights & Biases, and the one-line errors for out-of-memory, missing data and
every other mistake a user can make.

The fast tier checks the pieces in this process; the slow tier runs real training processes
(main.py) against each other, traces real steps, and logs to a real (offline) W&B run.
"""
import ast
import datetime
import glob
import importlib
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from span_lm import cli
from span_lm import config as config_lib
from span_lm.model import costs as costs_lib
from span_lm.model import plan as plan_lib
from span_lm.model.config import ModelConfig
from span_lm.tools import hlo as hlo_lib
from span_lm.train import loop
from span_lm.train import oom as oom_lib
from span_lm.train import run_lock
from span_lm.train import steps as steps_lib
from span_lm.train import telemetry
from span_lm.train.metrics import read_metrics

import synthetic_run as sr

REPO = sr.REPO


def _error_lines(stderr: str) -> list:
  """stderr without the progress bar's redraws."""
  lines = [l.replace("\x1b[A", "").strip() for l in stderr.replace("\r", "\n").splitlines()]
  return [l for l in lines if l and not l.startswith(("train:", "valid:", "eval ", "full "))]


# ------------------------------------------------------------------------------ the run's lock


def test_a_second_lock_on_a_directory_is_refused_naming_the_holder(tmp_path):
  lock = run_lock.acquire(str(tmp_path))
  try:
    holder = json.loads((tmp_path / "run.lock").read_text())
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
    before = (tmp_path / "run.lock").read_bytes()
    with pytest.raises(run_lock.RunLockedError) as e:
      run_lock.acquire(str(tmp_path))  # its own open file: flock refuses it as another process
    msg = str(e.value)
    assert "\n" not in msg
    assert f"run directory {tmp_path} is in use: host {socket.gethostname()}, pid {os.getpid()}, " \
        f"since {holder['since']} holds its lock" in msg
    assert "kill -TERM" in msg and "another --config.workdir" in msg
    assert (tmp_path / "run.lock").read_bytes() == before  # the refused one wrote nothing
  finally:
    lock.release()
  assert (tmp_path / "run.lock").read_text() == ""  # released: empty, not deleted
  run_lock.acquire(str(tmp_path)).release()


def test_a_start_that_fails_leaves_no_directory_it_made(tmp_path):
  run_lock.acquire(str(tmp_path / "new")).release(undo=True)
  assert not (tmp_path / "new").exists()
  (tmp_path / "old").mkdir()
  run_lock.acquire(str(tmp_path / "old")).release(undo=True)  # not made by the lock: kept
  assert (tmp_path / "old" / "run.lock").read_text() == ""


def _dead_pid() -> int:
  proc = subprocess.Popen([sys.executable, "-c", "pass"])
  proc.wait()
  return proc.pid


def test_a_dead_holders_lock_is_taken_over_saying_so(tmp_path):
  dead = {"host": socket.gethostname(), "pid": _dead_pid(), "since": "2020-01-01T00:00:00+00:00",
          "token": "x"}
  (tmp_path / "run.lock").write_text(json.dumps(dead))
  lock = run_lock.acquire(str(tmp_path))
  try:
    assert lock.note.startswith(f"took over the lock of host {dead['host']}, pid {dead['pid']}, "
                                "since 2020-01-01T00:00:00+00:00: that process is gone")
    assert json.loads((tmp_path / "run.lock").read_text())["pid"] == os.getpid()
  finally:
    lock.release()


def test_another_hosts_lock_counts_while_its_heartbeat_is_fresh(tmp_path):
  other = {"host": "node-17", "pid": 4242, "since": "2026-01-01T00:00:00+00:00", "token": "y"}
  path = tmp_path / "run.lock"
  path.write_text(json.dumps(other))
  with pytest.raises(run_lock.RunLockedError, match=r"host node-17, pid 4242, since .* holds it "
                     r"\(its heartbeat is \d+s old"):
    run_lock.acquire(str(tmp_path))
  old = time.time() - run_lock.STALE_S - 5
  os.utime(path, (old, old))
  lock = run_lock.acquire(str(tmp_path))
  try:
    assert "took over the lock of host node-17, pid 4242" in lock.note and "heartbeat stopped" \
        in lock.note
  finally:
    lock.release()


def test_the_heartbeat_refreshes_the_lock_and_a_takeover_stops_the_run(tmp_path, monkeypatch):
  lock = run_lock.acquire(str(tmp_path))
  try:
    old = time.time() - 1000
    os.utime(lock.path, (old, old))
    lock.heartbeat()
    assert time.time() - os.stat(lock.path).st_mtime < 60
    lock.check()  # still ours
    # Another host decided this process was dead and wrote its own holder into the file.
    pathlib.Path(lock.path).write_text(json.dumps({"host": "node-3", "pid": 7, "since": "t",
                                                   "token": "theirs"}))
    lock.heartbeat()
    with pytest.raises(run_lock.RunLockedError, match="taken over by host node-3, pid 7"):
      lock.check()
  finally:
    lock.release()
  assert "node-3" in pathlib.Path(lock.path).read_text()  # release leaves their content alone


# ------------------------------------------------------------------------- throughput and MFU


def test_peak_flops_follow_the_chip_table_and_the_dtype():
  peak, why = telemetry.peak_flops("NVIDIA H100 80GB HBM3", "bfloat16")
  assert peak == 989.4e12 and "h100 bfloat16" in why
  assert telemetry.peak_flops("NVIDIA H100 80GB HBM3", "float32")[0] == 494.7e12  # TF32
  assert telemetry.peak_flops("Tesla V100-SXM2-16GB", "float16")[0] == 125e12
  assert telemetry.peak_flops("TPU v5 lite", "bfloat16")[0] == 197e12
  peak, why = telemetry.peak_flops("cpu", "float32")
  assert peak is None and "no peak FLOP/s is known for device kind 'cpu'" in why


def test_mfu_counts_the_plans_model_flops_without_recomputation():
  cfg = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=2, d_ff=128,
                    span={"size": 128, "ramp": 8, "mode": "adaptive"}, remat="layer")
  plan = plan_lib.initial_plan(cfg)
  tp = telemetry.Throughput(cfg, 8, 64, num_devices=4, device_kind="cpu", peak_tflops=2.0)
  model = costs_lib.train_step_flops(cfg.replace(remat="none"), plan, 8, 64)
  assert tp.step_flops(plan) == model < costs_lib.train_step_flops(cfg, plan, 8, 64)
  assert tp.step_flops(plan_lib.full_plan(cfg)) > model  # the learned plan's, not the full span's
  out = tp.interval(10, 10 * model, 0.5)
  assert out["tokens_per_s"] == 8 * 64 * 10 / 0.5
  assert out["mfu"] == pytest.approx(10 * model / 0.5 / (4 * 2e12), rel=1e-12)
  assert telemetry.Throughput(cfg, 8, 64, num_devices=1, device_kind="cpu").interval(
      1, model, 1.0)["mfu"] is None


def test_the_generation_count_is_the_ring_decoders_matmuls():
  """costs.generation_macs equals the dot products XLA compiles for one token of `sample`'s ring
  decoder (SpanTransformer with kv caches, ring_pos), for a dynamic-span model and an adaptive one
  with persistent memory and uneven per-head windows."""
  from span_lm.model import caches as caches_lib  # pylint: disable=g-import-not-at-top
  from span_lm.model.transformer import SpanTransformer  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  base = dict(vocab_size=50, d_model=32, n_layers=2, n_heads=4, d_ff=64)
  for extra in ({"span": {"size": 64, "ramp": 8, "mode": "dynamic"}},
                {"span": {"size": 64, "ramp": 8, "mode": "adaptive"}, "pers_mem": 16}):
    cfg = ModelConfig(**base, **extra)
    if cfg.span.mode == "adaptive":
      plan = plan_lib.plan_from_ratios(cfg, [np.array([0.1, 0.9, 0.3, 0.2])] * 2)
    else:
      plan = plan_lib.full_plan(cfg)
    model = SpanTransformer(cfg, plan, kv_cache=True)
    caches = caches_lib.init_caches(cfg, plan, 1, kv=True)
    params = model.init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32), caches,
                        train=False)["params"]
    rings = caches_lib.to_ring(caches, 1, cfg.n_heads)
    step = jax.jit(lambda p, t, c: model.apply({"params": p}, t, c, train=False, ring_pos=5))
    hlo = step.lower(params, jnp.zeros((1, 1), jnp.int32), rings).compile().as_text()
    assert hlo_lib.hlo_dot_flops(hlo) == 2 * sum(costs_lib.generation_macs(cfg, plan).values()), \
        extra


# ----------------------------------------------------------------------------- out of memory


_GPU_RUNTIME = ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 34359738368 bytes.\n"
                "BufferAssignment OOM Debugging.\nBufferAssignment stats:\n"
                "             parameter allocation:    1.00GiB")
_TPU_COMPILE = ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory "
                "space hbm. Used 20.05G of 15.48G hbm. Exceeded hbm capacity by 4.57G.\n\n"
                "Total hbm usage >= 20.57G:\n    reserved        530.00M \n")
_TPU_RUNTIME = ("RESOURCE_EXHAUSTED: Error allocating device buffer: Attempting to allocate "
                "8.00G. That was not possible. There are 6.43G free.; (0x0x0_HBM0)")


@pytest.mark.parametrize("text, asked, capacity, free", [
    (_GPU_RUNTIME, 34359738368, None, None),
    ("RESOURCE_EXHAUSTED: Failed to allocate request for 32.00GiB (34359738368B) on device "
     "ordinal 0", 34359738368, None, None),
    (_TPU_COMPILE, int(20.05 * 2**30), int(15.48 * 2**30), None),
    (_TPU_RUNTIME, 8 * 2**30, None, int(6.43 * 2**30)),
])
def test_out_of_memory_messages_are_parsed(text, asked, capacity, free):
  assert oom_lib.parse(text) == {"asked": asked, "capacity": capacity, "free": free}
  assert oom_lib.find(jax.errors.JaxRuntimeError(text)) is not None


def test_a_full_disk_is_not_an_out_of_memory():
  assert oom_lib.find(ValueError("RESOURCE_EXHAUSTED: No space left on device")) is None


def test_out_of_memory_line_names_the_step_sizes_and_the_settings_that_fit(monkeypatch):
  config = config_lib.load_config("configs/enwik8.py")
  monkeypatch.setattr(sys, "argv", ["main.py", "--config=configs/enwik8.py",
                                    "--config.workdir=RUN"])
  msg = oom_lib.message(jax.errors.JaxRuntimeError(_GPU_RUNTIME), "at step 3", config,
                        device=(80 * 2**30, "NVIDIA H100 80GB HBM3", 8))
  assert "\n" not in msg
  split = config.optim.batch_split
  assert msg.startswith("out of device memory at step 3: asked for 32.00 GiB, on a device (NVIDIA "
                        "H100 80GB HBM3) of 80.00 GiB. To fit, try --config.optim.batch_split=")
  new = int(msg.split("--config.optim.batch_split=")[1].split()[0])
  assert new > split and config.data.batch % new == 0 and (config.data.batch // new) % 8 == 0
  assert "--config.model.remat=layer" in msg
  assert msg.endswith("python main.py --config=configs/enwik8.py --config.workdir=RUN "
                      "--config.mode=compile --config.compile.targets=h100:8 "
                      f"--config.optim.batch_split={new} --config.model.remat=layer")


def _oom_step(real, where):
  """A StepCompiler.train that compiles for real and whose step 3 (or compile) runs out of
  memory as XLA reports it."""
  def train(self, plan, state, batch):
    if where == "compile":
      raise jax.errors.JaxRuntimeError(_TPU_COMPILE)
    fn = real(self, plan, state, batch)

    def step(state, batch):
      if int(state["step"]) == 2:  # the third step
        raise jax.errors.JaxRuntimeError(_GPU_RUNTIME)
      return fn(state, batch)
    return step
  return train


@pytest.mark.parametrize("where, expect", [
    ("step", "error: out of device memory at step 3: asked for 32.00 GiB, on a device (cpu) of "
     "unknown size. To fit, try "),
    ("compile", "error: out of device memory compiling the train step for step 1: asked for "
     "20.05 GiB, on a device (cpu) of 15.48 GiB. To fit, try "),
])
def test_out_of_memory_through_the_cli_is_one_line(tmp_path, capsys, monkeypatch, where, expect):
  monkeypatch.setattr(steps_lib.StepCompiler, "train",
                      _oom_step(steps_lib.StepCompiler.train, where))
  config = sr.config_for(tmp_path, {"train.steps": 6, "train.checkpoint_every": 100,
                                    "train.eval_every": 100, "train.full_eval_at_end": False})
  capsys.readouterr()
  assert cli.main(config) == cli.EXIT_ERROR
  err = _error_lines(capsys.readouterr().err)
  assert len(err) == 1 and err[0].startswith(expect), err
  # 8 streams over 8 devices: no batch split leaves every device a whole row per piece
  assert "To fit, try --config.model.remat=layer (each layer recomputed" in err[0]
  assert "batch_split" not in err[0]
  assert "--config.mode=compile" in err[0] and "Traceback" not in err[0]
  assert open(tmp_path / "run.lock").read() == ""  # the lock was given back
  if where == "compile":  # (quick: nothing runs) SPAN_LM_DEBUG=1 keeps the traceback
    monkeypatch.setenv("SPAN_LM_DEBUG", "1")
    with pytest.raises(oom_lib.DeviceOutOfMemoryError) as e:
      cli.main(config)
    assert isinstance(e.value.__cause__, jax.errors.JaxRuntimeError)


# --------------------------------------------------------------- one line for every user error


def _exception_classes() -> dict:
  """Every exception class the package defines, by module (read from the source)."""
  out = {}
  for path in sorted((REPO / "span_lm").rglob("*.py")):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ClassDef) and any(
          getattr(b, "id", getattr(b, "attr", "")).endswith(("Error", "Exception"))
          for b in node.bases):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts)
        out[f"{module}.{node.name}"] = (module, node.name)
  return out


def _instance(cls):
  from span_lm.train import checkpoint as ckpt_lib  # pylint: disable=g-import-not-at-top
  if cls is ckpt_lib.CheckpointReadError:
    return cls(4, "/runs/x/checkpoints/4", "its meta has no valid 'step' entry")
  if cls is ckpt_lib.CheckpointDamagedError:
    return cls(4, "/runs/x/checkpoints/4", ["params/layers_3/attn/proj_query/kernel"])
  from span_lm import safe_pickle  # pylint: disable=g-import-not-at-top
  if cls is safe_pickle.ForbiddenGlobalError:
    return cls("/data/evil.pt", "os.system")
  return cls(f"a {cls.__name__} the user can fix:\n  first detail\n  second detail")


def test_every_user_error_the_package_raises_is_one_line(tmp_path, capsys, monkeypatch):
  classes = _exception_classes()
  # The sweep finds them all (a new class must be added to cli.USER_ERRORS' reach, or here).
  assert {n.rsplit(".", 1)[1] for n in classes} >= {
      "ConfigError", "ConfigPathError", "NonFiniteLossError", "CheckpointReadError",
      "DatasetUnavailableError", "DataIntegrityError", "DownloadError", "FormatError",
      "RunLockedError", "DeviceOutOfMemoryError", "WandbError"}
  for module, name in classes.values():
    cls = getattr(importlib.import_module(module), name)
    exc = _instance(cls)

    def failing(config, exc=exc):
      try:
        raise RuntimeError("the cause, chained") from None
      except RuntimeError as cause:
        raise exc from cause
    monkeypatch.setattr(cli, "run", failing)
    capsys.readouterr()
    assert cli.main({"mode": "train", "workdir": str(tmp_path)}) == cli.EXIT_ERROR, name
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "Traceback" not in err[0], (name, err)
    assert "the cause" not in err[0]
    assert ("can fix: first detail; second detail" in err[0] or "cannot be read" in err[0]
            or "refused to load" in err[0] or "is damaged: params/" in err[0]), err


def test_an_unknown_mode_lists_the_modes(capsys):
  assert cli.main({"mode": "spanz", "workdir": None}) == cli.EXIT_ERROR
  err = capsys.readouterr().err.strip()
  assert err == ("error: config.mode='spanz': unknown mode; choose one of train, eval, import, "
                 "export, spans, flops, sample, compile, verify (python main.py --help describes "
                 "each)")
  assert set(config_lib.MODES) == {"train", "eval", "import", "export", "spans", "flops",
                                   "sample", "compile", "verify"}


def test_help_lists_every_mode():
  out = subprocess.run([sys.executable, "main.py", "--help"], cwd=REPO, env=sr.worker_env(1),
                       capture_output=True, text=True, timeout=120, check=False)
  assert out.returncode in (0, 1), out.stderr
  text = out.stdout + out.stderr
  for mode in config_lib.MODES:
    assert f"\n  {mode} " in text, mode


@pytest.mark.parametrize("overrides, message", [
    ({"train.profile_start": -1, "train.profile_steps": 2},
     "config.train.profile_start=-1: must be an integer >= 0"),
    ({"train.profile_start": 3, "train.profile_steps": -2},
     "config.train.profile_steps=-2: must be an integer >= 0"),
    ({"train.profile_start": 3},
     "config.train.profile_start=3: profiling needs both: set --config.train.profile_steps too"),
    ({"train.peak_tflops": -1.0}, "config.train.peak_tflops=-1.0: must be a finite number >= 0"),
])
def test_observability_fields_are_checked_in_one_line(tmp_path, overrides, message):
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.validate(sr.config_for(tmp_path, overrides))
  assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_wandb_without_the_package_is_refused_before_anything_starts(tmp_path, capsys,
                                                                     monkeypatch):
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: None if name == "wandb" else real(name, *a))
  config = sr.config_for(tmp_path / "run", {"train.wandb": "my-project"})
  assert cli.main(config) == cli.EXIT_ERROR
  err = capsys.readouterr().err.strip().splitlines()
  assert err == ["error: config.train.wandb='my-project': the wandb package is not installed: pip "
                 "install 'span_lm[wandb]' (or pip install 'wandb>=0.16,<1'), or leave out "
                 "--config.train.wandb"]
  assert not (tmp_path / "run").exists()


# ============================================================================= real processes


def _config_file(tmp_path, workdir, overrides) -> pathlib.Path:
  ov = dict(sr.TINY, workdir=str(workdir), **overrides)
  path = tmp_path / f"config_{len(list(tmp_path.glob('config_*.py')))}.py"
  path.write_text("from span_lm import config as config_lib\n\n"
                  f"def get_config():\n  return config_lib.load_config('configs/tiny.py:smoke', "
                  f"{ov!r})\n")
  return path


def _main(config_file, *flags, env=None):
  return subprocess.Popen([sys.executable, "main.py", f"--config={config_file}", *flags],
                          cwd=REPO, env=dict(sr.worker_env(1), PYTHONUNBUFFERED="1", **(env or {})),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _snapshot(directory: pathlib.Path) -> dict:
  return {str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns,
                                          p.read_bytes() if p.is_file() else None)
          for p in sorted(directory.rglob("*"))}


def _wait(predicate, proc, timeout=240):
  deadline = time.time() + timeout
  while time.time() < deadline and proc.poll() is None:
    if predicate():
      return
    time.sleep(0.2)
  out, err = proc.communicate(timeout=30) if proc.poll() is not None else ("", "")
  raise AssertionError(f"timed out or exited: {out[-2000:]} {err[-2000:]}")


@pytest.mark.slow
def test_two_trainings_on_one_directory_eval_meanwhile_and_kill9_takeover(tmp_path):
  """A holds the directory; B (another override, as a changed relaunch would be) is refused in
  one line before compiling and changes nothing; eval reads the run meanwhile; after kill -9 of A,
  C takes the lock over, says so, resumes and finishes."""
  workdir = tmp_path / "run"
  long = {"train.steps": 100_000, "train.log_every": 2, "train.checkpoint_every": 4,
          "train.eval_every": 100_000, "train.full_eval_at_end": False,
          "train.eval_batches": 2}
  a = _main(_config_file(tmp_path, workdir, long))
  try:
    _wait(lambda: len([p for p in (workdir / "checkpoints").glob("[0-9]*")
                       if p.name.isdigit()]) >= 1 if (workdir / "checkpoints").exists() else False,
          a)
    holder = json.loads((workdir / "run.lock").read_text())
    assert holder["pid"] == a.pid
    a.send_signal(signal.SIGSTOP)  # hold A still so the directory can be compared
    try:
      time.sleep(1.0)
      before = _snapshot(workdir)
      b = _main(_config_file(tmp_path, workdir, dict(long, **{"optim.lr": 0.05})))
      t0 = time.time()
      out, err = b.communicate(timeout=240)
      assert b.returncode == 1, err[-3000:]
      lines = _error_lines(err)
      assert lines == [
          f"error: run directory {workdir} is in use: host {socket.gethostname()}, pid {a.pid}, "
          f"since {holder['since']} holds its lock ({workdir / 'run.lock'}). Wait for that run to "
          f"finish, stop it (it checkpoints on SIGTERM: kill -TERM {a.pid} on "
          f"{socket.gethostname()}), or train in another --config.workdir; eval, spans, flops and "
          "sample may read it meanwhile"], err[-3000:]
      assert "compiled" not in out + err and "model:" not in out
      assert _snapshot(workdir) == before  # config.json, metrics, checkpoints, lock: untouched
      print(f"refused in {time.time() - t0:.1f}s")
    finally:
      a.send_signal(signal.SIGCONT)

    ev = _main(_config_file(tmp_path, workdir, long), "--config.mode=eval")
    out, err = ev.communicate(timeout=300)
    assert ev.returncode == 0, err[-3000:]
    assert "eval step " in out and " test: bpc " in out
    assert a.poll() is None  # A trains on
  finally:
    a.kill()
    a.wait(timeout=60)
  assert json.loads((workdir / "run.lock").read_text())["pid"] == a.pid  # left by the kill -9
  last = max(int(p.name) for p in (workdir / "checkpoints").glob("[0-9]*") if p.name.isdigit())
  c = _main(_config_file(tmp_path, workdir, dict(long, **{"train.steps": last + 4})))
  out, err = c.communicate(timeout=300)
  assert c.returncode == 0, err[-3000:]
  assert (f"run directory lock: took over the lock of host {socket.gethostname()}, pid {a.pid}, "
          f"since {holder['since']}: that process is gone") in out, out
  assert f"at step {last}" in out
  assert (workdir / "run.lock").read_text() == ""


@pytest.mark.slow
def test_profile_traces_the_steps_asked_and_not_again_on_resume(tmp_path, capsys):
  common = {"train.checkpoint_every": 6, "train.eval_every": 100, "train.full_eval_at_end": False,
            "train.profile_start": 3, "train.profile_steps": 2}
  capsys.readouterr()
  loop.train(sr.config_for(tmp_path, common, {"train.steps": 6}))
  out = capsys.readouterr().out
  traces = glob.glob(str(tmp_path / "profile" / "plugins" / "profile" / "*" / "*.xplane.pb"))
  assert len(traces) == 1 and os.path.getsize(traces[0]) > 0
  assert f"profile: tracing steps 3-4 into {tmp_path / 'profile'}" in out
  assert f"profile: wrote the trace of steps 3-4 to {traces[0]}" in out
  assert os.path.exists(os.path.join(os.path.dirname(traces[0]), "perfetto_trace.json.gz"))
  data = jax.profiler.ProfileData.from_file(traces[0])
  steps = sorted({dict(ev.stats)["step_num"] for plane in data.planes for line in plane.lines
                  for ev in line.events if ev.name == "train"})
  assert steps == [3, 4]
  # The traced steps' device work is in the trace (the last one was waited for).
  names = {ev.name for plane in data.planes for line in plane.lines for ev in line.events}
  assert any("train_step" in n or "jit" in n for n in names), sorted(names)[:50]
  loop.train(sr.config_for(tmp_path, common, {"train.steps": 8}))  # resumes at 6 > 3
  out = capsys.readouterr().out
  assert "profile: steps 3-4 (train.profile_start) came before this run's first step 7 " \
      "(resumed): not traced again" in out
  assert glob.glob(str(tmp_path / "profile" / "plugins" / "profile" / "*" / "*.xplane.pb")) == \
      traces


@pytest.mark.slow
def test_every_interval_logs_tokens_per_s_and_mfu(tmp_path, capsys):
  """Fixed spans (one plan): each train row's MFU is the plan's model FLOPs over the interval's
  time and the peak of the devices; without a peak (CPU) it is null and the log says why once."""
  common = {"train.steps": 6, "train.log_every": 2, "train.checkpoint_every": 100,
            "train.eval_every": 100, "train.full_eval_at_end": False,
            "model.span.mode": "fixed", "train.tensorboard": True}
  capsys.readouterr()
  loop.train(sr.config_for(tmp_path / "peak", common, {"train.peak_tflops": 0.5}))
  cap = capsys.readouterr()
  config = sr.config_for(tmp_path / "peak", common)
  cfg = ModelConfig.from_config(config.model, vocab_size=16)
  step_flops = costs_lib.train_step_flops(cfg, plan_lib.full_plan(cfg), 8, 16)
  rows = [r for r in read_metrics(str(tmp_path / "peak")) if r["split"] == "train"]
  assert [r["step"] for r in rows] == [2, 4, 6]
  for r in rows:
    secs = 8 * 16 * 2 / r["tokens_per_s"]
    assert r["model_tflops_per_s"] == pytest.approx(2 * step_flops / secs / 1e12, rel=1e-9)
    assert r["mfu"] == pytest.approx(2 * step_flops / secs / (jax.device_count() * 0.5e12),
                                     rel=1e-9)
    assert f"MFU {100 * r['mfu']:.1f}%" in cap.out
  assert "mfu=" in cap.err and "tok/s=" in cap.err  # the progress bar's postfix
  events = b"".join(p.read_bytes() for p in (tmp_path / "peak" / "tb").rglob("*") if p.is_file())
  assert b"train/mfu" in events and b"train/tokens_per_s" in events

  loop.train(sr.config_for(tmp_path / "cpu", common))
  out = capsys.readouterr().out
  rows = [r for r in read_metrics(str(tmp_path / "cpu")) if r["split"] == "train"]
  assert all(r["mfu"] is None and r["tokens_per_s"] > 0 for r in rows)
  assert out.count("mfu: null in the logs: no peak FLOP/s is known for device kind 'cpu'") == 1


def _wandb_records(run_dir: str) -> list:
  """The records of an offline W&B run file (<run>/run-<id>.wandb: W&B's LevelDB-style log of
  protobuf Records: a 7-byte header, then 32 KiB blocks of chunks with a 7-byte chunk header)."""
  from wandb.proto import wandb_internal_pb2  # pylint: disable=g-import-not-at-top
  data = pathlib.Path(glob.glob(os.path.join(run_dir, "run-*.wandb"))[0]).read_bytes()
  assert data[:4] == b":W&B"
  pos, block, out, part = 7, 32768, [], b""
  while pos + 7 <= len(data):
    left = block - pos % block
    if left < 7:
      pos += left
      continue
    length = int.from_bytes(data[pos + 4:pos + 6], "little")
    kind = data[pos + 6]
    if kind == 0 and length == 0:
      break
    part += data[pos + 7:pos + 7 + length]
    pos += 7 + length
    if kind in (1, 4):  # full, last
      r = wandb_internal_pb2.Record()
      r.ParseFromString(part)
      out.append(r)
      part = b""
  return out


@pytest.mark.slow
def test_wandb_logs_the_metrics_and_config_and_a_resume_continues_the_run(tmp_path, monkeypatch):
  pytest.importorskip("wandb")
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_SILENT", "true")
  common = {"train.checkpoint_every": 4, "train.eval_every": 4, "train.full_eval_at_end": False,
            "train.log_every": 2, "train.wandb": "span-lm-test", "train.wandb_name": "tiny"}
  loop.train(sr.config_for(tmp_path, common, {"train.steps": 4}))
  run_id = (tmp_path / "wandb_id").read_text().strip()
  first = glob.glob(str(tmp_path / "wandb" / f"offline-run-*-{run_id}"))
  assert len(first) == 1
  records = _wandb_records(first[0])
  history = {}
  for r in records:
    if r.WhichOneof("record_type") == "history":
      history[r.history.step.num] = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                     for i in r.history.item}
  rows = read_metrics(str(tmp_path))
  for row in rows:  # every numeric value metrics.jsonl has, W&B has at that step
    for k, v in row.items():
      if k in ("step", "split") or v is None:
        continue
      if isinstance(v, list):
        assert history[row["step"]][f"{row['split']}/{k}/0"] == pytest.approx(v[0]), k
      else:
        assert history[row["step"]][f"{row['split']}/{k}"] == pytest.approx(v), k
  assert "train/mfu" not in history[2] and "train/tokens_per_s" in history[2]  # null on CPU
  runs = [r.run for r in records if r.WhichOneof("record_type") == "run"]
  assert runs and runs[0].run_id == run_id and runs[0].project == "span-lm-test" and \
      runs[0].display_name == "tiny"
  config = {u.key: json.loads(u.value_json) for u in runs[0].config.update}
  value = lambda v: v.get("value", v) if isinstance(v, dict) else v  # {'value': ...} in some W&B
  assert value(config["model"])["d_model"] == 32 and value(config["train"])["steps"] == 4
  assert value(config["train"])["wandb"] == "span-lm-test"

  loop.train(sr.config_for(tmp_path, common, {"train.steps": 8}))  # resumes: the same W&B run
  assert (tmp_path / "wandb_id").read_text().strip() == run_id
  runs = glob.glob(str(tmp_path / "wandb" / f"offline-run-*-{run_id}"))
  assert len(runs) == 2
  second = [r for r in _wandb_records(sorted(set(runs) - set(first))[0])
            if r.WhichOneof("record_type") == "history"]
  assert {r.history.step.num for r in second} == {6, 8}  # the new steps, logged once
  resumed = [r.run for r in _wandb_records(sorted(set(runs) - set(first))[0])
             if r.WhichOneof("record_type") == "run"]
  assert resumed[0].run_id == run_id


_NO_NETWORK = {k: "http://127.0.0.1:9" for k in ("http_proxy", "https_proxy", "HTTP_PROXY",
                                                 "HTTPS_PROXY")}


@pytest.mark.slow
@pytest.mark.parametrize("config_file, dataset", [
    ("configs/enwik8_small.py", "enwik8"), ("configs/text8.py", "text8"),
    ("configs/wiki103_pers.py", "wikitext103"), ("configs/cifar10_sparse.py", "cifar10")])
def test_a_paper_dataset_without_network_is_one_line(tmp_path, config_file, dataset):
  """Every download goes to a proxy nobody listens on (127.0.0.1:9): the network is
  unreachable, as on a cluster's compute nodes and in CI. No test touches the network."""
  env = dict(sr.worker_env(1), **_NO_NETWORK)
  for k in ("no_proxy", "NO_PROXY"):
    env.pop(k, None)
  data_dir = tmp_path / "data"
  proc = subprocess.run([sys.executable, "main.py", f"--config={config_file}",
                         f"--config.workdir={tmp_path / 'run'}",
                         f"--config.data.data_dir={data_dir}"], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=300, check=False)
  assert proc.returncode == 1, proc.stderr[-3000:]
  lines = _error_lines(proc.stderr)
  lines = [l for l in lines if not l.startswith(f"{dataset}.zip") and "MB" not in l]  # progress
  assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-5000:]
  if dataset == "cifar10":
    assert lines[0].startswith(f"error: no CIFAR-10 python batches in {data_dir}")
  else:
    assert lines[0].startswith(f"error: {dataset}: downloading failed (") and \
        "by hand and place it at" in lines[0], lines
  assert not (tmp_path / "run").exists()  # the lock was given back, its new directory removed


@pytest.mark.slow
def test_wandb_that_cannot_start_is_one_line(tmp_path):
  """Online, without an API key (and without network): W&B's own UsageError, in one line."""
  pytest.importorskip("wandb")
  env = dict(_NO_NETWORK, HOME=str(tmp_path / "home"), WANDB_MODE="online")
  (tmp_path / "home").mkdir()
  cfg = _config_file(tmp_path, tmp_path / "run", {"train.wandb": "span-lm-test"})
  full = dict(sr.worker_env(1), PYTHONUNBUFFERED="1", **env)
  for k in ("WANDB_API_KEY", "no_proxy", "NO_PROXY"):
    full.pop(k, None)
  proc = subprocess.run([sys.executable, "main.py", f"--config={cfg}"], cwd=REPO, env=full,
                        capture_output=True, text=True, timeout=300, check=False,
                        stdin=subprocess.DEVNULL)
  assert proc.returncode == 1, proc.stderr[-3000:]
  lines = [l for l in _error_lines(proc.stderr) if l.startswith("error:")]
  assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
  assert lines[0].startswith("error: wandb: could not start run ") and "wandb login" in lines[0]
  assert (tmp_path / "run" / "run.lock").read_text() == ""

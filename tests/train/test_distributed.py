"""Multi-process data parallelism: two real processes on localhost equal one process.

Each worker process is tests/synthetic_run.py run as a script (`python tests/synthetic_run.py
JSON`) with 4 fake CPU devices; they meet through jax.distributed at a localhost coordinator,
read their own halves of the streams and train the global batch together. The same run in this (8-device)
process gives the same losses, and the checkpoint the pair wrote restores here.
"""
import json
import signal
import socket
import subprocess
import time

import pytest

import synthetic_run
from synthetic_run import TINY, config_for, train_losses, worker_command, worker_env

REPO = synthetic_run.REPO

def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _start_pair(tmp_path, workdir, extra: dict | None = None) -> list:
  """Two worker processes (4 fake devices each) meeting at a localhost coordinator."""
  port = _free_port()
  procs = []
  for pid in range(2):
    ov = dict(TINY, workdir=str(workdir), **{"dist.coordinator": f"localhost:{port}",
                                             "dist.num_processes": 2, "dist.process_id": pid,
                                             "dist.init_timeout": 60}, **(extra or {}))
    log = open(tmp_path / f"worker{pid}.log", "w")
    procs.append((subprocess.Popen(worker_command(ov), cwd=REPO, env=worker_env(4), stdout=log,
                                   stderr=subprocess.STDOUT), log))
  return procs


def _stop_pair(procs) -> None:
  for p, log in procs:
    if p.poll() is None:
      p.kill()
    log.close()


def _pair_logs(tmp_path, procs) -> list[str]:
  """Each worker's output, after checking that it exited cleanly."""
  logs = [(tmp_path / f"worker{i}.log").read_text() for i in range(2)]
  for (p, _), text in zip(procs, logs):
    assert p.returncode == 0, text[-3000:]
  return logs


def _run_worker(overrides: dict, env: dict) -> tuple[str, dict]:
  """One worker process to the end: (its stdout, its RESULT line)."""
  p = subprocess.run(worker_command(overrides), cwd=REPO, env=env, capture_output=True, text=True,
                     timeout=150, check=False)
  assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
  return p.stdout, json.loads(p.stdout.split("RESULT ")[-1])


def _split_lines(workdir, split):
  from span_lm.train.metrics import read_metrics  # pylint: disable=g-import-not-at-top
  return {r["step"]: r for r in read_metrics(str(workdir)) if r["split"] == split}


def test_decide_from_config_and_environment():
  import ml_collections  # pylint: disable=g-import-not-at-top
  from span_lm.train import distributed  # pylint: disable=g-import-not-at-top

  def dist(**kw):
    d = ml_collections.ConfigDict(dict(mode="auto", coordinator="", num_processes=0,
                                       process_id=-1, local_device_ids="", init_timeout=300))
    d.update(kw)
    return d

  assert not distributed.decide(dist(), {})[0]
  assert not distributed.decide(dist(), {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1",
                                         "SLURM_STEP_ID": "0"})[0]
  assert not distributed.decide(dist(), {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4"})[0]  # salloc
  assert distributed.decide(dist(), {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4",
                                     "SLURM_STEP_ID": "0"})[0]
  assert distributed.decide(dist(), {"TPU_WORKER_HOSTNAMES": "t-0,t-1,t-2,t-3"})[0]
  assert not distributed.decide(dist(), {"TPU_WORKER_HOSTNAMES": "localhost"})[0]
  assert distributed.decide(dist(), {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"})[0]
  assert distributed.decide(dist(coordinator="h:1"), {})[0]
  assert distributed.decide(dist(mode="on"), {})[0]
  assert not distributed.decide(dist(mode="off"), {"JAX_COORDINATOR_ADDRESS": "h:1"})[0]
  kw = distributed.init_kwargs(dist(coordinator="h:1", num_processes=2, process_id=1,
                                    local_device_ids="0,1"), {})
  assert kw == {"coordinator_address": "h:1", "num_processes": 2, "process_id": 1,
                "local_device_ids": [0, 1], "initialization_timeout": 300}
  kw = distributed.init_kwargs(dist(), {"JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"})
  assert kw == {"num_processes": 4, "process_id": 3, "initialization_timeout": 300}


@pytest.mark.slow
def test_two_processes_equal_one(tmp_path):
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from span_lm.data import batching  # pylint: disable=g-import-not-at-top
  from span_lm.model import plan as plan_lib  # pylint: disable=g-import-not-at-top
  from span_lm.train import loop  # pylint: disable=g-import-not-at-top

  t0 = time.perf_counter()
  two = tmp_path / "two"
  procs = _start_pair(tmp_path, two)
  try:
    for p, _ in procs:
      p.wait(timeout=150)
  finally:
    _stop_pair(procs)
  logs = _pair_logs(tmp_path, procs)
  assert "distributed: 2 processes, 8 devices (4 per process" in logs[0]
  assert "| loss" in logs[0] and "| loss" not in logs[1]  # only process 0 prints progress
  t_two = time.perf_counter() - t0

  one = tmp_path / "one"
  result = loop.train(config_for(one))
  losses_two, losses_one = train_losses(two), train_losses(one)
  assert sorted(losses_two) == sorted(losses_one) == list(range(1, 7))
  np.testing.assert_allclose([losses_two[s] for s in range(1, 7)],
                             [losses_one[s] for s in range(1, 7)], rtol=1e-5)
  for split in ("valid", "full_valid", "full_test"):  # evaluation over both processes' streams
    a, b = _split_lines(two, split), _split_lines(one, split)
    assert sorted(a) == sorted(b) and a, split
    for s in a:
      np.testing.assert_allclose(a[s]["loss"], b[s]["loss"], rtol=1e-5)
      assert a[s]["tokens"] == b[s]["tokens"]

  # The pair's checkpoint restores in one process (8 devices here), at the last step.
  run = loop.Run(config_for(two))
  try:
    assert run.ckpt.all_steps() == [3, 6]
    state, meta = run.restore()
  finally:
    run.ckpt.close()
  assert meta["step"] == 6 and int(state["step"]) == 6
  walk = batching.StreamState()  # 6 blocks of 16 over streams of 80 tokens, seed 42
  for _ in range(6):
    walk, _ = batching.advance(walk, 80, 16, 42)
  assert meta["data"]["train"] == walk.to_dict()
  for a, b in zip(jax.tree.leaves(jax.device_get(state["params"])),
                  jax.tree.leaves(jax.device_get(result["state"]["params"]))):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  assert plan_lib.plan_from_json(meta["planner"]["plan"]) == result["plan"]
  print(f"two processes: {t_two:.1f}s wall")


@pytest.mark.slow
def test_fsdp_mesh_equals_data_parallel(tmp_path):
  """('data', 'fsdp') = (4, 2): params and optimizer state split, same losses and parameters."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from span_lm.train import loop  # pylint: disable=g-import-not-at-top

  short = {"train.steps": 3, "train.full_eval_at_end": False}
  dp = loop.train(config_for(tmp_path / "dp", short))
  fsdp_config = config_for(tmp_path / "fsdp", short, {"dist.fsdp": 2})
  fs = loop.train(fsdp_config)
  kernel = fs["state"]["params"]["layers_0"]["ff"]["fc1"]["kernel"]  # (embed, mlp)
  assert kernel.sharding.spec[0] == "fsdp" and len(kernel.addressable_shards[0].data) == 16
  np.testing.assert_allclose([l["loss"] for l in _split_lines(tmp_path / "fsdp", "train").values()],
                             [l["loss"] for l in _split_lines(tmp_path / "dp", "train").values()],
                             rtol=1e-5)
  for a, b in zip(jax.tree.leaves(jax.device_get(fs["state"]["params"])),
                  jax.tree.leaves(jax.device_get(dp["state"]["params"]))):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  # Its checkpoint restores onto the plain data-parallel layout.
  run = loop.Run(config_for(tmp_path / "fsdp", short))
  try:
    state, _ = run.restore()
  finally:
    run.ckpt.close()
  for a, b in zip(jax.tree.leaves(jax.device_get(state["params"])),
                  jax.tree.leaves(jax.device_get(fs["state"]["params"]))):
    np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_cpu_devices_split_trains_as_one_device(tmp_path):
  """config.dist.cpu_devices=2 in a fresh process (no XLA_FLAGS) gives 2 devices, and the same
  losses as the 8-device run in this process."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from span_lm.train import loop  # pylint: disable=g-import-not-at-top
  split = tmp_path / "split"
  env = worker_env(1)
  del env["XLA_FLAGS"]
  ov = dict(TINY, workdir=str(split), **{"dist.cpu_devices": 2, "train.full_eval_at_end": False})
  stdout, result = _run_worker(ov, env)
  assert "CPU host split into 2 devices" in stdout
  assert result["devices"] == 2
  one = tmp_path / "one"
  loop.train(config_for(one, {"train.full_eval_at_end": False}))
  a, b = train_losses(split), train_losses(one)
  assert sorted(a) == sorted(b) == list(range(1, 7))
  np.testing.assert_allclose([a[s] for s in a], [b[s] for s in a], rtol=1e-5)


@pytest.mark.slow
def test_restart_reads_the_persistent_compilation_cache(tmp_path):
  """A second process (a restart) loads its steps from train.compilation_cache instead of
  compiling them again."""
  cache = tmp_path / "xla"
  ov = {"train.compilation_cache": str(cache), "train.compilation_cache_min_secs": 0.0,
        "train.full_eval_at_end": False, "train.steps": 2, "train.eval_every": 2,
        "train.checkpoint_every": 2}
  hits = []
  for run in ("first", "restart"):
    _, result = _run_worker(dict(TINY, workdir=str(tmp_path / run), **ov), worker_env(2))
    hits.append(result["cache_hits"])
  assert any(f.name.startswith("jit_train_step") for f in cache.iterdir())
  assert hits[0] == 0 and hits[1] >= 2, hits  # the train and eval steps at least


@pytest.mark.slow
def test_sigterm_to_one_process_stops_both_at_one_step(tmp_path):
  """The preemption sync point: the signalled process and its peer checkpoint the same step."""
  workdir = tmp_path / "run"
  procs = _start_pair(tmp_path, workdir, {
      "train.steps": 100_000, "train.checkpoint_every": 100_000, "train.eval_every": 100_000,
      "train.full_eval_at_end": False})
  try:
    deadline = time.time() + 120
    while time.time() < deadline and all(p.poll() is None for p, _ in procs):
      if max(train_losses(workdir), default=0) >= 3:
        break
      time.sleep(0.2)
    procs[1][0].send_signal(signal.SIGTERM)  # process 1 only
    for p, _ in procs:
      p.wait(timeout=90)
  finally:
    _stop_pair(procs)
  results = [json.loads(text.split("RESULT ")[-1]) for text in _pair_logs(tmp_path, procs)]
  assert results[0]["preempted"] and results[1]["preempted"]
  assert results[0]["step"] == results[1]["step"] >= 3
  from span_lm.train import checkpoint as ckpt_lib  # pylint: disable=g-import-not-at-top
  with ckpt_lib.Checkpointer(workdir / "checkpoints") as ckpt:
    assert ckpt.all_steps() == [results[0]["step"]]


@pytest.mark.slow
def test_a_pair_takes_the_run_directorys_lock_once_and_is_refused_together(tmp_path):
  """Process 0 takes the lock for both; while a lone run holds the directory, a pair started on it
  stops in both processes before training, naming the holder (process 0) or process 0 (the
  other), and the lone run trains on."""
  import json as json_lib  # pylint: disable=g-import-not-at-top
  workdir = tmp_path / "run"
  lone_log = open(tmp_path / "lone.log", "w")
  lone = subprocess.Popen(worker_command(dict(TINY, workdir=str(workdir), **{
      "train.steps": 100_000, "train.checkpoint_every": 100_000, "train.eval_every": 100_000,
      "train.full_eval_at_end": False})), cwd=REPO, env=worker_env(4), stdout=lone_log,
      stderr=subprocess.STDOUT)
  try:
    deadline = time.time() + 120
    while time.time() < deadline and lone.poll() is None and not train_losses(workdir):
      time.sleep(0.2)
    assert lone.poll() is None, (tmp_path / "lone.log").read_text()[-3000:]
    assert json_lib.loads((workdir / "run.lock").read_text())["pid"] == lone.pid
    procs = _start_pair(tmp_path, workdir)
    try:
      for p, _ in procs:
        p.wait(timeout=150)
    finally:
      _stop_pair(procs)
    logs = [(tmp_path / f"worker{i}.log").read_text() for i in range(2)]
    assert all(p.returncode != 0 for p, _ in procs), logs
    assert f"is in use: host {socket.gethostname()}, pid {lone.pid}, since " in logs[0], logs[0]
    assert "process 0 could not take the lock of run directory" in logs[1], logs[1]
    assert "compiled train step" not in logs[0] + logs[1]
    assert lone.poll() is None
  finally:
    lone.kill()
    lone.wait(timeout=60)
    lone_log.close()
  # After the holder's death the pair takes the directory over (process 0 once) and trains.
  procs = _start_pair(tmp_path, workdir, {"train.steps": 4, "train.checkpoint_every": 4})
  try:
    for p, _ in procs:
      p.wait(timeout=150)
  finally:
    _stop_pair(procs)
  logs = _pair_logs(tmp_path, procs)
  assert logs[0].count("run directory lock: took over the lock of") == 1
  assert "took over" not in logs[1]
  assert (workdir / "run.lock").read_text() == ""


@pytest.mark.slow
def test_a_pairs_checkpoint_has_global_fingerprints_and_a_pair_verifies_what_it_restores(
    tmp_path):
  """Two processes save fingerprints of the global arrays (the numpy reference's of the state
  gathered here); two processes resuming verify before training, and both refuse a damaged
  step in agreement."""
  import shutil  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  from checkpoint_damage import damage_leaf, largest_param  # pylint: disable=g-import-not-at-top
  from span_lm.train import checkpoint as ckpt_lib  # pylint: disable=g-import-not-at-top
  from span_lm.train import fingerprint  # pylint: disable=g-import-not-at-top
  from span_lm.train import loop  # pylint: disable=g-import-not-at-top
  short = {"train.steps": 3, "train.full_eval_at_end": False}

  def pair(workdir, extra, ok=True):
    procs = _start_pair(tmp_path, workdir, extra)
    try:
      for p, _ in procs:
        p.wait(timeout=240)
    finally:
      _stop_pair(procs)
    if ok:
      return _pair_logs(tmp_path, procs)
    return [p.returncode for p, _ in procs], [
        (tmp_path / f"worker{i}.log").read_text() for i in range(2)]

  two = tmp_path / "two"
  pair(two, short)
  stored = ckpt_lib.stored_fingerprints(str(two / "checkpoints"), 3)
  run = loop.Run(config_for(two, short))
  try:
    state, _ = run.restore()  # 8 devices here, verified
  finally:
    run.ckpt.close()
  host = jax.device_get(state)
  assert stored["leaves"] == {p: fingerprint.fingerprint_numpy(x) for p, x in zip(
      fingerprint.leaf_paths(host), jax.tree.leaves(host))}

  damaged = tmp_path / "damaged"
  shutil.copytree(two, damaged)
  leaf = largest_param(damaged / "checkpoints" / "3")
  damage_leaf(damaged / "checkpoints" / "3", leaf, element=1, bit=7)

  logs = pair(two, {"train.steps": 6, "train.full_eval_at_end": False})  # resumes, verified
  assert f"resumed from {two / 'checkpoints'} at step 3" in logs[0]
  assert "damaged" not in logs[0] + logs[1] and "no fingerprints" not in logs[0]
  assert ckpt_lib.stored_fingerprints(str(two / "checkpoints"), 6)["leaves"]

  codes, logs = pair(damaged, {"train.steps": 6, "train.full_eval_at_end": False}, ok=False)
  assert all(c != 0 for c in codes), logs
  assert f"checkpoint step 3 in {damaged / 'checkpoints' / '3'} is damaged: {leaf}" in logs[0]
  for text in logs:  # both processes found it, neither trained on
    assert "none of its 1 checkpoints can be read (1 damaged" in text, text[-3000:]
    assert "| loss" not in text

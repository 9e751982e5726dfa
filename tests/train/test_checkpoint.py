"""Checkpointer against real Orbax on disk, with 8 fake CPU devices."""
import asyncio
import gc
import logging
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from span_lm.train import sharding
from span_lm.train.checkpoint import Checkpointer

B, L, D = 8, 4, 3


def _host_state(seed=0, d_model=D):
  """A small training state, as host numpy-backed jax values (placed on a mesh by _place)."""
  rng = np.random.default_rng(seed)
  params = {
      "emb": rng.standard_normal((11, d_model)).astype(np.float32),
      "layers": {"0": {"w": rng.standard_normal((d_model, d_model)).astype(np.float32),
                       "span": np.float32(0.25) * np.ones((2,), np.float32)}},
  }
  params = jax.tree.map(jnp.asarray, params)
  opt = optax.adam(1e-3)
  opt_state = opt.init(params)
  grads = jax.tree.map(jnp.ones_like, params)
  _, opt_state = opt.update(grads, opt_state, params)  # non-trivial mu/nu/count
  return {
      "params": params,
      "opt_state": opt_state,
      "step": jnp.int32(123),
      "rng": jax.random.key_data(jax.random.key(seed)),
      "caches": tuple(jnp.asarray(rng.standard_normal((B, L, d_model)), jnp.float32)
                      for _ in range(2)),
      "eval_caches": (jnp.asarray(rng.standard_normal((B, L, d_model)), jnp.float32),),
  }


def _abstract(state):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)


def _target(state, mesh):
  abstract = _abstract(state)
  return sharding.with_shardings(abstract, sharding.state_shardings(abstract, mesh))


def _place(state, mesh):
  return jax.device_put(state, sharding.state_shardings(_abstract(state), mesh))


def _assert_bit_identical(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape
    assert x.tobytes() == y.tobytes()


def _as_saved(meta: dict) -> dict:
  """A restored meta without the fingerprints entry save adds to it."""
  return {k: v for k, v in meta.items() if k != "fingerprints"}


META = {"config": {"model": {"d_model": 3, "span_mode": "adaptive"}, "tags": ["a", "b"]},
        "data": {"position": 4096, "split": "train"}, "metrics": [{"loss": 1.5}, {"loss": 1.25}],
        "note": "hello"}


@pytest.fixture(scope="module")
def saved_8dev(tmp_path_factory):
  """One async checkpoint written from an 8-device mesh (shared by the restore tests)."""
  directory = tmp_path_factory.mktemp("ckpt8")
  mesh8 = sharding.make_mesh(8)
  state = _place(_host_state(), mesh8)
  assert state["caches"][0].sharding.spec == jax.sharding.PartitionSpec("data", None, None)
  with Checkpointer(directory, save_every=10) as ckpt:
    assert ckpt.save(10, state, META)
  return directory, jax.device_get(state)


@pytest.mark.parametrize("num_devices", [2, 1])
def test_restore_onto_fewer_devices_is_bit_identical(saved_8dev, num_devices):
  directory, host_state = saved_8dev
  mesh = sharding.make_mesh(num_devices)
  target = _target(host_state, mesh)
  with Checkpointer(directory) as ckpt:
    assert ckpt.latest_step() == 10
    state, meta = ckpt.restore(target)
  _assert_bit_identical(state, host_state)
  assert type(state["opt_state"][0]) is type(host_state["opt_state"][0])  # NamedTuples restored
  assert isinstance(state["caches"], tuple)
  for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(target)):
    assert got.sharding == want.sharding
    assert len(got.sharding.device_set) == num_devices
  assert state["caches"][0].sharding.spec == jax.sharding.PartitionSpec("data", None, None)
  assert state["rng"].dtype == jnp.uint32
  jax.random.wrap_key_data(state["rng"])  # still usable as key data
  assert _as_saved(meta) == META and set(meta["fingerprints"]["leaves"]) == set(
      sharding.path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(host_state)[0])


def test_meta_round_trip_and_numpy_values(tmp_path, saved_8dev):
  directory, _ = saved_8dev
  with Checkpointer(directory) as ckpt:
    assert _as_saved(ckpt.restore_meta()) == META
    assert _as_saved(ckpt.restore_meta(step=10)) == META
  with Checkpointer(tmp_path, save_every=1, async_save=False) as ckpt:
    ckpt.save(1, {"x": jnp.zeros(2)}, {"loss": np.float32(0.5), "shape": (2, 3),
                                       "arr": np.arange(3)})
    assert _as_saved(ckpt.restore_meta()) == {"loss": 0.5, "shape": [2, 3], "arr": [0, 1, 2]}


def test_restore_params_only(saved_8dev):
  directory, host_state = saved_8dev
  mesh = sharding.make_mesh(1)
  abstract_params = sharding.with_shardings(
      _abstract(host_state["params"]),
      jax.tree.map(lambda _: sharding.replicated(mesh), host_state["params"]))
  with Checkpointer(directory) as ckpt:
    params = ckpt.restore_params(abstract_params)
  _assert_bit_identical(params, host_state["params"])
  assert all(len(x.sharding.device_set) == 1 for x in jax.tree.leaves(params))


def test_incompatible_checkpoint_names_the_path(saved_8dev):
  directory, host_state = saved_8dev
  mesh = sharding.make_mesh(2)
  other = _host_state(d_model=5)  # every D-sized dim differs
  with Checkpointer(directory) as ckpt:
    with pytest.raises(ValueError, match=r"params/layers/0/w: checkpoint \(3, 3\) float32, "
                                         r"expected \(5, 5\) float32"):
      ckpt.restore(_target(other, mesh))
    with pytest.raises(ValueError, match=r"caches/1"):
      ckpt.restore(_target(other, mesh))
    # Tree mismatch: a missing and an extra entry are both named.
    changed = dict(host_state, extra=jnp.zeros(2))
    del changed["eval_caches"]
    with pytest.raises(ValueError, match=r"(?s)extra: expected.*missing.*eval_caches/0: in checkpoint"):
      ckpt.restore(_target(changed, mesh))
    bad_params = sharding.with_shardings(
        _abstract(other["params"]),
        jax.tree.map(lambda _: sharding.replicated(mesh), other["params"]))
    with pytest.raises(ValueError, match=r"params/emb: checkpoint \(11, 3\)"):
      ckpt.restore_params(bad_params)
    with pytest.raises(ValueError, match="has no sharding"):
      ckpt.restore(_abstract(host_state))
    with pytest.raises(FileNotFoundError, match="step 7"):
      ckpt.restore(_target(host_state, mesh), step=7)


def test_float32_caches_restore_into_a_bf16_models_caches(saved_8dev):
  """Checkpoints from before bf16 models kept bf16 caches (float32 caches) resume: the caches
  are read cast; any other dtype change (a parameter's) is still refused by name."""
  directory, host_state = saved_8dev
  mesh = sharding.make_mesh(2)
  bf16 = lambda t: jax.tree.map(lambda x: x.astype(jnp.bfloat16), t)
  newer = dict(host_state, caches=bf16(host_state["caches"]),
               eval_caches=bf16(host_state["eval_caches"]))
  with Checkpointer(directory) as ckpt:
    state, _ = ckpt.restore(_target(newer, mesh))
    for got, want in zip(state["caches"] + state["eval_caches"],
                         host_state["caches"] + host_state["eval_caches"]):
      assert got.dtype == jnp.bfloat16
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want.astype(jnp.bfloat16)))
    _assert_bit_identical(state["params"], host_state["params"])
    with pytest.raises(ValueError, match=r"params/emb: checkpoint \(11, 3\) float32, "
                                         r"expected \(11, 3\) bfloat16"):
      ckpt.restore(_target(dict(newer, params=bf16(host_state["params"])), mesh))


def test_save_interval_force_and_existing_step(tmp_path, caplog):
  state = {"x": jnp.arange(4.0)}
  with Checkpointer(tmp_path, save_every=5, async_save=False) as ckpt:
    assert not ckpt.save(3, state, {})
    assert ckpt.save(5, state, {"v": 1})
    assert not ckpt.save(6, state)
    assert ckpt.save(7, state, {"v": 2}, force=True)  # final save off the interval
    assert ckpt.all_steps() == [5, 7]
    with caplog.at_level(logging.WARNING):
      assert not ckpt.save(5, {"x": jnp.ones(4)}, {"v": 3}, force=True)
      assert not ckpt.save(6, state, force=True)  # below the latest step (7)
    assert "already exists" in caplog.text and "later step 7" in caplog.text
    assert _as_saved(ckpt.restore_meta(5)) == {"v": 1}  # not overwritten
    assert ckpt.all_steps() == [5, 7] and ckpt.latest_step() == 7
    with pytest.raises(ValueError, match="key_data"):
      ckpt.save(10, {"rng": jax.random.key(0)})


def test_max_to_keep_rotation(tmp_path):
  state = {"x": jnp.arange(4.0)}
  with Checkpointer(tmp_path, max_to_keep=2, save_every=1) as ckpt:
    for step in range(1, 5):
      assert ckpt.save(step, dict(state, x=state["x"] + step), {"step": step})
    ckpt.wait()
    assert ckpt.all_steps() == [3, 4]
  with Checkpointer(tmp_path, max_to_keep=2) as ckpt:
    assert ckpt.latest_step() == 4
    assert ckpt.all_steps() == [3, 4]
    assert _as_saved(ckpt.restore_meta()) == {"step": 4}
  assert sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit()) == ["3", "4"]


def test_empty_directory_and_uncommitted_tmp_step(tmp_path):
  with Checkpointer(tmp_path) as ckpt:
    assert ckpt.latest_step() is None
    with pytest.raises(FileNotFoundError, match="no committed checkpoint"):
      ckpt.restore_meta()
  with Checkpointer(tmp_path, save_every=10, async_save=False) as ckpt:
    ckpt.save(10, {"x": jnp.arange(3.0)}, {"step": 10})
  # Orbax writes '<step>.orbax-checkpoint-tmp' and renames it on commit. Simulate a save that died
  # before the rename: a full copy of step 10 under the tmp name of step 20, minus the commit marker.
  tmp_step = tmp_path / "20.orbax-checkpoint-tmp"
  shutil.copytree(tmp_path / "10", tmp_step)
  (tmp_step / "commit_success.txt").unlink(missing_ok=True)
  with Checkpointer(tmp_path) as ckpt:
    assert ckpt.latest_step() == 10
    assert ckpt.all_steps() == [10]
    assert _as_saved(ckpt.restore_meta()) == {"step": 10}
  # A directory holding only an uncommitted step has no checkpoint at all.
  only_tmp = tmp_path / "other"
  only_tmp.mkdir()
  shutil.copytree(tmp_step, only_tmp / "20.orbax-checkpoint-tmp")
  with Checkpointer(only_tmp) as ckpt:
    assert ckpt.latest_step() is None


def _failing_save(late: int):
  """A full disk under Orbax's async save, deterministically: one write fails at once, so
  asyncio.gather raises while 15 sibling writes still wait on their (TensorStore) futures; those
  fail `late` loop iterations after the loop was told to stop."""
  async def save():
    loop = asyncio.get_running_loop()
    futures = [loop.create_future() for _ in range(15)]

    async def write(f):
      await f

    async def first():
      raise ValueError("No space left on device (first write)")

    def complete():
      for f in futures:
        f.set_exception(ValueError("No space left on device (later write)"))

    async def in_flight():  # the completions land as run_until_complete stops the loop
      loop.call_soon(*[loop.call_soon] * late, complete)
    await asyncio.gather(first(), in_flight(), *[write(f) for f in futures])
  return save()


def _orbax_0_12_8_run_sync(coro):
  """orbax.checkpoint._src.asyncio_utils._run_sync_via_new_loop as released: closes the loop
  right after run_until_complete."""
  loop = asyncio.new_event_loop()
  try:
    asyncio.set_event_loop(loop)
    return loop.run_until_complete(coro)
  finally:
    asyncio.set_event_loop(None)
    loop.close()


@pytest.mark.slow
@pytest.mark.parametrize("late", [1, 2])
def test_failed_async_writes_are_retrieved_before_orbax_closes_the_loop(tmp_path, caplog, late):
  """Issue 39: a full disk during an async save printed one 'Future exception was never retrieved'
  (or 'Task exception ...') per failed write, when the garbage collector got to them. Orbax's
  loops now finish their stranded tasks before closing: the first error is raised, nothing else."""
  from orbax.checkpoint._src import asyncio_utils  # pylint: disable=g-import-not-at-top
  caplog.set_level(logging.DEBUG)

  def reports():
    gc.collect()
    found = [r.getMessage() for r in caplog.records
             if r.name == "asyncio" and r.levelno >= logging.WARNING]
    caplog.clear()
    return found

  # The mechanism: Orbax 0.12.8's loop leaves each later failure unretrieved (late=1: "Task
  # exception was never retrieved", late=2: "Future exception ...", as in the issue).
  with pytest.raises(ValueError, match="first write"):
    _orbax_0_12_8_run_sync(_failing_save(late))
  assert len(reports()) == 15
  Checkpointer(tmp_path).close()  # makes Orbax's loops finish their tasks
  with pytest.raises(ValueError, match="first write"):
    asyncio_utils.run_sync(_failing_save(late))
  assert reports() == []


@pytest.mark.parametrize("listed", [False, True])
def test_a_step_deleted_while_read_is_not_damage(tmp_path, capsys, listed):
  """An eval beside a training run: while the reader reads the newest step, the run saves two
  more and its max_to_keep deletes the older ones. The reader lists the directory again and
  reads the run's newest step; it does not call the vanished steps unreadable (it once ended
  with 'none of its 2 checkpoints can be read'). listed: the reader saw the new listing first."""
  import types  # pylint: disable=g-import-not-at-top
  from span_lm.train import restore  # pylint: disable=g-import-not-at-top
  directory = str(tmp_path / "ck")
  with Checkpointer(directory, max_to_keep=2, save_every=1, async_save=False) as trainer:
    for s in (1, 2):
      trainer.save(s, {"x": jnp.full(2, float(s))}, {"step": s})
    with Checkpointer(directory, max_to_keep=2) as reader:
      read = []

      def read_meta(s):
        read.append(s)
        if len(read) == 1:  # the training run moves on meanwhile
          for t in (3, 4):
            trainer.save(t, {"x": jnp.full(2, float(t))}, {"step": t})
          trainer.wait()
          if listed:
            assert reader.all_steps(reread=True) == [3, 4]
        reader.step_path(s)  # as reading the state does (it once raised Orbax's ValueError)
        return _as_saved(reader.restore_meta(s))

      run = types.SimpleNamespace(ckpt=reader, process_index=0, process_count=1)
      assert restore.newest_readable(run, read_meta, None, move_aside=True) == {"step": 4}
  assert read == [2, 4]
  assert "checkpoint step 2 was deleted while read" in capsys.readouterr().out
  assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["3", "4"]  # nothing moved aside


_WRITER = """
import sys, time
import jax.numpy as jnp
from span_lm.train.checkpoint import Checkpointer
with Checkpointer(sys.argv[1], max_to_keep=2, save_every=1, async_save=True) as ck:
  t0 = time.time()
  step = 0
  while time.time() - t0 < float(sys.argv[2]):
    step += 1
    ck.save(step, {"x": jnp.full(64, float(step))}, {"step": step})
    time.sleep(0.01)
print("saved", step)
"""


@pytest.mark.slow
def test_listing_a_directory_a_run_is_saving_into_never_fails(tmp_path):
  """A real training-like process saves a step every ~10 ms and deletes its oldest (max_to_keep
  2) while this process opens the directory and lists it again and again, as an eval beside a
  run does. Orbax lists the step directories, then stats each: a step deleted in between once
  surfaced as 'No such file or directory: <run>/checkpoints/104' and ended the eval."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top
  directory = tmp_path / "ck"
  writer = subprocess.Popen([sys.executable, "-c", _WRITER, str(directory), "8"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  try:
    while not directory.exists() and writer.poll() is None:
      time.sleep(0.05)
    listings, seen = 0, set()
    while writer.poll() is None:
      with Checkpointer(str(directory), max_to_keep=2) as reader:  # lists as it opens
        for _ in range(5):
          steps = reader.all_steps(reread=True)
          assert len(steps) <= 3 and steps == sorted(steps)
          seen.update(steps)
          listings += 1
    out, _ = writer.communicate(timeout=60)
  finally:
    if writer.poll() is None:
      writer.kill()
  assert writer.returncode == 0, out[-2000:]
  assert listings > 50 and len(seen) > 20, (listings, len(seen), out)


# ------------------------------------------------------------------------------- fingerprints


def _copy(saved_8dev, tmp_path):
  directory, host_state = saved_8dev
  shutil.copytree(directory, tmp_path / "ck")
  return tmp_path / "ck", host_state


def test_every_save_stores_the_leaves_fingerprints(saved_8dev):
  """meta['fingerprints'] (the contract with the export code): the algorithm and, for every
  leaf by its path, the fingerprint of its global contents: here the numpy reference's of the
  state gathered on the host, though the save ran on 8 devices."""
  import json  # pylint: disable=g-import-not-at-top
  from span_lm.train import checkpoint as ckpt_lib  # pylint: disable=g-import-not-at-top
  from span_lm.train import fingerprint  # pylint: disable=g-import-not-at-top
  directory, host_state = saved_8dev
  on_disk = json.loads((directory / "10" / "meta" / "metadata").read_text())["fingerprints"]
  want = {sharding.path_str(p): fingerprint.fingerprint_numpy(x)
          for p, x in jax.tree_util.tree_flatten_with_path(host_state)[0]}
  assert on_disk["algorithm"] == fingerprint.ALGORITHM == "wsum32x2-fmix32"
  assert on_disk["leaves"] == want and len(want) == 15
  assert on_disk["arrays"]["params/layers/0/w"] == "float32[3,3]"
  assert ckpt_lib.stored_fingerprints(str(directory), 10) == on_disk
  with Checkpointer(directory) as ckpt:
    assert ckpt.stored_fingerprints() == on_disk
    assert ckpt.restore_meta(10)["fingerprints"] == on_disk  # verified, returned with the meta
    verdict = ckpt.verify(10)
  assert verdict.status == "verified" and verdict.arrays == 15 and verdict.saved_at is not None


def test_a_damaged_leaf_saved_on_8_devices_is_named_restored_on_2_or_1(saved_8dev, tmp_path):
  from checkpoint_damage import damage_leaf  # pylint: disable=g-import-not-at-top
  from span_lm.train.checkpoint import CheckpointDamagedError  # pylint: disable=g-import-not-at-top
  directory, host_state = _copy(saved_8dev, tmp_path)
  damage_leaf(directory / "10", "params/layers/0/w", element=4, bit=3)
  mesh2, mesh1 = sharding.make_mesh(2), sharding.make_mesh(1)
  with Checkpointer(directory) as ckpt:
    with pytest.raises(CheckpointDamagedError) as e:
      ckpt.restore(_target(host_state, mesh2))
    assert str(e.value) == (f"checkpoint step 10 in {directory / '10'} is damaged: "
                            "params/layers/0/w differs from its saved fingerprint")
    assert e.value.step == 10 and e.value.leaves == ["params/layers/0/w"]
    params_target = sharding.with_shardings(
        _abstract(host_state["params"]),
        jax.tree.map(lambda _: sharding.replicated(mesh1), host_state["params"]))
    with pytest.raises(CheckpointDamagedError, match=r"params/layers/0/w differs"):
      ckpt.restore_params(params_target)
    verdict = ckpt.verify(10)
  assert verdict.status == "damaged" and verdict.leaves == ["params/layers/0/w"]


def test_a_damaged_float32_cache_is_named_before_the_cast_to_bf16(saved_8dev, tmp_path):
  from checkpoint_damage import damage_leaf  # pylint: disable=g-import-not-at-top
  from span_lm.train.checkpoint import CheckpointDamagedError  # pylint: disable=g-import-not-at-top
  directory, host_state = _copy(saved_8dev, tmp_path)
  damage_leaf(directory / "10", "caches/1", element=17, bit=0)  # the lowest mantissa bit
  bf16 = lambda t: jax.tree.map(lambda x: x.astype(jnp.bfloat16), t)
  newer = dict(host_state, caches=bf16(host_state["caches"]),
               eval_caches=bf16(host_state["eval_caches"]))
  with Checkpointer(directory) as ckpt:
    with pytest.raises(CheckpointDamagedError, match=r"is damaged: caches/1 differs"):
      ckpt.restore(_target(newer, sharding.make_mesh(2)))


@pytest.mark.parametrize("change, named", [
    (lambda m: m["data"].update(position=4097), "meta differs from the digest saved with it"),
    (lambda m: m.update(fingerprintz=m.pop("fingerprints")), "meta (its key 'fingerprintz'"),
    (lambda m: m["fingerprints"]["leaves"].update({"params/emb": "0" * 16}),
     "params/emb differs from its saved fingerprint"),
    (lambda m: m["fingerprints"]["arrays"].update({"step": "int32[1]"}),
     "state/_METADATA, step (the state's array metadata names other"),
    (lambda m: m["fingerprints"].update(algorithm="crc32c"), "meta (its fingerprints use the "
     "algorithm 'crc32c'"),
])
def test_a_changed_meta_is_damage(saved_8dev, tmp_path, change, named):
  """The meta (data position, span plan, config) is checked against its digest, and the
  fingerprints entry itself against the state: a flipped bit in a name that made the step look
  older than fingerprints is damage too."""
  from checkpoint_damage import edit_meta  # pylint: disable=g-import-not-at-top
  from span_lm.train.checkpoint import CheckpointDamagedError  # pylint: disable=g-import-not-at-top
  directory, host_state = _copy(saved_8dev, tmp_path)
  edit_meta(directory / "10", change)
  with Checkpointer(directory) as ckpt:
    with pytest.raises(CheckpointDamagedError) as e:
      ckpt.restore(_target(host_state, sharding.make_mesh(2)))
    assert named in str(e.value) and "\n" not in str(e.value)
    if "digest" in named or "key" in named or "algorithm" in named:
      with pytest.raises(CheckpointDamagedError):
        ckpt.restore_meta(10)
    assert ckpt.verify(10).status == "damaged"


def test_a_checkpoint_saved_before_fingerprints_restores_with_one_note(saved_8dev, tmp_path,
                                                                      capsys):
  from checkpoint_damage import edit_meta  # pylint: disable=g-import-not-at-top
  directory, host_state = _copy(saved_8dev, tmp_path)
  edit_meta(directory / "10", lambda m: m.pop("fingerprints"))
  with Checkpointer(directory, save_every=1) as ckpt:
    capsys.readouterr()
    for _ in range(2):
      state, meta = ckpt.restore(_target(host_state, sharding.make_mesh(2)))
      assert meta == META
    _assert_bit_identical(state, host_state)
    out = capsys.readouterr().out
    assert out.count("has no fingerprints") == 1, out
    assert (f"checkpoint step 10 in {directory} has no fingerprints: saved before they existed; "
            "it is not verified") in out
    assert ckpt.verify(10).status == "unverified"
    assert ckpt.stored_fingerprints(10) is None
    ckpt.save(11, state, meta)  # a resumed run's next save has them
    ckpt.wait()
    assert ckpt.stored_fingerprints(11)["leaves"]["params/emb"]


def test_verify_mode_beside_a_training_run_that_deletes_a_step(tmp_path, capsys, monkeypatch):
  """A step that a run saving into the directory deletes (max_to_keep) while verify reads it is
  not damage: the table says so and the exit status is 0."""
  from span_lm import config as config_lib  # pylint: disable=g-import-not-at-top
  from span_lm.tools import verify  # pylint: disable=g-import-not-at-top
  directory = tmp_path / "checkpoints"
  with Checkpointer(directory, save_every=1, async_save=False) as ckpt:
    for s in (1, 2):
      ckpt.save(s, {"x": jnp.full(3, float(s))}, {"step": s})
  real = Checkpointer.verify

  def verify_after_a_deletion(self, step):
    if step == 1:
      shutil.rmtree(directory / "1")
    return real(self, step)
  monkeypatch.setattr(Checkpointer, "verify", verify_after_a_deletion)
  config = config_lib.base_config()
  config.workdir, config.mode = str(tmp_path), "verify"
  out = verify.report(config)
  printed = capsys.readouterr().out
  assert [v.status for v in out["verdicts"]] == ["deleted", "verified"], printed
  assert out["exit_status"] == 0 and "deleted while read" in printed

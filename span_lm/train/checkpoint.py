"""Training checkpoints: a thin wrapper over `orbax.checkpoint.CheckpointManager`.

Each step directory holds two items: 'state' (the array pytree, StandardSave/StandardRestore) and
'meta' (a JSON dict: config, data position, metrics). Saving is asynchronous; Orbax writes into
'<step>.orbax-checkpoint-tmp' and renames on commit, so an interrupted save is never reported as a
checkpoint. Restores take an abstract target with shardings, so a run saved on N devices resumes on
M devices, and are checked against the stored metadata first so that a mismatch is a ValueError
naming the paths rather than a deep Orbax/TensorStore error. A step whose files cannot be read
(truncated, corrupted, deleted by hand) is a CheckpointReadError naming its directory, so callers
can fall back to an older step.

Fingerprints (train/fingerprint.py): every save stores, in its meta, a fingerprint of each leaf of
the state computed on the devices, the leaves' dtypes and shapes, and a digest of the rest of the
meta (meta['fingerprints'], below). Every read checks them before returning anything: the meta
against its digest, the state's array metadata against the described leaves, each restored leaf
against its fingerprint. A difference is a CheckpointDamagedError (a CheckpointReadError) naming
the step's directory and the leaves, so the fallback to an older step applies to it too. A step
saved before fingerprints existed restores unverified, with one note per Checkpointer.
"""
import asyncio
import datetime
import hashlib
import json
import logging
import os
import re
import time
import weakref
from typing import Any, NamedTuple, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp

from span_lm.train import fingerprint as fingerprint_lib
from span_lm.train import metrics as metrics_lib
from span_lm.train.sharding import path_str

log = logging.getLogger(__name__)

_MAX_LISTED = 20  # mismatching paths listed in an error message


def _jsonable(x: Any) -> Any:
  """numpy/jax scalars and arrays -> Python values, tuples -> lists (JSON cannot hold them)."""
  if isinstance(x, dict):
    return {str(k): _jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_jsonable(v) for v in x]
  if isinstance(x, (np.generic, np.ndarray, jax.Array)):
    return np.asarray(x).tolist()
  return x


def _leaves_by_path(tree: Any) -> dict:
  return {path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _describe(x: Any) -> str:
  shape = getattr(x, "shape", None)
  dtype = getattr(x, "dtype", None)
  return f"{tuple(shape) if shape is not None else '?'} {np.dtype(dtype).name if dtype is not None else '?'}"


def _finish_tasks(loop: asyncio.AbstractEventLoop, tasks) -> None:
  """Runs `loop` (stopped, not closed) until no task created on it is pending: each is cancelled
  and awaited, and the callbacks already queued (a task's wakeup, asyncio.gather's bookkeeping)
  run, so every exception a task or future holds is retrieved before the loop closes. Exceptions
  other than cancellation are logged at DEBUG (WARNING with SPAN_LM_DEBUG=1)."""
  async def finish():
    for _ in range(10):  # a cancelled task may start another: a few rounds
      pending = [t for t in list(tasks) if not t.done() and t is not asyncio.current_task()]
      if not pending:
        break
      for t in pending:
        t.cancel()
      results = await asyncio.gather(*pending, return_exceptions=True)
      level = logging.WARNING if os.environ.get("SPAN_LM_DEBUG") else logging.DEBUG
      for t, r in zip(pending, results):
        if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError):
          log.log(level, "Orbax task %s failed after its operation's first error", t.get_name(),
                  exc_info=r)
    await asyncio.sleep(0)  # callbacks queued by the last completions
  loop.run_until_complete(finish())


def _run_sync_via_new_loop(coro):
  """Orbax's `asyncio_utils._run_sync_via_new_loop` (0.12.x: the loop that runs each background
  write), finishing the loop's tasks before closing it.

  Orbax runs `run_until_complete(coro)` and closes the loop. When one array's write fails (a full
  disk), `asyncio.gather` in Orbax's serialization raises at once while the sibling writes are
  still in flight; closing the loop then strands them: TensorStore completes their futures on a
  loop that never runs again, and asyncio prints 'Future exception was never retrieved' (or
  'Task exception ...', 'coroutine ... was never awaited') for each when it is collected, at a
  time that depends on thread scheduling. Here the stranded tasks are cancelled and awaited on
  the same loop first, as asyncio.run() does, so each failed write is retrieved deterministically.
  Tasks are tracked per loop (a task factory) rather than with asyncio.all_tasks(), whose global
  WeakSet Orbax avoids iterating across threads.
  """
  loop = asyncio.new_event_loop()
  tasks = weakref.WeakSet()

  def factory(loop, coro, **kwargs):
    task = asyncio.Task(coro, loop=loop, **kwargs)
    tasks.add(task)
    return task
  loop.set_task_factory(factory)
  try:
    asyncio.set_event_loop(loop)
    return loop.run_until_complete(coro)
  finally:
    try:
      _finish_tasks(loop, tasks)
    finally:
      asyncio.set_event_loop(None)
      loop.close()


_ORBAX_LOOPS_FINISH = []


def finish_orbax_tasks() -> None:
  """Makes Orbax finish its event loops' tasks before closing them (see _run_sync_via_new_loop).

  Once per process; only the loops Orbax's run_sync creates change. An Orbax without that
  function is left as it is (the full-disk tests in tests/test_faults.py would show the noise).
  """
  if _ORBAX_LOOPS_FINISH:
    return
  _ORBAX_LOOPS_FINISH.append(True)
  try:
    from orbax.checkpoint._src import asyncio_utils  # pylint: disable=g-import-not-at-top
  except ImportError:
    return
  if callable(getattr(asyncio_utils, "_run_sync_via_new_loop", None)):
    asyncio_utils._run_sync_via_new_loop = _run_sync_via_new_loop  # pylint: disable=protected-access


class CheckpointReadError(OSError):
  """A committed checkpoint step whose files cannot be read (an OSError: a file-system fault).

  `step`, `path`: the step and its directory; the message is one line.
  """

  def __init__(self, step: int, path: str, reason: str):
    self.step, self.path, self.reason = step, path, reason
    super().__init__(f"checkpoint step {step} in {path} cannot be read ({reason})")


class CheckpointDamagedError(CheckpointReadError):
  """A committed step whose contents differ from the fingerprints saved with it (a damaged file:
  its bytes still decode, to other values). `leaves`: the leaf paths found damaged (or the part
  of the step: 'meta', 'state/_METADATA'); the message is one line naming the step's directory
  (in the run directory), the step and the leaves."""

  def __init__(self, step: int, path: str, leaves, why: Optional[str] = None):
    self.leaves = list(leaves)
    shown = ", ".join(self.leaves[:_MAX_NAMED])
    more = len(self.leaves) - _MAX_NAMED
    what = shown + (f" and {more} more" if more > 0 else "")
    if why is None:
      why = ("differs from its saved fingerprint" if len(self.leaves) == 1 else
             f"({len(self.leaves)} leaves) differ from their saved fingerprints")
    super().__init__(step, path, f"damaged: {what} {why}")
    self.args = (f"checkpoint step {step} in {path} is damaged: {what} {why}",)

  def __str__(self) -> str:
    return self.args[0]


_MAX_NAMED = 5  # damaged leaves named in one line

# meta['fingerprints'] = {'algorithm': fingerprint.ALGORITHM, 'leaves': {path: hex},
#                         'arrays': {path: 'float32[512,2048]'}, 'meta': digest of the rest}
FINGERPRINTS = "fingerprints"


def meta_digest(meta: dict) -> str:
  """sha256 (16 hex digits) of the meta's canonical JSON, without its 'fingerprints' entry."""
  rest = {k: v for k, v in meta.items() if k != FINGERPRINTS}
  text = json.dumps(rest, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
  return hashlib.sha256(text.encode("ascii")).hexdigest()[:16]


def _array_text(x) -> str:
  return f"{np.dtype(x.dtype).name}[{','.join(str(int(d)) for d in x.shape)}]"


def _mangled_key(meta: dict) -> Optional[str]:
  """A top-level key one byte away from 'fingerprints' (a flipped bit in its name would make a
  fingerprinted step look like one saved before fingerprints)."""
  for k in meta:
    if k != FINGERPRINTS and len(k) == len(FINGERPRINTS) and sum(
        a != b for a, b in zip(k, FINGERPRINTS)) == 1:
      return k
  return None


def _reason(e: BaseException) -> str:
  """One line about why a read failed: the innermost exception's first line, shortened."""
  while e.__cause__ is not None or (e.__context__ is not None and not e.__suppress_context__):
    e = e.__cause__ or e.__context__
  text = str(e).strip().splitlines()[0] if str(e).strip() else ""
  text = text if len(text) <= 160 else text[:157] + "..."
  return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _castable_cache(path: str, stored, expected) -> bool:
  """Carried caches saved in another float dtype (float32 before bf16 models kept bf16 caches,
  model/caches.py) restore cast: attention reads them in the model's dtype either way."""
  floats = all(jax.dtypes.issubdtype(np.dtype(x.dtype), np.floating) for x in (stored, expected))
  return floats and path.split("/", 1)[0] in ("caches", "eval_caches")


def describe(state: Any, meta: dict) -> dict:
  """meta['fingerprints'] for `state` saved with `meta` (its other entries): the fingerprints,
  computed on the devices (fingerprint.fingerprints), the leaves' dtypes and shapes, the digest."""
  leaves = _leaves_by_path(state)
  return {"algorithm": fingerprint_lib.ALGORITHM, "leaves": fingerprint_lib.fingerprints(state),
          "arrays": {p: _array_text(x) for p, x in leaves.items()}, "meta": meta_digest(meta)}


def _malformed(fps: Any) -> Optional[str]:
  """Why meta['fingerprints'] cannot be used (damage, or a newer span_lm's algorithm), or None."""
  if not isinstance(fps, dict) or not all(
      isinstance(fps.get(k), d) for k, d in (("leaves", dict), ("arrays", dict), ("meta", str))):
    return "(its fingerprints entry is incomplete)"
  if fps.get("algorithm") != fingerprint_lib.ALGORITHM:
    return (f"(its fingerprints use the algorithm {fps.get('algorithm')!r}, this span_lm knows "
            f"{fingerprint_lib.ALGORITHM!r})")
  return None


def stored_fingerprints(directory: str, step: Optional[int] = None) -> Optional[dict]:
  """meta['fingerprints'] of checkpoint `step` (latest by default) in a checkpoints directory
  (Checkpointer.stored_fingerprints); None for a step saved before fingerprints existed."""
  if not os.path.isdir(directory):
    raise FileNotFoundError(f"no checkpoint directory {directory}")
  with Checkpointer(directory, max_to_keep=None) as ckpt:
    return ckpt.stored_fingerprints(step)


class Verdict(NamedTuple):
  """Checkpointer.verify's answer for one step. status: 'verified', 'damaged' (leaves: which),
  'unreadable' (reason: why), 'unverified' (saved before fingerprints; every leaf read)."""
  step: int
  saved_at: Optional[datetime.datetime]
  status: str
  leaves: list
  reason: str
  arrays: int  # leaves read


def _spread(m, mesh) -> jax.ShapeDtypeStruct:
  """A restore target for stored array metadata `m`: split along its largest dimension that the
  devices divide, else replicated (the verify mode reads a state as saved, on any host)."""
  shape, n = tuple(m.shape), mesh.devices.size
  dims = [d for d in range(len(shape)) if shape[d] % n == 0 and shape[d] >= n]
  spec = [None] * len(shape)
  if dims and n > 1:
    spec[max(dims, key=lambda d: shape[d])] = "x"
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
  return jax.ShapeDtypeStruct(shape, m.dtype, sharding=sharding)


def _listing(list_steps, attempts: int = 20):
  """list_steps() (Orbax listing the step directories), again while a step vanishes under it.
  Orbax lists the directory, then stats each step's directory and metadata; a run saving into
  it deletes its oldest step meanwhile (max_to_keep), which Orbax raises as FileNotFoundError or
  ValueError ('No step path found'). A reader beside a training run (eval, spans, sample, verify)
  lists again: the deleted step is simply gone from the new listing."""
  for attempt in range(attempts):
    try:
      return list_steps()
    except (FileNotFoundError, NotADirectoryError, ValueError):
      if attempt == attempts - 1:
        raise
      time.sleep(0.05)


class Checkpointer:
  """Saves every `save_every` steps (or when forced), keeps the newest `max_to_keep`."""

  def __init__(self, directory: str, max_to_keep: Optional[int] = 3, save_every: int = 1000,
               async_save: bool = True):
    if save_every < 1:
      raise ValueError(f"save_every={save_every}: must be >= 1")
    self.directory = os.path.abspath(os.fspath(directory))
    self.save_every = save_every
    finish_orbax_tasks()
    # Explicit (default) name format, so restore_params can locate '<dir>/<step>/state'.
    self._name_format = ocp.step.standard_name_format()
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep,
        enable_async_checkpointing=async_save,
        step_name_format=self._name_format,
        create=True,
    )
    # Handlers registered up front: without them a fresh manager cannot read item metadata.
    self._manager = _listing(lambda: ocp.CheckpointManager(
        self.directory, options=options, item_names=("state", "meta"),
        item_handlers={"state": ocp.StandardCheckpointHandler(),
                       "meta": ocp.JsonCheckpointHandler()}))
    self._noted_unverified = False  # the note about steps without fingerprints: once

  # --- queries -----------------------------------------------------------------------------------

  def latest_step(self) -> Optional[int]:
    """Highest committed step, or None (uncommitted tmp directories do not count).

    The highest, not Orbax's "most recently saved", so the answer is the same in every session.
    """
    steps = self._manager.all_steps()
    return max(steps) if steps else None

  def all_steps(self, *, reread: bool = False) -> list:
    """Committed steps, oldest first; reread lists the directory again (another process may
    save and delete meanwhile: a training run beside an eval)."""
    if reread:
      _listing(self._manager.reload)
    return sorted(self._manager.all_steps())

  def should_save(self, step: int) -> bool:
    return step % self.save_every == 0

  # --- save --------------------------------------------------------------------------------------

  def save(self, step: int, state: Any, meta: Optional[dict] = None, force: bool = False) -> bool:
    """Starts an (async) save if `step` is on the interval or `force`; returns whether it did.

    A step that already has a checkpoint, or is below the latest one, is skipped with a warning:
    existing checkpoints are never overwritten and one directory holds one monotone history
    (Orbax's own policy; to branch from an old step, save into a new directory).
    """
    step = int(step)
    if not (force or self.should_save(step)):
      return False
    if step in self._manager.all_steps():
      log.warning("checkpoint for step %d already exists in %s; not overwriting", step,
                  self.directory)
      return False
    latest = self.latest_step()
    if latest is not None and step < latest:
      log.warning("not saving step %d: %s already holds the later step %d", step, self.directory,
                  latest)
      return False
    typed_keys = [p for p, x in _leaves_by_path(state).items()
                  if jax.dtypes.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key)]
    if typed_keys:
      raise ValueError(f"typed PRNG keys at {typed_keys}: store jax.random.key_data(key) instead")
    meta = _jsonable(dict(meta or {}))
    meta.pop(FINGERPRINTS, None)
    json.dumps(meta)  # fail here, synchronously, rather than in the async writer
    meta[FINGERPRINTS] = describe(state, meta)
    # force=True: the interval decision above is ours, not Orbax's save_interval_steps.
    return self._manager.save(
        step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                      meta=ocp.args.JsonSave(meta)),
        force=True)

  def wait(self) -> None:
    """Blocks until pending async saves are committed."""
    self._manager.wait_until_finished()

  # --- restore -----------------------------------------------------------------------------------

  def _note_unverified(self, step: int) -> None:
    if not self._noted_unverified:
      self._noted_unverified = True
      metrics_lib.say(f"note: checkpoint step {step} in {self.directory} has no fingerprints: "
                      "saved before they existed; it is not verified")

  def _read_meta(self, step: int) -> tuple:
    """(meta, meta['fingerprints'] or None): the meta checked against its digest; a step saved
    before fingerprints is noted (once) and gives None."""
    meta = self._reading(step, lambda: self._manager.restore(
        step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta)
    if not isinstance(meta, dict):
      raise CheckpointReadError(step, self.step_path(step), "its 'meta' item is not a JSON object")
    fps = meta.get(FINGERPRINTS)
    if fps is None:
      mangled = _mangled_key(meta)
      if mangled is not None:
        raise CheckpointDamagedError(step, self.step_path(step), ["meta"],
                                     f"(its key {mangled!r} should read {FINGERPRINTS!r})")
      self._note_unverified(step)
      return meta, None
    problem = _malformed(fps)
    if problem is None and fps["meta"] != meta_digest(meta):
      problem = "differs from the digest saved with it"
    if problem is not None:
      raise CheckpointDamagedError(step, self.step_path(step), ["meta"], problem)
    return meta, fps

  def _check_described(self, step: int, stored: dict, fps: Optional[dict]) -> None:
    """The state's array metadata (state/_METADATA) against the leaves the meta describes."""
    if fps is None:
      return
    arrays = fps["arrays"]
    bad = [p for p in stored if arrays.get(p) != _array_text(stored[p])]
    bad += [p for p in arrays if p not in stored]
    if bad or set(fps["leaves"]) != set(arrays):
      raise CheckpointDamagedError(
          step, self.step_path(step), ["state/_METADATA"] + bad,
          "(the state's array metadata names other leaves, dtypes or shapes than the meta "
          "saved with it)")

  def _verify(self, step: int, tree: Any, fps: Optional[dict]) -> None:
    """Each leaf of `tree` (named as in the saved state) against its saved fingerprint."""
    if fps is None:
      return
    bad = fingerprint_lib.mismatches(fps["leaves"], fingerprint_lib.fingerprints(tree))
    if bad:
      raise CheckpointDamagedError(step, self.step_path(step), bad)

  def stored_fingerprints(self, step: Optional[int] = None) -> Optional[dict]:
    """meta['fingerprints'] of `step` (latest by default), after checking the meta's digest:
    {'algorithm': name, 'leaves': {leaf path: hex}, 'arrays': {leaf path: 'dtype[shape]'},
    'meta': digest}; None for a step saved before fingerprints existed."""
    return self._read_meta(self._resolve_step(step))[1]

  def _resolve_step(self, step: Optional[int]) -> int:
    self.wait()
    if step is None:
      step = self.latest_step()
      if step is None:
        raise FileNotFoundError(f"no committed checkpoint in {self.directory}")
    elif step not in self._manager.all_steps():
      raise FileNotFoundError(f"no checkpoint for step {step} in {self.directory}; "
                              f"available: {self.all_steps()}")
    return int(step)

  def step_path(self, step: int) -> str:
    """The directory of committed step `step`; FileNotFoundError once it is gone (a run saving
    into the directory deletes its older steps: restore.newest_readable reads the newest)."""
    try:
      found = self._name_format.find_step(self._manager.directory, step)
    except ValueError as e:
      raise FileNotFoundError(f"checkpoint step {step} is not in {self.directory}") from e
    return os.path.join(self.directory, str(found.path.name))

  def _reading(self, step: int, fn):
    """Runs a read of `step`; any failure inside Orbax/TensorStore becomes CheckpointReadError."""
    try:
      return fn()
    except (KeyboardInterrupt, CheckpointReadError):
      raise
    except Exception as e:  # pylint: disable=broad-except
      path = os.path.join(self.directory, str(step))
      try:
        path = self.step_path(step)
      except Exception:  # pylint: disable=broad-except
        pass
      raise CheckpointReadError(step, path, _reason(e)) from e

  def _stored_leaves(self, step: int) -> dict:
    item = self._reading(step, lambda: self._manager.item_metadata(step).state)
    if item is None:
      raise ValueError(f"checkpoint step {step} in {self.directory} has no readable 'state' item")
    return _leaves_by_path(getattr(item, "tree", item))

  def _check_compatible(self, step: int, expected: dict, stored: dict) -> None:
    """Raises ValueError listing every path whose tree position, shape or dtype differ."""
    problems = []
    for p, x in expected.items():
      if p not in stored:
        problems.append(f"  {p}: expected {_describe(x)}, missing from checkpoint")
      else:
        s = stored[p]
        if (tuple(s.shape) != tuple(np.shape(x))
            or (np.dtype(s.dtype) != np.dtype(x.dtype) and not _castable_cache(p, s, x))):
          problems.append(f"  {p}: checkpoint {_describe(s)}, expected {_describe(x)}")
    for p in stored:
      if p not in expected:
        problems.append(f"  {p}: in checkpoint {_describe(stored[p])}, not in expected state")
    if problems:
      more = len(problems) - _MAX_LISTED
      lines = problems[:_MAX_LISTED] + ([f"  ... and {more} more"] if more > 0 else [])
      raise ValueError(f"checkpoint step {step} in {self.directory} does not match the expected "
                       f"state ({len(problems)} mismatches):\n" + "\n".join(lines))

  @staticmethod
  def _require_shardings(abstract: Any) -> Any:
    """Concrete arrays -> their ShapeDtypeStruct; a struct without a sharding is an error."""
    def one(path, x):
      if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
      if getattr(x, "sharding", None) is None:
        raise ValueError(f"restore target {path_str(path)} has no sharding: pass "
                         "jax.ShapeDtypeStruct(shape, dtype, sharding=...) leaves "
                         "(see sharding.state_shardings / with_shardings)")
      return x
    return jax.tree_util.tree_map_with_path(one, abstract)

  def restore(self, abstract_state: Any, step: Optional[int] = None) -> tuple:
    """Returns (state, meta) for `step` (latest by default), laid out as `abstract_state` says;
    every leaf verified against its fingerprint (CheckpointDamagedError) before it is returned.
    A cache stored in another float dtype (_castable_cache) is read as stored, verified, then
    cast."""
    step = self._resolve_step(step)
    abstract_state = self._require_shardings(abstract_state)
    meta, fps = self._read_meta(step)
    stored = self._stored_leaves(step)
    self._check_described(step, stored, fps)
    self._check_compatible(step, _leaves_by_path(abstract_state), stored)

    def as_stored(path, x):
      s = stored[path_str(path)]
      return x if np.dtype(s.dtype) == np.dtype(x.dtype) else jax.ShapeDtypeStruct(
          x.shape, s.dtype, sharding=x.sharding)
    read_target = jax.tree_util.tree_map_with_path(as_stored, abstract_state)
    state = self._reading(step, lambda: self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(read_target))).state)
    self._verify(step, state, fps)
    cast = jax.tree.map(lambda x, want: x if x.dtype == want.dtype else jax.jit(
        lambda a, dt=want.dtype: a.astype(dt), out_shardings=want.sharding)(x),
                        state, abstract_state)
    return cast, meta

  def restore_meta(self, step: Optional[int] = None) -> dict:
    """The meta saved with `step` (latest by default), checked against its digest, with the
    'fingerprints' entry save added (stored_fingerprints reads it alone)."""
    return self._read_meta(self._resolve_step(step))[0]

  def _restore_part(self, step: int, target: dict) -> dict:
    """The top-level entries of the saved state that `target` names (partial_restore)."""
    # StandardRestore has no partial mode and the manager's 'state' handler only accepts
    # Standard args, so read the item directory with a PyTree checkpointer (partial_restore).
    path = os.path.join(self.step_path(step), "state")

    def read():
      with ocp.PyTreeCheckpointer() as ckptr:
        return ckptr.restore(path, args=ocp.args.PyTreeRestore(
            item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
            partial_restore=True))
    return self._reading(step, read)

  def restore_params(self, abstract_params: Any, step: Optional[int] = None) -> Any:
    """Restores only state['params'] (for evaluation: no optimizer state or caches read),
    verified against their fingerprints."""
    step = self._resolve_step(step)
    target = {"params": self._require_shardings(abstract_params)}
    _, fps = self._read_meta(step)
    stored_all = self._stored_leaves(step)
    self._check_described(step, stored_all, fps)
    stored = {p: x for p, x in stored_all.items() if p == "params" or p.startswith("params/")}
    self._check_compatible(step, _leaves_by_path(target), stored)
    out = self._restore_part(step, target)
    self._verify(step, {"params": out["params"]}, fps)
    return out["params"]

  # --- verification (the verify mode) -----------------------------------------------------------

  def saved_at(self, step: int) -> Optional[datetime.datetime]:
    """When `step` was committed (Orbax's step metadata; the directory's mtime without it)."""
    try:
      ns = self._manager.metadata(step).commit_timestamp_nsecs
      if ns:
        return datetime.datetime.fromtimestamp(ns / 1e9)
    except Exception:  # pylint: disable=broad-except
      pass
    try:
      return datetime.datetime.fromtimestamp(os.path.getmtime(self.step_path(step)))
    except OSError:
      return None

  def verify(self, step: int) -> "Verdict":
    """Reads every leaf of `step` as it was saved (spread over this host's devices, one
    top-level entry of the state at a time) and checks it: a Verdict, never an exception for a
    damaged or unreadable step."""
    status, leaves, reason, n = "verified", [], "", 0
    try:
      _, fps = self._read_meta(step)
      item = self._reading(step, lambda: self._manager.item_metadata(step).state)
      tree = getattr(item, "tree", item)
      self._check_described(step, _leaves_by_path(tree), fps)
      mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("x",))
      for key in sorted(tree):
        target = {key: jax.tree.map(lambda m: _spread(m, mesh), tree[key])}
        part = self._restore_part(step, target)
        n += len(jax.tree.leaves(part))
        if fps is not None:
          leaves += fingerprint_lib.mismatches(
              fps["leaves"], fingerprint_lib.fingerprints({key: part[key]}))
        del part
      if fps is None:
        status = "unverified"
      elif leaves:
        status = "damaged"
    except CheckpointDamagedError as e:
      status, leaves, reason = "damaged", e.leaves, str(e)
    except (CheckpointReadError, FileNotFoundError, ValueError) as e:
      status, reason = "unreadable", str(e)
    return Verdict(step, self.saved_at(step), status, leaves, reason, n)

  def move_aside(self, step: int, why: str = "unreadable") -> str:
    """Renames an unreadable (or damaged: why='damaged') step to '<step>.<why>' (never deletes
    it) so that later saves of that step and beyond proceed; returns the new path."""
    src = self.step_path(step)
    dst, n = f"{src}.{why}", 1
    while os.path.exists(dst):
      n += 1
      dst = f"{src}.{why}{n}"
    os.rename(src, dst)
    self._manager.reload()
    return dst

  def moved_aside(self) -> list:
    """Names of the steps moved aside in this directory ('4.damaged', '7.unreadable2'), sorted."""
    pattern = re.compile(r"^(\d+)\.(damaged|unreadable)\d*$")
    try:
      names = [n for n in os.listdir(self.directory) if pattern.match(n)]
    except OSError:
      return []
    return sorted(names, key=lambda n: (int(pattern.match(n).group(1)), n))

  # --- lifetime ----------------------------------------------------------------------------------

  def close(self) -> None:
    """Waits for pending saves, then releases the manager."""
    self._manager.wait_until_finished()
    self._manager.close()

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

"""Training checkpoints: a thin wrapper over `orbax.checkpoint.CheckpointManager`.

Each step directory holds two items: 'state' (the array pytree, StandardSave/StandardRestore) and
'meta' (a JSON dict: config, data position, metrics). Saving is asynchronous; Orbax writes into
'<step>.orbax-checkpoint-tmp' and renames on commit, so an interrupted save is never reported as a
checkpoint. Restores take an abstract target with shardings, so a run saved on N devices resumes on
M devices, and are checked against the stored metadata first so that a mismatch is a ValueError
naming the paths rather than a deep Orbax/TensorStore error. A step whose files cannot be read
(truncated, corrupted, deleted by hand) is a CheckpointReadError naming its directory, so callers
can fall back to an older step.
"""
import asyncio
import json
import logging
import os
import weakref
from typing import Any, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp

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
    self._manager = ocp.CheckpointManager(
        self.directory, options=options, item_names=("state", "meta"),
        item_handlers={"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()})

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
      self._manager.reload()
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
    json.dumps(meta)  # fail here, synchronously, rather than in the async writer
    # force=True: the interval decision above is ours, not Orbax's save_interval_steps.
    return self._manager.save(
        step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                      meta=ocp.args.JsonSave(meta)),
        force=True)

  def wait(self) -> None:
    """Blocks until pending async saves are committed."""
    self._manager.wait_until_finished()

  # --- restore -----------------------------------------------------------------------------------

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
    """Returns (state, meta) for `step` (latest by default), laid out as `abstract_state` says."""
    step = self._resolve_step(step)
    abstract_state = self._require_shardings(abstract_state)
    self._check_compatible(step, _leaves_by_path(abstract_state), self._stored_leaves(step))
    out = self._reading(step, lambda: self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore())))
    return out.state, out.meta

  def restore_meta(self, step: Optional[int] = None) -> dict:
    step = self._resolve_step(step)
    meta = self._reading(step, lambda: self._manager.restore(
        step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta)
    if not isinstance(meta, dict):
      raise CheckpointReadError(step, self.step_path(step), "its 'meta' item is not a JSON object")
    return meta

  def restore_params(self, abstract_params: Any, step: Optional[int] = None) -> Any:
    """Restores only state['params'] (for evaluation: no optimizer state or caches read)."""
    step = self._resolve_step(step)
    target = {"params": self._require_shardings(abstract_params)}
    stored = {p: x for p, x in self._stored_leaves(step).items()
              if p == "params" or p.startswith("params/")}
    self._check_compatible(step, _leaves_by_path(target), stored)
    # StandardRestore has no partial mode and the manager's 'state' handler only accepts
    # Standard args, so read the item directory with a PyTree checkpointer (partial_restore).
    path = os.path.join(self.step_path(step), "state")

    def read():
      with ocp.PyTreeCheckpointer() as ckptr:
        return ckptr.restore(path, args=ocp.args.PyTreeRestore(
            item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
            partial_restore=True))
    return self._reading(step, read)["params"]

  def move_aside(self, step: int) -> str:
    """Renames an unreadable step to '<step>.unreadable' (never deletes it) so that later saves
    of that step and beyond proceed; returns the new path."""
    src = self.step_path(step)
    dst, n = src + ".unreadable", 1
    while os.path.exists(dst):
      n += 1
      dst = f"{src}.unreadable{n}"
    os.rename(src, dst)
    self._manager.reload()
    return dst

  # --- lifetime ----------------------------------------------------------------------------------

  def close(self) -> None:
    """Waits for pending saves, then releases the manager."""
    self._manager.wait_until_finished()
    self._manager.close()

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

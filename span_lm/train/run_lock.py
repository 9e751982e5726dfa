"""One writer per run directory: the lock a training process holds on `<workdir>/run.lock`.

Two training processes on one directory (a double launch, a requeued job whose predecessor still
runs) would both resume from the same checkpoint and both write its steps and metrics.jsonl. So
training takes this lock before it compiles or writes anything, and a second one is refused in
one line naming the holder (host, pid, since when) and what to do, having touched nothing.

Mechanism:
  * an OS lock, fcntl.flock(LOCK_EX | LOCK_NB) on the lock file, held for the run's lifetime. The
    kernel releases it when the holder dies in any way (kill -9 included), so on one host a dead
    holder never blocks the next run;
  * the file's content (JSON: host, pid, the pid's start time, since, a random token) names the
    holder for the refusal message, and its mtime is a heartbeat (a thread touches it every
    HEARTBEAT_S seconds). flock does not reach across hosts on every shared file system, so a
    holder on another host is trusted while its heartbeat is younger than STALE_S; a lost node's
    lock is taken over after that. Where flock is not supported at all, a holder on this host is
    alive while its pid runs with the same start time.
A lock taken over from a dead or silent holder says so. The file is never deleted (deleting it
would let two processes lock two different files); releasing it empties it.

Read-only modes (eval, spans, flops, sample) never take it. With several processes
(jax.distributed) process 0 takes it and the others learn the outcome from it.
"""
import datetime
import errno
import json
import os
import secrets
import socket
import threading
import time
from typing import Any

from span_lm.train import distributed as dist_lib

LOCK_NAME = "run.lock"
HEARTBEAT_S = 30.0
STALE_S = 600.0  # a holder on another host whose heartbeat is older than this is gone

try:
  import fcntl  # pylint: disable=g-import-not-at-top
except ImportError:  # pragma: no cover  (not POSIX)
  fcntl = None


class RunLockedError(RuntimeError):
  """Another live training process holds the run directory (a user's mistake: one line)."""


def lock_path(workdir: str) -> str:
  return os.path.join(workdir, LOCK_NAME)


def _pid_start(pid: int) -> str | None:
  """The process's start time in clock ticks since boot (/proc/PID/stat field 22), or None."""
  try:
    with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
      return f.read().rsplit(")", 1)[1].split()[19]
  except (OSError, IndexError):
    return None


def _pid_alive(pid: int, start: str | None) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    pass  # alive, another user's
  except OSError:
    return True
  now = _pid_start(pid)
  return start is None or now is None or now == start  # a reused pid started later


def _read(fd: int) -> dict[str, Any] | None:
  os.lseek(fd, 0, os.SEEK_SET)
  data = b""
  while True:
    chunk = os.read(fd, 65536)
    if not chunk:
      break
    data += chunk
  if not data.strip():
    return None
  try:
    holder = json.loads(data)
  except (ValueError, UnicodeDecodeError):
    return {"unreadable": data[:200].decode("utf-8", "replace")}
  return holder if isinstance(holder, dict) else {"unreadable": str(holder)[:200]}


def describe(holder: dict[str, Any] | None) -> str:
  """'host H, pid P, since T' for a lock's content."""
  if not holder:
    return "an unknown process"
  if "unreadable" in holder:
    return f"an unknown process (unreadable lock content {holder['unreadable']!r})"
  return (f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, since "
          f"{holder.get('since', '?')}")


def _age(path: str) -> float:
  try:
    return max(0.0, time.time() - os.stat(path).st_mtime)
  except OSError:
    return float("inf")


class RunLock:
  """The run directory's lock, held until `release` (or the process's death)."""

  def __init__(self, workdir: str, fd: int, holder: dict[str, Any], note: str | None,
               created: bool = False):
    self.workdir, self.path = workdir, lock_path(workdir)
    self.created = created  # the lock made the run directory (see release's `undo`)
    self._fd, self.holder, self.note = fd, holder, note
    self.lost: dict[str, Any] | None = None  # who took the lock over (our heartbeat stalled)
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._beat, name="span_lm-run-lock", daemon=True)
    self._thread.start()

  def _beat(self):
    while not self._stop.wait(HEARTBEAT_S):
      self.heartbeat()

  def heartbeat(self) -> None:
    """Refreshes the lock's mtime; notes a takeover by another process (self.lost)."""
    if self._fd is None:
      return
    try:
      now = _read(self._fd)
      if now is not None and now.get("token") != self.holder["token"]:
        self.lost = now
        return
      os.utime(self.path)
    except OSError:
      pass  # a file system hiccup: the next beat tries again

  def check(self) -> None:
    """Raises RunLockedError when another process took the run directory over (it judged this
    one dead: its heartbeat stalled for STALE_S, e.g. a suspended job); called where the loop
    is about to write."""
    if self.lost is not None:
      raise RunLockedError(
          f"{self.path}: this run's lock was taken over by {describe(self.lost)} (this process's "
          f"heartbeat stalled for over {STALE_S:.0f}s); stopping without writing: two writers "
          "would corrupt the run. Stop one of them, then rerun to resume")

  def release(self, undo: bool = False) -> None:
    """Frees the lock. undo (a run that failed before it started): a run directory this lock
    created and that holds nothing else is removed, so a refused start leaves no trace."""
    self._stop.set()
    if self._fd is None:
      return
    fd, self._fd = self._fd, None
    try:
      now = _read(fd)
      if now is not None and now.get("token") == self.holder["token"]:
        os.ftruncate(fd, 0)  # free; the file stays (see the module docstring)
        if undo and self.created and os.listdir(self.workdir) == [LOCK_NAME]:
          os.unlink(self.path)  # still locked: nobody else can have taken it
          os.rmdir(self.workdir)
    except OSError:
      pass
    finally:
      if fcntl is not None:
        try:
          fcntl.flock(fd, fcntl.LOCK_UN)
        except OSError:
          pass
      os.close(fd)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.release()


def acquire(workdir: str, *, stale_s: float = STALE_S) -> RunLock:
  """Takes `<workdir>/run.lock` (creating workdir) or raises RunLockedError naming the holder.

  A refused process changes nothing in the directory (it only opens the existing file)."""
  created = not os.path.isdir(workdir)
  os.makedirs(workdir, exist_ok=True)
  path = lock_path(workdir)
  fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
  try:
    os_lock = True
    if fcntl is not None:
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
          raise RunLockedError(_refusal(path, _read(fd), "holds its lock")) from None
        os_lock = False  # ENOLCK, EOPNOTSUPP...: a file system without flock
    else:
      os_lock = False
    host = socket.gethostname()
    previous, note = _read(fd), None
    if previous:
      same_host = previous.get("host") == host
      pid = previous.get("pid")
      if same_host and isinstance(pid, int) and pid != os.getpid():
        # flock free: the holder is gone (its pid may be reused); without flock, ask the kernel
        if not os_lock and _pid_alive(pid, previous.get("pid_start")):
          raise RunLockedError(_refusal(path, previous, "is running"))
        note = (f"took over the lock of {describe(previous)}: that process is gone (killed or "
                "crashed); its run resumes from its last checkpoint")
      elif not same_host:
        age = _age(path)
        if age < stale_s:
          raise RunLockedError(_refusal(
              path, previous, f"holds it (its heartbeat is {age:.0f}s old; another host's lock "
              f"counts as abandoned after {stale_s:.0f}s without one)"))
        note = (f"took over the lock of {describe(previous)}: its heartbeat stopped "
                f"{age:.0f}s ago (a lost node or a killed job)")
      elif "unreadable" in previous:
        note = f"took over a lock with unreadable content ({previous['unreadable']!r})"
    holder = {"host": host, "pid": os.getpid(), "pid_start": _pid_start(os.getpid()),
              "since": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
              "token": secrets.token_hex(8)}
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, (json.dumps(holder) + "\n").encode())
    os.fsync(fd)
  except BaseException:
    os.close(fd)
    raise
  return RunLock(workdir, fd, holder, note, created)


def take(workdir: str, echo=print) -> RunLock | None:
  """The run directory's lock, taken by process 0 only, for all (the others stop with it when it
  cannot be taken); a note about the previous holder goes to `echo`."""
  lock = dist_lib.on_process_0(lambda: acquire(workdir), lambda: RunLockedError(
      f"process 0 could not take the lock of run directory {workdir} (its output says who "
      "holds it): not training"))
  if lock is not None and lock.note:
    echo(f"run directory lock: {lock.note}")
  return lock


def _refusal(path: str, holder: dict[str, Any] | None, how: str) -> str:
  workdir = os.path.dirname(path) or "."
  return (f"run directory {workdir} is in use: {describe(holder)} {how} ({path}). Wait for "
          f"that run to finish, stop it (it checkpoints on SIGTERM: kill -TERM "
          f"{(holder or {}).get('pid', 'PID')}{'' if not holder or 'host' not in holder else ' on ' + str(holder['host'])}), "
          "or train in another --config.workdir; eval, spans, flops and sample may read it "
          "meanwhile")

"""The `verify` mode: every checkpoint of a run directory read back whole and checked against the
fingerprints saved with it (train/checkpoint.py, train/fingerprint.py); a table, and exit status
1 when any step is damaged or unreadable.

It reads the state as it was saved (the shapes and dtypes in the checkpoint, spread over this
host's devices), so it needs neither the run's data nor its model code: only the checkpoints.
"""
from span_lm.train import checkpoint as ckpt_lib
from span_lm.train import metrics as metrics_lib

_echo = metrics_lib.echo

_SHOWN = {"verified": "verified", "damaged": "DAMAGED", "unreadable": "UNREADABLE",
          "unverified": "saved before fingerprints", "deleted": "deleted while read"}


def _line(v: ckpt_lib.Verdict) -> str:
  if v.status == "verified":
    what = f"verified ({v.arrays} arrays)"
  elif v.status == "unverified":
    what = f"saved before fingerprints: not verified ({v.arrays} arrays read)"
  elif v.status == "deleted":
    what = "deleted while read (a run saving into the directory keeps its newest steps)"
  elif v.status == "damaged":
    named = ", ".join(v.leaves[:8]) + (f" and {len(v.leaves) - 8} more" if len(v.leaves) > 8
                                       else "")
    what = f"DAMAGED: {named}"
  else:
    what = f"UNREADABLE: {v.reason}"
  when = v.saved_at.strftime("%Y-%m-%d %H:%M:%S") if v.saved_at else "?"
  return f"{v.step:>10}  {when:<19}  {what}"


def report(config) -> dict:
  """Verifies every committed step in config.workdir/checkpoints; prints the table. Returns
  {'verdicts': [...], 'exit_status': 0 | 1} (1: a step is damaged or unreadable)."""
  import os  # pylint: disable=g-import-not-at-top
  from span_lm import config as config_lib  # pylint: disable=g-import-not-at-top
  from span_lm.train import distributed as dist_lib  # pylint: disable=g-import-not-at-top
  config = config_lib.checked(config)  # builds no run.Run
  dist_lib.initialize(config)  # a no-op for a lone process
  directory = os.path.join(config.workdir, "checkpoints")
  if not os.path.isdir(directory):
    raise FileNotFoundError(f"no checkpoint in {directory} to verify")
  with ckpt_lib.Checkpointer(directory, max_to_keep=None) as ckpt:
    ckpt._noted_unverified = True  # pylint: disable=protected-access  (the table says so)
    steps = ckpt.all_steps()
    if not steps:
      raise FileNotFoundError(f"no committed checkpoint in {directory} to verify")
    _echo(f"checkpoints in {directory} (fingerprints: {ckpt_lib.fingerprint_lib.ALGORITHM}):")
    _echo(f"{'step':>10}  {'saved':<19}  status")
    verdicts = []
    for s in steps:
      v = ckpt.verify(s)
      if v.status == "unreadable" and s not in ckpt.all_steps(reread=True):
        v = v._replace(status="deleted")  # not damage: the training run's max_to_keep
      verdicts.append(v)
      _echo(_line(v))
    aside = ckpt.moved_aside()
  counts = {k: sum(v.status == k for v in verdicts) for k in _SHOWN}
  if aside:
    _echo(f"moved aside earlier (not checked): {', '.join(aside)}")
  _echo(f"{len(verdicts)} checkpoints: " + ", ".join(
      f"{n} {_SHOWN[k]}" for k, n in counts.items() if n))
  if counts["unverified"]:
    _echo("a checkpoint saved before fingerprints is read but cannot be checked; a resumed run "
          "writes fingerprints from its next save on")
  bad = counts["damaged"] + counts["unreadable"]
  return {"verdicts": verdicts, "moved_aside": aside, "exit_status": 1 if bad else 0}

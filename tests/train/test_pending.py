"""PendingSteps (span_lm/train/pending.py): dispatch ahead, read late, a refused step rewinds
the window and names what to replay. numpy flags stand for a step's metrics: no model."""
import numpy as np
import pytest

from span_lm.train import pending as pending_lib


class _Loss:
  """A loss that records when the host waited for it (jax.block_until_ready calls this)."""

  def __init__(self, step, waited):
    self.step, self._waited = step, waited

  def block_until_ready(self):
    self._waited.append(self.step)
    return self


def _metrics(step, *, skipped=0, short=None, ratios=None, loss=None):
  m = {"loss": np.float32(step) if loss is None else loss, "skipped": np.int32(skipped)}
  if short is not None:
    m["short"] = np.int32(short)
  if ratios is not None:
    m["span_ratio"] = np.asarray(ratios, np.float32)
  return m


def _z(step):  # span ratios (2 layers, 2 heads) that say which step they came from
  return [[step / 100, 0.5], [0.25, step / 100]]


def test_applied_steps_are_read_in_order_with_their_flags_and_ratios():
  p = pending_lib.PendingSteps()
  for s in (1, 2, 3):
    p.push(s, _metrics(s, skipped=int(s == 2), short=0, ratios=_z(s)), f"data@{s - 1}")
  assert len(p) == 3
  reads, refused = p.drain()
  assert refused is None and len(p) == 0
  assert [(r.step, r.skipped) for r in reads] == [(1, False), (2, True), (3, False)]
  np.testing.assert_array_equal(np.stack(reads[2].ratios), np.asarray(_z(3), np.float32))
  assert p.drain() == ([], None)  # nothing unread: nothing to read again


def test_fixed_spans_have_no_ratios_and_no_refusals():
  p = pending_lib.PendingSteps()
  p.push(1, _metrics(1), None)
  (read,), refused = p.drain()
  assert read.ratios is None and not read.skipped and refused is None


def test_a_refused_step_rewinds_exactly_itself_and_the_steps_after_it():
  """Steps 1-2 applied (read at an earlier log-less read), 3-4 applied, 5 refused, 6-7 no-ops
  behind it: reads are 3 and 4; the replay starts at 5's data position and runs 3 steps; the
  loss window loses exactly the losses of 5, 6 and 7."""
  p = pending_lib.PendingSteps()
  for s in (1, 2):
    p.push(s, _metrics(s, short=0, ratios=_z(s)), f"data@{s - 1}")
  p.drain()  # e.g. an evaluation step: the window goes on
  for s, short in ((3, 0), (4, 0), (5, 1), (6, 1), (7, 1)):
    p.push(s, _metrics(s, short=short, ratios=_z(s)), f"data@{s - 1}")
  reads, refused = p.drain()
  assert [r.step for r in reads] == [3, 4]
  assert (refused.step, refused.replay, refused.data_before) == (5, 3, "data@4")
  np.testing.assert_array_equal(np.stack(refused.ratios), np.asarray(_z(5), np.float32))
  assert len(p) == 0
  assert [float(x) for x in p.take_losses()] == [1.0, 2.0, 3.0, 4.0]
  assert p.take_losses() == []  # the window starts again


def test_the_replayed_steps_are_read_again_as_new_steps():
  p = pending_lib.PendingSteps()
  p.push(1, _metrics(1, short=1, ratios=_z(1)), "data@0")
  p.push(2, _metrics(2, short=1, ratios=_z(2)), "data@1")
  _, refused = p.drain()
  assert (refused.step, refused.replay, refused.data_before) == (1, 2, "data@0")
  for s in (1, 2):  # the loop replays from the refused step on a wider plan
    p.push(s, _metrics(s, short=0, ratios=_z(s), loss=np.float32(10 + s)), f"data@{s - 1}")
  reads, refused = p.drain()
  assert refused is None and [r.step for r in reads] == [1, 2]
  assert [float(x) for x in p.take_losses()] == [11.0, 12.0]  # only the replayed steps' losses


def test_a_step_applied_after_a_refused_one_is_an_internal_error():
  p = pending_lib.PendingSteps()
  p.push(1, _metrics(1, short=1, ratios=_z(1)), None)
  p.push(2, _metrics(2, short=0, ratios=_z(2)), None)
  with pytest.raises(RuntimeError, match="step 1 was refused but a later step was applied"):
    p.drain()


@pytest.mark.parametrize("lag", [1, 3, pending_lib.MAX_IN_FLIGHT])
def test_the_host_waits_for_the_step_lag_steps_back_and_never_reads_flags_early(lag):
  waited = []
  p = pending_lib.PendingSteps(max_in_flight=lag)
  for s in range(1, 12):
    p.push(s, _metrics(s, loss=_Loss(s, waited)), None)
    assert waited == list(range(1, s - lag + 1))  # step s waits for step s - lag, no other
  assert len(p) == 11  # nothing was read: pushing never drains
  p.drain()
  waited.clear()
  for s in range(12, 12 + lag):  # after a read the queue is empty: no wait for lag more steps
    p.push(s, _metrics(s, loss=_Loss(s, waited)), None)
  assert waited == []
  p.push(12 + lag, _metrics(12 + lag, loss=_Loss(12 + lag, waited)), None)
  assert waited == [12]

"""examples/masked_lm.py (issue 43, goal 9), run as a user runs it, from another folder, for a
handful of steps at tiny sizes: padded rows and packed rows both train with a finite masked loss,
print every layer's learned spans back and ahead for every head, and time the span path against
the dense path in the same run."""
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "examples" / "masked_lm.py"
LAYERS, HEADS, MAX_SPAN, RAMP = 2, 2, 16, 4


@pytest.mark.slow
@pytest.mark.parametrize("packing", ["padded", "packed"])
def test_masked_lm_example_trains_and_prints_spans_both_ways_and_its_speed(tmp_path, packing):
  cmd = [sys.executable, str(SCRIPT), "--steps", "4", "--log_every", "2", "--batch", "4",
         "--length", "40", "--max_span", str(MAX_SPAN), "--ramp", str(RAMP), "--layers",
         str(LAYERS), "--heads", str(HEADS), "--d_model", "32", "--speed_reps", "1",
         "--packing", packing]
  proc = subprocess.run(cmd, cwd=tmp_path,
                        capture_output=True, text=True, timeout=600, check=False)
  out = proc.stdout
  assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
  assert f"{packing}: batch 4, 4 steps" in out, out

  curve = re.findall(r"^step +(\d+): train (\S+)  valid (\S+)  \((\d+)% of the rows real", out,
                     re.M)
  assert [int(c[0]) for c in curve] == [2, 4], out
  for _, train, valid, real in curve:
    assert np.isfinite(float(train)) and 0 < float(train) < 20, out  # bits per masked token
    assert np.isfinite(float(valid)) and 0 < float(valid) < 20, out
    assert 0 < int(real) <= 100

  rows = re.findall(r"^\| (block\d) \| (back|ahead) \| (.*) \|$", out, re.M)
  assert [(b, s) for b, s, _ in rows] == [
      (f"block{i}", s) for i in range(LAYERS) for s in ("back", "ahead")], out
  for _, _, cells in rows:
    cells = re.findall(r"([0-9.]+) \((\d+)\)", cells)
    assert len(cells) == HEADS, out
    for z, window in cells:
      assert 0 <= float(z) <= MAX_SPAN and RAMP <= int(window) <= MAX_SPAN, out
      # the window is ceil(z) + R (z printed rounded to 0.1)
      assert abs(int(window) - min(MAX_SPAN, float(z) + RAMP)) <= 1.05, out

  times = dict(re.findall(r"^  (span|dense) path \(attn_impl='\w+'\) +([0-9.]+) ms$", out, re.M))
  assert set(times) == {"span", "dense"} and all(float(t) > 0 for t in times.values()), out
  assert re.search(r"the span path takes [0-9.]+x the dense path's time", out), out

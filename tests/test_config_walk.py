"""The run config's walk from main.py to the train step (bench/config_walk.py): the ConfigDict of
the command line stops at its edge. Once span_lm/config.py has checked it into a RunConfig, no
function of span_lm is handed the ConfigDict again, in training or in a tool that compiles the
train step (flops)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("mode", ["train", "flops"])
def test_the_configdict_stops_at_the_command_line(mode, tmp_path):
  out = tmp_path / "walk.json"
  proc = subprocess.run([sys.executable, "-m", "bench.config_walk", "--tree", ROOT, "--mode", mode,
                         "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  walk = json.loads(out.read_text())
  assert walk["reached_build"], walk  # the walk went all the way to the step builder
  assert walk["path"][0] == "span_lm/cli.py" and walk["path"][-1] == "span_lm/train/steps.py"
  assert "span_lm/run_config.py" in walk["path"]  # the RunConfig was made on the way
  assert walk["configdict_after_runconfig"] == [], walk["configdict_after_runconfig"]
  assert walk["enters_config_py"] <= 2, walk["path"]  # the edge: checked once (Run's no-op)

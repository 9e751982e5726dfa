"""examples/nnx_decoder.py, run as a user runs it, from another folder, for a handful of steps at
tiny sizes: it trains (finite loss), prints every block's spans and what decoding reads, checks
that the prompt decoded token by token gives the full forward's logits, and generates text."""
import pathlib
import re
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "examples" / "nnx_decoder.py"


@pytest.mark.slow
def test_nnx_decoder_example_trains_decodes_as_the_full_forward_and_generates(tmp_path):
  cmd = [sys.executable, "-W", "ignore", str(SCRIPT), "--steps", "4", "--log_every", "2",
         "--batch", "4", "--length", "32", "--d_model", "32", "--generate", "12"]
  proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600,
                        check=False)
  out = proc.stdout
  assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
  bits = [float(b) for b in re.findall(r"^step +\d+: ([0-9.]+) bits per byte", out, re.M)]
  assert len(bits) == 2 and all(0 < b < 20 for b in bits), out
  reads = re.findall(r"^  block(\d): z .* reads per KV head \[(\d+), (\d+)\] of 64 slots$", out,
                     re.M)
  assert [b for b, *_ in reads] == ["0", "1"], out
  assert all(16 <= int(r) <= 64 for _, *rs in reads for r in rs), out
  err = float(re.search(r"token by token against the full forward: (\S+) relative", out)[1])
  assert err < 1e-5, out
  assert re.search(r"^generated 12 bytes", out, re.M), out

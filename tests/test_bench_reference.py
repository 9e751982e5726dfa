"""bench/reference_step.py: what it checks before PyTorch is needed (CI has no torch)."""
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _reference_step(reference_dir):
  return subprocess.run([sys.executable, "-m", "bench.reference_step",
                         "--reference_dir", str(reference_dir)], capture_output=True, text=True,
                        cwd=REPO, timeout=120)


def test_refuses_a_directory_that_is_not_the_reference(tmp_path):
  (tmp_path / "README.md").write_text("not adaptive-span")
  out = _reference_step(tmp_path)
  assert out.returncode != 0
  assert "has no models.py" in out.stderr and "facebookresearch/adaptive-span" in out.stderr
  assert "Traceback" not in out.stderr  # a clear message, not a crash in torch's import


def test_refuses_a_modified_reference(tmp_path):
  """Ratios are quoted against the reference's own code: a changed file is refused in one line."""
  (tmp_path / "models.py").write_text("# not the reference's models.py\n")
  out = _reference_step(tmp_path)
  assert out.returncode != 0
  assert "models.py is modified" in out.stderr and "27b815f" in out.stderr
  assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1

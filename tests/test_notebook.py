"""The Colab notebook runs top to bottom (so it cannot rot): trains, plots, counts, samples."""
import os
import pathlib
import re

import pytest

NOTEBOOK = pathlib.Path(__file__).resolve().parents[1] / "notebooks" / "span_lm_tour.ipynb"


@pytest.mark.slow
def test_tour_notebook_executes(enwik8_head, tmp_path, monkeypatch):
  nbformat = pytest.importorskip("nbformat", reason="pip install -r requirements.txt (nbformat)")
  nbclient = pytest.importorskip("nbclient", reason="pip install -r requirements.txt (nbclient)")
  pytest.importorskip("ipykernel", reason="pip install -r requirements.txt (ipykernel)")
  # The kernel inherits this environment: a fresh run directory, a short run, CPU.
  monkeypatch.setenv("SPAN_LM_TOUR_WORKDIR", str(tmp_path / "tour"))
  monkeypatch.setenv("SPAN_LM_TOUR_STEPS", "30")
  monkeypatch.setenv("MPLBACKEND", "Agg")
  nb = nbformat.read(NOTEBOOK, as_version=4)
  client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                   resources={"metadata": {"path": str(NOTEBOOK.parent)}})
  client.execute()
  outputs = {i: "".join(o.get("text", "") for o in c.get("outputs", []))
             for i, c in enumerate(nb.cells) if c.cell_type == "code"}
  text = "\n".join(outputs.values())
  assert "step 30:" in text  # trained
  assert "| layer | h0 | h1 | h2 | h3 |" in text and "wrote heads plot" in text  # spans
  assert "XLA:" in text and "Table 1" in text  # FLOPs
  assert "temperature 0.8" in text  # sampled
  # the drop-in layer: spans start at z = 8 and shrink towards the task's distance 6 (reach z + 4)
  last = [line for line in text.splitlines() if line.startswith("step 300: loss")]
  assert last, text[-2000:]
  spans = [float(x) for x in re.findall(r"-?\d+\.\d+", last[0].split("spans z", 1)[1])]
  assert len(spans) == 4 and max(spans) < 8.0 and float(last[0].split()[3].rstrip(",")) < 0.1
  images = sum(1 for c in nb.cells for o in c.get("outputs", [])
               if "image/png" in o.get("data", {}))
  assert images >= 3
  assert os.path.exists(tmp_path / "tour" / "spans_heads.png")

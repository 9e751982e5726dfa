"""bench/refactor_proof.py's cases file covers the run config: a field added to the schema without
its bad-value cases fails here (remake the file: `python -m bench.refactor_proof --make-cases`)."""
import dataclasses
import json
import pathlib

from span_lm import config as config_lib

from bench import refactor_proof

REPO = pathlib.Path(__file__).resolve().parents[1]


def _leaves(node, prefix=""):
  """Dotted names of a run config's values (a ConfigDict's, or a dataclass's)."""
  items = (node.items() if hasattr(node, "items") else
           ((f.name, getattr(node, f.name)) for f in dataclasses.fields(node)))
  out = []
  for name, value in items:
    if hasattr(value, "items") or dataclasses.is_dataclass(value):
      out += _leaves(value, f"{prefix}{name}.")
    else:
      out.append(prefix + name)
  return out


def test_every_leaf_of_the_run_config_has_its_bad_value_cases(monkeypatch):
  monkeypatch.chdir(REPO)
  leaves = set(_leaves(config_lib.load_config(refactor_proof.BASE_CONFIG)))
  cases = json.loads(pathlib.Path(refactor_proof.CASES_FILE).read_text())
  covered = {c["leaf"] for c in cases if "leaf" in c}
  assert len(leaves) > 100
  assert sorted(leaves - covered) == [], "fields without cases: remake the cases file"
  for c in cases:
    if "leaf" in c:
      values = (refactor_proof.PATH_BAD_VALUES if c["leaf"] in refactor_proof.PATH_LEAVES else
                refactor_proof.BAD_VALUES[c["kind"]])
      assert len([d for d in cases if d.get("leaf") == c["leaf"]]) == len(values)
  assert len({c["id"] for c in cases}) == len(cases)

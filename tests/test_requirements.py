"""requirements.txt and pyproject.toml admit the same tested versions of the core libraries, and
the environment running the tests is inside them (the ranges say what CI tests: .ci/run)."""
import pathlib
import re
import tomllib
from importlib import metadata

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
CORE = ("jax", "flax", "optax", "orbax-checkpoint")


def _ranges(lines) -> dict:
  out = {}
  for line in lines:
    m = re.match(r"^\s*([A-Za-z0-9_.-]+)(\[[^\]]*\])?\s*([<>=!~].*)$", line.split("#")[0].strip())
    if m and m.group(1).lower() in CORE and not m.group(2):
      out[m.group(1).lower()] = m.group(3).replace(" ", "")
  return out


def _version(text: str) -> tuple:
  return tuple(int(x) for x in re.findall(r"\d+", text))


def test_requirements_and_pyproject_admit_the_same_versions():
  req = _ranges((REPO / "requirements.txt").read_text().splitlines())
  proj = _ranges(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"])
  assert set(req) == set(CORE) and req == proj


@pytest.mark.parametrize("name", CORE)
def test_the_installed_version_is_inside_the_tested_range(name):
  spec = _ranges((REPO / "requirements.txt").read_text().splitlines())[name]
  have = _version(metadata.version(name))
  for clause in spec.split(","):
    op, v = re.match(r"(<=|>=|==|<|>)(.*)", clause).groups()
    want = _version(v)
    assert {"<=": have <= want, ">=": have >= want, "==": have == want, "<": have < want,
            ">": have > want}[op], f"{name} {metadata.version(name)} outside {spec}"

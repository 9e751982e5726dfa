"""Damage for the checkpoint tests: a flipped bit in a file, or in one element of a saved leaf.

`damage_leaf` changes one bit of one stored element through TensorStore (a new version of the
step's OCDBT database: what a restore reads is then a different, well-formed value, exactly the
damage Orbax cannot see); `flip_bit` changes a byte of a file in place. Nothing here imports JAX
at module level (worker processes import this before JAX).
"""
import json
import pathlib


def flip_bit(path, offset: int, bit: int = 0) -> None:
  path = pathlib.Path(path)
  data = bytearray(path.read_bytes())
  data[offset] ^= 1 << bit
  path.write_bytes(bytes(data))


def damage_leaf(step_dir, leaf: str, element: int = 0, bit: int = 0) -> None:
  """Flips `bit` of element `element` (C order) of leaf 'params/layers_0/...' in the saved
  state of `step_dir` (a '<checkpoints>/<step>' directory)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorstore as ts  # pylint: disable=g-import-not-at-top
  state = pathlib.Path(step_dir) / "state"
  arr = ts.open({"driver": "zarr", "kvstore": {
      "driver": "ocdbt", "base": f"file://{state}/", "path": leaf.replace("/", ".") + "/"}}).result()
  a = np.array(arr.read().result())
  raw = a.reshape(-1).view(np.uint8)
  raw[element * a.dtype.itemsize + bit // 8] ^= 1 << (bit % 8)
  arr.write(a).result()


def edit_meta(step_dir, change) -> None:
  """Rewrites the step's meta JSON with change(meta) applied (a valid file with other values)."""
  path = pathlib.Path(step_dir) / "meta" / "metadata"
  meta = json.loads(path.read_text())
  change(meta)
  path.write_text(json.dumps(meta))


def largest_param(step_dir) -> str:
  """The leaf path of the largest parameter saved in step_dir (from its meta's description)."""
  meta = json.loads((pathlib.Path(step_dir) / "meta" / "metadata").read_text())
  arrays = meta["fingerprints"]["arrays"]

  def size(text):
    dims = text.split("[", 1)[1].rstrip("]")
    n = 1
    for d in dims.split(",") if dims else []:
      n *= int(d)
    return n
  return max((p for p in arrays if p.startswith("params/")), key=lambda p: size(arrays[p]))

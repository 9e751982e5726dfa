"""Flax parameter trees as safetensors files: one flat name per leaf, and a checked reader.

Names: a tree path's keys joined by '.', a key `name_N` written `name.N` (`layers_3/attn/query/
kernel` -> `layers.3.attn.query.kernel`, `in_emb/emb_0` -> `in_emb.emb.0`); `unflatten` inverts
it. Keys holding '.', keys that are only digits and empty keys are refused: they would not
read back. span_lm's run export (span_lm/tools/safetensors_format.py) names tensors with these.

Reading a file someone sent you: `check_file` parses the header itself, only to validate it
(8-byte little-endian header length, then JSON), with bounded reads: a claimed header or tensor
larger than the file, overlapping or out-of-range offsets, a byte count that is not
shape x dtype, unknown dtypes, and (given what is expected) a missing, extra, reshaped or
retyped tensor are each refused in one line (SafetensorsError, a ValueError) before anything of
the claimed size is allocated. Only then is the file handed to the safetensors library, which
does all the reading and writing (safetensors is an optional extra: pip install safetensors).
"""
from collections.abc import Mapping
import json
import math
import os
import re
import struct
from typing import Any

import numpy as np

FILE_NAME = "model.safetensors"
MAX_HEADER = 100 * 1024 * 1024  # the safetensors library's own limit on the JSON header
PIP = "pip install 'safetensors>=0.4,<1'"
# safetensors dtype -> numpy dtype name (BF16 is ml_dtypes' bfloat16, which jax brings)
DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
          "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U64": "uint64",
          "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool"}
ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
            "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1}
_INDEXED = re.compile(r"^(.+)_(\d+)$")


class SafetensorsError(ValueError):
  """A safetensors file that is malformed or is not the model expected (one line)."""


class MissingLibraryError(ImportError, ValueError):
  """safetensors is not installed (a ValueError too: the command line reports it in one line)."""


def library():
  """The safetensors package, or MissingLibraryError naming the pip command."""
  try:
    import safetensors.numpy  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise MissingLibraryError(f"safetensors is not installed: {PIP} (or pip install "
                              "span_lm[safetensors])"
                      ) from None
  return safetensors


def _key(entry) -> str:
  return str(getattr(entry, "key", getattr(entry, "name", entry)))


def flat_name(path) -> str:
  """The tensor name of a tree path (a tuple of keys or jax path entries)."""
  parts = []
  for k in (_key(p) for p in path):
    if not k or "." in k or k.isdigit():
      raise ValueError(f"parameter key {k!r} (in {'/'.join(map(_key, path))}) cannot be a "
                       "safetensors name: keys must be non-empty, without '.', not only digits")
    m = _INDEXED.match(k)
    parts += [m.group(1), m.group(2)] if m else [k]
  return ".".join(parts)


def tree_path(name: str) -> tuple[str, ...]:
  """flat_name's inverse: 'layers.3.attn.query.kernel' -> ('layers_3', 'attn', 'query',
  'kernel')."""
  out = []
  for part in name.split("."):
    if part.isdigit() and out:
      out[-1] = f"{out[-1]}_{part}"
    else:
      out.append(part)
  return tuple(out)


def flatten(params) -> dict[str, Any]:
  """{flat name: leaf} of a parameter tree (a nested mapping; Flax's FrozenDict too)."""
  import jax  # pylint: disable=g-import-not-at-top
  out = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    name = flat_name(path)
    if name in out:
      raise ValueError(f"two parameters share the safetensors name {name!r}")
    out[name] = leaf
  return out


def unflatten(flat: Mapping[str, Any]) -> dict:
  """The nested dict of {flat name: array}."""
  tree: dict = {}
  for name, value in flat.items():
    *parents, leaf = tree_path(name)
    node = tree
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = value
  return tree


def dtype_code(dtype) -> str:
  """The safetensors dtype ('F32') of a numpy/jax dtype."""
  name = np.dtype(dtype).name
  for code, n in DTYPES.items():
    if n == name:
      return code
  raise ValueError(f"dtype {name} has no safetensors code")


# ---- reading: the header checked first -----------------------------------------------------------


def read_header(path) -> tuple[dict, dict]:
  """(tensors {name: {'dtype', 'shape', 'data_offsets'}}, __metadata__) of a safetensors file,
  validated against the file's size with bounded reads; SafetensorsError names the first fault."""
  path = os.fspath(path)
  size = os.path.getsize(path)
  where = os.path.basename(path)
  raw = _header_bytes(path, size)
  header, meta = _parse_header(path, raw)
  data_len = size - 8 - len(raw)
  spans = [_tensor_span(where, name, t, data_len) for name, t in header.items()]
  end = 0
  for begin, stop, name in sorted(spans):
    if begin < end:
      raise SafetensorsError(f"{where}: tensor {name!r}: data_offsets [{begin}, {stop}] overlap "
                             "the previous tensor's")
    if begin > end:
      raise SafetensorsError(f"{where}: bytes [{end}, {begin}) before tensor {name!r} belong to "
                             "no tensor")
    end = stop
  if end != data_len:
    raise SafetensorsError(f"{where}: {data_len - end:,} data bytes after the last tensor belong "
                           "to no tensor")
  return header, meta


def _header_bytes(path: str, size: int) -> bytes:
  """The JSON header's bytes, read only once its claimed length fits the file (and the limit)."""
  if size < 8:
    raise SafetensorsError(f"{path}: {size} bytes, too short for a safetensors file (8-byte "
                           "header length, JSON header, data)")
  with open(path, "rb") as f:
    (n,) = struct.unpack("<Q", f.read(8))
    if n > MAX_HEADER or 8 + n > size:
      raise SafetensorsError(f"{path}: claims a header of {n:,} bytes; the file has {size:,} "
                             f"(limit {MAX_HEADER:,}): not a (complete) safetensors file")
    return f.read(n)


def _parse_header(path: str, raw: bytes) -> tuple[dict, dict]:
  """The header as a JSON object without repeated names, and its __metadata__ (strings only)."""
  def no_duplicates(pairs):
    keys = [k for k, _ in pairs]
    twice = sorted(k for k in set(keys) if keys.count(k) > 1)
    if twice:
      raise SafetensorsError(f"{path}: its header names {twice[:3]} more than once")
    return dict(pairs)

  try:
    header = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicates)
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise SafetensorsError(f"{path}: its header is not JSON ({e})") from None
  if not isinstance(header, dict):
    raise SafetensorsError(f"{path}: its header is a JSON {type(header).__name__}, not an object")
  meta = header.pop("__metadata__", None) or {}
  if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
    raise SafetensorsError(f"{path}: __metadata__ must map strings to strings")
  return header, meta


def _tensor_span(where: str, name: str, t, data_len: int) -> tuple[int, int, str]:
  """(begin, end, name) of one header entry, checked: its fields, dtype, shape, and offsets that
  lie in the data and hold exactly the shape's bytes."""
  if not isinstance(t, dict) or set(t) != {"dtype", "shape", "data_offsets"}:
    raise SafetensorsError(f"{where}: tensor {name!r}: an entry needs exactly dtype, shape, "
                           "data_offsets")
  code, shape, offs = t["dtype"], t["shape"], t["data_offsets"]
  if code not in ITEMSIZE:
    raise SafetensorsError(f"{where}: tensor {name!r}: unknown dtype {code!r}")
  ints = lambda xs: isinstance(xs, list) and all(
      isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in xs)
  if not ints(shape):
    raise SafetensorsError(f"{where}: tensor {name!r}: shape {shape!r} is not a list of "
                           "non-negative integers")
  if not ints(offs) or len(offs) != 2 or offs[0] > offs[1]:
    raise SafetensorsError(f"{where}: tensor {name!r}: data_offsets {offs!r} are not "
                           "[begin, end] with begin <= end")
  claimed = math.prod(shape) * ITEMSIZE[code]
  if offs[1] > data_len:
    raise SafetensorsError(f"{where}: tensor {name!r}: data_offsets {offs} run past the "
                           f"{data_len:,} data bytes the file holds (out of range)")
  if offs[1] - offs[0] != claimed:
    raise SafetensorsError(f"{where}: tensor {name!r}: {code} {shape} needs {claimed:,} bytes, "
                           f"its data_offsets {offs} hold {offs[1] - offs[0]:,}")
  return offs[0], offs[1], name


def check_expected(header: dict, expected: Mapping[str, tuple[tuple[int, ...], str]],
                   where: str = FILE_NAME) -> None:
  """Refuses (one line) a header whose tensors are not `expected` {name: (shape, numpy dtype
  name)}: missing, extra, another shape or dtype. dtype None: any floating dtype."""
  missing = sorted(set(expected) - set(header))
  extra = sorted(set(header) - set(expected))
  if missing or extra:
    parts = ([f"missing {', '.join(missing[:5])}" + (" ..." if len(missing) > 5 else "")]
             if missing else []) + ([f"unexpected {', '.join(extra[:5])}" +
                                     (" ..." if len(extra) > 5 else "")] if extra else [])
    raise SafetensorsError(f"{where} does not hold the model's tensors: {'; '.join(parts)}")
  for name, (shape, dtype) in expected.items():
    got = header[name]
    if tuple(got["shape"]) != tuple(shape):
      raise SafetensorsError(f"{where}: tensor {name!r} has shape {tuple(got['shape'])}, the "
                             f"model needs {tuple(shape)}")
    got_dtype = DTYPES[got["dtype"]]
    if dtype is None and got["dtype"] not in ("F64", "F32", "F16", "BF16"):
      raise SafetensorsError(f"{where}: tensor {name!r} is {got_dtype}, not a float dtype")
    if dtype is not None and got_dtype != np.dtype(dtype).name:
      raise SafetensorsError(f"{where}: tensor {name!r} is {got_dtype}, the model declares "
                             f"{np.dtype(dtype).name}")


def check_file(path, expected=None) -> tuple[dict, dict]:
  """read_header, then (given {name: (shape, dtype)}) check_expected: (header, metadata)."""
  header, meta = read_header(path)
  if expected is not None:
    check_expected(header, expected, os.path.basename(os.fspath(path)))
  return header, meta


def read_tensors(path, expected=None) -> dict[str, np.ndarray]:
  """{name: numpy array} of a safetensors file, checked (check_file) before the library reads."""
  header, _ = check_file(path, expected)
  lib = library()
  try:
    return dict(lib.numpy.load_file(os.fspath(path)))
  except (KeyError, TypeError, ValueError):
    if not any(t["dtype"] == "BF16" for t in header.values()):
      raise
    # safetensors releases whose numpy reader lacks bfloat16: the flax one (jax arrays) reads it
    import safetensors.flax  # pylint: disable=g-import-not-at-top
    return {k: np.asarray(v) for k, v in safetensors.flax.load_file(os.fspath(path)).items()}


# ---- the layer's parameters ----------------------------------------------------------------------


def save_safetensors(params, path, metadata: Mapping[str, str] | None = None) -> str:
  """Writes a Flax parameter tree (e.g. a model built on AdaptiveSpanAttention: variables
  ['params']) to the safetensors file `path`, its leaves as they are (dtype kept), under
  flat_name's names. metadata: strings stored in the header's __metadata__."""
  lib = library()
  import jax  # pylint: disable=g-import-not-at-top
  flat = {k: np.ascontiguousarray(np.asarray(jax.device_get(v)))
          for k, v in flatten(params).items()}
  lib.numpy.save_file(flat, os.fspath(path), metadata=dict(metadata) if metadata else None)
  return os.fspath(path)


def load_safetensors(path, like=None) -> dict:
  """A parameter tree from a file save_safetensors wrote, checked before it is read (check_file).

  like: a tree of what is expected (arrays or jax.ShapeDtypeStruct: e.g. `jax.eval_shape(
  model.init, ...)['params']`): every name, shape and dtype must match it, else one line.
  Returns nested dicts of numpy arrays (pass them to model.apply as {'params': tree})."""
  expected = None
  if like is not None:
    expected = {k: (tuple(v.shape), np.dtype(v.dtype).name) for k, v in flatten(like).items()}
  return unflatten(read_tensors(path, expected))

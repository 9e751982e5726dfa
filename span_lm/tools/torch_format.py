"""Reads and writes `torch.save` files without torch: tensors come and go as numpy arrays.

Reference checkpoints must be importable where torch is not installed (it is not a dependency).
Both container formats are read: the zip archive of torch >= 1.6 (`<name>/data.pkl` plus one
`<name>/data/<key>` record per storage) and the older "legacy" stream (magic number, protocol,
system info, the pickle, the storage keys, then each storage as an int64 element count and its
raw bytes), in which the published adaptive-span models (2019) were saved.

A .pt file is data and never runs code: every pickle in it (the legacy header objects included)
is read by span_lm/safe_pickle.py with the allowlist `_GLOBALS` (an OrderedDict, torch.Size, the
storage types and the tensor/parameter rebuild functions, each a stand-in that checks its
arguments); any other name is refused (ForbiddenGlobalError: one line naming the file and the
name), and no fallback is tried for such a file. Sizes are checked against the file before
anything is read or allocated: a storage's element count against its zip record or against the
bytes left in the legacy stream, a zip record's size against the archive (records are stored
uncompressed, as torch.save writes them: no decompression bombs), a tensor's size and
strides against its storage, and all tensors together against their storages' bytes. A file this
reader cannot read for another reason raises FormatError; `load` then tries
`torch.load(weights_only=True)` when torch is installed.

`save` writes either format (pickle protocol 2, as torch does); torch.load reads both.
"""
import collections
import io
import os
import pickle
import struct
import zipfile
from typing import Any

import numpy as np

from span_lm import safe_pickle
from span_lm.safe_pickle import printable

_LEGACY_MAGIC = 0x1950a86a20f9469cfc6c
_LEGACY_PROTOCOL = 1001

_DTYPES = {  # torch storage class name -> numpy dtype
    "DoubleStorage": np.float64, "FloatStorage": np.float32, "HalfStorage": np.float16,
    "BFloat16Storage": np.uint16,  # raw bits, widened to float32 below
    "LongStorage": np.int64, "IntStorage": np.int32, "ShortStorage": np.int16,
    "CharStorage": np.int8, "ByteStorage": np.uint8, "BoolStorage": np.bool_,
    "UntypedStorage": np.uint8,
}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()
          if k not in ("BFloat16Storage", "UntypedStorage")}
_MAX_COUNT = 2 ** 62  # any element count, offset, size or stride above this is not a real file
_OUTPUT_FACTOR = 4  # all tensors together may hold this many times their storages' bytes


class FormatError(safe_pickle.PickleDataError):
  """The file is not a torch.save file this reader understands (malformed, truncated, other)."""


class _NoState:
  """A stand-in the pickle may not give state to (BUILD): its fields come from checked calls."""
  __slots__ = ()

  def __setstate__(self, state):
    raise FormatError(f"state given to a {type(self).__name__.strip('_')}")


class _StorageType(_NoState):
  __slots__ = ("name", "dtype")

  def __init__(self, name: str):
    self.name = name
    self.dtype = np.dtype(_DTYPES[name])


class _Storage(_NoState):
  """A storage whose bytes may arrive after the pickle (legacy format)."""
  __slots__ = ("type", "numel", "array")

  def __init__(self, storage_type: _StorageType, numel: int):
    self.type, self.numel, self.array = storage_type, numel, None

  @property
  def nbytes(self) -> int:
    return self.numel * self.type.dtype.itemsize

  def fill(self, raw: bytes, order: str = "little") -> None:
    dtype = self.type.dtype.newbyteorder("<" if order == "little" else ">")
    flat = np.frombuffer(raw, dtype=dtype).astype(self.type.dtype)
    if self.type.name == "BFloat16Storage":
      flat = (flat.astype(np.uint32) << 16).view(np.float32)
    self.array = flat


class _Tensor(_NoState):
  """A tensor waiting for its storage's data; resolved after the whole file is read."""
  __slots__ = ("storage", "offset", "size", "stride")

  def __init__(self, storage, offset, size, stride):
    self.storage, self.offset, self.size, self.stride = storage, offset, size, stride

  def nbytes(self) -> int:
    """The bytes of the array resolve() makes (its storage's data must be there)."""
    count = 1
    for n in self.size:
      count *= n
    return count * self.storage.array.dtype.itemsize

  def check(self) -> None:
    """Raises FormatError unless every element the tensor reads lies in its storage."""
    flat = self.storage.array
    if flat is None:
      raise FormatError("a tensor's storage data is missing from the file")
    if not self.size:
      if self.offset >= flat.size:
        raise FormatError(f"a scalar tensor at offset {self.offset:,} of a storage of "
                          f"{flat.size:,} elements")
    elif 0 in self.size:
      other = 1
      for n in self.size:
        other *= max(n, 1)
      if other * flat.dtype.itemsize >= _MAX_COUNT:
        raise FormatError(f"an empty tensor of size {self.size}")
    else:
      span = self.offset + sum((n - 1) * s for n, s in zip(self.size, self.stride)) + 1
      if span > flat.size:
        raise FormatError(f"a tensor of size {self.size} and stride {self.stride} at offset "
                          f"{self.offset:,} runs past its storage of {flat.size:,} elements")

  def resolve(self) -> np.ndarray:
    """The tensor as a new array (call check() first)."""
    flat = self.storage.array
    if not self.size:
      return np.array(flat[self.offset])
    if 0 in self.size:
      return np.zeros(self.size, flat.dtype)
    stride = [0 if n == 1 else s * flat.dtype.itemsize for n, s in zip(self.size, self.stride)]
    return np.lib.stride_tricks.as_strided(flat[self.offset:], self.size, stride).copy()


def _count(x, what: str) -> int:
  if type(x) is not int or not 0 <= x <= _MAX_COUNT:
    raise FormatError(f"{what} {printable(x)} is not a count")
  return x


def _dims(x, what: str) -> tuple[int, ...]:
  if not isinstance(x, (tuple, list)) or len(x) > safe_pickle.MAX_NDIM:
    raise FormatError(f"{what} {printable(x)} is not a tuple of at most "
                      f"{safe_pickle.MAX_NDIM} counts")
  return tuple(_count(n, what) for n in x)


def _storage_key(key) -> str:
  if isinstance(key, bytes):
    key = key.decode("utf-8", "replace")
  if type(key) is int:
    key = str(key)
  if not isinstance(key, str):
    raise FormatError(f"storage key {printable(key)}")
  return key


def _rebuild_tensor(storage, offset, size, stride, *unused):
  """torch._utils._rebuild_tensor(_v2)'s stand-in: a lazy tensor over a checked storage."""
  if not isinstance(storage, _Storage):
    raise FormatError("a tensor whose storage is not a storage")
  size, stride = _dims(size, "tensor size"), _dims(stride, "tensor stride")
  if len(size) != len(stride):
    raise FormatError(f"a tensor of size {size} with stride {stride}")
  return _Tensor(storage, _count(offset, "tensor offset"), size, stride)


def _rebuild_parameter(data, *unused):
  if not isinstance(data, _Tensor):
    raise FormatError("a parameter that is not a tensor")
  return data


def _torch_size(dims=()):
  return _dims(dims, "torch.Size")


def _ordered_dict(items=()):
  """collections.OrderedDict's stand-in: empty (protocol 2+) or from [key, value] pairs (as
  Python 2 pickled it), keys of the kinds a pickle's dicts may have."""
  if not isinstance(items, (list, tuple)):
    raise FormatError("an OrderedDict built from something other than a list of pairs")
  out = collections.OrderedDict()
  for pair in items:
    if not isinstance(pair, (list, tuple)) or len(pair) != 2 or not safe_pickle.safe_key(pair[0]):
      raise FormatError("an OrderedDict built from something other than (key, value) pairs")
    out[pair[0]] = pair[1]
  return out


_GLOBALS = {
    ("collections", "OrderedDict"): _ordered_dict,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch", "Size"): _torch_size,
    **safe_pickle.BYTES_PROTOCOL2,  # bytes values in protocol-2 pickles
    **{(module, name): _StorageType(name)
       for module in ("torch", "torch.cuda", "torch.storage") for name in _DTYPES},
}


def _storage_pid(pid, length: int):
  if (not isinstance(pid, tuple) or len(pid) != length or pid[0] not in ("storage", b"storage")
      or not isinstance(pid[1], _StorageType)):
    raise FormatError(f"unsupported persistent id {printable(pid)}")
  return pid[1], _storage_key(pid[2]), _count(pid[4], "storage size")


def _resolve(obj, storages):
  """obj with each lazy tensor as a numpy array, containers rebuilt (their instance attributes,
  such as a state_dict's _metadata, dropped); all tensors together hold at most _OUTPUT_FACTOR
  times the storages' bytes (views of one storage are the only way past 1x)."""
  budget = [_OUTPUT_FACTOR * sum(st.array.nbytes for st in storages if st.array is not None)]
  cache = {}

  def walk(o):
    t = type(o)
    if t is _Tensor:
      key = (id(o.storage), o.offset, o.size, o.stride)
      if key not in cache:
        o.check()
        budget[0] -= o.nbytes()
        if budget[0] < 0:
          raise FormatError("the tensors claim more data than their storages hold "
                            f"({_OUTPUT_FACTOR}x; overlapping or expanded views)")
        cache[key] = o.resolve()
      return cache[key]
    if t in (_Storage, _StorageType):
      raise FormatError(f"a bare {t.__name__.strip('_')} outside a tensor")
    if isinstance(o, dict):
      out = collections.OrderedDict() if isinstance(o, collections.OrderedDict) else {}
      for k, v in dict.items(o):
        out[k] = walk(v)
      return out
    if t is list:
      return [walk(v) for v in o]
    if t is tuple:
      return tuple(walk(v) for v in o)
    return o

  return walk(obj)


def _record(zf: zipfile.ZipFile, name: str, archive_size: int, expected: int | None = None,
            limit: int | None = None) -> bytes:
  """The bytes of one zip record, its claimed sizes checked before it is read."""
  try:
    info = zf.getinfo(name)
  except KeyError:
    raise FormatError(f"no record {printable(name)} in the zip file") from None
  if info.compress_type != zipfile.ZIP_STORED:  # torch.save never compresses: no zip bombs
    raise FormatError(f"record {printable(name)} is compressed (method {info.compress_type}); "
                      "torch.save stores its records uncompressed")
  if info.compress_size != info.file_size:
    raise FormatError(f"record {printable(name)}: stored with sizes {info.compress_size:,} "
                      f"and {info.file_size:,}")
  if info.header_offset + info.compress_size > archive_size:
    raise FormatError(f"record {printable(name)} claims {info.compress_size:,} bytes at offset "
                      f"{info.header_offset:,} of a file of {archive_size:,} bytes")
  if expected is not None and info.file_size != expected:
    raise FormatError(f"record {printable(name)} holds {info.file_size:,} bytes, its storage "
                      f"claims {expected:,}")
  if limit is not None and info.file_size > limit:
    raise FormatError(f"record {printable(name)} holds {info.file_size:,} bytes (at most "
                      f"{limit} expected)")
  data = zf.read(info)
  if len(data) != info.file_size:
    raise FormatError(f"record {printable(name)}: read {len(data):,} of {info.file_size:,} bytes")
  return data


def _load_zip(f, path: str, size: int) -> Any:
  with zipfile.ZipFile(f) as zf:
    names = zf.namelist()
    pkl = [n for n in names if n.endswith("data.pkl") and n.count("/") == 1]
    if len(pkl) != 1:
      raise FormatError("a zip file without one '<name>/data.pkl' record")
    prefix = pkl[0][:-len("data.pkl")]
    order = "little"
    if prefix + "byteorder" in names:
      order = _record(zf, prefix + "byteorder", size, limit=16).decode("ascii", "replace").strip()
      if order not in ("little", "big"):
        raise FormatError(f"byte order {printable(order)}")
    storages = {}

    def storage_for(pid):
      storage_type, key, numel = _storage_pid(pid, 5)
      if key not in storages:
        st = _Storage(storage_type, numel)
        st.fill(_record(zf, f"{prefix}data/{key}", size, expected=st.nbytes), order)
        storages[key] = st
      if storages[key].type is not storage_type or storages[key].numel != numel:
        raise FormatError(f"storage {printable(key)} is read as two different storages")
      return storages[key]

    obj = safe_pickle.loads(_record(zf, pkl[0], size), _GLOBALS, path=path,
                            persistent_load=storage_for)
    return _resolve(obj, storages.values())


def _load_legacy(f, path: str, size: int) -> Any:
  _legacy_header(f, path, size)
  storages, views = {}, []
  obj = safe_pickle.load_from(f, _GLOBALS, path=path, end=size,
                              persistent_load=_legacy_storage_for(storages, views))
  keys = safe_pickle.load_from(f, {}, path=path, end=size)
  if not isinstance(keys, list):
    raise FormatError("the storage keys of a legacy torch.save file are not a list")
  keys = [_storage_key(key) for key in keys]
  if len(set(keys)) != len(keys):
    raise FormatError("a storage key is listed twice")
  for key in keys:
    st = storages.get(key)
    if st is None:
      raise FormatError(f"data for storage {printable(key)}, which no tensor names")
    _fill_legacy_storage(f, key, st, size)
  for st, root, offset in views:
    if root.array is not None:
      st.array = root.array[offset:offset + st.numel]
  return _resolve(obj, storages.values())


def _legacy_header(f, path: str, size: int) -> None:
  """Reads the three pickles before a legacy file's object: the magic number, the protocol and
  the system info (little-endian only)."""
  try:
    magic = safe_pickle.load_from(f, {}, path=path, end=size)
  except safe_pickle.ForbiddenGlobalError:
    raise
  except safe_pickle.PickleDataError as e:
    why = str(e)[len(f"{path}: "):] if str(e).startswith(f"{path}: ") else str(e)
    raise FormatError(f"neither a zip nor a legacy torch.save file ({why})") from e
  if type(magic) is not int or magic != _LEGACY_MAGIC:
    raise FormatError("not a torch.save file (bad magic number)")
  protocol = safe_pickle.load_from(f, {}, path=path, end=size)
  if type(protocol) is not int or protocol != _LEGACY_PROTOCOL:
    raise FormatError("unsupported legacy torch.save protocol")
  info = safe_pickle.load_from(f, {}, path=path, end=size)
  if not isinstance(info, dict):
    raise FormatError("the system info of a legacy torch.save file is not a dict")
  if info.get("little_endian", True) is not True:
    raise FormatError("big-endian legacy files are not supported")


def _legacy_storage_for(storages: dict, views: list):
  """The pickle's persistent_load: a storage per key (in `storages`), or a view of one (its data
  copied from the root's once read: listed in `views`)."""
  def storage_for(pid):
    storage_type, key, numel = _storage_pid(pid, 6)
    if key not in storages:
      storages[key] = _Storage(storage_type, numel)
    root = storages[key]
    if root.type is not storage_type or root.numel != numel:
      raise FormatError(f"storage {printable(key)} is read as two different storages")
    view = pid[5]
    if view is None:
      return root
    if not isinstance(view, tuple) or len(view) != 3:
      raise FormatError(f"storage view {printable(view)}")
    offset, count = _count(view[1], "view offset"), _count(view[2], "view size")
    if offset + count > numel:
      raise FormatError(f"a view of {count:,} elements at {offset:,} of a storage of {numel:,}")
    st = _Storage(storage_type, count)
    views.append((st, root, offset))
    return st

  return storage_for


def _fill_legacy_storage(f, key, st: _Storage, size: int) -> None:
  """One storage's data as the legacy file stores it: its element count, then its bytes."""
  head = f.read(8)
  if len(head) != 8:
    raise FormatError("truncated storage data")
  (n,) = struct.unpack("<q", head)
  if n != st.numel:
    raise FormatError(f"storage {printable(key)} has {n:,} elements in its data and "
                      f"{st.numel:,} in the pickle")
  left = size - f.tell()
  if st.nbytes > left:
    raise FormatError(f"storage {printable(key)} claims {n:,} elements ({st.nbytes:,} bytes) "
                      f"where {left:,} bytes remain (truncated or corrupt file)")
  raw = f.read(st.nbytes)
  if len(raw) != st.nbytes:
    raise FormatError("truncated storage data")
  st.fill(raw)


def _read(path: str) -> Any:
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    try:
      if zipfile.is_zipfile(f):
        return _load_zip(f, path, size)
      f.seek(0)
      return _load_legacy(f, path, size)
    except safe_pickle.ForbiddenGlobalError:
      raise
    except safe_pickle.PickleDataError as e:
      text = str(e)
      raise FormatError(text if text.startswith(f"{path}: ") else f"{path}: {text}") from e
    except MemoryError:  # never expected: every size is checked first; a bug, kept visible
      raise
    except Exception as e:  # pylint: disable=broad-except  # zipfile, numpy, struct on bad bytes
      raise FormatError(f"{path}: malformed torch.save file ({type(e).__name__}: "
                        f"{printable(str(e), 200)})") from e


def _to_numpy(obj):
  """torch.load's output with every tensor as a numpy array."""
  import torch  # pylint: disable=g-import-not-at-top
  if isinstance(obj, torch.Tensor):
    t = obj.detach().cpu()
    return t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy()
  if isinstance(obj, dict):
    out = type(obj)() if isinstance(obj, collections.OrderedDict) else {}
    for k, v in obj.items():
      out[k] = _to_numpy(v)
    return out
  if isinstance(obj, (list, tuple)):
    return type(obj)(_to_numpy(v) for v in obj)
  return obj


def load(path, *, allow_torch: bool = True) -> Any:
  """The object a torch.save file holds, tensors as numpy arrays (bfloat16 widened to float32).

  Reads without torch. A file whose pickle names anything outside the allowlist raises
  safe_pickle.ForbiddenGlobalError (never retried). A file this reader cannot read otherwise
  is read by torch.load(weights_only=True, on CPU) when torch is installed (and allow_torch);
  FileNotFoundError / FormatError otherwise.
  """
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"no such file: {path}")
  try:
    return _read(path)
  except FormatError as e:
    if not allow_torch:
      raise
    try:
      import torch  # pylint: disable=g-import-not-at-top
    except ImportError:
      raise FormatError(f"{e} (installing torch may read it)") from e
    try:
      obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e2:  # pylint: disable=broad-except
      why = (str(e2).strip().splitlines() or [type(e2).__name__])[0]
      raise FormatError(f"{e}; torch.load(weights_only=True) could not read it either "
                        f"({printable(why, 200)})") from e2
    return _to_numpy(obj)


# --------------------------------------------------------------------------------------- writing


class _Global:
  """A reference to `module.name` written as a pickle GLOBAL without importing the module."""

  def __init__(self, module: str, name: str):
    self.module, self.name = module, name

  def __call__(self, *args):  # pickle wants a callable reduce function; never called here
    raise TypeError("placeholder")


class _SaveStorage:

  def __init__(self, key: str, array: np.ndarray):
    self.key, self.array = key, array


class _SaveTensor:
  """Pickles as torch._utils._rebuild_tensor_v2 over one contiguous storage."""

  def __init__(self, storage: _SaveStorage):
    self.storage = storage

  def __reduce__(self):
    a = self.storage.array
    stride = tuple(s // a.itemsize for s in a.strides) if a.ndim else ()
    return (_Global("torch._utils", "_rebuild_tensor_v2"),
            (self.storage, 0, tuple(a.shape), stride, False, collections.OrderedDict()))


class _Pickler(pickle._Pickler):  # the Python pickler: its dispatch table can be extended
  dispatch = dict(pickle._Pickler.dispatch)

  def _save_global_ref(self, obj):
    self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())

  dispatch[_Global] = _save_global_ref

  def __init__(self, f, legacy: bool):
    super().__init__(f, protocol=2)
    self._legacy = legacy

  def persistent_id(self, obj):
    if isinstance(obj, _SaveStorage):
      a = obj.array
      pid = ("storage", _Global("torch", _NAMES[a.dtype]), obj.key, "cpu", a.size)
      return pid + (None,) if self._legacy else pid  # legacy: no storage view
    return None


def save(obj: Any, path, *, use_torch: bool = False, legacy: bool = False) -> None:
  """Writes `obj` (dicts, lists, numbers, strings, numpy arrays) as torch.save would.

  Arrays become tensors. use_torch: write with torch.save itself (torch must be installed).
  legacy: the pre-1.6 stream format instead of the zip archive (what torch < 1.6 reads).
  """
  path = os.fspath(path)
  if use_torch:
    _save_with_torch(obj, path)
    return
  storages: list[_SaveStorage] = []
  wrap = _wrapper(storages)
  tmp = f"{path}.tmp{os.getpid()}"
  if legacy:
    with open(tmp, "wb") as f:
      for header in (_LEGACY_MAGIC, _LEGACY_PROTOCOL,
                     {"protocol_version": _LEGACY_PROTOCOL, "little_endian": True,
                      "type_sizes": {"short": 2, "int": 4, "long": 8}}):
        pickle.dump(header, f, protocol=2)
      _Pickler(f, legacy=True).dump(wrap(obj))
      pickle.dump([st.key for st in storages], f, protocol=2)
      for st in storages:
        f.write(struct.pack("<q", st.array.size) + _le_bytes(st.array))
  else:
    buf = io.BytesIO()
    _Pickler(buf, legacy=False).dump(wrap(obj))
    name = os.path.splitext(os.path.basename(path))[0] or "archive"
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as zf:
      zf.writestr(f"{name}/data.pkl", buf.getvalue())
      zf.writestr(f"{name}/byteorder", "little")
      for st in storages:
        zf.writestr(f"{name}/data/{st.key}", _le_bytes(st.array))
      zf.writestr(f"{name}/version", "3\n")
  os.replace(tmp, path)


def _save_with_torch(obj: Any, path: str) -> None:
  """save(use_torch=True): the arrays as torch tensors, written by torch.save itself."""
  import torch  # pylint: disable=g-import-not-at-top

  def to_torch(o):
    if isinstance(o, np.ndarray):
      return torch.from_numpy(np.array(o, order="C"))  # a writable copy
    if isinstance(o, dict):
      out = type(o)() if isinstance(o, collections.OrderedDict) else {}
      for k, v in o.items():
        out[k] = to_torch(v)
      return out
    if isinstance(o, (list, tuple)):
      return type(o)(to_torch(v) for v in o)
    return o

  torch.save(to_torch(obj), path)


def _wrapper(storages: list):
  """The function that copies an object for pickling: each array a tensor over a new storage
  (appended to `storages` in the order met), containers rebuilt, the rest as it is."""
  def wrap(o):
    if isinstance(o, (np.ndarray, np.generic)):
      a = np.ascontiguousarray(o)
      if a.dtype not in _NAMES:
        raise TypeError(f"cannot save arrays of dtype {a.dtype}")
      storages.append(_SaveStorage(str(len(storages)), a))
      return _SaveTensor(storages[-1])
    if isinstance(o, dict):
      out = type(o)() if isinstance(o, collections.OrderedDict) else {}
      for k, v in o.items():
        out[k] = wrap(v)
      return out
    if isinstance(o, (list, tuple)):
      return type(o)(wrap(v) for v in o)
    return o

  return wrap


def _le_bytes(a: np.ndarray) -> bytes:
  return a.astype(a.dtype.newbyteorder("<")).tobytes()

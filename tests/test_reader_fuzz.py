"""Property-based fuzz of the file readers (slow tier): valid .pt files (both formats, the
committed torch-written fixtures included) and CIFAR-10 batches (Python 2, protocols 2 and 4),
mutated by bit flips, truncation, insertion, deletion and overwrites with telling bytes; the
readers return or raise the package's format error (safe_pickle.PickleDataError), in one line,
within 30 s per file and without allocating more than 64x the file's bytes + 1 MiB."""
import contextlib
import pathlib
import pickle
import signal

import numpy as np
import pytest

import pickle_payloads as pp
from span_lm import safe_pickle
from span_lm.data import cifar
from span_lm.tools import torch_format

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # pylint: disable=g-import-not-at-top,wrong-import-position

pytestmark = pytest.mark.filterwarnings(  # pickletools on a mangled protocol-0 string
    "ignore:invalid escape sequence:DeprecationWarning")
TORCH_FILES = pathlib.Path(__file__).resolve().parent / "fixtures" / "golden" / "torch_files"

_MUTATION = st.one_of(
    st.tuples(st.just("flip"), st.floats(0, 1), st.integers(0, 7)),
    st.tuples(st.just("truncate"), st.floats(0, 1), st.just(0)),
    st.tuples(st.just("insert"), st.floats(0, 1), st.binary(min_size=1, max_size=8)),
    st.tuples(st.just("delete"), st.floats(0, 1), st.integers(1, 16)),
    st.tuples(st.just("overwrite"), st.floats(0, 1), st.sampled_from(
        [b"\xff" * 4, b"\x7f\xff\xff\xff", b"\x00" * 8, b"\xff" * 8, b"\x00\x00\x00\x40",
         b"c", b"R", b"\x93", b"b", b"Q", b"(", b"."])),
)


def _mutate(data: bytes, mutations) -> bytes:
  out = bytearray(data)
  for kind, where, arg in mutations:
    pos = min(int(where * len(out)), max(len(out) - 1, 0))
    if kind == "flip" and out:
      out[pos] ^= 1 << arg
    elif kind == "truncate":
      del out[pos:]
    elif kind == "insert":
      out[pos:pos] = arg
    elif kind == "delete":
      del out[pos:pos + arg]
    elif kind == "overwrite":
      out[pos:pos + len(arg)] = arg
  return bytes(out)


class _Hang(Exception):
  pass


@contextlib.contextmanager
def _no_hang(seconds: int):
  def on_alarm(signum, frame):
    raise _Hang(f"the reader ran for more than {seconds} s")
  previous = signal.signal(signal.SIGALRM, on_alarm)
  signal.alarm(seconds)
  try:
    yield
  finally:
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


FUZZ = settings(max_examples=300, deadline=10_000, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow])


def _fuzz_one(path: pathlib.Path, data: bytes, read):
  """Reads a mutated file: it reads, or raises the package's format error; never anything else,
  never for longer than 30 s, never allocating more than 64x the file's bytes + 1 MiB."""
  path.write_bytes(data)
  with _no_hang(30), pp.bounded_allocation(64 * len(data) + (1 << 20)):
    try:
      read(path)
    except safe_pickle.PickleDataError as e:
      assert "\n" not in str(e), str(e)


@pytest.mark.slow
@pytest.mark.parametrize("base", ["zip", "legacy", "adaptive_zip.pt", "pers_legacy.pt"])
def test_fuzz_pt_reader(tmp_path, base):
  data = (pp.valid_pt_files(tmp_path)[base] if base in ("zip", "legacy")
          else (TORCH_FILES / base).read_bytes())
  path = tmp_path / "fuzz.pt"

  @FUZZ
  @given(st.lists(_MUTATION, min_size=1, max_size=4))
  def run(mutations):
    _fuzz_one(path, _mutate(data, mutations), lambda p: torch_format.load(p, allow_torch=False))

  run()


@pytest.mark.slow
@pytest.mark.parametrize("base", ["python2", "protocol2", "protocol4"])
def test_fuzz_cifar_reader(tmp_path, base):
  images = np.random.default_rng(0).integers(0, 256, (2, 3072), dtype=np.uint8)
  d = {b"batch_label": b"b", b"labels": [0, 1], b"data": images, b"filenames": [b"0.png"] * 2}
  data = pp.small_py2_batch() if base == "python2" else pickle.dumps(d, protocol=int(base[-1]))
  path = tmp_path / "data_batch_1"

  @FUZZ
  @given(st.lists(_MUTATION, min_size=1, max_size=4))
  def run(mutations):
    _fuzz_one(path, _mutate(data, mutations), cifar.read_batch)

  run()

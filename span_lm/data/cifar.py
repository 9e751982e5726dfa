"""CIFAR-10 as sequences of 3072 bytes (Sparse Transformer Sec. 7.1) from the python pickle batches.

Reads the standard `cifar-10-batches-py` files (data_batch_1..5, test_batch: pickled dicts whose
b'data' is uint8 (N, 3072), channel-planar R, G, B of a 32x32 image) from a local directory;
nothing is downloaded. Each image becomes 3072 byte tokens in raster order, row by row, each
pixel's R, G, B together: position p is (row, column, channel) = unravel(p, (32, 32, 3)), the
coordinates of the model's data position embeddings (model.sparse.pos='data').

A batch is data and never runs code: it is unpickled by span_lm/safe_pickle.py with numpy's
array reconstruction as the only names allowed (plus the latin-1 bytes of protocol-2 pickles),
then checked (b'data' uint8 (N, 3072), b'labels' N ints); anything else is one line naming the
file. A `cifar-10-python.tar.gz` in data_dir is unpacked (its published md5 checked first, only
the batch files taken, with tarfile's 'data' filter) when no batches are there yet.

Splits as the paper: the last 2000 training images are the validation set (1/25 of the training
images when fewer than 50000 are present, e.g. a test fixture), test_batch is the test set. Each
split is the concatenation of its images, so a block of 3072 tokens read at a multiple of 3072 is
one image (with its next-byte targets).
"""
import os
import pathlib
import pickle
import shutil
import tarfile
import zlib

import numpy as np

from span_lm import safe_pickle
from span_lm.data import download
from span_lm.data.prepare import Splits

TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_FILE = "test_batch"
IMAGE_SHAPE = (32, 32, 3)
IMAGE_BYTES = 32 * 32 * 3
PAPER_VALID = 2000
ARCHIVE = "cifar-10-python.tar.gz"
ARCHIVE_MD5 = "c58f30108f718f92721af3b95e74349a"  # https://www.cs.toronto.edu/~kriz/cifar.html
BATCH_DIR = "cifar-10-batches-py"
_ARCHIVE_FILES = TRAIN_FILES + (TEST_FILE, "batches.meta", "readme.html")
_ALLOWED = {**safe_pickle.NUMPY_ARRAYS, **safe_pickle.BYTES_PROTOCOL2}


def find_dir(data_dir, *, archive_md5: str | None = None) -> pathlib.Path:
  """data_dir itself, or its cifar-10-batches-py subdirectory (where the tarball unpacks); a
  cifar-10-python.tar.gz in data_dir is checked (md5) and unpacked there when neither holds the
  batches. archive_md5: the archive's expected md5 (default ARCHIVE_MD5, the published one)."""
  d = pathlib.Path(data_dir)
  for cand in (d, d / BATCH_DIR):
    if (cand / TRAIN_FILES[0]).is_file():
      return cand
  if (d / ARCHIVE).is_file():
    return unpack_archive(d / ARCHIVE, d, md5=archive_md5)
  raise FileNotFoundError(
      f"no CIFAR-10 python batches in {d} or {d / BATCH_DIR}: put {ARCHIVE} "
      "(https://www.cs.toronto.edu/~kriz/cifar.html) in that directory or unpack it there, and "
      "set config.data.data_dir")


def unpack_archive(archive, dest, *, md5: str | None = None) -> pathlib.Path:
  """Checks `archive`'s md5, then unpacks its batch files into dest/cifar-10-batches-py (only
  those regular files, tarfile's 'data' filter on, through a temporary directory renamed at the
  end). md5: the expected md5 (default ARCHIVE_MD5). Returns that directory; DataIntegrityError
  for an archive that is not the published one, or that does not unpack."""
  archive, dest = pathlib.Path(archive), pathlib.Path(dest)
  try:
    download.verify_file(archive, md5=md5 or ARCHIVE_MD5)  # before anything in it is read
  except download.DataIntegrityError as e:
    raise download.DataIntegrityError(
        f"{e}: not the published {ARCHIVE} (a truncated or corrupt download?); nothing was "
        "unpacked: download it again from https://www.cs.toronto.edu/~kriz/cifar.html") from e
  out = dest / BATCH_DIR
  tmp = dest / f".{BATCH_DIR}.tmp{os.getpid()}"
  shutil.rmtree(tmp, ignore_errors=True)
  try:
    with tarfile.open(archive, "r:gz") as tar:
      wanted = {f"{BATCH_DIR}/{name}" for name in _ARCHIVE_FILES}
      members = [m for m in tar.getmembers() if m.name in wanted and m.isreg()]
      if not any(m.name == f"{BATCH_DIR}/{TRAIN_FILES[0]}" for m in members):
        raise download.DataIntegrityError(f"{archive}: no {BATCH_DIR}/{TRAIN_FILES[0]} in it")
      tmp.mkdir(parents=True)
      kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
      tar.extractall(tmp, members=members, **kwargs)
    os.replace(tmp / BATCH_DIR, out)
  except (tarfile.TarError, EOFError, OSError, zlib.error) as e:
    if isinstance(e, download.DataIntegrityError):
      raise
    raise download.DataIntegrityError(f"{archive}: unpacking failed ({e})") from e
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  return out


def read_batch(path) -> tuple[np.ndarray, np.ndarray]:
  """(images uint8 (N, 3072) channel-planar, labels int64 (N,)) of one pickle batch.

  Raises safe_pickle.PickleDataError (ForbiddenGlobalError for a name outside the allowlist)
  for a file that is not such a batch."""
  with open(path, "rb") as f:
    raw = f.read()
  d = safe_pickle.loads(raw, _ALLOWED, path=path, encoding="bytes")
  if not isinstance(d, dict) or b"data" not in d or b"labels" not in d:
    raise safe_pickle.PickleDataError(
        f"{path}: not a CIFAR-10 python batch (a dict with b'data' and b'labels')")
  data, labels = d[b"data"], d[b"labels"]
  if (not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2
      or data.shape[1] != IMAGE_BYTES):
    what = (f"{data.dtype} {data.shape}" if isinstance(data, np.ndarray)
            else type(data).__name__)
    raise safe_pickle.PickleDataError(
        f"{path}: b'data' is {what}, expected uint8 (N, {IMAGE_BYTES})")
  if (not isinstance(labels, list) or len(labels) != data.shape[0]
      or not all(type(l) is int and 0 <= l < 2 ** 31 for l in labels)):
    raise safe_pickle.PickleDataError(
        f"{path}: b'labels' is not a list of {data.shape[0]} non-negative ints")
  return np.ascontiguousarray(data), np.asarray(labels, np.int64)


def write_batch(path, images_Nx3072: np.ndarray, labels) -> None:
  """Writes a batch in the original format (tests; converting other image sets)."""
  d = {b"batch_label": os.path.basename(str(path)).encode(), b"labels": list(map(int, labels)),
       b"data": np.asarray(images_Nx3072, np.uint8),
       b"filenames": [f"{i}.png".encode() for i in range(len(labels))]}
  with open(path, "wb") as f:
    pickle.dump(d, f, protocol=4)  # bytes as bytes (protocol 2 wraps them in _codecs.encode)


def to_raster(images_Nx3072: np.ndarray) -> np.ndarray:
  """Channel-planar (N, 3, 32, 32) rows -> (N, 3072) raster order with interleaved channels."""
  n = images_Nx3072.shape[0]
  return images_Nx3072.reshape(n, 3, 32, 32).transpose(0, 2, 3, 1).reshape(n, IMAGE_BYTES)


def load_images(data_dir) -> dict[str, np.ndarray]:
  """{'train', 'valid', 'test'} -> uint8 (N, 3072) raster-order images."""
  d = find_dir(data_dir)
  train = [read_batch(d / f)[0] for f in TRAIN_FILES if (d / f).is_file()]
  if not (d / TEST_FILE).is_file():
    raise FileNotFoundError(f"{d / TEST_FILE} is missing")
  train = to_raster(np.concatenate(train))
  n_valid = PAPER_VALID if len(train) >= 50_000 else max(1, len(train) // 25)
  return {"train": train[:-n_valid], "valid": train[-n_valid:],
          "test": to_raster(read_batch(d / TEST_FILE)[0])}


def cifar10_splits(data_dir) -> Splits:
  """The byte streams of the three splits (images concatenated), vocabulary of 256 bytes."""
  images = load_images(data_dir)
  flat = {k: v.reshape(-1) for k, v in images.items()}
  return Splits(flat["train"], flat["valid"], flat["test"], tuple(str(i) for i in range(256)),
                name="cifar10")

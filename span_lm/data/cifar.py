"""CIFAR-10 as sequences of 3072 bytes (Sparse Transformer Sec. 7.1) from the python pickle batches.

Reads the standard `cifar-10-batches-py` files (data_batch_1..5, test_batch: pickled dicts whose
b'data' is uint8 (N, 3072), channel-planar R, G, B of a 32x32 image) from a local directory;
nothing is downloaded. Each image becomes 3072 byte tokens in raster order, row by row, each
pixel's R, G, B together: position p is (row, column, channel) = unravel(p, (32, 32, 3)), the
coordinates of the model's data position embeddings (model.sparse.pos='data').

Splits as the paper: the last 2000 training images are the validation set (1/25 of the training
images when fewer than 50000 are present, e.g. a test fixture), test_batch is the test set. Each
split is the concatenation of its images, so a block of 3072 tokens read at a multiple of 3072 is
one image (with its next-byte targets).
"""
import os
import pathlib
import pickle

import numpy as np

from span_lm.data.prepare import Splits

TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_FILE = "test_batch"
IMAGE_SHAPE = (32, 32, 3)
IMAGE_BYTES = 32 * 32 * 3
PAPER_VALID = 2000


def find_dir(data_dir) -> pathlib.Path:
  """data_dir itself, or its cifar-10-batches-py subdirectory (where the tarball unpacks)."""
  d = pathlib.Path(data_dir)
  for cand in (d, d / "cifar-10-batches-py"):
    if (cand / TRAIN_FILES[0]).is_file():
      return cand
  raise FileNotFoundError(
      f"no CIFAR-10 python batches in {d} or {d / 'cifar-10-batches-py'}: unpack "
      "cifar-10-python.tar.gz (https://www.cs.toronto.edu/~kriz/cifar.html) there and set "
      "config.data.data_dir")


def read_batch(path) -> tuple[np.ndarray, np.ndarray]:
  """(images uint8 (N, 3072) channel-planar, labels int64 (N,)) of one pickle batch."""
  with open(path, "rb") as f:
    d = pickle.load(f, encoding="bytes")
  data = np.asarray(d[b"data"], np.uint8)
  if data.ndim != 2 or data.shape[1] != IMAGE_BYTES:
    raise ValueError(f"{path}: b'data' has shape {data.shape}, expected (N, {IMAGE_BYTES})")
  return data, np.asarray(d[b"labels"], np.int64)


def write_batch(path, images_Nx3072: np.ndarray, labels) -> None:
  """Writes a batch in the original format (tests; converting other image sets)."""
  d = {b"batch_label": os.path.basename(str(path)).encode(), b"labels": list(map(int, labels)),
       b"data": np.asarray(images_Nx3072, np.uint8),
       b"filenames": [f"{i}.png".encode() for i in range(len(labels))]}
  with open(path, "wb") as f:
    pickle.dump(d, f, protocol=2)


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

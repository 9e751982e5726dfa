"""The demo corpus shipped inside the package: the first 4,154,000 bytes of enwik8.

So that a fresh clone or `pip install` trains, evaluates and tests with no download and nothing
beside the checkout (`config.data.dataset='enwik8_head'`, configs/tiny.py). Stored xz-compressed
(enwik8_head.xz, 1.17 MB) and decompressed in memory with the standard library's lzma.

Source: enwik8, Matt Mahoney's Large Text Compression Benchmark (http://mattmahoney.net/dc/),
the first 10^8 bytes of an English Wikipedia XML dump of 2006-03-03; this is its first 4,154,000
bytes, byte for byte. Licence: Wikipedia text, CC BY-SA 3.0 / GFDL (see README.md here).
"""
import functools
import hashlib
import importlib.resources
import lzma

import numpy as np

FILE = "enwik8_head.xz"
SIZE = 4_154_000  # bytes, decompressed
MD5 = "7007cce93037fb4e59c3b2c8dc6db975"  # of the decompressed bytes
# (train_end, valid_end): train = [0, 3654000), valid = [3654000, 3904000), test = [3904000, end).
SPLIT_BYTES = (3_654_000, 3_904_000)


def compressed_path():
  """The packaged .xz file (a Traversable; a pathlib.Path for an installed or cloned package)."""
  return importlib.resources.files(__name__) / FILE


@functools.lru_cache(maxsize=1)
def read_bytes() -> bytes:
  """The decompressed corpus, checked against its size and md5 (cached)."""
  with compressed_path().open("rb") as f:
    raw = lzma.decompress(f.read())
  if len(raw) != SIZE or hashlib.md5(raw).hexdigest() != MD5:
    raise ValueError(f"{compressed_path()}: decompressed to {len(raw):,} bytes that are not the "
                     f"demo corpus ({SIZE:,} bytes, md5 {MD5}); reinstall span_lm")
  return raw


def as_array() -> np.ndarray:
  """The corpus as a read-only uint8 array."""
  return np.frombuffer(read_bytes(), dtype=np.uint8)

"""Where token ids come from: the benchmark corpora, a local raw file, or a synthetic task.

`load_splits(config.data)` is the one entry point. `dataset='enwik8_head'` reads the head of
enwik8 packaged in span_lm/data/demo (the demo and the tests: no download, no path). The
benchmark corpora are prepared once into `<data_dir>/<name>/` ({train,valid,test}.npy +
vocab.json, written atomically, vocab.json last as the completion marker); later runs only read
that cache. The archive is downloaded only when the cache is missing and the zip is not already
in `data_dir`.

Optional `config.data` fields (a hand-built config.data may lack them; defaults in brackets):
  vocab_order     [auto] first | frequency | auto (frequency for wikitext103, else first)
  file_vocab      [reference] reference (newline -> <eos>, first-appearance ids) | bytes (ids = byte)
  synthetic_seed  [0] seed of the synthetic task (its permutation and noise)
"""
import dataclasses
import json
import math
import os
import pathlib
import zipfile

import numpy as np

from span_lm.data import download as dl
from span_lm.data import prepare
from span_lm.data.prepare import Splits

CACHE_FORMAT = 1


class DatasetUnavailableError(RuntimeError):
  """The dataset is neither prepared nor downloadable; the message says where to put it."""


@dataclasses.dataclass(frozen=True)
class Corpus:
  """A benchmark corpus: where its zip comes from and what it must contain."""
  url: str
  zip_name: str
  members: tuple[str, ...]  # one raw member (bytes corpora) or train/valid/test text files
  member_size: int | None = None
  member_md5: str | None = None
  zip_size: int | None = None
  heldout: int = prepare.REFERENCE_HELDOUT  # bytes corpora: size of valid and of test


CORPORA = {
    "enwik8": Corpus("http://mattmahoney.net/dc/enwik8.zip", "enwik8.zip", ("enwik8",),
                     member_size=100_000_000, member_md5="a1fa5ffddb56f4953e226637dabbb36a",
                     zip_size=36_445_475),
    "text8": Corpus("http://mattmahoney.net/dc/text8.zip", "text8.zip", ("text8",),
                    member_size=100_000_000),
    "wikitext103": Corpus(
        "https://s3.amazonaws.com/research.metamind.io/wikitext/wikitext-103-v1.zip",
        "wikitext-103-v1.zip",
        tuple(f"wikitext-103/wiki.{s}.tokens" for s in prepare.SPLITS)),
}
DEMO = "enwik8_head"  # the corpus packaged in span_lm/data/demo (no download, no path)
DATASETS = tuple(CORPORA) + (DEMO, "file", "synthetic", "cifar10")


def _get(cfg, key, default):
  """A config field that may be absent (ConfigDict, dict or any attribute holder)."""
  if isinstance(cfg, dict):
    value = cfg.get(key, default)
  else:
    value = getattr(cfg, key, default)
  return default if value is None else value


# ---------------------------------------------------------------------------------------- cache


def _atomic_write(path: pathlib.Path, write) -> None:
  tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
  try:
    with open(tmp, "wb") as f:
      write(f)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  finally:
    if tmp.exists():
      tmp.unlink()


def save_cache(cache_dir, tok: Splits, name: str, meta: dict) -> None:
  """Writes the splits, then vocab.json (the marker that the cache is complete)."""
  cache_dir = pathlib.Path(cache_dir)
  cache_dir.mkdir(parents=True, exist_ok=True)
  for s in prepare.SPLITS:
    _atomic_write(cache_dir / f"{s}.npy", lambda f, a=tok.split(s): np.save(f, a))
  info = dict(format=CACHE_FORMAT, name=name, vocab=list(tok.vocab),
              lengths={s: int(tok.split(s).size) for s in prepare.SPLITS},
              dtype=str(tok.train.dtype), **meta)
  _atomic_write(cache_dir / "vocab.json", lambda f: f.write(json.dumps(info).encode()))


def load_cache(cache_dir) -> Splits | None:
  """The cached splits, or None when the cache is absent, partial or of another format."""
  cache_dir = pathlib.Path(cache_dir)
  try:
    info = json.loads((cache_dir / "vocab.json").read_text())
    if info.get("format") != CACHE_FORMAT:
      return None
    arrays = {s: np.load(cache_dir / f"{s}.npy", mmap_mode="r") for s in prepare.SPLITS}
  except (OSError, ValueError):
    return None
  if any(arrays[s].shape != (info["lengths"][s],) for s in prepare.SPLITS):
    return None
  return Splits(**arrays, vocab=tuple(info["vocab"]), name=info["name"])


# ------------------------------------------------------------------------------ benchmark corpora


def _zip_path(data_dir: pathlib.Path, name: str, corpus: Corpus, allow_download: bool):
  """The corpus zip: found in data_dir (or data_dir/name), else downloaded to data_dir."""
  for candidate in (data_dir / corpus.zip_name, data_dir / name / corpus.zip_name):
    if candidate.exists():
      return candidate
  dest = data_dir / corpus.zip_name
  manual = (f"Download {corpus.url} by hand and place it at {dest} "
            f"(or put a prepared cache in {data_dir / name}), then run again.")
  if not allow_download:
    raise DatasetUnavailableError(f"{name}: not prepared and no {corpus.zip_name}. {manual}")
  try:
    return dl.download(corpus.url, dest, expected_size=corpus.zip_size)
  except dl.DataIntegrityError:
    raise
  except OSError as e:  # DownloadError, URLError, disk errors
    raise DatasetUnavailableError(f"{name}: downloading failed ({e}). {manual}") from e


def prepare_corpus(name: str, zip_path, vocab_order: str = "first") -> Splits:
  """Reference preparation of one benchmark corpus from its zip."""
  corpus = CORPORA[name]
  if name in ("enwik8", "text8"):
    raw = dl.read_zip_member(zip_path, corpus.members[0], expected_size=corpus.member_size,
                             md5=corpus.member_md5)
    parts = prepare.reference_split(np.frombuffer(raw, dtype=np.uint8), corpus.heldout)
    tokenize = prepare.tokenize_enwik8 if name == "enwik8" else prepare.tokenize_text8
    tok = tokenize(*parts)
  else:
    dl.check_zip(zip_path, {m: None for m in corpus.members})
    with zipfile.ZipFile(zip_path) as zf:
      readers = [prepare.zip_text_lines(zf, m) for m in corpus.members]
      tok = prepare.tokenize_words(*readers)
  return prepare.sort_by_frequency(tok) if vocab_order == "frequency" else tok


def corpus_splits(name: str, data_dir, vocab_order: str = "auto", allow_download=True) -> Splits:
  """A benchmark corpus from its cache, preparing (and downloading) it first if needed."""
  if name not in CORPORA:
    raise ValueError(f"unknown corpus {name!r}; choose one of {tuple(CORPORA)}")
  if vocab_order == "auto":
    vocab_order = "frequency" if name == "wikitext103" else "first"
  if vocab_order not in ("first", "frequency"):
    raise ValueError(f"vocab_order={vocab_order!r}: choose first | frequency | auto")
  data_dir = pathlib.Path(data_dir)
  cache_dir = data_dir / (name if vocab_order == "first" else f"{name}-freq")
  splits = load_cache(cache_dir)
  if splits is None:
    zip_path = _zip_path(data_dir, name, CORPORA[name], allow_download)
    tok = prepare_corpus(name, zip_path, vocab_order)
    save_cache(cache_dir, tok, name,
               dict(source=str(zip_path), vocab_order=vocab_order, url=CORPORA[name].url))
    splits = load_cache(cache_dir)
  return splits


# ------------------------------------------------------------------------------------ local file


def split_offsets(n: int, split_fractions=(0.9, 0.05, 0.05), split_bytes=()) -> tuple[int, int, int]:
  """(train_end, valid_end, test_end) byte offsets for a file of n bytes."""
  if len(split_bytes):
    if len(split_bytes) != 2:
      raise ValueError(f"split_bytes={tuple(split_bytes)}: give (train_end, valid_end)")
    a, b = (int(x) for x in split_bytes)
    c = n
  else:
    f = tuple(float(x) for x in split_fractions)
    if len(f) != 3 or min(f) < 0 or sum(f) > 1 + 1e-9:
      raise ValueError(f"split_fractions={f}: three non-negative fractions summing to <= 1")
    a, b, c = round(n * f[0]), round(n * (f[0] + f[1])), min(n, round(n * sum(f)))
  if not 0 < a < b < c <= n:
    raise ValueError(f"split offsets (train_end={a}, valid_end={b}, test_end={c}) leave an empty "
                     f"split in a file of {n:,} bytes")
  return a, b, c


def file_splits(path, split_fractions=(0.9, 0.05, 0.05), split_bytes=(),
                vocab: str = "reference") -> Splits:
  """Byte-level splits of a raw local file.

  vocab='reference' tokenises as the reference does enwik8 (newline -> <eos>, first-appearance
  ids), so results compare with the reference run on the same bytes; vocab='bytes' keeps the
  byte values as ids (vocabulary 256).
  """
  path = pathlib.Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"data file {path} does not exist (config.data.path)")
  raw = np.fromfile(path, dtype=np.uint8)
  if not raw.size:
    raise ValueError(f"data file {path} is empty")
  return _byte_splits(raw, split_offsets(raw.size, split_fractions, split_bytes), vocab,
                      name=f"file:{path.name}")


def demo_splits(vocab: str = "reference", split_bytes=()) -> Splits:
  """The packaged head of enwik8 (span_lm/data/demo), split at split_bytes (train_end,
  valid_end), by default demo.SPLIT_BYTES: 3,654,000 / 250,000 / 250,000 bytes."""
  from span_lm.data import demo  # pylint: disable=g-import-not-at-top
  raw = demo.as_array()
  return _byte_splits(raw, split_offsets(raw.size, split_bytes=tuple(split_bytes) or
                                         demo.SPLIT_BYTES), vocab, name=DEMO)


def _byte_splits(raw: np.ndarray, offsets, vocab: str, name: str) -> Splits:
  a, b, c = offsets
  parts = raw[:a], raw[a:b], raw[b:c]
  if vocab == "reference":
    tok = prepare.tokenize_enwik8(*parts)
  elif vocab == "bytes":
    tok = Splits(*parts, vocab=tuple(str(i) for i in range(256)))
  else:
    raise ValueError(f"file_vocab={vocab!r}: choose reference | bytes")
  return Splits(tok.train, tok.valid, tok.test, tok.vocab, name=name)


def split_needs(block: int, batch: int, eval_batch: int) -> dict[str, int]:
  """Tokens each split must hold: train and valid feed B streams of one block (plus its target)
  during training; test is read only by the full evaluation."""
  return {"train": batch * (block + 1), "valid": batch * (block + 1), "test": eval_batch * 2}


def min_file_bytes(block: int, batch: int, eval_batch: int,
                   split_fractions=(0.9, 0.05, 0.05), split_bytes=()) -> int | None:
  """The smallest raw file whose splits are long enough for one batch (None: no size is, since
  split_bytes fixes a train or valid split that is too short). A byte is at least one token."""
  need = split_needs(block, batch, eval_batch)
  if len(split_bytes):
    a, b = (int(x) for x in split_bytes)
    if a < need["train"] or b - a < need["valid"]:
      return None
    return b + need["test"]
  f = tuple(float(x) for x in split_fractions)
  if len(f) != 3 or min(f) <= 0:
    return None
  n = max(math.ceil(need[s] / fs) for s, fs in zip(prepare.SPLITS, f))
  while True:  # rounding of the offsets: step up to the first size that holds every split
    try:
      a, b, c = split_offsets(n, f)
    except ValueError:
      a = b = c = 0
    if a >= need["train"] and b - a >= need["valid"] and c - b >= need["test"]:
      return n
    n += 1


def check_file_size(path, block: int, batch: int, eval_batch: int,
                    split_fractions=(0.9, 0.05, 0.05), split_bytes=()) -> None:
  """One clear line when a local file is too small for the configured batches."""
  size = os.path.getsize(path)
  need = min_file_bytes(block, batch, eval_batch, split_fractions, split_bytes)
  per = f"data.batch={batch} streams of data.block+1={block + 1} tokens"
  if need is None:
    raise ValueError(f"config.data.split_bytes={tuple(split_bytes)}: the train and valid splits "
                     f"must each hold {batch * (block + 1):,} bytes ({per})")
  if size < need:
    how = (f"data.split_bytes={tuple(split_bytes)}" if len(split_bytes)
           else f"data.split_fractions={tuple(split_fractions)}")
    raise ValueError(f"config.data.path={str(path)!r}: {size:,} bytes, but this config needs a "
                     f"file of at least {need:,} bytes (train and valid splits of {per} each, "
                     f"at {how}); use a larger file or a smaller data.block/data.batch")


# ------------------------------------------------------------------------------------- synthetic


def _perm_power(perm: np.ndarray, x: np.ndarray, j: np.ndarray) -> np.ndarray:
  """perm applied j times to x, elementwise, through perm's cycle decomposition."""
  v = perm.size
  cycle_of, pos_in, starts, lens, members = (np.empty(v, np.int64), np.empty(v, np.int64),
                                             [], [], [])
  seen = np.zeros(v, bool)
  for s in range(v):
    if seen[s]:
      continue
    starts.append(len(members))
    u = s
    while not seen[u]:
      seen[u] = True
      cycle_of[u], pos_in[u] = len(lens), len(members) - starts[-1]
      members.append(u)
      u = perm[u]
    lens.append(len(members) - starts[-1])
  c = cycle_of[x]
  starts, lens, members = np.asarray(starts), np.asarray(lens), np.asarray(members)
  return members[starts[c] + (pos_in[x] + j) % lens[c]]


def synthetic_tokens(length: int, vocab: int, distance: int, noise: float, seed: int = 0):
  """A sequence with x[t] = perm[x[t-D]] with probability 1-noise, else uniform; and perm.

  The D interleaved chains (t mod D) are Markov chains that restart at a uniform token at each
  noise event, so x[t] = perm^j(u) with j steps since the chain's last restart: no Python loop
  over time, deterministic in `seed`.
  """
  if vocab < 2 or distance < 1 or not 0 <= noise <= 1 or length <= distance:
    raise ValueError(f"synthetic task needs vocab >= 2, distance >= 1, noise in [0, 1] and "
                     f"length > distance; got {vocab=}, {distance=}, {noise=}, {length=}")
  rng = np.random.default_rng(seed)
  perm = rng.permutation(vocab)
  rows = -(-length // distance)
  restart = rng.random((rows, distance)) < noise
  restart[0] = True
  fresh = rng.integers(vocab, size=(rows, distance))
  step = np.arange(rows)[:, None]
  last = np.maximum.accumulate(np.where(restart, step, 0), axis=0)
  base = np.take_along_axis(fresh, last, axis=0)
  x = _perm_power(perm, base, step - last).reshape(-1)[:length]
  return x.astype(prepare.id_dtype(vocab)), perm


def synthetic_splits(length=2_000_000, vocab=16, distance=64, noise=0.1, seed=0,
                     split_fractions=(0.9, 0.05, 0.05)) -> Splits:
  x, _ = synthetic_tokens(length, vocab, distance, noise, seed)
  a, b, c = split_offsets(length, split_fractions)
  return Splits(x[:a], x[a:b], x[b:c], tuple(str(i) for i in range(vocab)),
                name=f"synthetic(D={distance},V={vocab},noise={noise})")


# ----------------------------------------------------------------------------------- entry point


def check_lengths(splits: Splits, block: int, batch: int, eval_batch: int) -> None:
  """Clear errors for splits too short for the configured streams and block."""
  for s, n in split_needs(block, batch, eval_batch).items():
    have = splits.split(s).size
    if have < n:
      raise ValueError(
          f"{splits.name}: the {s} split has {have:,} tokens, fewer than the {n:,} needed "
          f"(data.batch={batch}, data.block={block}, data.eval_batch={eval_batch}); "
          f"use a longer file, other split sizes, or a smaller block/batch")


# The corpora's vocabulary sizes, known without their files (enwik8: bytes, an upper bound).
KNOWN_VOCAB = {"enwik8": 256, "text8": 28, "wikitext103": 267735}


def vocab_size_offline(data_cfg) -> tuple[int, str]:
  """The vocabulary config.data gives, found without downloading (for the tools that size a model
  before or without its data: the compile mode, the flops report): the local data's, else the
  corpus's known size, else bytes' 256; with where it came from."""
  try:
    return load_splits(data_cfg, allow_download=False).vocab_size, "local data"
  except (OSError, ValueError, RuntimeError):
    pass
  dataset = _get(data_cfg, "dataset", "enwik8")
  if dataset in KNOWN_VOCAB:
    return KNOWN_VOCAB[dataset], f"{dataset} (known size)"
  return 256, "assumed (bytes)"


def load_splits(data_cfg, *, allow_download: bool = True) -> Splits:
  """The trainer's entry point: config.data -> Splits (a local file wins when path is set)."""
  path = _get(data_cfg, "path", None)
  dataset = _get(data_cfg, "dataset", "enwik8")
  fractions = tuple(_get(data_cfg, "split_fractions", (0.9, 0.05, 0.05)))
  block, batch, eval_batch = (_get(data_cfg, k, 1) for k in ("block", "batch", "eval_batch"))
  if path is not None:
    split_bytes = tuple(_get(data_cfg, "split_bytes", ()))
    if os.path.isfile(path):
      check_file_size(path, block, batch, eval_batch, fractions, split_bytes)
    splits = file_splits(path, fractions, split_bytes, _get(data_cfg, "file_vocab", "reference"))
  elif dataset == "file":
    raise ValueError("data.dataset='file' needs data.path, the raw file to read")
  elif dataset == DEMO:
    splits = demo_splits(_get(data_cfg, "file_vocab", "reference"),
                         tuple(_get(data_cfg, "split_bytes", ())))
  elif dataset == "synthetic":
    splits = synthetic_splits(
        _get(data_cfg, "synthetic_length", 2_000_000), _get(data_cfg, "synthetic_vocab", 16),
        _get(data_cfg, "synthetic_distance", 64), _get(data_cfg, "synthetic_noise", 0.1),
        _get(data_cfg, "synthetic_seed", 0), fractions)
  elif dataset == "cifar10":  # local python pickle batches in data_dir (span_lm/data/cifar.py)
    from span_lm.data import cifar  # pylint: disable=g-import-not-at-top
    splits = cifar.cifar10_splits(_get(data_cfg, "data_dir", "data_cache"))
  elif dataset in CORPORA:
    splits = corpus_splits(dataset, _get(data_cfg, "data_dir", "data_cache"),
                           _get(data_cfg, "vocab_order", "auto"), allow_download)
  else:
    raise ValueError(f"data.dataset={dataset!r}: choose one of {DATASETS}")
  check_lengths(splits, block, batch, eval_batch)
  return splits

"""Reference-exact tokenisation of enwik8, text8 and WikiText-103.

The reference (facebookresearch/adaptive-span) prepares data with the transformer-xl /
awd-lstm-lm scripts: each split is written as text, then read back line by line with
`line.split() + ['<eos>']`, one dictionary growing over train, valid and test in that order.
For the byte and character corpora we never write that text: the same ids follow from numpy on
the raw bytes (tests/data/test_data.py checks this against a plain port of the reference).

Rules this reproduces:
  enwik8  token = byte; newline (10) -> <eos>; one extra <eos> ends a non-empty split that does
          not end with a newline (the last text line has no newline of its own).
  text8   each split is `.strip()`ped, ' ' -> '_', one <eos> at the end of a non-empty split.
  words   `line.split() + ['<eos>']` per line (WikiText-103), done in Python: it is text.
Ids are in order of first appearance over train, then new tokens of valid, then of test.
"""
import dataclasses
import io
from typing import Iterable, Sequence

import numpy as np

EOS = "<eos>"
SPLITS = ("train", "valid", "test")
REFERENCE_HELDOUT = 5_000_000  # enwik8/text8: valid and test are the last 2 x 5M bytes
_EOS_SYMBOL = 256  # stands for <eos> among byte symbols 0..255
_ASCII_SPACE = b" \t\n\r\x0b\x0c\x1c\x1d\x1e\x1f"  # what str.strip()/split() treat as space


@dataclasses.dataclass(frozen=True)
class Splits:
  """Token ids of the three splits (1-D; uint8 when the vocabulary fits, else int32), the token
  strings by id, and the source's name ('' until a source names them)."""
  train: np.ndarray
  valid: np.ndarray
  test: np.ndarray
  vocab: tuple[str, ...]
  name: str = ""

  @property
  def vocab_size(self) -> int:
    return len(self.vocab)

  def split(self, name: str) -> np.ndarray:
    return getattr(self, name)


def reference_split(data, heldout: int = REFERENCE_HELDOUT):
  """train = all but the last 2*heldout, valid = the next heldout, test = the last heldout."""
  if len(data) <= 2 * heldout:
    raise ValueError(f"need more than {2 * heldout} bytes to hold out 2 x {heldout}, got {len(data)}")
  return data[:-2 * heldout], data[-2 * heldout:-heldout], data[-heldout:]


def _as_bytes_array(part) -> np.ndarray:
  if isinstance(part, np.ndarray):
    return part.astype(np.uint8, copy=False).ravel()
  return np.frombuffer(bytes(part), dtype=np.uint8)


def enwik8_symbols(part) -> np.ndarray:
  """Byte symbols of one split as the reference reads them: newline -> <eos>, maybe one more."""
  b = _as_bytes_array(part)
  sym = b.astype(np.uint16)
  sym[b == 10] = _EOS_SYMBOL
  if b.size and b[-1] != 10:
    sym = np.append(sym, np.uint16(_EOS_SYMBOL))
  return sym


def text8_symbols(part) -> np.ndarray:
  """Character symbols of one text8 split: strip, ' ' -> '_', one <eos> if anything is left.

  Exact for ASCII text whose only inner whitespace is ' ' (text8 is a-z and ' '); anything else
  would be tokenised differently by the reference's split(), so it is refused.
  """
  b = _as_bytes_array(bytes(_as_bytes_array(part)).strip(_ASCII_SPACE))
  other_space = np.isin(b, np.frombuffer(_ASCII_SPACE[1:], np.uint8))
  if (b >= 128).any() or other_space.any():
    raise ValueError("text8 tokenisation expects ASCII text whose only whitespace is ' '")
  sym = b.astype(np.uint16)
  sym[b == 32] = ord("_")
  if sym.size:
    sym = np.append(sym, np.uint16(_EOS_SYMBOL))
  return sym


def first_appearance(seqs: Sequence[np.ndarray], n_symbols: int,
                     chunk: int = 1 << 20) -> np.ndarray:
  """Symbols in order of first appearance over the concatenation of `seqs`.

  Chunked: a bincount per chunk finds the chunks where a new symbol appears, and only those
  are searched (a sort of 90M tokens would take seconds; this takes a fraction of one).
  """
  seen = np.zeros(n_symbols, dtype=bool)
  order = []
  for s in seqs:
    for start in range(0, s.size, chunk):
      part = s[start:start + chunk]
      new = np.flatnonzero((np.bincount(part, minlength=n_symbols) > 0) & ~seen)
      if new.size:
        first = [np.argmax(part == sym) for sym in new]
        order.extend(new[np.argsort(first, kind="stable")].tolist())
        seen[new] = True
  return np.asarray(order, dtype=np.int64)


def id_dtype(vocab_size: int):
  return np.uint8 if vocab_size <= 256 else np.int32


def tokenize_symbols(splits: Sequence[np.ndarray], token_str) -> Splits:
  """Ids by first appearance (train, then valid, then test) for symbol arrays in [0, 256]."""
  order = first_appearance(splits, _EOS_SYMBOL + 1)
  dtype = id_dtype(order.size)
  lut = np.zeros(_EOS_SYMBOL + 1, dtype=dtype)
  lut[order] = np.arange(order.size)
  ids = [lut[s] for s in splits]
  vocab = tuple(EOS if s == _EOS_SYMBOL else token_str(int(s)) for s in order)
  return Splits(*ids, vocab=vocab)


def tokenize_enwik8(train, valid, test) -> Splits:
  """enwik8-style byte tokenisation (also used for any local raw file)."""
  return tokenize_symbols([enwik8_symbols(p) for p in (train, valid, test)], str)


def tokenize_text8(train, valid, test) -> Splits:
  return tokenize_symbols([text8_symbols(p) for p in (train, valid, test)], chr)


def tokenize_lines(lines: Iterable[str], word2id: dict) -> np.ndarray:
  """`line.split() + ['<eos>']` per line; unseen words get the next id (the dict is updated)."""
  out = []
  chunk = []
  for line in lines:
    words = line.split()
    words.append(EOS)
    try:
      chunk.extend([word2id[w] for w in words])
    except KeyError:  # rare after the first lines: grow the dictionary in order of appearance
      for w in words:
        if w not in word2id:
          word2id[w] = len(word2id)
      chunk.extend([word2id[w] for w in words])
    if len(chunk) >= 1 << 22:  # keep Python int lists small
      out.append(np.asarray(chunk, dtype=np.int64))
      chunk = []
  out.append(np.asarray(chunk, dtype=np.int64))
  return np.concatenate(out)


def tokenize_words(train: Iterable[str], valid: Iterable[str], test: Iterable[str]) -> Splits:
  """Word-level tokenisation of three line iterables (open text files, io.StringIO, lists)."""
  word2id = {}
  ids = [tokenize_lines(lines, word2id) for lines in (train, valid, test)]
  dtype = id_dtype(len(word2id))
  return Splits(*(a.astype(dtype) for a in ids), vocab=tuple(word2id))


def sort_by_frequency(tok: Splits) -> Splits:
  """Re-number train tokens by descending train count, as the reference's sort_dict does.

  Reference: `sorted(word2count.items(), key=lambda kv: kv[1])[::-1]` over train, with
  word2count in first-appearance order; a stable ascending sort reversed, so ties end up in
  reverse order of first appearance. Tokens absent from train (the reference would fail with a
  KeyError on them) keep their place after the train tokens.
  """
  n_train_vocab = int(tok.train.max()) + 1 if tok.train.size else 0
  counts = np.bincount(tok.train, minlength=n_train_vocab)
  order = np.argsort(counts, kind="stable")[::-1]  # old ids in new-id order
  order = np.concatenate([order, np.arange(n_train_vocab, len(tok.vocab))])
  new_id = np.empty(len(tok.vocab), dtype=np.int64)
  new_id[order] = np.arange(order.size)
  dtype = id_dtype(len(tok.vocab))
  ids = [new_id[a].astype(dtype) for a in (tok.train, tok.valid, tok.test)]
  return dataclasses.replace(tok, train=ids[0], valid=ids[1], test=ids[2],
                             vocab=tuple(tok.vocab[i] for i in order))


def zip_text_lines(zf, member: str) -> io.TextIOWrapper:
  """A zip member read as the reference reads a text file: utf8, universal newlines."""
  return io.TextIOWrapper(zf.open(member), encoding="utf8")

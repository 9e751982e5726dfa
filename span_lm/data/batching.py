"""The reference's contiguous-stream batching, with a resumable position.

A split is cut into B contiguous streams, `data[: n//B*B].reshape(B, -1)`; a step reads the block
`X = streams[:, pos:pos+M]` and the targets `Y = streams[:, pos+1:pos+M+1]`, then pos advances by
M. When `pos >= L - M` after advancing (L = stream length) the reference restarts at a random
offset in [0, M) and zeroes the caches, so the NEXT block starts with zero caches. Here that
offset comes from `default_rng((seed, restarts))`, so the whole walk is a pure function of the
state `{pos, restarts}`, which a checkpoint stores as JSON.

`align` (config.data.align) keeps blocks on record boundaries for data made of fixed-size records
(CIFAR-10 images of 3072 bytes): streams are cut to a multiple of it and restart offsets are
multiples of it. align=1 is the reference's walk.

Full evaluation walks a split once from pos 0 with the caches carried. By default it scores
every target: the last, shorter block is padded to M with a 0/1 weight array (one shape, one
compilation). `drop_last=True` is the reference's loop, which skips that tail.
"""
import dataclasses
import math
from typing import Iterator, NamedTuple

import numpy as np


def as_streams(data: np.ndarray, batch: int, align: int = 1) -> np.ndarray:
  """(B, n//B) view of a 1-D split: B contiguous streams, the remainder dropped (each stream a
  multiple of `align` tokens long, so that every stream starts on a record boundary)."""
  n = len(data) // batch // align * align
  if n < 2:
    raise ValueError(f"a split of {len(data):,} tokens cannot make {batch} streams of >= 2 tokens")
  return np.asarray(data)[:n * batch].reshape(batch, n)


def process_slice(batch: int, process_index: int = 0, process_count: int = 1) -> slice:
  """The streams one process owns: a contiguous 1/process_count of them (as the reference)."""
  if batch % process_count or not 0 <= process_index < process_count:
    raise ValueError(f"{batch} streams do not split over process {process_index} of {process_count}")
  per = batch // process_count
  return slice(process_index * per, (process_index + 1) * per)


@dataclasses.dataclass(frozen=True)
class StreamState:
  """Where the training walk is: the next block's position and how many restarts happened."""
  pos: int = 0
  restarts: int = 0

  def to_dict(self) -> dict:
    return {"pos": int(self.pos), "restarts": int(self.restarts)}

  @classmethod
  def from_dict(cls, d: dict) -> "StreamState":
    return cls(pos=int(d["pos"]), restarts=int(d["restarts"]))


def restart_offset(seed: int, restarts: int, block: int, stream_len: int, align: int = 1) -> int:
  """The offset of restart number `restarts` (0-based): uniform in [0, M), from (seed, restarts);
  with align > 1, uniform over the multiples of align there (always 0 when align = M).

  Streams shorter than 2M (where the reference could read past the end) draw from [0, L - M).
  """
  rng = np.random.default_rng((seed % 2**63, restarts))  # SeedSequence wants non-negative
  choices = max(1, -(-min(block, stream_len - block) // align))
  return align * int(rng.integers(choices))


def advance(state: StreamState, stream_len: int, block: int, seed: int, align: int = 1):
  """(next state, reset) after reading the block at state.pos; reset: zero caches now."""
  pos = state.pos + block
  if pos >= stream_len - block:
    return StreamState(restart_offset(seed, state.restarts, block, stream_len, align),
                       state.restarts + 1), True
  return StreamState(pos, state.restarts), False


class Batch(NamedTuple):
  """One training block. reset: zero the caches after this block, before the next one."""
  x: np.ndarray  # (B, M) int32 inputs
  y: np.ndarray  # (B, M) int32 targets, x shifted by one
  reset: bool


class StreamIterator:
  """Endless training blocks over one split; `state` is all it needs to resume exactly.

  With several processes each one builds the same global streams and keeps its slice, so they
  all walk the same positions. The first block of a fresh walk starts from zero caches (the
  caller initialises them so); after that, `Batch.reset` says when to zero them.
  """

  def __init__(self, data: np.ndarray, batch: int, block: int, seed: int,
               state: StreamState | dict | None = None, process_index: int = 0,
               process_count: int = 1, align: int = 1):
    self.block, self.seed, self.align = block, seed, align
    streams = as_streams(data, batch, align)
    self.stream_len = streams.shape[1]
    if self.stream_len < block + 1:
      raise ValueError(f"streams of {self.stream_len:,} tokens are shorter than one block of "
                       f"{block} plus its target ({len(data):,} tokens over {batch} streams)")
    self.streams = streams[process_slice(batch, process_index, process_count)]
    self.state = state

  @property
  def state(self) -> StreamState:
    return self._state

  @state.setter
  def state(self, state: StreamState | dict | None) -> None:
    state = StreamState() if state is None else state
    state = StreamState.from_dict(state) if isinstance(state, dict) else state
    if not 0 <= state.pos <= self.stream_len - self.block - 1:
      raise ValueError(f"stream position {state.pos} is outside [0, {self.stream_len - self.block - 1}]")
    self._state = state

  def __iter__(self) -> Iterator[Batch]:
    return self

  def __next__(self) -> Batch:
    pos, m = self._state.pos, self.block
    x = self.streams[:, pos:pos + m].astype(np.int32)
    y = self.streams[:, pos + 1:pos + m + 1].astype(np.int32)
    self._state, reset = advance(self._state, self.stream_len, m, self.seed, self.align)
    return Batch(x, y, reset)


# ----------------------------------------------------------------------------------- full eval


class EvalBatch(NamedTuple):
  """One evaluation block, padded to M; weights marks the real targets (0/1)."""
  x: np.ndarray  # (B, M) int32
  y: np.ndarray  # (B, M) int32
  weights: np.ndarray  # (B, M) float32
  n_tokens: int  # real targets in this block, all streams of this process


def eval_positions(stream_len: int, block: int, drop_last: bool = False):
  """(pos, length) of each evaluation block over streams of length L.

  Default: blocks at 0, M, 2M, ... until every target 1..L-1 is scored once. drop_last: the
  reference's full_eval loop, ceil(L/M) iterations that stop after the block where the advanced
  position reaches L - M; every block it reads is whole.
  """
  if drop_last:
    if stream_len < block + 1:
      raise ValueError(f"drop_last needs streams of > {block} tokens, got {stream_len}")
    pos = 0
    for _ in range(math.ceil(stream_len / block)):
      yield pos, block
      pos += block
      if pos >= stream_len - block:
        break
  else:
    for pos in range(0, stream_len - 1, block):
      yield pos, min(block, stream_len - 1 - pos)


def eval_blocks(data: np.ndarray, batch: int, block: int, drop_last: bool = False,
                process_index: int = 0, process_count: int = 1,
                align: int = 1) -> Iterator[EvalBatch]:
  """The full evaluation walk (start with zero caches, carry them across blocks)."""
  streams = as_streams(data, batch, align)
  stream_len = streams.shape[1]
  streams = streams[process_slice(batch, process_index, process_count)]
  for pos, m in eval_positions(stream_len, block, drop_last):
    x = np.zeros((streams.shape[0], block), np.int32)
    y = np.zeros_like(x)
    weights = np.zeros(x.shape, np.float32)
    x[:, :m] = streams[:, pos:pos + m]
    y[:, :m] = streams[:, pos + 1:pos + m + 1]
    weights[:, :m] = 1.0
    yield EvalBatch(x, y, weights, m * streams.shape[0])

"""What the inspection tools need from a run directory: model, parameters, span plan, vocabulary.

`restore(config)` reads the checkpoint the way `loop.evaluate` does (parameters only, checked
against the config) and puts the parameters on one device: the tools run batch-1 programs, which
replicated over a mesh would only repeat the same work on every device.
`Codec` turns text into the run's token ids and back, for every vocabulary the data code builds.
"""
import dataclasses
import os
from typing import Any

import jax
import numpy as np

from span_lm.data import prepare
from span_lm.model import plan as plan_lib
from span_lm.model.config import ModelConfig
from span_lm.model.plan import SpanPlan


class Codec:
  """Text <-> ids for a vocabulary of the data code (Splits.vocab, Splits.name).

  bytes: enwik8 and local files (tokens are byte values as strings, newline is <eos>);
  chars: text8 (' ' is '_'); words: WikiText-103 and the synthetic task (space-separated).
  """

  def __init__(self, vocab: tuple[str, ...], name: str = ""):
    self.vocab = tuple(vocab)
    self.ids = {t: i for i, t in enumerate(self.vocab)}
    if name == "text8":
      self.kind = "chars"
    elif all(t == prepare.EOS or (t.isdigit() and int(t) < 256) for t in self.vocab) and not (
        name.startswith("synthetic")):
      self.kind = "bytes"
    else:
      self.kind = "words"
    self.eos = self.ids.get(prepare.EOS)

  def _bytes_id(self, byte: int) -> int | None:
    if byte == 10 and self.eos is not None and "10" not in self.ids:
      return self.eos
    return self.ids.get(str(byte))

  def encode(self, text: str) -> np.ndarray:
    """Token ids of `text`; ValueError naming what the vocabulary lacks."""
    if self.kind == "bytes":
      ids = [self._bytes_id(b) for b in text.encode("utf-8")]
      units = [bytes([b]) for b in text.encode("utf-8")]
    elif self.kind == "chars":
      units = ["_" if c == " " else (prepare.EOS if c == "\n" else c) for c in text]
      ids = [self.ids.get(u) for u in units]
    else:
      units = [w for line in text.split("\n") for w in line.split() + [prepare.EOS]][:-1]
      ids = [self.ids.get(u) for u in units]
    missing = sorted({repr(u) for u, i in zip(units, ids) if i is None})
    if missing:
      raise ValueError(f"the run's vocabulary ({len(self.vocab)} tokens) has no token for "
                       f"{', '.join(missing[:20])}")
    return np.asarray(ids, np.int32)

  def token_text(self, i: int) -> str:
    """What token `i` stands for in text (bytes decoded as Latin-1, one character per token)."""
    t = self.vocab[int(i)]
    if t == prepare.EOS:
      return "\n"
    if self.kind == "bytes":
      return chr(int(t))
    if self.kind == "chars":
      return " " if t == "_" else t
    return t

  def decode(self, ids) -> str:
    if self.kind == "bytes":
      raw = bytes(10 if self.vocab[int(i)] == prepare.EOS else int(self.vocab[int(i)])
                  for i in ids)
      return raw.decode("utf-8", errors="replace")
    if self.kind == "chars":
      return "".join(self.token_text(i) for i in ids)
    return " ".join(self.token_text(i) for i in ids).replace(" \n ", "\n")

  def label(self, i: int) -> str:
    """A visible one-token label for plots: newline and space drawn as symbols."""
    s = self.token_text(i)
    return {"\n": "\u23ce", " ": "\u2423"}.get(s, s if s.isprintable() else "?")


@dataclasses.dataclass
class Restored:
  config: Any
  model_cfg: ModelConfig
  params: Any
  plan: SpanPlan  # the plan training ran with at this checkpoint
  step: int
  meta: dict
  codec: Codec
  splits: Any

  @property
  def tight_plan(self) -> SpanPlan:
    """The cheapest exact plan for these parameters (training shrinks its plan lazily)."""
    return plan_lib.plan_from_params(self.model_cfg, self.params)

  @property
  def out_dir(self) -> str:
    return self.config.workdir


def restore(config, step: int | None = None) -> Restored:
  """The checkpoint at `step` (latest by default) of the run in config.workdir (a RunConfig)."""
  from span_lm.train import run as run_lib  # pylint: disable=g-import-not-at-top
  run = run_lib.Run(config)
  try:
    if run.ckpt.latest_step() is None:
      raise FileNotFoundError(f"no checkpoint in {run.ckpt.directory}: train the run first "
                              "(--config.mode=train)")
    params, plan, meta = run.restore_params(step)
  finally:
    run.ckpt.close()
  params = jax.device_put(params, jax.devices()[0])
  return Restored(config=config, model_cfg=run.model_cfg, params=params, plan=plan,
                  step=int(meta["step"]), meta=meta, codec=Codec(run.splits.vocab, run.splits.name),
                  splits=run.splits)


def out_path(config, name: str) -> str:
  """Where a tool writes `name`: next to the run (config.workdir), else the working directory."""
  directory = config.workdir or "."
  os.makedirs(directory, exist_ok=True)
  return os.path.abspath(os.path.join(directory, name))


def tools_field(config, name: str, default=None):
  """config.tools.<name> of a RunConfig, `default` where it is None."""
  value = getattr(config.tools, name)
  return default if value is None else value

"""Sequence models: `build_model(cfg, plan)` builds the architecture named by config.model.arch.

`ARCHS` (model/archs.py) is the table of architectures: each record holds its model builder, its
context and cache lengths, its FLOPs and memory counts, its checkpoint identity and its config
checks.
"""
from span_lm.model.archs import ARCHS


def build_model(cfg, plan=None, kv_cache: bool = False):
  """The Flax module of cfg.arch (its imports stay lazy): the SpanTransformer, or the
  SparseTransformer for arch='sparse'.

  kv_cache: inference with caches of projected keys/values (span arch only).
  """
  return ARCHS[cfg.arch].build(cfg, plan, kv_cache)

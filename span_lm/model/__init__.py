"""Sequence models: `build_model(cfg, plan)` picks the architecture named by config.model.arch."""


def build_model(cfg, plan=None, kv_cache: bool = False):
  """SparseTransformer for arch='sparse', else the SpanTransformer (imports stay lazy).

  kv_cache: inference with caches of projected keys/values (span arch only).
  """
  if cfg.arch == "sparse":
    if kv_cache:
      raise ValueError("kv_cache applies to the span Transformer only (the sparse one has no cache)")
    from span_lm.model.sparse_transformer import SparseTransformer  # pylint: disable=g-import-not-at-top
    return SparseTransformer(cfg, plan)
  from span_lm.model.transformer import SpanTransformer  # pylint: disable=g-import-not-at-top
  return SpanTransformer(cfg, plan, kv_cache=kv_cache)

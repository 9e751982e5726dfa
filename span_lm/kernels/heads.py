"""Grouped key/value heads (GQA; MQA with one): the one rule every implementation shares. Its own
module, free of the door, so the implementations the door imports can use it without a circle."""


def kv_group(q_heads: int, kv_heads: int) -> int:
  """Query heads per key/value head (query head h reads key/value head h // group), or a
  ValueError naming both counts."""
  if kv_heads < 1 or q_heads % kv_heads:
    raise ValueError(f"attention: {q_heads} query heads are not a multiple of {kv_heads} "
                     "key/value heads")
  return q_heads // kv_heads

"""The 'jnp' and 'dense' rows of kernels/sparse_door.py: model/sparse.py's fast path and its
masked reference (any backend, any shape)."""


def block_sparse_attention(q_BxHxNxD, k_BxHxNxD, v_BxHxNxE, heads, *, interpret=False):
  del interpret
  from span_lm.model import sparse  # pylint: disable=g-import-not-at-top
  return sparse.sparse_attention(q_BxHxNxD, k_BxHxNxD, v_BxHxNxE, heads)


def misfit(heads, n, head_dim) -> str:
  del heads, n, head_dim
  return ""


def dense_attention(q_BxHxNxD, k_BxHxNxD, v_BxHxNxE, heads, *, interpret=False):
  del interpret
  from span_lm.model import sparse  # pylint: disable=g-import-not-at-top
  return sparse.reference_attention(q_BxHxNxD, k_BxHxNxD, v_BxHxNxE, heads)

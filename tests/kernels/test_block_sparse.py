"""The block maps the sparse kernels skip by agree with the pattern's (n, n) connectivity."""
import numpy as np
import pytest

from span_lm.kernels.sparse import block_sparse as bs
from span_lm.model import sparse


def _heads():
  for pat in ("fixed", "strided", "local", "dense"):
    for comb in ("merged", "split", "interleaved"):
      for layer in (0, 1):
        yield from sparse.layer_heads(pat, comb, 4, layer, 8, 2)


@pytest.mark.parametrize("n,bq,bk", [(50, 8, 8), (50, 16, 8), (50, 4, 16), (64, 32, 32)])
def test_block_map_and_lists_match_connectivity(n, bq, bk):
  for h in _heads():
    conn = bs.connectivity(h, n)
    bmap = bs.block_map(h, n, bq, bk)
    nq, nk = bmap.shape
    padded = np.zeros((nq * bq, nk * bk), bool)
    padded[:n, :n] = conn
    r = padded.reshape(nq, bq, nk, bk)
    want = np.where(r.all((1, 3)), bs.FULL, np.where(r.any((1, 3)), bs.PARTIAL, bs.EMPTY))
    np.testing.assert_array_equal(bmap, want, err_msg=str(h))
    counts, idx = bs.block_lists(bmap)
    for q in range(nq):
      np.testing.assert_array_equal(idx[q, :counts[q]], np.nonzero(bmap[q])[0])
      assert (idx[q, counts[q]:] == (idx[q, counts[q] - 1] if counts[q] else 0)).all()


def test_connectivity_is_the_papers_formula():
  n, l, c = 40, 8, 2
  i, j = np.arange(n)[:, None], np.arange(n)[None, :]
  causal = j <= i
  got = bs.connectivity(bs.HeadPattern("fixed", local=True, summary=True, stride=l, c=c,
                                       offset=2), n)
  want = causal & ((i // l == j // l) | ((j % l >= l - c - 2) & (j % l < l - 2)))
  np.testing.assert_array_equal(got, want)
  got = bs.connectivity(bs.HeadPattern("strided", local=True, summary=True, stride=l), n)
  np.testing.assert_array_equal(got, causal & ((i - j < l) | ((i - j) % l == 0)))


def test_computed_fraction_counts_nonempty_blocks():
  dense = sparse.layer_heads("dense", "merged", 2, 0, 8, 2)
  assert bs.computed_fraction(dense, 64, 8, 8) == 1.0
  local = sparse.layer_heads("local", "merged", 2, 0, 8, 2)
  assert bs.computed_fraction(local, 64, 8, 8) == 15 / 36  # 8 diagonal + 7 below, of 36 causal

"""bench/mosaic_gpu_span.py, a study for issue 55 item 5 (docs/kernels.md, "The way forward for
the GPU kernels"): the span kernel's forward pass in Pallas Mosaic GPU. Not a path of the model.

- `slow`: jax's Mosaic GPU interpreter (CPU) runs the kernel's interpretable form (fold=False)
  against span_lm's reference, with per-row spans that reach every key tile and spans that skip
  tiles (the banded key range per query tile).
- `compile`: the kernel (both forms) lowers and compiles deviceless for an H100 (sm_90a) through
  XLA and ptxas, with no spills, warpgroup matmuls and TMA copies; for an A100 (sm_80) it stops
  where Mosaic GPU's Hopper instructions do. Both on jax 0.10.2 and 0.12."""
import importlib.util

import numpy as np
import pytest

import jax.numpy as jnp

from bench import mosaic_gpu_span as mgs

HAS_CUDA = any(importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin"))


def _has_interpreter() -> bool:
  try:
    return importlib.util.find_spec("jax._src.pallas.mosaic_gpu.interpret") is not None
  except ImportError:
    return False


@pytest.mark.slow
@pytest.mark.skipif(not _has_interpreter(), reason="this jax has no Mosaic GPU interpreter")
def test_interpreted_forward_matches_reference():
  """Head 0's spans reach the whole window (every key tile from 0), head 1's stop short (the
  first key tiles skipped: lo > 0); bf16 in, float32 reference on the same bf16 values."""
  q, k, v, pe, z = mgs.inputs(seed=1)
  z = z.at[:, 1].multiply(60.0 / 256.0)
  ranges = np.asarray(mgs.key_tile_ranges(z, w=256, ramp=32, bq=64, bk=64))
  assert ranges[0, 0, 0, 0] == 0 and ranges[0, 1, 0, 0] > 0, ranges  # the test sees both
  out = mgs.span_forward(q, k, v, pe, z, fold=False, interpret=mgs.interpret_params())
  want = mgs.reference(q, k, v, pe, z)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want), atol=3e-2, rtol=3e-2)
  # and the comparison can fail: other spans move the reference well past the tolerance
  assert float(jnp.max(jnp.abs(mgs.reference(q, k, v, pe, z * 0.5) - want))) > 0.3


@pytest.mark.compile
@pytest.mark.skipif(not HAS_CUDA, reason="needs the CUDA plugin: pip install -e .[gpu-compile]")
@pytest.mark.parametrize("fold", [True, False])
def test_compiles_deviceless_for_h100(fold):
  """ptxas' report and the PTX of the Mosaic kernel compiled for sm_90a: no spills, wgmma, TMA
  loads into shared memory waited on with mbarriers, the output leaves by one TMA store, and no
  plain global stores; one warpgroup, dynamic shared memory within the H100's 227 KiB."""
  facts = mgs.compile_facts("h100", fold=fold)
  assert "error" not in facts, facts.get("error")
  rep = facts["ptxas"]
  assert rep is not None and rep["arch"] == "sm_90a", facts
  assert rep["spill_store"] == 0 == rep["spill_load"] and rep["registers"] <= 255, rep
  ptx = facts["ptx"]
  assert ptx["target"] == "sm_90a" and ptx["wgmma"] > 0 and ptx["mma"] == 0, ptx
  assert ptx["tma_loads"] > 0 and ptx["tma_stores"] == 1 and ptx["mbarrier_waits"] > 0, ptx
  assert ptx["plain_global_stores"] == 0 and ptx["atomics"] == 0, ptx
  launch = facts["launch"]
  assert launch["threads"] == 128 and 0 < launch["dynamic_smem"] <= 227 * 1024, launch


@pytest.mark.compile
@pytest.mark.skipif(not HAS_CUDA, reason="needs the CUDA plugin: pip install -e .[gpu-compile]")
def test_ampere_is_refused():
  """The same kernel for an A100 (sm_80) does not compile (the door's rule: a Mosaic GPU kernel
  on sm_90 and later only). jax 0.10.2: Mosaic's pass pipeline stops at wgmma ("not supported on
  sm_80"); jax 0.12: LLVM aborts the process at a Hopper intrinsic ("Cannot select: intrinsic
  %llvm.nvvm.elect.sync")."""
  facts = mgs.compile_facts("a100_80")
  err = facts.get("error", "")
  assert "not supported on sm_80" in err or "Cannot select" in err, facts

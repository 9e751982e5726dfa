"""Attention kernels behind two doors, one folder per family (docs/kernels.md):

  span/    learned-span attention: the door (span/door.py: `Spec`, `select`, `check`, ...), the
           implementations it picks (reference, cpu, the Pallas GPU and TPU kernels) and their
           tile tables and cost models.
  sparse/  the Sparse Transformer's fixed patterns: its door (sparse/door.py: `SparseSpec`,
           `select`, `check`) and its implementations (jnp, dense, splash, the Triton kernel).
  here     what both share: the target platform (target.py), chips, matmuls, grouped heads,
           hashed dropout and the Pallas helpers (pallas_common.py).

The span door's names are this package's own (`kernels.Spec`, `kernels.select`, ...), as the
model and the layers call them. It imports no jax: the config validates with it.
"""
from span_lm.kernels.span.door import (  # noqa: F401  (the package's API)
    ALIASES, ATTN_IMPLS, ATTN_PRECISIONS, GPU_COMPILER_OPTIONS, GPU_TIMINGS, IMPLS, KV, Attention,
    Impl, Segments, Spec, check, check_attention, choose, chunk, compiler_options, decode,
    fit_fallback, fused_misfit, gpu_preference, gpu_tiles, kv_group, parse_tiles, runtime_spans,
    select, tile_misfit, why)

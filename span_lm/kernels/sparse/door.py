"""The Sparse Transformer's attention door, of the span door's shape: the model builds a
`SparseSpec`, `select(spec)` picks a row of `SPARSE_IMPLS` by platform (kernels/target.py: the
host's backend or the chip a deviceless compile names) and fit, logged once; `check(spec)`
refuses an explicit choice that cannot run in one line naming the field.

Rows: jnp (model/sparse.py's O(n sqrt n) fast path; 'fast', its old name, is read as 'jnp' with
a warning), dense (the masked n x n reference), splash (jax's TPU splash attention), pallas (the
Triton block-sparse kernel, kernels/sparse/pallas_gpu_sparse.py), the kernels interpreted
(splash_interpret, pallas_interpret: any backend, for tests), and auto (TPU: splash where it
fits; GPU of compute capability >= 8.0: pallas where it fits; else jnp). docs/kernels.md, "The
Sparse Transformer's attention", has the table and how to add a kernel.
"""
import dataclasses
import importlib
import logging
import warnings
from typing import Any

from span_lm.kernels import target

log = logging.getLogger(__name__)
_logged: set = set()
ALIASES = {"fast": "jnp"}  # old configs and checkpoints


@dataclasses.dataclass(frozen=True)
class SparseImpl:
  """One implementation: `module.block_sparse_attention(q, k, v, heads, *, interpret)` (queries
  pre-scaled, causal, float32 softmax, a query with no key gives zeros) and
  `module.misfit(heads, n, head_dim) -> str` ('' where it runs)."""
  name: str
  module: str
  platform: str | None = None  # the backend its compiled kernel needs (None: any)
  needs: str = ""  # for check's refusal
  interpret: bool = False
  kernel: bool = False  # skips blocks (the FLOPs accounting counts its computed blocks)
  fn: str = "block_sparse_attention"  # the module's attention function

  @property
  def ops(self):
    return importlib.import_module(self.module)

  def misfit(self, heads, n: int, head_dim: int) -> str:
    return self.ops.misfit(heads, n, head_dim)

  def __call__(self, q_BxHxNxD, k_BxHxNxD, v_BxHxNxE, heads):
    return getattr(self.ops, self.fn)(q_BxHxNxD, k_BxHxNxD, v_BxHxNxE, heads,
                                           interpret=self.interpret)


_GPU = "a Triton block-sparse kernel, which needs a GPU (Ampere or newer)"
_TPU = "jax's splash attention (a Mosaic kernel), which needs a TPU"
SPARSE_IMPLS: dict[str, SparseImpl] = {i.name: i for i in (
    SparseImpl("jnp", "span_lm.kernels.sparse.sparse_jnp"),
    SparseImpl("dense", "span_lm.kernels.sparse.sparse_jnp", fn="dense_attention"),
    SparseImpl("splash", "span_lm.kernels.sparse.splash_sparse", platform="tpu", needs=_TPU,
               kernel=True),
    SparseImpl("splash_interpret", "span_lm.kernels.sparse.splash_sparse", interpret=True,
               kernel=True),
    SparseImpl("pallas", "span_lm.kernels.sparse.pallas_gpu_sparse", platform="gpu", needs=_GPU,
               kernel=True),
    SparseImpl("pallas_interpret", "span_lm.kernels.sparse.pallas_gpu_sparse", interpret=True,
               kernel=True),
)}
SPARSE_IMPL_NAMES = ("auto",) + tuple(SPARSE_IMPLS) + tuple(ALIASES)  # what the config may name


@dataclasses.dataclass(frozen=True)
class SparseSpec:
  """What the sparse door needs of one layer's attention, and nothing else: the model builds one
  (model/sparse.py) as the span model builds its `kernels.Spec`. An old name (ALIASES) is read
  as the new one on construction, with a FutureWarning, as the span door's `Attention` reads its
  own."""
  impl: str = "auto"  # a row of SPARSE_IMPLS, or 'auto'
  heads: Any = None  # the layer's head patterns (block_sparse.HeadPattern each); None: unknown
  n: int | None = None  # positions: queries and keys (causal)
  head_dim: int | None = None  # of the queries and keys

  def __post_init__(self):
    if self.impl in ALIASES:
      warnings.warn(f"config.model.sparse.impl={self.impl!r} is now {ALIASES[self.impl]!r}",
                    FutureWarning, stacklevel=3)
      object.__setattr__(self, "impl", ALIASES[self.impl])


def check(spec: SparseSpec, *, backend: str | None = None) -> None:
  """One-line ValueError where an explicit choice cannot run (unknown name, a compiled kernel
  on another backend, the spec's shapes where given, which it cannot tile)."""
  name = spec.impl
  if name == "auto":
    return
  impl = SPARSE_IMPLS.get(name)
  if impl is None:
    raise ValueError(f"config.model.sparse.impl={name!r}: choose one of {SPARSE_IMPL_NAMES}")
  if backend is not None and impl.platform not in (None, backend):
    raise ValueError(f"config.model.sparse.impl={name!r} runs {impl.needs}; this process has "
                     f"{backend} devices: use 'auto' (or {name + '_interpret'!r})")
  if impl.module == SPARSE_IMPLS["pallas"].module:
    target.refuse_without_triton("sparse.impl", name, impl.needs, "jnp")
  if spec.heads is not None:
    why = impl.misfit(spec.heads, spec.n, spec.head_dim)
    if why:
      raise ValueError(f"config.model.sparse.impl={name!r}: {why}")


def _auto(spec: SparseSpec) -> tuple[SparseImpl, str]:
  heads, n, head_dim = spec.heads, spec.n, spec.head_dim
  platform = target.current()
  if platform.name == "tpu":
    why = SPARSE_IMPLS["splash"].misfit(heads, n, head_dim)
    return SPARSE_IMPLS["jnp" if why else "splash"], why
  if platform.name == "gpu":  # Pallas' Triton backend: compute capability 8.0 and later
    cc = platform.compute_capability
    why = (f"compute capability {cc} (the Triton kernel needs 8.0 or later)"
           if cc is None or cc < 8.0 else target.triton_missing()
           or SPARSE_IMPLS["pallas"].misfit(heads, n, head_dim))
    return SPARSE_IMPLS["jnp" if why else "pallas"], why
  return SPARSE_IMPLS["jnp"], "" if platform.name == "cpu" else f"backend {platform.name}"


def _pick(spec: SparseSpec) -> tuple[SparseImpl, str]:
  """(the implementation, why: '' or the reason auto passed over a kernel)."""
  if spec.impl == "auto":
    return _auto(spec)
  check(spec)
  return SPARSE_IMPLS[spec.impl], ""


def choose(spec: SparseSpec) -> tuple[str, str]:
  """(what `select` picks, why), unlogged: for reports."""
  impl, why = _pick(spec)
  return impl.name, why


def select(spec: SparseSpec) -> SparseImpl:
  """The implementation that runs the spec's heads over its n positions; an explicit choice that
  does not fit raises (check). Logged once per distinct choice."""
  impl, why = _pick(spec)
  key = (spec.impl, impl.name, spec.n, spec.head_dim, why)
  if key not in _logged:
    _logged.add(key)
    log.info("sparse attention: %s (sparse.impl=%s, n %d%s)", impl.name, spec.impl, spec.n,
             f"; {why}" if why else "")
  return impl

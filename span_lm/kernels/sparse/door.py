"""The Sparse Transformer's attention implementations, chosen like the span kernels' (`IMPLS`):
one row per implementation, `select` by platform (kernels/target.py: the host's backend or the
chip a deviceless compile names) and fit, logged once; an explicit choice that cannot run is
refused by `check` in one line naming the field.

Rows: 'jnp' (model/sparse.py's O(n sqrt n) fast path; 'fast', its old name, is read as 'jnp'
with a warning), 'dense' (the masked n x n reference), 'splash' (jax's TPU splash attention,
the heads' patterns as computable masks, skipping all-zero blocks both ways), 'splash_interpret'
(interpreted, any backend: tests), 'pallas' (GPU: kernels/sparse/pallas_gpu_sparse.py's Triton
block-sparse kernel), 'pallas_interpret', 'auto' (TPU: splash where it fits, GPU of compute
capability >= 8.0: pallas where it fits, else jnp; CPU: jnp). docs/kernels.md, "The Sparse
Transformer's attention", has the table; adding a kernel is one row in SPARSE_IMPLS and, for
'auto', one line in `_auto`, where the module offers `block_sparse_attention(q, k, v, heads, *,
interpret=False)` and `misfit(heads, n, head_dim) -> str`.
"""
import dataclasses
import importlib
import logging
import warnings

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
    SparseImpl("splash_interpret", "span_lm.kernels.sparse.splash_sparse", interpret=True, kernel=True),
    SparseImpl("pallas", "span_lm.kernels.sparse.pallas_gpu_sparse", platform="gpu", needs=_GPU,
               kernel=True),
    SparseImpl("pallas_interpret", "span_lm.kernels.sparse.pallas_gpu_sparse", interpret=True,
               kernel=True),
)}
SPARSE_IMPL_NAMES = ("auto",) + tuple(SPARSE_IMPLS) + tuple(ALIASES)  # what the config may name


def canonical(name: str) -> str:
  if name in ALIASES:
    warnings.warn(f"config.model.sparse.impl={name!r} is now {ALIASES[name]!r}", FutureWarning,
                  stacklevel=3)
    return ALIASES[name]
  return name


def check(name: str, heads=None, n: int | None = None, head_dim: int | None = None, *,
          backend: str | None = None) -> None:
  """One-line ValueError where an explicit choice cannot run (unknown name, a compiled kernel
  on another backend, shapes it cannot tile)."""
  name = ALIASES.get(name, name)
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
  if heads is not None:
    why = impl.misfit(heads, n, head_dim)
    if why:
      raise ValueError(f"config.model.sparse.impl={name!r}: {why}")


def _auto(heads, n, head_dim) -> tuple[SparseImpl, str]:
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


def _pick(name: str, heads, n: int, head_dim: int) -> tuple[SparseImpl, str]:
  """(the implementation, why: '' or the reason auto passed over a kernel); `name` canonical."""
  if name == "auto":
    return _auto(heads, n, head_dim)
  check(name, heads, n, head_dim)
  return SPARSE_IMPLS[name], ""


def choose(name: str, heads, n: int, head_dim: int) -> tuple[str, str]:
  """(what `select` picks, why), unlogged: for reports."""
  impl, why = _pick(ALIASES.get(name, name), heads, n, head_dim)
  return impl.name, why


def select(name: str, heads, n: int, head_dim: int) -> SparseImpl:
  """The implementation that runs these heads over n positions; an explicit choice that does
  not fit raises (check). Logged once per distinct choice."""
  name = canonical(name)
  impl, why = _pick(name, heads, n, head_dim)
  key = (name, impl.name, n, head_dim, why)
  if key not in _logged:
    _logged.add(key)
    log.info("sparse attention: %s (sparse.impl=%s, n %d%s)", impl.name, name, n,
             f"; {why}" if why else "")
  return impl

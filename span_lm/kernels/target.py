"""The platform the code is being compiled for: the host's backend, or a chip named for a
deviceless compile (`compiling_for`, used by the compile mode: span_lm/tools/compile.py).

Every platform choice (the attention implementation in `kernels.select`, the matmul layouts in
`kernels.matmul.contract`, the fused kernel's tiles) asks here instead of jax.default_backend(),
so a step compiled on a CPU host for an H100 or a TPU traces the code that chip would run.
"""
import contextlib
import dataclasses
import threading


@dataclasses.dataclass(frozen=True)
class Platform:
  """'cpu', 'gpu' or 'tpu'; for NVIDIA GPUs the compute capability (e.g. 9.0), else None; the
  device kind as jax reports it ('TPU v5 lite', 'NVIDIA H100 80GB HBM3'), or '' if unknown."""
  name: str
  compute_capability: float | None = None
  kind: str = ""


_state = threading.local()


def current() -> Platform:
  """The target of the code being traced now."""
  forced = getattr(_state, "platform", None)
  if forced is not None:
    return forced
  import jax  # pylint: disable=g-import-not-at-top  (the door, which imports us, imports no jax)
  backend = jax.default_backend()
  dev = jax.devices()[0]
  cc = None
  if backend == "gpu":
    try:
      cc = float(getattr(dev, "compute_capability", None))
    except (TypeError, ValueError):
      cc = None
  return Platform(backend, cc, getattr(dev, "device_kind", ""))


def name() -> str:
  return current().name


@contextlib.contextmanager
def compiling_for(platform: str, compute_capability: float | None = None, kind: str = "",
                  device=None):
  """Trace for `platform` ('cpu', 'gpu', 'tpu'; 'cuda' is read as 'gpu') whatever this host has.

  device: a device of the target's deviceless topology (jax.experimental.topologies), made the
  default device meanwhile: from jax 0.11 Pallas's Triton lowering reads the GPU generation it
  lowers for there (without it, a CPU host's kernels fail with 'No supported GPU devices found').
  """
  platform = {"cuda": "gpu", "rocm": "gpu"}.get(platform, platform)
  if platform not in ("cpu", "gpu", "tpu"):
    raise ValueError(f"unknown platform {platform!r}: cpu, gpu or tpu")
  old = getattr(_state, "platform", None)
  _state.platform = Platform(platform, compute_capability, kind)
  try:
    if device is None:
      yield _state.platform
    else:
      import jax  # pylint: disable=g-import-not-at-top
      with jax.default_device(device):
        yield _state.platform
  finally:
    _state.platform = old



def pallas_triton():
  """jax.experimental.pallas.triton, the GPU kernels' lowering, imported without jax's
  DeprecationWarning (jax >= 0.11): the dependency is ours, known and planned for
  (docs/kernels.md, "The way forward for the GPU kernels"), not something a user of the kernels can act on.
  ImportError where this jax has removed it (`triton_missing` says so first)."""
  import importlib  # pylint: disable=g-import-not-at-top
  import warnings  # pylint: disable=g-import-not-at-top
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*Triton backend is deprecated.*")
    return importlib.import_module("jax.experimental.pallas.triton")


def triton_missing() -> str:
  """'' where this jax has Pallas's Triton backend (the GPU kernels' lowering), else why not.

  jax 0.11 deprecated `jax.experimental.pallas.triton` for removal (Mosaic GPU replaces it, on
  Hopper and later only): on a jax without it the GPU kernels are unavailable and `auto` takes
  the XLA path. Asked only where a GPU kernel is in play, so `import span_lm` never loads it.
  """
  try:
    pallas_triton()
  except ImportError as e:
    import jax  # pylint: disable=g-import-not-at-top
    return (f"this jax ({jax.__version__}) has no Pallas Triton backend "
            f"(jax.experimental.pallas.triton: {type(e).__name__})")
  return ""


def refuse_without_triton(field: str, name: str, needs: str, xla: str) -> None:
  """The one-line refusal of an explicit Pallas-Triton kernel (`field`={name}) on a jax without
  that backend; xla: the implementation that runs instead. Nothing where the backend is there."""
  missing = triton_missing()
  if missing:
    raise ValueError(f"config.model.{field}={name!r} runs {needs}, built on Pallas's Triton "
                     f"backend, but {missing}: use 'auto' or {xla!r} (the XLA path), or a jax "
                     "that has it (0.10-0.12)")

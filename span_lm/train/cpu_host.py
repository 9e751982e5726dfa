"""Host tuning for CPU training, all of it in one place: the host split into one JAX device per
core, and glibc malloc settings. Neither runs on GPU or TPU (cpu_only); both must act before the
JAX backend starts (train/run.py calls them first).

Devices: XLA:CPU runs most of one device's operations (everything but large matmuls) on one
thread, so with one device per core the halves of a batch run side by side (setup_cpu_devices).

Huge pages (on by default; config.dist.cpu_huge_pages, the benchmarks' --no_huge_pages): XLA:CPU
mallocs each execution's large temporaries afresh, and glibc serves them from fresh mmap'd pages
that the kernel faults in and zeroes 4 KiB at a time, every step. glibc's tunable
glibc.malloc.hugetlb=1 has malloc ask for transparent huge pages (madvise), 2 MiB per fault: a
fraction of the faults, the same peak resident memory (docs/benchmarks.md, "Huge pages"). A
tunable is read at process start only, so main.py re-executes itself once with it set
(exec_with_huge_pages); a notebook's kernel needs GLIBC_TUNABLES set before it starts.

Malloc arenas (off by default; config.dist.cpu_keep_freed_memory or the benchmarks'
--keep_freed_memory):
keep freed heap memory for reuse without raising the peak. XLA:CPU allocates each execution's
temporaries with malloc and frees them when the step ends. With glibc's defaults the per-thread
arenas trim their freed heap tops and return them to the kernel, so later steps fault the same
pages in again (the kernel zeroing them). One arena that is never trimmed keeps those pages.

What is not done: serving the large buffers from the heap too (no mmap'd chunks). It removed
more faults, but the single no-mmap heap fragments: freed holes that a later, larger buffer
does not fit stay resident, and peak resident memory rose above glibc's defaults on every
benchmark shape measured. Chunks above the mmap threshold (32 MiB, glibc's own maximum) are
still mmap'd and returned when freed, so the heap only holds small and medium buffers and its
peak stays at or below the defaults' (docs/benchmarks.md, "malloc and peak resident memory").
"""
import ctypes
import logging
import os
import sys
from typing import Mapping

import jax

from span_lm import config as config_lib
from span_lm.model import archs
from span_lm.train import distributed as dist_lib

log = logging.getLogger("span_lm")

# mallopt parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
_INT_MAX = 2**31 - 1  # mallopt takes an int: larger values would wrap (0: trim on every free)
_MMAP_THRESHOLD = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: the largest allowed


def _glibc():
  if not sys.platform.startswith("linux"):
    return None
  try:
    libc = ctypes.CDLL(None)
    libc.gnu_get_libc_version  # pylint: disable=pointless-statement  # musl has no such symbol
    libc.mallopt  # pylint: disable=pointless-statement
  except (OSError, AttributeError):
    return None
  libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
  libc.mallopt.restype = ctypes.c_int
  libc.gnu_get_libc_version.restype = ctypes.c_char_p
  return libc


HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"
_THP = "/sys/kernel/mm/transparent_hugepage/enabled"


_REEXECUTED = "SPAN_LM_HUGE_PAGES_EXEC"  # set in the re-executed process: never a second exec


def _thp_mode() -> str:
  """The kernel's transparent huge page mode (always, madvise, never), or '' where unknown."""
  try:
    with open(_THP) as f:
      text = f.read()
  except OSError:
    return ""
  return text[text.find("[") + 1:text.find("]")] if "[" in text else ""


def _glibc_version() -> tuple[int, ...]:
  libc = _glibc()
  if libc is None:
    return ()
  try:
    return tuple(int(p) for p in libc.gnu_get_libc_version().decode().split(".")[:2])
  except ValueError:
    return ()


def _huge_pages_supported() -> bool:
  """glibc 2.35+ (which has the tunable) and the kernel's transparent huge pages on."""
  return _glibc_version() >= (2, 35) and _thp_mode() in ("always", "madvise")


def huge_pages_env(env: Mapping[str, str] | None = None) -> dict | None:
  """The environment with glibc's huge-page tunable added to GLIBC_TUNABLES, or None where it
  would change nothing: not glibc 2.35+ (which has the tunable), the kernel's transparent huge
  pages off or unknown, already re-executed once, or a glibc.malloc.hugetlb setting already
  there (the user's own choice stands)."""
  env = dict(os.environ if env is None else env)
  if not _huge_pages_supported() or env.get(_REEXECUTED):
    return None
  tunables = env.get("GLIBC_TUNABLES", "")
  if "glibc.malloc.hugetlb" in tunables:
    return None
  env["GLIBC_TUNABLES"] = ":".join(t for t in (tunables, HUGE_PAGES_TUNABLE) if t)
  return env


def huge_pages_active() -> bool:
  return (HUGE_PAGES_TUNABLE in os.environ.get("GLIBC_TUNABLES", "").split(":")
          and _huge_pages_supported())


def exec_with_huge_pages(config) -> None:
  """Replaces this process by the same command (the interpreter's own options included) with huge
  pages for malloc, when config asks for them (dist.cpu_huge_pages), JAX will run on the CPU and
  the tunable is not set yet; returns (doing nothing) otherwise. Call before anything that must
  not run twice; the PID, open terminal and signals stay the same."""
  if config.dist.get("cpu_huge_pages", False):
    reexec_with_huge_pages()


def reexec_with_huge_pages() -> None:
  """exec_with_huge_pages without a config (the benchmark scripts): on CPU hosts only, once."""
  env = huge_pages_env() if cpu_only() else None
  if env is None:
    return
  env[_REEXECUTED] = "1"
  sys.stdout.flush()
  sys.stderr.flush()
  os.execve(sys.executable, [sys.executable] + list(sys.orig_argv[1:]), env)


def keep_freed_memory() -> tuple[bool, str]:
  """Sets one malloc arena, no trimming, and a fixed 32 MiB mmap threshold for this process.

  Call before the JAX backend starts (its threads take an arena on their first allocation); the
  settings apply to allocations made afterwards. Returns (applied, why)."""
  libc = _glibc()
  if libc is None:
    return False, "not glibc"
  for param, value in ((_M_ARENA_MAX, 1), (_M_TRIM_THRESHOLD, _INT_MAX),
                       (_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)):
    if libc.mallopt(param, value) != 1:
      return False, f"mallopt({param}, {value}) failed"
  return True, (f"glibc {libc.gnu_get_libc_version().decode()}: one arena, no trim, "
                f"mmap above {_MMAP_THRESHOLD >> 20} MiB")


def add_flag(parser) -> None:
  """The benchmark scripts' malloc flags (argparse): --no_huge_pages, --keep_freed_memory."""
  parser.add_argument("--no_huge_pages", dest="huge_pages", action="store_false", default=True,
                      help="run span_lm without glibc.malloc.hugetlb=1 (on by default, as in "
                           "main.py: span_lm/train/cpu_host.py)")
  parser.add_argument("--keep_freed_memory", dest="system_malloc", action="store_false",
                      help="one arena, no trimming, mmap above 32 MiB (span_lm/train/cpu_host.py;"
                           " off by default, as in main.py: docs/benchmarks.md)")
  parser.add_argument("--system_malloc", dest="system_malloc", action="store_true", default=True,
                      help="glibc malloc as it is (the default)")


AUTO_MAX_CPU_DEVICES = 8  # a cap: more devices mean a wider all-reduce (docs/benchmarks.md)


def apply_flags(args) -> None:
  """What add_flag's flags ask for, before the JAX backend starts (huge pages: re-executes)."""
  if args.huge_pages:
    reexec_with_huge_pages()
  if not args.system_malloc:
    keep_freed_memory()


def keeps_one_cpu_device(config) -> bool:
  """Whether auto (dist.cpu_devices=0) keeps the host as one device: bf16 span models, all of
  whose matmuls run multi-threaded on XLA:CPU (kernels/matmul.py), so splitting the host only
  halves each device's threads; one device measured faster for them, float32 slower
  (docs/benchmarks.md)."""
  arch = archs.ARCHS.get(getattr(config.model, "arch", archs.DEFAULT))
  return (str(getattr(config.model, "dtype", "float32")) == "bfloat16"
          and arch is not None and arch.banded)


def choose_cpu_devices(requested: int, cores: int, batches: tuple[int, ...]) -> int:
  """Devices to split a CPU host into: `requested`, or (0) the most, up to the core count (at
  most AUTO_MAX_CPU_DEVICES), that divide every per-step batch."""
  if requested:
    return requested
  for n in range(max(1, min(cores, AUTO_MAX_CPU_DEVICES)), 0, -1):
    if all(b % n == 0 for b in batches):
      return n
  return 1


def accelerator_plugins() -> list[str]:
  """Installed PJRT plugins JAX would load (CUDA, ROCm, TPU), found without starting a backend."""
  import importlib.metadata  # pylint: disable=g-import-not-at-top
  import importlib.util  # pylint: disable=g-import-not-at-top
  import pkgutil  # pylint: disable=g-import-not-at-top
  names = [ep.name for ep in importlib.metadata.entry_points(group="jax_plugins")]
  try:
    import jax_plugins  # pylint: disable=g-import-not-at-top
    names += [m.name for m in pkgutil.iter_modules(jax_plugins.__path__)]
  except ImportError:
    pass
  if importlib.util.find_spec("libtpu") is not None:
    names.append("libtpu")
  return names


def backend_started() -> bool:
  """Whether a JAX backend is already running in this process (a notebook, a test session)."""
  try:
    from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
    return bool(xla_bridge.backends_are_initialized())
  except (ImportError, AttributeError):  # a JAX without it: assume so (leave things alone)
    return True


def cpu_only(env: Mapping[str, str] | None = None) -> bool:
  """Whether JAX will run on the host CPU (JAX_PLATFORMS, or no accelerator plugin installed),
  decided without starting a backend."""
  env = os.environ if env is None else env
  platforms = env.get("JAX_PLATFORMS", "")
  if platforms:
    return platforms.split(",")[0].strip() == "cpu"
  return not accelerator_plugins()


def setup_cpu_devices(config, env: Mapping[str, str] | None = None) -> tuple[int | None, str]:
  """Splits a CPU host into config.dist.cpu_devices JAX devices (0: auto) for data parallelism.

  Why: XLA:CPU runs most of one device's operations (everything but large matmuls) on one thread,
  and the banded attention and layer norms are such operations; with one device per core the
  halves of the batch run side by side (bench/train_step.py; docs/benchmarks.md). Auto keeps one
  device for bf16 span models, which measured faster that way (keeps_one_cpu_device). Must run
  before the backend starts; a user's --xla_force_host_platform_device_count is left alone.
  Returns (devices set or None, why).
  """
  env = os.environ if env is None else env
  requested = int(config.dist.cpu_devices)
  if "xla_force_host_platform_device_count" in env.get("XLA_FLAGS", ""):
    return None, "XLA_FLAGS sets --xla_force_host_platform_device_count"
  if requested == 1:
    return None, "config.dist.cpu_devices=1"
  if requested == 0:
    if not cpu_only(env):
      return None, "an accelerator platform is available"
    if dist_lib.decide(config.dist, env)[0]:
      return None, "multi-process run (set config.dist.cpu_devices explicitly)"
    if keeps_one_cpu_device(config):
      return None, f"auto: one device for {config.model.dtype} models"
  cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  n = choose_cpu_devices(requested, cores or 1,
                         tuple(config_lib.per_step_batches(config).values()))
  try:
    jax.config.update("jax_num_cpu_devices", n)
  except RuntimeError:  # the backend already started (a notebook, a test): keep its devices
    return None, "the JAX backend was already initialised"
  return n, f"config.dist.cpu_devices={requested}" if requested else "auto: one per core"


def setup(config) -> tuple[int | None, str]:
  """Both settings as config.dist asks, before any backend use. A process whose backend already
  runs (a notebook, a test session) keeps its allocator and devices: its threads have their
  arenas and heaps already. Returns setup_cpu_devices' (devices set or None, why)."""
  fresh = not backend_started()
  n_cpu, why = setup_cpu_devices(config)
  if config.dist.cpu_keep_freed_memory and fresh and cpu_only():
    kept, how = keep_freed_memory()
    log.info("host malloc: %s", how if kept else f"left as it is ({how})")
  return n_cpu, why

"""glibc malloc settings for CPU training: keep freed heap memory for reuse, never raise the peak.

Why: XLA:CPU allocates each execution's temporaries with malloc and frees them when the step
ends. With glibc's defaults the per-thread arenas trim their freed heap tops and return them to
the kernel, so later steps fault the same pages in again (the kernel zeroing them). One arena
that is never trimmed keeps those pages for reuse.

What is not done: serving the large buffers from the heap too (no mmap'd chunks). It removed
more faults, but the single no-mmap heap fragments: freed holes that a later, larger buffer
does not fit stay resident, and peak resident memory rose above glibc's defaults on every
benchmark shape measured (1.7x for bf16 S=1024, 19.2 against 11.3 GB for a float32 S=8192
step). Chunks above the mmap threshold (32 MiB, glibc's own maximum) are still mmap'd and
returned when freed, so the heap only holds small and medium buffers and its peak stays at or
below the defaults' (docs/benchmarks.md, "malloc and peak resident memory").
"""
import ctypes
import sys

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
  """--keep_freed_memory for the benchmark scripts (argparse): opt in to keep_freed_memory(), as
  main.py does with --config.dist.cpu_keep_freed_memory=True; glibc's defaults otherwise."""
  parser.add_argument("--keep_freed_memory", dest="system_malloc", action="store_false",
                      help="one arena, no trimming, mmap above 32 MiB (span_lm/train/host_memory.py;"
                           " off by default, as in main.py: docs/benchmarks.md)")
  parser.add_argument("--system_malloc", dest="system_malloc", action="store_true", default=True,
                      help="glibc malloc as it is (the default)")

"""glibc malloc settings that let XLA:CPU reuse a step's buffers instead of faulting them in.

Why: XLA:CPU allocates each execution's temporaries (hundreds of MiB for a training step) with
malloc and frees them when the step ends. glibc serves allocations above 32 MiB with fresh mmaps
and hands freed heap tops back to the kernel, so every step touches new pages: the fixed-span
issue-8 step took ~190,000 minor page faults (~750 MiB zeroed by the kernel) and 0.36 s of system
time per 0.86-0.93 s step on the 2-core CPU. With one arena, no mmap chunks and no trimming, steps
reuse the pages earlier steps faulted in (the heap still grows now and then during the first
steps): ~0 faults per step and 0.65-0.69 s (docs/benchmarks.md, session 5).

The cost: freed memory stays with the process (its resident size stays at its peak, which a
training loop reaches again every step anyway), and all threads share one malloc arena (XLA's
worker threads allocate little; the large buffers are allocated once per execution).
"""
import ctypes
import sys

# mallopt parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
_INT_MAX = 2**31 - 1  # mallopt takes an int: larger values would wrap (0: trim on every free)


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
  """Sets one malloc arena, no mmap'd chunks and no trimming for this process.

  Call before the JAX backend starts (its threads take an arena on their first allocation); the
  settings apply to allocations made afterwards. Returns (applied, why)."""
  libc = _glibc()
  if libc is None:
    return False, "not glibc"
  for param, value in ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _INT_MAX)):
    if libc.mallopt(param, value) != 1:
      return False, f"mallopt({param}, {value}) failed"
  return True, f"glibc {libc.gnu_get_libc_version().decode()}: one arena, no mmap, no trim"


def add_flag(parser) -> None:
  """--system_malloc for the benchmark scripts (argparse), which call keep_freed_memory() unless
  it is given, as main.py does on CPU hosts."""
  parser.add_argument("--system_malloc", action="store_true",
                      help="leave glibc malloc as it is (default: one arena, no mmap'd chunks, "
                           "no trimming, as main.py on CPU hosts: span_lm/train/host_memory.py)")

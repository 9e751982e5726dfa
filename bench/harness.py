"""What every bench script shares, in one place so that a number means the same in every table:
timing (warm-up calls, then the median), XLA's compiled memory (one formula), the roofline
(model FLOP/s against the chip's peak), JSON rows written as they complete, markdown tables.

The scripts run as `python -m bench.<name>` from the repository root (the checkout's span_lm is
then the one imported, installed or not); this module imports no jax at the top, so the GPU
driver (which never takes the device) can use it too.
"""
import json
import os
import platform
import subprocess
import time
import traceback

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# --------------------------------------------------------------------------------------- timing


def _ready(x):
  import jax  # pylint: disable=g-import-not-at-top
  return jax.block_until_ready(x)


def time_calls(call, reps: int, warmup: int = 1) -> list[float]:
  """Seconds of each of `reps` calls of `call()` (each waited for), after `warmup` untimed calls:
  the first compiles, so it never counts."""
  for _ in range(warmup):
    _ready(call())
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    _ready(call())
    times.append(time.perf_counter() - t)
  return times


def median_s(call, reps: int, warmup: int = 1) -> float:
  """The median of `time_calls`: one slow call (a page fault, another process) does not move it."""
  return float(np.median(time_calls(call, reps, warmup)))


def timed_ms(f, args, reps: int, runs: int = 3) -> float:
  """Median ms per call of `runs` runs of `reps` back-to-back calls of f(*args) after one warm
  call: back to back, so launch gaps hide behind the device's queue as in a model."""
  _ready(f(*args))
  out = []
  for _ in range(runs):
    t0 = time.perf_counter()
    for _ in range(reps):
      r = f(*args)
    _ready(r)
    out.append((time.perf_counter() - t0) / reps * 1e3)
  return float(np.median(out))


def time_steps(step, state, batch, reps: int, warmup: int):
  """A training step that donates its state: `warmup` untimed steps, then `reps` timed ones.
  Returns (state, last metrics, seconds of each timed step)."""
  metrics = None
  for _ in range(warmup):
    state, metrics = step(state, batch)
  _ready(state)
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    state, metrics = step(state, batch)
    _ready((state, metrics))
    times.append(time.perf_counter() - t)
  return state, metrics, times


def matmul_gflops(a, reps: int, block_each: bool = False) -> float:
  """GFLOP/s of a jitted a @ a (float32 accumulation) on a's device: the best of 3 runs of `reps`
  calls (each waited for with block_each, else the last), after one call that compiles."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
  f(a, a).block_until_ready()
  best = float("inf")
  for _ in range(3):
    t = time.perf_counter()
    for _ in range(reps):
      r = f(a, a)
      if block_each:
        r.block_until_ready()
    r.block_until_ready()
    best = min(best, (time.perf_counter() - t) / reps)
  return 2 * a.shape[0]**3 / best / 1e9


def compile_timed(lowerable, *args):
  """(compiled, seconds) of jit(...).lower(*args).compile()."""
  t0 = time.perf_counter()
  compiled = lowerable.lower(*args).compile()
  return compiled, time.perf_counter() - t0


# --------------------------------------------------------------------------------------- memory


def memory(compiled) -> dict:
  """XLA's memory analysis of a compiled function, in bytes: its temporaries, arguments and
  outputs, and `total`, what it holds at once (arguments + outputs + temporaries, less the
  outputs that reuse donated arguments). Every bench table's compiled bytes are this total."""
  m = compiled.memory_analysis()
  out = {"temp": int(m.temp_size_in_bytes), "argument": int(m.argument_size_in_bytes),
         "output": int(m.output_size_in_bytes), "alias": int(m.alias_size_in_bytes)}
  out["total"] = out["temp"] + out["argument"] + out["output"] - out["alias"]
  return out


def compiled_bytes(compiled) -> int | None:
  """`memory(compiled)["total"]`, or None where the backend gives no analysis."""
  try:
    return memory(compiled)["total"]
  except Exception:  # pylint: disable=broad-except
    return None


# ------------------------------------------------------------------------------------- roofline


def roofline(flops: float, seconds: float, dtype: str, peaks: dict | None,
             measured_tflops: float | None = None) -> dict:
  """Model TFLOP/s of a step and its fraction of the chip's dense peak for `dtype`
  (span_lm/kernels/chips.py; float32 also against TF32), and of a matmul measured on this device
  where there is one (the CPU has no data-sheet peak)."""
  tflops = flops / seconds / 1e12
  peak = (peaks or {}).get(dtype)
  out = {"model_tflops_per_s": tflops, "mfu": tflops / peak if peak else None}
  if dtype == "float32" and peaks and peaks.get("tf32"):
    out["mfu_tf32"] = tflops / peaks["tf32"]
  out["of_measured_matmul"] = tflops / measured_tflops if measured_tflops else None
  return out


# ----------------------------------------------------------------------------------------- rows


def emit(row: dict) -> dict:
  """One row to stdout as `ROW {json}`, flushed: the GPU driver appends it to its row file the
  moment it arrives, so a child killed later keeps it."""
  print("ROW " + json.dumps(row, default=str), flush=True)
  return row


class RowFile:
  """Rows appended to a JSON-lines file as they complete (flushed and synced: a run cut short
  keeps every finished row)."""

  def __init__(self, path: str):
    self.path = path
    self._f = open(path, "a")  # pylint: disable=consider-using-with

  def write(self, row: dict) -> None:
    self._f.write(json.dumps(row, default=str) + "\n")
    self._f.flush()
    os.fsync(self._f.fileno())

  def close(self) -> None:
    self._f.close()


def read_rows(path: str) -> list[dict]:
  """The rows of a JSON-lines file; a line cut by a kill is skipped."""
  rows = []
  with open(path) as f:
    for line in f:
      try:
        rows.append(json.loads(line))
      except json.JSONDecodeError:
        pass
  return rows


def error_row(e: BaseException, limit: int = 2000, trace: bool = True) -> dict:
  """A failed row's fields: `oom` kept apart from other errors (a size, not a bug)."""
  msg = f"{type(e).__name__}: {e}"
  oom = "RESOURCE_EXHAUSTED" in msg or "out of memory" in msg.lower()
  row = {"status": "oom" if oom else "error", "error": msg[:limit]}
  if trace:
    row["trace"] = traceback.format_exc()[-3000:]
  return row


def rel(a, b) -> float:
  """max|a - b| / max|b| in float64 (inf where not finite): the tolerance every check uses."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  err = float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))
  return err if np.isfinite(err) else float("inf")


def commit(repo: str = REPO) -> str | None:
  """The checkout's short commit, for a result's header (None outside git)."""
  try:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True,
                          text=True, timeout=10, check=False).stdout.strip() or None
  except Exception:  # pylint: disable=broad-except
    return None


def env_row() -> dict:
  """The device and versions a GPU child ran on (its first row)."""
  import jax  # pylint: disable=g-import-not-at-top
  from span_lm.kernels import chips  # pylint: disable=g-import-not-at-top
  dev = jax.devices()[0]
  cc = getattr(dev, "compute_capability", None)
  row = {"kind": "env", "device": dev.device_kind, "backend": jax.default_backend(),
         "cc": float(cc) if cc else None, "python": platform.python_version(),
         "jax": jax.__version__, "device_count": jax.device_count()}
  try:
    import jaxlib  # pylint: disable=g-import-not-at-top
    row["jaxlib"] = jaxlib.__version__
  except ImportError:
    pass
  row.update(cuda_versions(("cuda_runtime", "cuda_driver", "cudnn")))
  row["memory_bytes"] = (dev.memory_stats() or {}).get("bytes_limit")
  row["peak_table"] = chips.peak_tflops(dev.device_kind)
  return row


def cuda_versions(names) -> dict:
  """jax's CUDA library versions by name ('cudnn': ...); {} without the CUDA plugin."""
  try:
    from jax._src.lib import cuda_versions as cv  # pylint: disable=g-import-not-at-top
  except Exception:  # pylint: disable=broad-except
    return {}
  if cv is None:
    return {}
  out = {}
  for name in names:
    try:
      out[name] = getattr(cv, f"{name}_get_version")()
    except Exception as e:  # pylint: disable=broad-except
      out[name] = f"n/a ({type(e).__name__})"
  return out


# ------------------------------------------------------------------------------------- markdown


def fmt(x, spec: str = "{:.3g}") -> str:
  return "-" if x is None else spec.format(x)


def gib(x) -> str:
  return "-" if not x else f"{x / 2**30:.2f}"


def first_line(s, n: int = 140) -> str:
  return (s or "").strip().splitlines()[0][:n] if s else ""


def table(header, rows) -> list[str]:
  """A markdown table's lines: the header, its rule, one line per row of cells."""
  line = lambda cells: "|" + "|".join(f" {c} " if str(c) else " " for c in cells) + "|"
  return [line(header), "|" + "---|" * len(header)] + [line(r) for r in rows]


# ------------------------------------------------------------------------------- GPU children


class Child:
  """The rows of one GPU child process (bench/gpu_kernel_check.py, gpu_encoder.py,
  gpu_sparse.py): each printed as it completes and kept, naming the device it ran on."""

  def __init__(self):
    self.rows, self.device = [], None

  def emit(self, row: dict) -> dict:
    row = dict(row, device=self.device) if self.device else row
    self.rows.append(emit(row))
    return row

  def measure(self, row: dict, deadline: float, fn) -> dict:
    """row updated with fn()'s fields, its error, or `skipped` where the deadline has passed
    (nothing starts after it), and the seconds it took; then emitted."""
    if time.time() > deadline:
      return self.emit(dict(row, status="skipped", error="past the family's deadline"))
    t0 = time.perf_counter()
    try:
      row.update(fn())
    except Exception as e:  # pylint: disable=broad-except
      row.update(error_row(e, 600, trace=False))
    row["seconds"] = round(time.perf_counter() - t0, 2)
    return self.emit(row)


def fwd_bwd_ms(fwd, fargs, bwd, bargs, reps: int) -> dict:
  """A timing row's fields: forward and forward+backward ms (`timed_ms`)."""
  return {"fwd_ms": round(timed_ms(fwd, fargs, reps), 3),
          "fwd_bwd_ms": round(timed_ms(bwd, bargs, reps), 3), "status": "ok"}


def check_fields(got: dict, want: dict, tol: float, zeros: bool = True) -> dict:
  """A correctness row's fields: every tensor's `rel` difference, the worst, and pass or FAIL.
  With `zeros`, the tensors whose reference is all zeros (they prove nothing: FAIL too)."""
  diffs = {n: rel(got[n], want[n]) for n in want}
  zero = [n for n in want if float(np.max(np.abs(np.asarray(want[n], np.float64)))) == 0.0]
  worst = max(diffs, key=diffs.get)
  ok = diffs[worst] <= tol and not (zeros and zero)
  out = {"status": "pass" if ok else "FAIL", "diffs": diffs, "worst": worst,
         "worst_diff": diffs[worst]}
  return dict(out, zero_reference=zero) if zeros else out


def child_main(name: str, doc: str, parts: dict) -> None:
  """The command line of a GPU child: `parts` ({name: fn(args, env row, deadline)}) run in
  order after the env row; --dry_run rehearses on the CPU (the kernel interpreted, tiny shapes,
  cuDNN's stand-in); a failed row fails the process."""
  import argparse  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  ap = argparse.ArgumentParser(description=doc,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--out", default="", help="also write every row as one JSON list")
  ap.add_argument("--dry_run", action="store_true",
                  help="CPU rehearsal: --interpret --small --cudnn_standin")
  ap.add_argument("--interpret", action="store_true", help="interpret the kernel (any backend)")
  ap.add_argument("--small", action="store_true", help="tiny shapes (the CPU rehearsal)")
  ap.add_argument("--cudnn_standin", action="store_true",
                  help="time jax.nn.dot_product_attention(implementation='xla') instead")
  ap.add_argument("--parts", nargs="*", default=list(parts), choices=list(parts))
  ap.add_argument("--deadline", type=float, default=0.0, help="epoch seconds; 0: none")
  a = ap.parse_args()
  if a.dry_run:
    a.interpret = a.small = a.cudnn_standin = True
    jax.config.update("jax_platforms", "cpu")
  if jax.default_backend() != "gpu" and not a.interpret:
    raise SystemExit(f"{name}: no GPU here: --dry_run rehearses on the CPU")
  deadline = a.deadline or float("inf")
  env = env_row()
  CHILD.emit(env)
  CHILD.device = env["device"]  # every row names the device it ran on
  for part, fn in parts.items():
    if part in a.parts:
      fn(a, env, deadline)
  if a.out:
    with open(a.out, "w") as f:
      json.dump(CHILD.rows, f, indent=1, default=str)
  bad = [r for r in CHILD.rows if r.get("status") in ("FAIL", "error")]
  if bad:
    raise SystemExit(f"{name}: {len(bad)} row(s) failed: "
                     f"{[r.get('case') or r.get('path') or r.get('paths') or r.get('span_mode') for r in bad]}")


CHILD = Child()


# --------------------------------------------------------------------------------- commands


def int_flags(parser, **defaults) -> None:
  """Integer flags of a bench command (--layers, --d_model, ...), each with its default: the shape
  flags every script shares, spelled the same everywhere."""
  for name, default in defaults.items():
    parser.add_argument(f"--{name}", type=int, default=default)


def write_json(path: str, obj, indent: int = 1) -> None:
  """A result file (rows and the command that made them)."""
  with open(path, "w") as f:
    json.dump(obj, f, indent=indent, default=str)

"""Where a forward + backward pass of the issue-8 model spends its time, per XLA operation kind.

One jitted value_and_grad of the 4-layer stack (bench/attention_span.py's cases and shapes) on
one device, timed, then traced with jax.profiler; prints the total per fusion kind (the op name
with its numeric suffix dropped: ynn_fusion = YNNPACK matmuls, wrapped_reduce-window, ...) and
the most expensive single operations; also the page faults and system/user CPU time per run
(kernel time spent faulting in fresh buffers: span_lm/train/cpu_host.py).
On two cores concurrent operations overlap (their times add up to more than the step). On one
core (`taskset -c 0 python -m bench.profile_step ...`) they do not overlap, but YNNPACK
operations read up to 2x their clocked time (docs/benchmarks.md, "Why the last 5 % of the fixed
span did not come"; 2-core AMX Xeon, 2026-11-24). Use the per-op times to find where to look,
and whole-step times of alternating variants to decide.

  python -m bench.profile_step --case short --dtype bfloat16
"""
import argparse
import collections
import glob
import gzip
import json
import re
import resource
import tempfile

import jax
import numpy as np

from bench import attention_span
from span_lm.train import cpu_host


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--case", default="short",
                 choices=["fixed", "short", "mixed", "mixed_nogroup", "long"])
  p.add_argument("--span", type=int, default=1024)
  p.add_argument("--dtype", default="float32")
  p.add_argument("--heads", type=int, default=4,
                 help="8: issue 8's mixed layer (one long head of eight)")
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--top", type=int, default=15)
  p.add_argument("--hlo", default="", help="write the compiled HLO here (to read what a fusion is)")
  cpu_host.add_flag(p)
  a = p.parse_args()
  cpu_host.apply_flags(a)  # before the backend starts
  shapes = argparse.Namespace(layers=4, d_model=256, heads=a.heads, d_ff=1024, block=128, batch=16,
                              short_span=64, dtype=a.dtype)
  cfg, plan, params = attention_span.make_case(a.case, a.span, shapes)
  step, _ = attention_span.compile_case(cfg, plan, params, shapes)
  if a.hlo:
    with open(a.hlo, "w") as f:
      f.write(step.as_text())
  jax.block_until_ready(step(params))  # the first run's buffers are new in any case
  r0 = resource.getrusage(resource.RUSAGE_SELF)
  times = attention_span.time_compiled(step, params, a.reps)  # one more warm-up, then timed
  r1 = resource.getrusage(resource.RUSAGE_SELF)
  print(f"plan {plan.describe()}\nfwd+bwd median {np.median(times):.3f} s, min {min(times):.3f} s")
  n = len(times) + 1  # the process's page faults and CPU time per run, from the second run on
  print(f"per run: {(r1.ru_minflt - r0.ru_minflt) / n:,.0f} minor page faults, system time "
        f"{(r1.ru_stime - r0.ru_stime) / n:.3f} s, "
        f"user time {(r1.ru_utime - r0.ru_utime) / n:.3f} s")

  print(trace_summary(lambda: jax.block_until_ready(step(params)), a.top))


def trace_summary(run, top: int, runs: int = 3) -> str:
  """Traces `runs` calls of run() with jax.profiler; the time per XLA operation kind (numeric
  suffix dropped) and the most expensive single operations, in ms per call."""
  with tempfile.TemporaryDirectory() as d:
    jax.profiler.start_trace(d)
    for _ in range(runs):
      run()
    jax.profiler.stop_trace()
    trace = sorted(glob.glob(f"{d}/plugins/profile/*/*.trace.json.gz"))[-1]
    events = json.load(gzip.open(trace))["traceEvents"]
  by_kind, by_op, count = collections.Counter(), collections.Counter(), collections.Counter()
  for e in events:
    if e.get("ph") == "X" and "Thunk" not in e["name"] and "$" not in e["name"]:
      ms = e.get("dur", 0) / 1000 / runs  # microseconds over the runs -> ms per run
      by_kind[re.sub(r"\.\d+$", "", e["name"])] += ms
      count[re.sub(r"\.\d+$", "", e["name"])] += 1
      by_op[e["name"]] += ms
  lines = [f"traced operations: {sum(by_kind.values()):.1f} ms per run\n\nper kind (ms, count):"]
  lines += [f"{v:8.1f}  x{count[k] // runs:4d}  {k}" for k, v in by_kind.most_common(top)]
  lines.append("\nsingle operations (ms):")
  lines += [f"{v:8.1f}  {k}" for k, v in by_op.most_common(top)]
  return "\n".join(lines)


if __name__ == "__main__":
  main()

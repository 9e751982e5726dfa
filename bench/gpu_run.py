"""GPU evidence in one command: one run on one GPU (written on an H100 and an H200) that finishes
within 8 minutes and writes each row to disk as it completes, most important first.
bench/README.md says what it needs and how to run it on a machine without network.

  python3 -m bench.gpu_run --out DIR              # a GPU machine: ~7-8 minutes, offline
  python3 -m bench.gpu_run --dry_run --out DIR    # CPU rehearsal: every family at tiny shapes
  python3 -m bench.gpu_run --md DIR/rows.jsonl    # the tables again from a (possibly cut) row file
  python3 -m bench.gpu_run --preset suite --out DIR   # the longer suite (bench/gpu_families.py)

Families of the default preset (`run`), in order, one child process each (each compile paid once in it; a crash or an
out-of-memory is that family's rows, not the run):
  kernel              bench/gpu_kernel_check.py: correctness of every kernel variant at small
                      shapes (values and every gradient against the reference impl's function;
                      fixed / adaptive / dynamic / short learned spans, persistent memory,
                      dropout, head dims 64 and 96, bf16 and float32), the attention layer with
                      a learned plan (windows < S) against the plain definition; then forward and
                      forward+backward ms at enwik8's layer shapes: the kernel (all spans at S,
                      learned spans 3 to 0.7 W), the XLA path, cuDNN flash attention
  encoder             bench/gpu_encoder.py: bidirectional attention with segment ids (packed
                      sequences, padding) through the drop-in layer's function: the kernel's
                      values and every gradient against the layer's dense definition, then ms of
                      the kernel (learned spans, all at S), the XLA path and cuDNN's dense flash
                      attention (segments as a mask; padding as lengths) at 8 x 2,048 tokens
  train_enwik8        configs/enwik8.py's bf16 training step, pallas and reference, learned plan
                      then the full plan (all spans at S): ms, tokens/s, MFU, compiled bytes
  reference           the reference's PyTorch step on the same device at the same two plans
                      (needs .gpu_carry/adaptive-span; bench/gpu_prepare.sh)
  train_enwik8_large  configs/enwik8_large.py's bf16 step (head dim 96, batch split 2), both
                      impls at the learned plan, then the full plan while time remains
  sampling            tokens/s of the cached decoder on the enwik8 model, learned and full plans
  sparse              bench/gpu_sparse.py: the Sparse Transformer's block-sparse kernel
                      (kernels/sparse/pallas_gpu_sparse.py): values and every gradient against the dense
                      masked reference (fixed merged / split / A2 alone, strided merged; bf16 and
                      float32), then at configs/enwik8_sparse_fixed.py's attention shape (12,288
                      tokens, 8 heads, head dim 64, fixed merged, bf16): the kernel against the
                      jnp path and, with dense heads, against cuDNN; ms of the kernel, the jnp path
                      (model/sparse.py sparse_attention) and cuDNN's dense causal flash attention

Out: DIR/rows.jsonl (one JSON row per line, appended and flushed as each arrives), DIR/report.md
(rewritten after every family; `--md` rebuilds it from a cut run's rows), DIR/run.log (the
children's stderr). Each family's time is capped so that the later ones keep a minimum (RESERVE_S)
of the total budget; a child skips (and records) a row it could not finish in time rather than
start it. A second run on the same warm machine reuses JAX's compilation cache.

--dry_run rehearses everything on the CPU: tiny shapes, the kernel interpreted, cuDNN replaced by
jax.nn.dot_product_attention(implementation='xla') (rows marked "cudnn_standin"), the PyTorch
reference by a marked stand-in where torch or the carried checkout is absent.
tests/test_gpu_suite.py runs it in CI.

The `suite` preset (`--preset suite`, 510 s on a GPU) runs the families bench/gpu_families.py
lists (env, correctness, training in bf16 and float32 at three plans, the issue-8 shapes, ...);
`--impls`, `--dtypes`, `--plans`, `--reference_dir` and `--reference_python` shape it.
"""
import argparse
import datetime
import json
import os
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

from bench import gpu_families as fam
from bench import gpu_report
from bench import harness

REPO = harness.REPO
FAMILIES = fam.FAMILIES
read_rows = harness.read_rows
markdown = gpu_report.markdown


class Run:
  """Runs a preset's families in order within the budget, appending each row to rows.jsonl."""

  def __init__(self, args):
    self.args = args
    self.t0 = time.time()
    self.deadline = self.t0 + args.budget_s
    self.carry = 0.0  # the suite preset: what a family left unused passes on
    self.env, self.impls = {}, {}
    os.makedirs(args.out, exist_ok=True)
    self.rows_path = os.path.join(args.out, "rows.jsonl")
    self.lock = threading.Lock()
    self.rows_file = harness.RowFile(self.rows_path)
    self.log = open(os.path.join(args.out, "run.log"), "a")  # pylint: disable=consider-using-with
    self.record({"kind": "run", "argv": sys.argv[1:], "dry_run": args.dry_run,
                 "preset": args.preset, "budget_s": args.budget_s,
                 "families": list(args.families),
                 "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                 "commit": harness.commit()})

  def record(self, row: dict, family: str | None = None) -> None:
    row = dict(row, t_s=round(time.time() - self.t0, 1))
    if family:
      row["family"] = family
    with self.lock:
      self.rows_file.write(row)

  def timeout(self, name: str, now: float) -> float:
    """The run preset: the family's estimate, capped, leaving the later families their minimum.
    The suite preset: its budget plus what the earlier ones left."""
    if self.args.preset == "suite":
      allowed = min(fam.SUITE_BUDGET_S[name] * self.args.budget_scale + self.carry,
                    self.deadline - now)
      if self.args.jobs > 1 and name != "env":  # side by side: each may use what is left
        allowed = self.deadline - now
      return allowed
    if self.args.dry_run:
      return self.deadline - now
    later = FAMILIES[FAMILIES.index(name) + 1:]
    reserve = sum(fam.RESERVE_S[f] for f in later if f in self.args.families)
    timeout = min(fam.CAP_S[name], self.deadline - now - reserve)
    return max(timeout, min(fam.RESERVE_S[name], self.deadline - now))

  def family(self, name: str) -> None:
    now = time.time()
    timeout = self.timeout(name, now)
    est = (fam.SUITE_BUDGET_S if self.args.preset == "suite" else fam.EST_S)[name]
    summary = {"kind": "family", "name": name, "timeout_s": round(timeout, 1), "estimate_s": est}
    if timeout < (3 if self.args.preset == "suite" else 5):
      self.record(dict(summary, status="skipped", reason="the run's budget was spent"), name)
      return
    try:
      if self.args.preset == "suite":
        jobs = fam.suite_jobs(name, self.opts())
      else:
        jobs = fam.run_jobs(name, self.args.dry_run)
    except Exception as e:  # pylint: disable=broad-except
      self.record(dict(summary, status="error", reason=f"{type(e).__name__}: {e}"), name)
      return
    n, errors = 0, []
    deadline = now + timeout
    for i, job in enumerate(jobs):
      left = deadline - time.time()
      if len(jobs) > 1 and left < 2:
        for j in jobs[i:]:
          for row in fam.expected_rows(j):
            self.record(dict(row, status="skipped", error="stage budget spent"), name)
        break
      share = min(left, 1.5 * left / (len(jobs) - i)) if len(jobs) > 1 else left
      rows, err = self.child(name, job, share, len(jobs) > 1 or self.args.preset == "suite")
      n += len(rows)
      if err:
        errors.append(err)
      got = [{k: r.get(k) for k in fam.KEYS.get(job.child, ())} for r in rows]
      for row in fam.expected_rows(job):
        if row not in got:
          self.record(dict(row, status="timeout" if err and "killed" in err else "error",
                           error=err or "the child did not report it"), name)
      if job.child == "correctness":
        self.resume_correctness(name, job, rows, err, deadline)
    if name == "env":
      self.set_env()
    status = errors[0] if errors else "ok"
    self.carry = max(0.0, timeout - (time.time() - now))
    self.record(dict(summary, status=status, seconds=round(time.time() - now, 1), rows=n), name)
    print(f"[{time.time() - self.t0:5.0f}s] {name}: {status}, {n} rows in "
          f"{time.time() - now:.0f}s", flush=True)
    self.write_md()

  def child(self, name: str, job, timeout: float, share_deadline: bool):
    """Runs one child, recording its rows as they arrive; returns (rows, error or None)."""
    now = time.time()
    argv = ["-m", job.module]
    if job.spec is None:
      argv += (["--dry_run"] if self.args.dry_run else []) + ["--deadline", str(now + timeout - 3)]
    else:
      child_deadline = now + timeout * 0.8 if share_deadline else now + timeout - 3
      argv += ["--child", job.child, "--spec", json.dumps(
          dict(job.spec, deadline=child_deadline, dry_run=self.args.dry_run))]
    with self.lock:
      self.log.write(f"\n=== {name}: {' '.join(argv)[:600]} (timeout {timeout:.0f}s)\n")
      self.log.flush()
    rows = []
    with subprocess.Popen([job.python or sys.executable] + argv, stdout=subprocess.PIPE,
                          stderr=self.log, text=True, cwd=REPO, env=self.child_env()) as proc:
      timer = threading.Timer(max(timeout, 1.0), proc.kill)
      timer.start()
      try:
        for line in proc.stdout:
          if line.startswith("ROW "):
            try:
              row = json.loads(line[4:])
            except json.JSONDecodeError:
              continue
            row.setdefault("kind", name)
            self.record(row, name)
            rows.append(row)
          else:
            with self.lock:
              self.log.write(line)
      finally:
        timer.cancel()
      rc = proc.wait()
    err = (None if rc == 0 else "killed at its time limit" if rc in (-9, 137) else
           f"exited with {rc} (run.log has its stderr)")
    return rows, err

  def resume_correctness(self, name, job, rows, err, deadline):
    """A correctness child that died (a kernel that kills the process) costs the pair in flight,
    recorded as its error; a new child takes the rest while time remains."""
    spec = job.spec
    while True:
      done = {(r["case_index"], r["impl"]) for r in rows if "case_index" in r}
      pending = [p for p in spec["pending"] if (p[0], p[1]) not in done]
      if not err or not pending:
        return
      ci, impl, use = pending.pop(0)
      case = {k: v for k, v in spec["cases"][ci].items() if k != "dry_all"}
      killed = "killed" in err
      self.record(dict(case, case_index=ci, impl=impl, attn_impl=use,
                       tol=fam.gpu_layer_check.TOL[case["dtype"]],
                       status="timeout" if killed else "error",
                       error=err if killed else f"the child died on this case: {err}"), name)
      left = deadline - time.time()
      if left < 2:
        return
      spec = dict(spec, pending=pending)
      rows, err = self.child(name, fam.Job(job.module, spec, job.child), left, True)

  def child_env(self) -> dict:
    env = dict(os.environ)
    env.pop("JAX_PLATFORMS", None)
    if self.args.jax_platforms is not None:
      env["JAX_PLATFORMS"] = self.args.jax_platforms
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if self.args.dry_run:
      env["JAX_PLATFORMS"] = "cpu"
      env.pop("XLA_FLAGS", None)
    else:
      if self.args.preset == "suite":
        env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
      if self.args.cache_dir:
        env.setdefault("JAX_COMPILATION_CACHE_DIR", self.args.cache_dir)
        env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "2")
    return env

  def set_env(self) -> None:
    """The suite's env row: which implementations the device's span_lm accepts, matmul rates."""
    rows = [r for r in harness.read_rows(self.rows_path) if r.get("family") == "env"
            and r.get("kind") == "env"]
    self.env = rows[-1] if rows else {}
    on_gpu = self.env.get("backend", "cpu") != "cpu" and not self.args.dry_run
    self.impls = fam.measured_impls(on_gpu, self.env.get("accepted_impls"), self.args.impls)
    self.record({"kind": "impls", "accepted": self.env.get("accepted_impls"),
                 "resolved": self.impls}, "env")

  def opts(self):
    a = self.args
    return SimpleNamespace(dry_run=a.dry_run, env=self.env, impls=self.impls, dtypes=a.dtypes,
                           plans=a.plans, reference_dir=a.reference_dir,
                           reference_python=a.reference_python)

  def run(self):
    fams = [f for f in fam.PRESETS[self.args.preset] if f in self.args.families]
    if self.args.preset == "suite":  # env first: the later families read it
      self.family("env")
      fams = [f for f in fams if f != "env"]
    if self.args.jobs > 1:  # the CPU rehearsal only: families side by side
      from concurrent import futures  # pylint: disable=g-import-not-at-top
      with futures.ThreadPoolExecutor(self.args.jobs) as pool:
        for f in [pool.submit(self.family, name) for name in fams]:
          f.result()
    else:
      for name in fams:
        self.family(name)
    self.record({"kind": "done", "seconds": round(time.time() - self.t0, 1)})
    self.write_md()
    self.rows_file.close()
    self.log.close()

  def write_md(self):
    with self.lock:
      text = markdown(harness.read_rows(self.rows_path))
      with open(os.path.join(self.args.out, "report.md"), "w") as f:
        f.write(text)


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--out", help="folder for rows.jsonl, report.md and run.log")
  p.add_argument("--md", help="print the report of this rows.jsonl (and rewrite report.md "
                              "beside it); runs nothing")
  p.add_argument("--dry_run", action="store_true",
                 help="CPU rehearsal: tiny shapes, kernel interpreted, stand-ins marked")
  p.add_argument("--preset", default="run", choices=sorted(fam.PRESETS),
                 help="run: the 8-minute evidence run; suite: the longer suite")
  p.add_argument("--budget_s", type=float, default=None,
                 help=f"the whole run's seconds (default {fam.BUDGET_S:.0f}, suite "
                      f"{sum(fam.SUITE_BUDGET_S.values())}; dry run 900, suite 100)")
  p.add_argument("--families", nargs="*", default=None,
                 choices=sorted(set(sum(fam.PRESETS.values(), ()))),
                 help="run only these of the preset's families (suite: env always runs)")
  p.add_argument("--jobs", type=int, default=None,
                 help="families side by side (default: 2 for the dry run, 1 on a GPU)")
  p.add_argument("--cache_dir", default="/tmp/span_lm_gpu_jax_cache",
                 help="JAX's persistent compilation cache on the device ('' for none)")
  p.add_argument("--impls", nargs="*", default=None,
                 help="suite: only these model.attention.impl values (span_lm.kernels.IMPLS)")
  p.add_argument("--dtypes", nargs="*", default=["bfloat16", "float32"], help="suite")
  p.add_argument("--plans", nargs="*", default=list(fam.PLANS), choices=fam.ALL_PLANS,
                 help="suite: span plans of the training families")
  p.add_argument("--reference_dir", default=fam.REFERENCE_DIR,
                 help="suite: a checkout of facebookresearch/adaptive-span (bench/gpu_prepare.sh)")
  p.add_argument("--reference_python", default=sys.executable,
                 help="suite: the interpreter with PyTorch for the reference family")
  args = p.parse_args()
  if args.md:
    text = markdown(harness.read_rows(args.md))
    with open(os.path.join(os.path.dirname(os.path.abspath(args.md)), "report.md"), "w") as f:
      f.write(text)
    print(text)
    return
  if not args.out:
    p.error("--out DIR is required")
  preset = fam.PRESETS[args.preset]
  args.families = list(preset) if args.families is None else [
      f for f in preset if f in args.families or (args.preset == "suite" and f == "env")]
  # This process only reads configs: it never takes the device (nor its memory) from a child.
  args.jax_platforms = os.environ.get("JAX_PLATFORMS")
  os.environ["JAX_PLATFORMS"] = "cpu"
  suite_s = float(sum(fam.SUITE_BUDGET_S.values()))
  if args.budget_s is None:
    args.budget_s = ((100.0 if args.dry_run else suite_s) if args.preset == "suite" else
                     900.0 if args.dry_run else fam.BUDGET_S)
  args.budget_scale = args.budget_s / suite_s
  if args.jobs is None:
    args.jobs = 2 if args.dry_run else 1
  r = Run(args)
  r.run()
  print(f"wrote {r.rows_path} and report.md in {time.time() - r.t0:.0f}s", flush=True)


if __name__ == "__main__":
  main()

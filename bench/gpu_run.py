"""GPU evidence in one command: one run on one GPU (written on an H100 and an H200) that finishes
within 8 minutes and writes each row to disk as it completes, most important first.
bench/README.md says what it needs and how to run it on a machine without network.

  python3 bench/gpu_run.py --out DIR              # a GPU machine: ~7-8 minutes, offline
  python3 bench/gpu_run.py --dry_run --out DIR    # CPU rehearsal: every family at tiny shapes
  python3 bench/gpu_run.py --md DIR/rows.jsonl    # the tables again from a (possibly cut) row file

Families, in order, one child process each (each compile paid once in it; a crash or an
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
                      (kernels/pallas_gpu_sparse.py): values and every gradient against the dense
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
"""
import argparse
import datetime
import json
import os
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
FAMILIES = ("kernel", "encoder", "train_enwik8", "reference", "train_enwik8_large", "sampling",
            "sparse")
# Device seconds, estimated from the H200 run of 2026-11-27 (a training step compiled in ~24 s,
# an enwik8 step ran in 18-470 ms): what each family should take, its cap, and the minimum it
# keeps for itself out of the earlier families' time.
EST_S = {"kernel": 110, "encoder": 50, "train_enwik8": 140, "reference": 25, "train_enwik8_large": 110,
         "sampling": 45, "sparse": 90}
CAP_S = {"kernel": 170, "encoder": 80, "train_enwik8": 175, "reference": 50, "train_enwik8_large": 150,
         "sampling": 60, "sparse": 150}
RESERVE_S = {"kernel": 0, "encoder": 25, "train_enwik8": 60, "reference": 25, "train_enwik8_large": 45,
             "sampling": 30, "sparse": 60}
ROW_EST_S = {"train_enwik8": 35, "train_enwik8_large": 50, "sampling": 15}  # one compile + reps
BUDGET_S = 480.0  # 8 minutes: the 10-minute command keeps ~2 for pip, start-up and slack
REFERENCE_GPUS = 8  # the paper's enwik8 runs: a batch of 64 streams over 8 GPUs
REFERENCE_H200_MS = 469.6  # the PyTorch reference's enwik8 step, batch 8, H200 (docs/gpu/)
IMPLS = ("pallas", "reference")
SPARSE_NAMES = ("out", "q", "k", "v")


def family_specs(family: str, dry: bool) -> tuple[list[str], dict | None]:
  """(script and arguments, spec or None) of one family's child."""
  if family == "kernel":
    return [os.path.join(HERE, "gpu_kernel_check.py")] + (["--dry_run"] if dry else []), None
  if family == "encoder":
    return [os.path.join(HERE, "gpu_encoder.py")] + (["--dry_run"] if dry else []), None
  if family == "sparse":
    return [os.path.join(HERE, "gpu_sparse.py")] + (["--dry_run"] if dry else []), None
  sys.path.insert(0, REPO)
  from span_lm import config as config_lib  # pylint: disable=g-import-not-at-top
  impls = [("pallas", "pallas_interpret" if dry else "pallas"), ("reference", "reference")]
  if family.startswith("train_"):
    label = family[6:]
    run = config_lib.load_config(f"configs/{label}.py")
    split = run.optim.batch_split
    model = {}
    if dry:  # the config's structure at tiny shapes (enwik8_large keeps a non-power-of-2 head)
      hd = 24 if label == "enwik8_large" else 16
      model = {"n_layers": 1, "n_heads": 4, "d_model": 4 * hd, "d_ff": 8 * hd, "span": 128,
               "attn_block": 16, "plan_granularity": 32, "plan_margin": 32}
    # learned plan first (both impls), then the full plan: the rows a cut keeps decide most
    variants = [{"impl": name, "use": use, "dtype": "bfloat16", "plans": [plan]}
                for plan in ("learned", "all_S") for name, use in impls]
    if dry:  # the interpreted kernel in a whole step compiles for minutes on CI's cores: the
      # kernel family rehearses it (and the layer with a plan); here the jnp path, both plans
      # for enwik8 (their keys are compared), the learned one for enwik8_large
      variants = [v for v in variants if v["impl"] == "reference" and
                  (label == "enwik8" or v["plans"] == ["learned"])]
    spec = {"label": label, "config": f"configs/{label}.py", "model": model,
            "batch_split": split, "batch": 2 * split if dry else run.data.batch // REFERENCE_GPUS,
            "block": 32 if dry else run.data.block, "variants": variants,
            "plans": ["learned", "all_S"], "reps": 1 if dry else 5, "warmup": 1 if dry else 2,
            "measured_tflops": {}, "row_estimate_s": 0 if dry else ROW_EST_S[family]}
    return [os.path.join(HERE, "gpu_suite.py"), "--child", "train"], spec
  if family == "reference":
    import gpu_suite  # pylint: disable=g-import-not-at-top
    cases = gpu_suite.enwik8_reference_cases(dry, ("learned", "all_S"))
    spec = {"label": "reference", "cases": cases, "reps": 2 if dry else 5,
            "reference_dir": os.path.join(REPO, ".gpu_carry", "adaptive-span")}
    return [os.path.join(HERE, "gpu_suite.py"), "--child", "reference"], spec
  if family == "sampling":
    model = {"n_layers": 1, "n_heads": 4, "d_model": 64, "d_ff": 128, "span": 128,
             "plan_granularity": 32} if dry else {}
    spec = {"label": "enwik8", "config": "configs/enwik8.py", "model": model,
            "dtype": "bfloat16", "impl": "auto", "use": "auto", "plans": ["learned", "all_S"],
            "batches": [8] if not dry else [2], "length": 8 if dry else 256,
            "reps": 1 if dry else 3, "row_estimate_s": 0 if dry else ROW_EST_S[family]}
    return [os.path.join(HERE, "gpu_suite.py"), "--child", "sampling"], spec
  raise ValueError(family)


class Run:
  """Runs the families in order within the budget, appending each row to rows.jsonl."""

  def __init__(self, args):
    self.args = args
    self.t0 = time.time()
    self.deadline = self.t0 + args.budget_s
    os.makedirs(args.out, exist_ok=True)
    self.rows_path = os.path.join(args.out, "rows.jsonl")
    self.lock = threading.Lock()
    self.rows_file = open(self.rows_path, "a")  # pylint: disable=consider-using-with
    self.log = open(os.path.join(args.out, "run.log"), "a")  # pylint: disable=consider-using-with
    self.record({"kind": "run", "argv": sys.argv[1:], "dry_run": args.dry_run,
                 "budget_s": args.budget_s, "families": list(args.families),
                 "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                 "commit": _commit()})

  def record(self, row: dict, family: str | None = None) -> None:
    row = dict(row, t_s=round(time.time() - self.t0, 1))
    if family:
      row["family"] = family
    with self.lock:
      self.rows_file.write(json.dumps(row, default=str) + "\n")
      self.rows_file.flush()
      os.fsync(self.rows_file.fileno())

  def family(self, name: str) -> None:
    now = time.time()
    later = FAMILIES[FAMILIES.index(name) + 1:]
    reserve = sum(RESERVE_S[f] for f in later if f in self.args.families)
    if self.args.dry_run:
      timeout = self.deadline - now
    else:
      timeout = min(CAP_S[name], self.deadline - now - reserve)
      timeout = max(timeout, min(RESERVE_S[name], self.deadline - now))
    summary = {"kind": "family", "name": name, "timeout_s": round(timeout, 1),
               "estimate_s": EST_S[name]}
    if timeout < 5:
      self.record(dict(summary, status="skipped", reason="the run's budget was spent"), name)
      return
    try:
      argv, spec = family_specs(name, self.args.dry_run)
    except Exception as e:  # pylint: disable=broad-except
      self.record(dict(summary, status="error", reason=f"{type(e).__name__}: {e}"), name)
      return
    child_deadline = now + timeout - 3
    if spec is None:
      argv = argv + ["--deadline", str(child_deadline)]
    else:
      argv = argv + ["--spec", json.dumps(dict(spec, deadline=child_deadline,
                                               dry_run=self.args.dry_run))]
    env = dict(os.environ)
    env.pop("JAX_PLATFORMS", None)
    if self.args.jax_platforms is not None:
      env["JAX_PLATFORMS"] = self.args.jax_platforms
    env["PYTHONPATH"] = REPO + os.pathsep + HERE + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if self.args.dry_run:
      env["JAX_PLATFORMS"] = "cpu"
      env.pop("XLA_FLAGS", None)
    elif self.args.cache_dir:
      env.setdefault("JAX_COMPILATION_CACHE_DIR", self.args.cache_dir)
      env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "2")
    with self.lock:
      self.log.write(f"\n=== {name}: {' '.join(argv)[:600]} (timeout {timeout:.0f}s)\n")
      self.log.flush()
    n = 0
    with subprocess.Popen([sys.executable] + argv, stdout=subprocess.PIPE, stderr=self.log,
                          text=True, cwd=REPO, env=env) as proc:
      timer = threading.Timer(timeout, proc.kill)
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
            n += 1
          else:
            with self.lock:
              self.log.write(line)
      finally:
        timer.cancel()
      rc = proc.wait()
    status = ("ok" if rc == 0 else "killed at its time limit" if rc in (-9, 137) else
              f"exited with {rc} (run.log has its stderr)")
    self.record(dict(summary, status=status, seconds=round(time.time() - now, 1), rows=n), name)
    print(f"[{time.time() - self.t0:5.0f}s] {name}: {status}, {n} rows in "
          f"{time.time() - now:.0f}s", flush=True)
    self.write_md()

  def run(self):
    fams = [f for f in FAMILIES if f in self.args.families]
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
      text = markdown(read_rows(self.rows_path))
      with open(os.path.join(self.args.out, "report.md"), "w") as f:
        f.write(text)


def _commit():
  try:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                          text=True, timeout=10, check=False).stdout.strip() or None
  except Exception:  # pylint: disable=broad-except
    return None


def read_rows(path: str) -> list[dict]:
  rows = []
  with open(path) as f:
    for line in f:
      try:
        rows.append(json.loads(line))
      except json.JSONDecodeError:
        pass  # a line cut by a kill
  return rows


# ---------------------------------------------------------------------------------- the report

def _f(x, fmt="{:.3g}"):
  return "-" if x is None else fmt.format(x)


def _first_line(s, n=140):
  return (s or "").strip().splitlines()[0][:n] if s else ""


GRADS = ("out", "q", "k", "v", "pe", "z", "pk", "pv")
MODEL_COLUMNS = (("out", "out"), ("q", "d_proj_query/kernel"), ("k", "d_proj_key/kernel"),
                 ("v", "d_proj_val/kernel"), ("o", "d_proj_out/kernel"), ("pe", "d_key_pe"),
                 ("h", "d_h"), ("cache", "d_cache"), ("span", "d_span_ratio"),
                 ("pers_k", "d_pers_key"), ("pers_v", "d_pers_val"))


def markdown(rows: list[dict]) -> str:
  """The tables of one run's rows (a cut run's too: what is there is shown)."""
  runs = [r for r in rows if r.get("kind") == "run"]
  head = runs[-1] if runs else {}
  if runs:  # a row file appended by several runs: the last one
    rows = rows[max(i for i, r in enumerate(rows) if r.get("kind") == "run"):]
  dry = head.get("dry_run")
  env = next((r for r in rows if r.get("kind") == "env"), {})
  done = next((r for r in rows if r.get("kind") == "done"), None)
  out = [f"# span_lm device run{' (CPU dry run: tiny shapes, not GPU numbers)' if dry else ''}",
         "", f"`python3 bench/gpu_run.py {' '.join(head.get('argv', []))}` at commit "
         f"{head.get('commit')}, started {head.get('started_utc')}; "
         + (f"finished in {done['seconds']:.0f} s" if done else
            "**cut short** (no closing row: the tables hold what had finished)")
         + f" of a {head.get('budget_s', 0):.0f} s budget.", ""]
  if env:
    out += [f"Device: {env.get('device')} (cc {env.get('cc')}, {env.get('backend')}), jax "
            f"{env.get('jax')}, jaxlib {env.get('jaxlib')}, CUDA runtime "
            f"{env.get('cuda_runtime')}, cuDNN {env.get('cudnn')}, memory "
            f"{_f((env.get('memory_bytes') or 0) / 2**30, '{:.0f}')} GiB, peak table "
            f"{env.get('peak_table')}.", ""]
  out += ["| family | status | seconds | timeout s | estimate s | rows |", "|---|---|---|---|---|---|"]
  fams = {r["name"]: r for r in rows if r.get("kind") == "family"}
  for name in head.get("families", FAMILIES):
    r = fams.get(name)
    if r is None:
      out.append(f"| {name} | not reached | | | {EST_S.get(name)} | |")
    else:
      out.append(f"| {name} | {r['status']} {r.get('reason', '')} | {r.get('seconds', '')} | "
                 f"{r.get('timeout_s')} | {r.get('estimate_s')} | {r.get('rows', '')} |")

  checks = [r for r in rows if r.get("kind") == "check"]
  if checks:
    out += ["", "## Kernel correctness (pallas_gpu.span_attention against banded_reference, "
            "float32, exact dots)", "",
            "Worst |kernel - reference| / max|reference| per tensor; bf16 inputs are compared "
            "with the float32 definition. z: the spans' gradient; pk/pv: persistent memory's.", "",
            "| case | shape B,H,M,W | tiles | status | " + " | ".join(GRADS) + " | worst | s |",
            "|" + "---|" * (6 + len(GRADS))]
    for r in checks:
      d = r.get("diffs", {})
      worst = (f"{r['worst']} {r['worst_diff']:.3g} (tol {r['tol']})" if "worst" in r else
               _first_line(r.get("error")))
      tiles = r.get("tiles") if r.get("shipped_tiles", True) else f"{r.get('tiles')} (other depth)"
      out.append(f"| {r['case']} | {r.get('shape')} | {tiles} | {r['status']} | " +
                 " | ".join(_f(d.get(g)) for g in GRADS) + f" | {worst} | {r.get('seconds')} |")
  mchecks = [r for r in rows if r.get("kind") == "model_check"]
  if mchecks:
    out += ["", "## Attention layer, learned plan (windows < S, heads grouped by window), "
            "against the plain definition", "",
            "| impl | dtype | head dim | spans | pers | groups [heads, window] | status | " +
            " | ".join(c for c, _ in MODEL_COLUMNS) + " | worst |",
            "|" + "---|" * (8 + len(MODEL_COLUMNS))]
    for r in mchecks:
      d = r.get("diffs", {})
      worst = (f"{r['worst']} {r['worst_diff']:.3g}" if "worst" in r else
               _first_line(r.get("error")))
      out.append(f"| {r.get('impl')} | {r.get('dtype')} | {r.get('head_dim')} | "
                 f"{r.get('span_mode')} | {r.get('pers_mem')} | "
                 f"{(r.get('shape') or {}).get('groups')} | {r['status']} | " +
                 " | ".join(_f(d.get(k)) for _, k in MODEL_COLUMNS) + f" | {worst} |")

  echecks = [r for r in rows if r.get("kind") == "encoder_check"]
  if echecks:
    names = ("out", "query", "key", "value", "span_ratio", "pos_back", "pos_ahead",
             "span_ratio_ahead")
    out += ["", "## Encoder correctness (bidirectional, segment ids: the layer's kernel path "
            "against its dense definition, float32, exact dots)", "",
            "| case | shape B,N,H,S | impl | status | " + " | ".join(names) +
            " | worst | padding out | s |", "|" + "---|" * (7 + len(names))]
    for r in echecks:
      d = r.get("diffs", {})
      worst = (f"{r['worst']} {r['worst_diff']:.3g} (tol {r['tol']})" if "worst" in r else
               _first_line(r.get("error")))
      out.append(f"| {r['case']} | {r.get('shape')} | {r.get('impl')} | {r['status']} | " +
                 " | ".join(_f(d.get(g)) for g in names) +
                 f" | {worst} | {_f(r.get('padding_out'))} | {r.get('seconds')} |")
  etimes = [r for r in rows if r.get("kind") == "encoder_time"]
  if etimes:
    ok = [r for r in etimes if r.get("status") == "ok"]
    base = {k: next((r for r in ok if r["path"].startswith(k)), None)
            for k in ("reference", "cudnn")}
    out += ["", f"## Encoder attention timings, bf16, {etimes[0].get('shape')}", "",
            "| path | spans | status | fwd ms | fwd+bwd ms | fwd+bwd vs XLA | "
            "fwd+bwd vs cuDNN (mask) | note |", "|---|---|---|---|---|---|---|---|"]
    for r in etimes:
      vs = lambda b, r=r: (f"{r['fwd_bwd_ms'] / b['fwd_bwd_ms']:.2f}x"
                           if b and r.get("fwd_bwd_ms") else "-")
      note = "; ".join(x for x in (r.get("note"), "interpreted" if r.get("interpret") else "")
                       if x)
      out.append(f"| {r['path']} | {r['spans']} | {r.get('status')} | {_f(r.get('fwd_ms'))} | "
                 f"{_f(r.get('fwd_bwd_ms'))} | {vs(base['reference'])} | {vs(base['cudnn'])} | "
                 f"{note or _first_line(r.get('error'))} |")

  schecks = [r for r in rows if r.get("kind") == "sparse_check"]
  if schecks:
    out += ["", "## Sparse Transformer kernel correctness (pallas_gpu_sparse against the dense "
            "masked reference, float32, exact dots)", "",
            "| case | dtype | shape | status | " + " | ".join(SPARSE_NAMES) + " | worst | s |",
            "|" + "---|" * (6 + len(SPARSE_NAMES))]
    for r in schecks:
      d = r.get("diffs", {})
      worst = (f"{r['worst']} {r['worst_diff']:.3g} (tol {r['tol']})" if "worst" in r else
               _first_line(r.get("error")))
      out.append(f"| {r['case']} | {r['dtype']} | {r.get('shape')} | {r['status']} | " +
                 " | ".join(_f(d.get(g)) for g in SPARSE_NAMES) + f" | {worst} | "
                 f"{r.get('seconds')} |")
  spairs = [r for r in rows if r.get("kind") == "sparse_pair"]
  stimes = [r for r in rows if r.get("kind") == "sparse_time"]
  if spairs or stimes:
    shape = (spairs or stimes)[0].get("shape")
    out += ["", f"## Sparse Transformer attention, bf16, {shape}", "",
            "| paths compared | status | " + " | ".join(SPARSE_NAMES) + " | worst |",
            "|" + "---|" * (3 + len(SPARSE_NAMES))]
    for r in spairs:
      d = r.get("diffs", {})
      worst = (f"{r['worst']} {r['worst_diff']:.3g} (tol {r['tol']})" if "worst" in r else
               _first_line(r.get("error")))
      out.append(f"| {' vs '.join(r['paths'])} | {r['status']} | " +
                 " | ".join(_f(d.get(g)) for g in SPARSE_NAMES) + f" | {worst} |")
    ok = [r for r in stimes if r.get("status") == "ok"]
    jnp_ = next((r for r in ok if r["path"] == "jnp"), None)
    cud = next((r for r in ok if r["path"].startswith("cudnn")), None)
    out += ["", "| path | status | fwd ms | fwd+bwd ms | fwd+bwd vs jnp | fwd+bwd vs cuDNN "
            "dense | note |", "|---|---|---|---|---|---|---|"]
    for r in stimes:
      vs = lambda base, r=r: (f"{r['fwd_bwd_ms'] / base['fwd_bwd_ms']:.2f}x"
                              if base and r.get("fwd_bwd_ms") else "-")
      note = "; ".join(x for x in (r.get("note"), "interpreted" if r.get("interpret") else "")
                       if x)
      out.append(f"| {r['path']} | {r.get('status')} | {_f(r.get('fwd_ms'))} | "
                 f"{_f(r.get('fwd_bwd_ms'))} | {vs(jnp_)} | {vs(cud)} | "
                 f"{note or _first_line(r.get('error'))} |")

  times = [r for r in rows if r.get("kind") == "time"]
  if times:
    ok = [r for r in times if r.get("status") == "ok"]
    ref = next((r for r in ok if r["path"] == "reference"), None)
    cud = next((r for r in ok if r["path"].startswith("cudnn")), None)
    shape = times[0].get("shape")
    out += ["", f"## Attention timings, bf16, {shape} (targets: kernel fwd+bwd <= 0.5x XLA, "
            "<= 2x cuDNN)", "",
            "| path | spans | tiles (tile, warps, stages) | status | fwd ms | fwd+bwd ms | "
            "fwd+bwd vs XLA | fwd+bwd vs cuDNN | note |", "|---|---|---|---|---|---|---|---|---|"]
    for r in times:
      vs = lambda base, r=r: (f"{r['fwd_bwd_ms'] / base['fwd_bwd_ms']:.2f}x"
                              if base and r.get("fwd_bwd_ms") else "-")
      tiles = r.get("tiles") or ""
      if tiles and r.get("shipped_tiles") is False:
        tiles = f"{tiles} (not the table's)"
      note = "; ".join(x for x in (r.get("note"), "interpreted" if r.get("interpret") else "")
                       if x)
      out.append(f"| {r['path']} | {r['spans']} | {tiles} | {r.get('status')} | "
                 f"{_f(r.get('fwd_ms'))} | {_f(r.get('fwd_bwd_ms'))} | {vs(ref)} | {vs(cud)} | "
                 f"{note or _first_line(r.get('error'))} |")

  ref_rows = [r for r in rows if r.get("family") == "reference" and "plan" in r]
  ref_tps = {(r.get("shapes"), r.get("plan")): r for r in ref_rows
             if r.get("status") in ("ok", "stand_in")}
  for fam in ("train_enwik8", "train_enwik8_large"):
    tr = [r for r in rows if r.get("family") == fam and "plan" in r]
    if not tr:
      continue
    out += ["", f"## Training step: configs/{fam[6:]}.py, bf16", "",
            "Full plan: all spans at S; learned: each layer's heads from 3 tokens to 0.7 S. "
            "`vs reference`: tokens/s over the PyTorch reference's on this device (same "
            f"plan; the H200 run of 2026-11-27 took {REFERENCE_H200_MS} ms per batch of 8). "
            "Peak GiB is the process's peak so far (rows share one process); compiled GiB is "
            "this step's own.", "",
            "| impl | plan | tiles | batch (split) | status | ms/step | tokens/s | MFU | "
            "vs reference | compiled GiB | peak GiB | compile s | keys/query |",
            "|" + "---|" * 13]
    for r in tr:
      head_ = f"| {r['impl']} ({r.get('attn_impl')}) | {r['plan']} | {r.get('tiles', '')} | " \
              f"{r.get('batch')} ({r.get('batch_split')}) | {r.get('status')} |"
      if r.get("status") != "ok":
        out.append(head_ + f" {_first_line(r.get('error'))} |" + " |" * 7)
        continue
      ref = ref_tps.get(("enwik8", r["plan"])) if fam == "train_enwik8" else None
      vs = "-"
      if ref:
        vs = f"{r['tokens_per_s'] / ref['tokens_per_s']:.2f}x" + (
            " (stand-in)" if ref.get("stand_in") else "")
      gib = lambda x: "-" if not x else f"{x / 2**30:.2f}"
      out.append(head_ + f" {r['seconds'] * 1e3:.1f} | {r['tokens_per_s']:.0f} | "
                 f"{_f(r.get('mfu'), '{:.1%}')} | {vs} | {gib(r.get('compiled_bytes'))} | "
                 f"{gib(r.get('peak_bytes'))} | {r['compile_seconds']:.1f} | "
                 f"{r.get('plan_keys')} |")
  if ref_rows:
    out += ["", "## Reference (PyTorch) training step, same device", "",
            "| shapes | plan | batch | status | ms/step | tokens/s | device, torch |",
            "|---|---|---|---|---|---|---|"]
    for r in ref_rows:
      if r.get("status") in ("ok", "stand_in"):
        note = (f"STAND-IN ({r.get('error')}): not a reference number" if r.get("stand_in")
                else f"{r.get('device')}, {r.get('torch')}")
        out.append(f"| {r['shapes']} | {r['plan']} | {r['batch']} | {r['status']} | "
                   f"{r['seconds'] * 1e3:.1f} | {r['tokens_per_s']:.0f} | {note} |")
      else:
        out.append(f"| {r.get('shapes')} | {r.get('plan')} | {r.get('batch')} | "
                   f"{r.get('status')} | {_first_line(r.get('error'))} | | |")
  samp = [r for r in rows if r.get("family") == "sampling" and "plan" in r]
  if samp:
    out += ["", "## Sampling (ring key/value caches, one jitted scan), enwik8 model", "",
            "| impl | plan | streams | tokens | status | tokens/s | compile s | keys/query |",
            "|---|---|---|---|---|---|---|---|"]
    for r in samp:
      if r.get("status") == "ok":
        out.append(f"| {r.get('attn_impl')} | {r['plan']} | {r['batch']} | {r['length']} | ok | "
                   f"{r['tokens_per_s']:.0f} | {r['compile_seconds']:.1f} | {r['plan_keys']} |")
      else:
        out.append(f"| {r.get('attn_impl')} | {r['plan']} | {r['batch']} | {r.get('length')} | "
                   f"{r.get('status')} | {_first_line(r.get('error'))} | | |")
  return "\n".join(out) + "\n"


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--out", help="folder for rows.jsonl, report.md and run.log")
  p.add_argument("--md", help="print the report of this rows.jsonl (and rewrite report.md "
                              "beside it); runs nothing")
  p.add_argument("--dry_run", action="store_true",
                 help="CPU rehearsal: tiny shapes, kernel interpreted, stand-ins marked")
  p.add_argument("--budget_s", type=float, default=None,
                 help=f"the whole run's seconds (default {BUDGET_S:.0f}; dry run 900)")
  p.add_argument("--families", nargs="*", default=list(FAMILIES), choices=FAMILIES)
  p.add_argument("--jobs", type=int, default=None,
                 help="families side by side (default: 2 for the dry run, 1 on a GPU)")
  p.add_argument("--cache_dir", default="/tmp/span_lm_gpu_jax_cache",
                 help="JAX's persistent compilation cache on the device ('' for none)")
  args = p.parse_args()
  if args.md:
    text = markdown(read_rows(args.md))
    with open(os.path.join(os.path.dirname(os.path.abspath(args.md)), "report.md"), "w") as f:
      f.write(text)
    print(text)
    return
  if not args.out:
    p.error("--out DIR is required")
  # This process only reads configs: it never takes the device (nor its memory) from a child.
  args.jax_platforms = os.environ.get("JAX_PLATFORMS")
  os.environ["JAX_PLATFORMS"] = "cpu"
  if args.budget_s is None:
    args.budget_s = 900.0 if args.dry_run else BUDGET_S
  if args.jobs is None:
    args.jobs = 2 if args.dry_run else 1
  r = Run(args)
  r.run()
  print(f"wrote {r.rows_path} and report.md in {time.time() - r.t0:.0f}s", flush=True)


if __name__ == "__main__":
  main()

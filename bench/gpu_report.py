"""The markdown report of a bench/gpu_run.py row file (a cut run's too: what is there is shown),
one function a table, each reading the rows of its kind."""
from bench import gpu_families as fam
from bench import gpu_layer_check
from bench.harness import first_line, fmt, gib, table

REFERENCE_H200_MS = 469.6  # the PyTorch reference's enwik8 step, batch 8, H200 (docs/gpu/)
GRADS = ("out", "q", "k", "v", "pe", "z", "pk", "pv")
MODEL_COLUMNS = (("out", "out"), ("q", "d_proj_query/kernel"), ("k", "d_proj_key/kernel"),
                 ("v", "d_proj_val/kernel"), ("o", "d_proj_out/kernel"), ("pe", "d_key_pe"),
                 ("h", "d_h"), ("cache", "d_cache"), ("span", "d_span_ratio"),
                 ("pers_k", "d_pers_key"), ("pers_v", "d_pers_val"))
ENCODER_NAMES = ("out", "query", "key", "value", "span_ratio", "pos_back", "pos_ahead",
                 "span_ratio_ahead")
SPARSE_NAMES = ("out", "q", "k", "v")
SUITE_DIFFS = MODEL_COLUMNS[:8]  # the suite's correctness table: spans' and pers' apart


def _kind(rows, kind):
  return [r for r in rows if r.get("kind") == kind]


def _worst(r, tol=True):
  if "worst" in r:
    return f"{r['worst']} {r['worst_diff']:.3g}" + (f" (tol {r['tol']})" if tol else "")
  return first_line(r.get("error"))


def _diffs(r, names):
  d = r.get("diffs", {})
  return [fmt(d.get(n)) for n in names]


def _vs(r, base):
  return f"{r['fwd_bwd_ms'] / base['fwd_bwd_ms']:.2f}x" if base and r.get("fwd_bwd_ms") else "-"


def _note(r):
  note = "; ".join(x for x in (r.get("note"), "interpreted" if r.get("interpret") else "") if x)
  return note or first_line(r.get("error"))


def _planned(rows, family):
  """A step family's rows (those with a plan: not its summary)."""
  return [r for r in rows if r.get("family") == family and "plan" in r]


def _first_ok(rows, test):
  return next((r for r in rows if r.get("status") == "ok" and test(r["path"])), None)


def header(rows, head):
  dry = head.get("dry_run")
  suite = head.get("preset") == "suite"
  done = next((r for r in rows if r.get("kind") == "done"), None)
  preset = " --preset suite" if suite and "--preset" not in head.get("argv", []) else ""
  out = [f"# span_lm device run{' (suite)' if suite else ''}"
         f"{' (CPU dry run: tiny shapes, not GPU numbers)' if dry else ''}",
         "", f"`python3 -m bench.gpu_run {' '.join(head.get('argv', []))}{preset}` at commit "
         f"{head.get('commit')}, started {head.get('started_utc')}; "
         + (f"finished in {done['seconds']:.0f} s" if done else
            "**cut short** (no closing row: the tables hold what had finished)")
         + f" of a {head.get('budget_s', 0):.0f} s budget.", ""]
  env = next((r for r in rows if r.get("kind") == "env" and "device" in r), {})
  if env:
    out += [f"Device: {env.get('device')} (cc {env.get('cc')}, {env.get('backend')}), jax "
            f"{env.get('jax')}, jaxlib {env.get('jaxlib')}, CUDA runtime "
            f"{env.get('cuda_runtime')}, cuDNN {env.get('cudnn')}, memory "
            f"{fmt((env.get('memory_bytes') or 0) / 2**30, '{:.0f}')} GiB, peak table "
            f"{env.get('peak_table')}.", ""]
  fams = {r["name"]: r for r in rows if r.get("kind") == "family"}
  est = fam.SUITE_BUDGET_S if suite else fam.EST_S
  lines = []
  for name in head.get("families", fam.FAMILIES):
    r = fams.get(name)
    lines.append([name, "not reached", "", "", est.get(name), ""] if r is None else
                 [name, f"{r['status']} {r.get('reason', '')}", r.get("seconds", ""),
                  r.get("timeout_s"), r.get("estimate_s"), r.get("rows", "")])
  out += table(("family", "status", "seconds", "timeout s", "estimate s", "rows"), lines)
  return out


def kernel_checks(rows):
  checks = _kind(rows, "check")
  if not checks:
    return []
  lines = []
  for r in checks:
    tiles = r.get("tiles") if r.get("shipped_tiles", True) else f"{r.get('tiles')} (other depth)"
    lines.append([r["case"], r.get("shape"), tiles, r["status"], *_diffs(r, GRADS), _worst(r),
                  r.get("seconds")])
  return ["", "## Kernel correctness (pallas_gpu.span_attention against banded_reference, "
          "float32, exact dots)", "",
          "Worst |kernel - reference| / max|reference| per tensor; bf16 inputs are compared "
          "with the float32 definition. z: the spans' gradient; pk/pv: persistent memory's.", ""
          ] + table(("case", "shape B,H,M,W", "tiles", "status", *GRADS, "worst", "s"), lines)


def model_checks(rows):
  checks = _kind(rows, "model_check")
  if not checks:
    return []
  lines = [[r.get("impl"), r.get("dtype"), r.get("head_dim"), r.get("span_mode"),
            r.get("pers_mem"), (r.get("shape") or {}).get("groups"), r["status"],
            *_diffs(r, [k for _, k in MODEL_COLUMNS]), _worst(r, tol=False)] for r in checks]
  return ["", "## Attention layer, learned plan (windows < S, heads grouped by window), "
          "against the plain definition", ""] + table(
              ("impl", "dtype", "head dim", "spans", "pers", "groups [heads, window]", "status",
               *(c for c, _ in MODEL_COLUMNS), "worst"), lines)


def encoder(rows):
  out = []
  checks = _kind(rows, "encoder_check")
  if checks:
    lines = [[r["case"], r.get("shape"), r.get("impl"), r["status"],
              *_diffs(r, ENCODER_NAMES), _worst(r), fmt(r.get("padding_out")), r.get("seconds")]
             for r in checks]
    out += ["", "## Encoder correctness (bidirectional, segment ids: the layer's kernel path "
            "against its dense definition, float32, exact dots)", ""] + table(
                ("case", "shape B,N,H,S", "impl", "status", *ENCODER_NAMES, "worst",
                 "padding out", "s"), lines)
  times = _kind(rows, "encoder_time")
  if times:
    ref = _first_ok(times, lambda p: p.startswith("reference"))
    cud = _first_ok(times, lambda p: p.startswith("cudnn"))
    lines = [[r["path"], r["spans"], r.get("status"), fmt(r.get("fwd_ms")),
              fmt(r.get("fwd_bwd_ms")), _vs(r, ref), _vs(r, cud), _note(r)] for r in times]
    out += ["", f"## Encoder attention timings, bf16, {times[0].get('shape')}", ""] + table(
        ("path", "spans", "status", "fwd ms", "fwd+bwd ms", "fwd+bwd vs XLA",
         "fwd+bwd vs cuDNN (mask)", "note"), lines)
  return out


def sparse(rows):
  out = []
  checks = _kind(rows, "sparse_check")
  if checks:
    lines = [[r["case"], r["dtype"], r.get("shape"), r["status"], *_diffs(r, SPARSE_NAMES),
              _worst(r), r.get("seconds")] for r in checks]
    out += ["", "## Sparse Transformer kernel correctness (pallas_gpu_sparse against the dense "
            "masked reference, float32, exact dots)", ""] + table(
                ("case", "dtype", "shape", "status", *SPARSE_NAMES, "worst", "s"), lines)
  pairs, times = _kind(rows, "sparse_pair"), _kind(rows, "sparse_time")
  if pairs or times:
    lines = [[" vs ".join(r["paths"]), r["status"], *_diffs(r, SPARSE_NAMES), _worst(r)]
             for r in pairs]
    out += ["", f"## Sparse Transformer attention, bf16, {(pairs or times)[0].get('shape')}",
            ""] + table(("paths compared", "status", *SPARSE_NAMES, "worst"), lines)
    jnp_ = _first_ok(times, lambda p: p == "jnp")
    cud = _first_ok(times, lambda p: p.startswith("cudnn"))
    lines = [[r["path"], r.get("status"), fmt(r.get("fwd_ms")), fmt(r.get("fwd_bwd_ms")),
              _vs(r, jnp_), _vs(r, cud), _note(r)] for r in times]
    out += [""] + table(("path", "status", "fwd ms", "fwd+bwd ms", "fwd+bwd vs jnp",
                         "fwd+bwd vs cuDNN dense", "note"), lines)
  return out


def kernel_times(rows):
  times = _kind(rows, "time")
  if not times:
    return []
  ref = _first_ok(times, lambda p: p == "reference")
  cud = _first_ok(times, lambda p: p.startswith("cudnn"))
  lines = []
  for r in times:
    tiles = r.get("tiles") or ""
    if tiles and r.get("shipped_tiles") is False:
      tiles = f"{tiles} (not the table's)"
    lines.append([r["path"], r["spans"], tiles, r.get("status"), fmt(r.get("fwd_ms")),
                  fmt(r.get("fwd_bwd_ms")), _vs(r, ref), _vs(r, cud), _note(r)])
  return ["", f"## Attention timings, bf16, {times[0].get('shape')} (targets: kernel fwd+bwd "
          "<= 0.5x XLA, <= 2x cuDNN)", ""] + table(
              ("path", "spans", "tiles (tile, warps, stages)", "status", "fwd ms", "fwd+bwd ms",
               "fwd+bwd vs XLA", "fwd+bwd vs cuDNN", "note"), lines)


def training(rows, suite):
  """The training tables (the run preset's: bf16 against the reference; the suite's: dtypes,
  peak memory and TFLOP/s too)."""
  ref_ok = {(r.get("shapes"), r.get("plan")): r for r in _planned(rows, "reference")
            if r.get("status") in (("ok",) if suite else ("ok", "stand_in"))}
  out = []
  names = ("train_enwik8", "train_issue8", "train_enwik8_large") if suite else (
      "train_enwik8", "train_enwik8_large")
  for name in names:
    tr = _planned(rows, name)
    if tr:
      out += (_suite_training if suite else _run_training)(name, tr, ref_ok)
  return out


def _run_training(name, tr, ref_ok):
  lines = []
  for r in tr:
    head = [f"{r['impl']} ({r.get('attn_impl')})", r["plan"], r.get("tiles", ""),
            f"{r.get('batch')} ({r.get('batch_split')})", r.get("status")]
    if r.get("status") != "ok":
      lines.append(head + [first_line(r.get("error"))] + [""] * 7)
      continue
    ref = ref_ok.get(("enwik8", r["plan"])) if name == "train_enwik8" else None
    vs = "-" if not ref else f"{r['tokens_per_s'] / ref['tokens_per_s']:.2f}x" + (
        " (stand-in)" if ref.get("stand_in") else "")
    lines.append(head + [f"{r['seconds'] * 1e3:.1f}", f"{r['tokens_per_s']:.0f}",
                         fmt(r.get("mfu"), "{:.1%}"), vs, gib(r.get("compiled_bytes")),
                         gib(r.get("peak_bytes")), f"{r['compile_seconds']:.1f}",
                         r.get("plan_keys")])
  return ["", f"## Training step: configs/{name[6:]}.py, bf16", "",
          "Full plan: all spans at S; learned: each layer's heads from 3 tokens to 0.7 S. "
          "`vs reference`: tokens/s over the PyTorch reference's on this device (same "
          f"plan; the H200 run of 2026-11-27 took {REFERENCE_H200_MS} ms per batch of 8). "
          "Peak GiB is the process's peak so far (rows share one process); compiled GiB is "
          "this step's own.", ""] + table(
              ("impl", "plan", "tiles", "batch (split)", "status", "ms/step", "tokens/s", "MFU",
               "vs reference", "compiled GiB", "peak GiB", "compile s", "keys/query"), lines)


def _suite_training(name, tr, ref_ok):
  lines = []
  for r in tr:
    head = [r["dtype"], f"{r['impl']} ({r.get('attn_impl')})", r["plan"],
            f"{r.get('batch')} ({r.get('batch_split')})", r.get("status")]
    if r.get("status") != "ok":
      lines.append(head + [first_line(r.get("error"), 160)] + [""] * 8)
      continue
    ref = ref_ok.get(("issue8" if name == "train_issue8" else name[6:], r["plan"]))
    vs = f"{r['tokens_per_s'] / ref['tokens_per_s']:.2f}x" if ref else "-"
    mfu = fmt(r.get("mfu"), "{:.1%}") + (f" (TF32 {r['mfu_tf32']:.1%})"
                                         if r.get("mfu_tf32") else "")
    if r.get("mfu") is None and r.get("of_measured_matmul"):  # no data-sheet peak (CPU)
      mfu = f"{r['of_measured_matmul']:.1%} of measured matmul"
    lines.append(head + [f"{r['seconds'] * 1e3:.1f}", f"{r['tokens_per_s']:.0f}",
                         gib(r.get("peak_bytes")), gib(r.get("compiled_bytes")), mfu,
                         f"{r['model_tflops_per_s']:.3g}", vs, f"{r['compile_seconds']:.1f}",
                         r["plan_keys"]])
  return ["", f"## Training step: {name[6:]}", ""] + table(
      ("dtype", "impl", "plan", "batch (split)", "status", "ms/step", "tokens/s", "peak GiB",
       "compiled GiB", "MFU", "model TFLOP/s", "vs reference tokens/s", "compile s",
       "keys/query"), lines)


def reference(rows, suite):
  lines = []
  for r in _planned(rows, "reference"):
    if r.get("status") in ("ok", "stand_in"):
      note = (f"{'stand-in' if suite else 'STAND-IN'} ({r.get('error')}): not a reference number"
              if r.get("stand_in") else f"{r.get('device')}, {r.get('torch')}")
      lines.append([r["shapes"], r["plan"], r["batch"], r["status"], f"{r['seconds'] * 1e3:.1f}",
                    f"{r['tokens_per_s']:.0f}"] + ([gib(r.get("peak_bytes")), note,
                                                    r.get("cache_sizes", "")] if suite else [note]))
    else:
      lines.append([r.get("shapes"), r.get("plan"), r.get("batch"), r.get("status"),
                    first_line(r.get("error"), 160 if suite else 140), ""] + [""] * (
                        3 if suite else 1))
  if not lines:
    return []
  cols = ("shapes", "plan", "batch", "status", "ms/step", "tokens/s") + (
      ("peak GiB", "device, torch", "caches") if suite else ("device, torch",))
  return ["", "## Reference (PyTorch) training step, same device", ""] + table(cols, lines)


def sampling(rows, suite):
  lines = []
  for r in _planned(rows, "sampling"):
    first = r.get("label") if suite else r.get("attn_impl")
    if r.get("status") == "ok":
      lines.append([first, r["plan"], r["batch"], r["length"], "ok", f"{r['tokens_per_s']:.0f}",
                    f"{r['compile_seconds']:.1f}", r["plan_keys"]])
    else:
      lines.append([first, r["plan"], r["batch"], r.get("length"), r.get("status"),
                    first_line(r.get("error"), 160 if suite else 140), "", ""])
  if not lines:
    return []
  title = "## Sampling (ring key/value caches, one jitted scan)" + (
      "" if suite else ", enwik8 model")
  return ["", title, ""] + table(
      ("model" if suite else "impl", "plan", "streams", "tokens", "status", "tokens/s",
       "compile s", "keys/query"), lines)


def suite_env(rows):
  env = next((r for r in rows if r.get("family") == "env" and r.get("kind") == "env"), None)
  if not env:
    return []
  keys = ("device_kind", "backend", "device_count", "memory_bytes", "python", "jax", "jaxlib",
          "flax", "optax", "orbax.checkpoint", "ml_collections", "numpy", "platform_version",
          "cuda_runtime", "cuda_driver", "cudnn", "cublas", "matmul_tflops_bfloat16",
          "matmul_tflops_float32", "float32_dot_rel_err_default_vs_highest", "peak_table")
  out = ["", "## Environment", ""] + [f"- {k}: {env.get(k)}" for k in keys if k in env]
  imp = next((r for r in rows if r.get("kind") == "impls"), {})
  out.append(f"- model.attention.impl accepted: {imp.get('accepted')}; measured here: " +
             ", ".join(f"{k} -> {v['use']}" if v["use"] else f"{k}: not run ({v['why']})"
                       for k, v in (imp.get("resolved") or {}).items()))
  return out


def suite_correctness(rows):
  rs = [r for r in rows if r.get("family") == "correctness" and "case_index" in r]
  if not rs:
    return []
  lines = []
  for r in rs:
    d = r.get("diffs", {})
    span = max((v for k, v in d.items() if "span" in k), default=None)
    pers = max((v for k, v in d.items() if "pers_" in k), default=None)
    lines.append([f"{r['impl']} ({r['attn_impl']})", r["dtype"], r["span_mode"],
                  "yes" if r["pers_mem"] else "no", r["head_dim"], r["status"],
                  *_diffs(r, [k for _, k in SUITE_DIFFS]), fmt(span), fmt(pers),
                  _worst(r, tol=False)])
  return ["", "## Correctness against the plain definition", "",
          "Worst |impl - definition| / max|definition| per tensor (bf16 against the float32 "
          "definition); q/k/v/o are the projection kernels' gradients, h and cache the "
          f"inputs'. Tolerance: {gpu_layer_check.TOL}.", ""] + table(
              ("impl", "dtype", "spans", "pers", "head dim", "status",
               *(c for c, _ in SUITE_DIFFS), "spans'", "pers'", "worst"), lines)


def markdown(rows: list[dict]) -> str:
  """The tables of one run's rows (a row file appended by several runs: the last one's)."""
  runs = [i for i, r in enumerate(rows) if r.get("kind") == "run"]
  head = rows[runs[-1]] if runs else {}
  if runs:
    rows = rows[runs[-1]:]
  suite = head.get("preset") == "suite"
  out = header(rows, head)
  if suite:
    out += suite_env(rows) + suite_correctness(rows)
  else:
    out += kernel_checks(rows) + model_checks(rows) + encoder(rows) + sparse(rows)
    out += kernel_times(rows)
  out += training(rows, suite)
  out += reference(rows, suite) + sampling(rows, suite)
  return "\n".join(out) + "\n"

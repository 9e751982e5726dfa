"""What each family of bench/gpu_run.py runs: its child processes (a module of bench and a JSON
spec), in priority order, and the time it is given. Two presets of families:

  run    (default) the 8-minute evidence run: the fused kernel's check and timings, the encoder,
         enwik8's and enwik8_large's bf16 steps (learned plan, then all spans at S), the PyTorch
         reference, sampling, the Sparse Transformer's kernel
  suite  the longer one (gpu_suite.py before it was folded in here): the device and its measured
         matmul rates, every implementation against the plain definition, training steps in bf16
         and float32 at three span plans (short, mixed, all at S), the reference at the issue-8
         and enwik8 shapes, bench/train_step.py's issue-8 shapes, enwik8_large, sampling

The implementations measured are span_lm.kernels.IMPLS's (`measured_impls`), never a list here.
"""
import dataclasses
import os

from bench import gpu_layer_check
from bench import gpu_steps
from bench import harness

PRESETS = {
    "run": ("kernel", "encoder", "train_enwik8", "reference", "train_enwik8_large", "sampling",
            "sparse"),
    "suite": ("env", "correctness", "train_enwik8", "reference", "train_issue8",
              "train_enwik8_large", "sampling"),
}
FAMILIES = PRESETS["run"]
# The run preset, device seconds estimated from the H200 run of 2026-11-27 (a training step
# compiled in ~24 s, an enwik8 step ran in 18-470 ms): what each family should take, its cap,
# and the minimum it keeps for itself out of the earlier families' time.
EST_S = {"kernel": 110, "encoder": 50, "train_enwik8": 140, "reference": 25,
         "train_enwik8_large": 110, "sampling": 45, "sparse": 90}
CAP_S = {"kernel": 170, "encoder": 80, "train_enwik8": 175, "reference": 50,
         "train_enwik8_large": 150, "sampling": 60, "sparse": 150}
RESERVE_S = {"kernel": 0, "encoder": 25, "train_enwik8": 60, "reference": 25,
             "train_enwik8_large": 45, "sampling": 30, "sparse": 60}
ROW_EST_S = {"train_enwik8": 35, "train_enwik8_large": 50, "sampling": 15}  # one compile + reps
BUDGET_S = 480.0  # 8 minutes: the 10-minute command keeps ~2 for pip, start-up and slack
# The suite preset: seconds per family on a GPU (510 in all: a 10-minute command keeps ~90 s for
# pip and start-up); what a family leaves unused passes on to the next.
SUITE_BUDGET_S = {"env": 25, "correctness": 110, "train_enwik8": 170, "reference": 70,
                  "train_issue8": 30, "train_enwik8_large": 70, "sampling": 35}
PLANS = ("short", "mixed", "all_S")  # in order of growing memory (a child's peak is cumulative)
ALL_PLANS = PLANS + ("learned",)  # learned: spans 3 tokens to 0.7 S per layer
REFERENCE_DIR = os.path.join(harness.REPO, ".gpu_carry", "adaptive-span")


@dataclasses.dataclass
class Job:
  """One child process: `python -m <module>` with --spec (or --deadline where spec is None)."""
  module: str
  spec: dict | None = None
  child: str | None = None  # bench.gpu_steps' --child
  python: str | None = None  # another interpreter (the reference's, with PyTorch)


def measured_impls(on_gpu: bool, accepted=None, only=None) -> dict:
  """{model.attention.impl: {"use": the name or None, "why": ...}} from span_lm.kernels.IMPLS:
  the readable definition everywhere; on a GPU the GPU's compiled kernels; in the CPU rehearsal
  the other unfused layouts and the GPU kernels interpreted. `accepted`: the names the device's
  span_lm accepts (its env row); a name it lacks is listed with use None."""
  from span_lm import kernels  # pylint: disable=g-import-not-at-top
  accepted = list(kernels.ATTN_IMPLS) if accepted is None else accepted
  gpu_ops = {i.ops_module for i in kernels.IMPLS.values() if i.platform == "gpu"}
  out = {}
  for name, impl in kernels.IMPLS.items():
    if on_gpu:
      keep = name == "reference" or (impl.platform == "gpu" and not impl.interpret)
    else:
      keep = not impl.fused or (impl.interpret and impl.ops_module in gpu_ops)
    if not keep or (only and name not in only):
      continue
    why = impl.needs or f"{impl.ops_module}{' interpreted' if impl.interpret else ''}"
    out[name] = ({"use": name, "why": why} if name in accepted else
                 {"use": None, "why": f"span_lm accepts attention.impl in {accepted}"})
  return out


def gpu_kernel(dry: bool) -> str:
  """The fused GPU kernel's impl name: compiled on a GPU, its interpreted twin in the rehearsal."""
  names = list(measured_impls(on_gpu=not dry))
  return next(n for n in names if n != "reference" and (not dry or n.endswith("_interpret")))


def tiny_model(label: str) -> dict:
  """A config's structure at tiny shapes (enwik8_large keeps a non-power-of-2 head)."""
  hd = 24 if label == "enwik8_large" else 16
  return {"n_layers": 1, "n_heads": 4, "d_model": 4 * hd, "d_ff": 8 * hd, "span.size": 128,
          "attention.block": 16, "plan.granularity": 32, "plan.margin": 32}


def _train_common(label: str, dry: bool, reps: int, warmup: int) -> dict:
  from span_lm import config as config_lib  # pylint: disable=g-import-not-at-top
  if label == "issue8":  # bench/train_step.py's shapes, its optimizer (gpu_steps._model_cfg)
    return {"label": label, "reps": reps, "warmup": warmup, "batch_split": 1,
            "model": {"d_model": 64 if dry else 256, "n_layers": 1 if dry else 4, "n_heads": 4,
                      "d_ff": 128 if dry else 1024, "span.size": 128 if dry else 1024,
                      "span.ramp": 32, "attention.block": 16 if dry else 64,
                      "plan.granularity": 32 if dry else 64},
            "batch": 2 if dry else 16, "block": 32 if dry else 128}
  run = config_lib.load_config(f"configs/{label}.py")
  split = run.optim.batch_split
  return {"label": label, "config": f"configs/{label}.py", "model": tiny_model(label) if dry else {},
          "batch_split": split, "reps": reps, "warmup": warmup,
          "batch": 2 * split if dry else run.data.batch // gpu_steps.REFERENCE_GPUS,
          "block": 32 if dry else run.data.block}


def _sampling(dry: bool, **kw) -> Job:
  model = {"n_layers": 1, "n_heads": 4, "d_model": 64, "d_ff": 128, "span.size": 128,
           "plan.granularity": 32} if dry else {}
  spec = dict({"label": "enwik8", "config": "configs/enwik8.py", "model": model, "use": "auto",
               "length": 8 if dry else 256, "reps": 1 if dry else 3}, **kw)
  return Job("bench.gpu_steps", spec, "sampling")


def run_jobs(family: str, dry: bool) -> list[Job]:
  """The run preset's family: one child."""
  if family in ("kernel", "encoder", "sparse"):
    module = {"kernel": "bench.gpu_kernel_check", "encoder": "bench.gpu_encoder",
              "sparse": "bench.gpu_sparse"}[family]
    return [Job(module)]
  impls = [("pallas", gpu_kernel(dry)), ("reference", "reference")]
  if family.startswith("train_"):
    label = family[6:]
    # learned plan first (both impls), then the full plan: the rows a cut keeps decide most
    variants = [{"impl": name, "use": use, "dtype": "bfloat16", "plans": [plan]}
                for plan in ("learned", "all_S") for name, use in impls]
    if dry:  # the interpreted kernel in a whole step compiles for minutes on CI's cores: the
      # kernel family rehearses it (and the layer with a plan); here the jnp path, both plans
      # for enwik8 (their keys are compared), the learned one for enwik8_large
      variants = [v for v in variants if v["impl"] == "reference" and
                  (label == "enwik8" or v["plans"] == ["learned"])]
    spec = dict(_train_common(label, dry, 1 if dry else 5, 1 if dry else 2), variants=variants,
                plans=["learned", "all_S"], measured_tflops={},
                row_estimate_s=0 if dry else ROW_EST_S[family])
    return [Job("bench.gpu_steps", spec, "train")]
  if family == "reference":
    cases = gpu_steps.enwik8_reference_cases(dry, ("learned", "all_S"))
    return [Job("bench.gpu_steps", {"label": "reference", "cases": cases,
                                    "reps": 2 if dry else 5, "reference_dir": REFERENCE_DIR},
                "reference")]
  if family == "sampling":
    return [_sampling(dry, dtype="bfloat16", impl="auto", plans=["learned", "all_S"],
                      batches=[2] if dry else [8], row_estimate_s=0 if dry else ROW_EST_S[family])]
  raise ValueError(family)


def suite_jobs(family: str, opts) -> list[Job]:
  """The suite preset's family. opts: dry_run, env (the env family's row), impls (resolved by
  `measured_impls`), dtypes, plans, reference_dir, reference_python."""
  dry = opts.dry_run
  if family == "env":
    return [Job("bench.gpu_steps", {}, "env")]
  if family == "correctness":
    cases = gpu_layer_check.correctness_cases(dry)
    slow = {"pallas_interpret"}  # the dry run interprets the kernel on a few cases only
    pending = [[ci, name, use] for ci, case in enumerate(cases) for name, use in runnable(opts)
               if not (dry and name in slow and not case.get("dry_all"))]
    return [Job("bench.gpu_steps", {"cases": cases, "pending": pending}, "correctness")]
  if family.startswith("train_"):
    label = family[6:]
    plans = ["issue8_short", "fixed"] if label == "issue8" else list(opts.plans)
    if dry and label == "enwik8_large":
      plans = ["mixed"]  # enwik8 rehearses the three plans; this one its head dim and split
    measured = {dt: opts.env.get(f"matmul_tflops_{dt}") for dt in ("bfloat16", "float32")}
    common = dict(_train_common(label, dry, 1 if dry else 5, 1 if dry else 2),
                  measured_tflops=measured, plans=plans)
    first = ("pallas", "reference")  # the fastest path first: a budget cut drops the tail
    impls = sorted(runnable(opts), key=lambda nu: first.index(nu[0]) if nu[0] in first else 9)
    variants = [{"impl": name, "use": use, "dtype": dt} for dt in opts.dtypes
                for name, use in impls]
    if dry:  # one child, one dtype per config; the interpreted kernel (slow to compile) has its
      # rehearsal in the correctness family
      dt = "bfloat16" if label == "enwik8" else "float32"
      variants = [v for v in variants if v["dtype"] == dt and v["impl"] != "pallas_interpret"]
      return [Job("bench.gpu_steps", dict(common, variants=variants), "train")]
    return [Job("bench.gpu_steps", dict(common, variants=[v]), "train") for v in variants]
  if family == "reference":
    i8 = {"layers": 1 if dry else 4, "d_model": 64 if dry else 256, "heads": 4,
          "d_ff": 128 if dry else 1024, "span": 128 if dry else 1024, "batch": 2 if dry else 16,
          "block": 32 if dry else 128, "dropout": 0.0}
    z = (64 - 32) / i8["span"]
    cases = [dict(i8, shapes="issue8", plan=plan, ratios=[[z] * i8["heads"]] * i8["layers"])
             for plan in ("issue8_short", "fixed")]
    cases += gpu_steps.enwik8_reference_cases(dry, opts.plans)
    spec = {"label": "reference", "reference_dir": opts.reference_dir, "cases": cases,
            "reps": 2 if dry else 5}
    return [Job("bench.gpu_steps", spec, "reference", opts.reference_python)]
  if family == "sampling":
    return [_sampling(dry, dtype="float32", impl="default", plans=["short", "all_S"],
                      batches=[2] if dry else [1, 8])]
  raise ValueError(family)


def runnable(opts) -> list[tuple[str, str]]:
  return [(name, r["use"]) for name, r in opts.impls.items() if r["use"]]


KEYS = {"train": ("label", "impl", "dtype", "plan"), "reference": ("shapes", "plan"),
        "sampling": ("label", "plan", "batch")}


def expected_rows(job: Job) -> list[dict]:
  """The rows a suite child should report, by their identifying keys (what it never reported is
  recorded with the reason)."""
  spec = job.spec or {}
  if job.child == "train":
    return [{"label": spec["label"], "impl": v["impl"], "dtype": v["dtype"], "plan": p}
            for v in spec["variants"] for p in v.get("plans", spec["plans"])]
  if job.child == "reference":
    return [{"shapes": c["shapes"], "plan": c["plan"]} for c in spec["cases"]]
  if job.child == "sampling":
    return [{"label": spec["label"], "plan": p, "batch": b} for p in spec["plans"]
            for b in spec["batches"]]
  return []

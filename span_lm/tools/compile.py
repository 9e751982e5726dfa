"""The compile mode: the real train and eval steps compiled for named chips on this host, no
device needed (as MaxText's train_compile.py does for TPUs; here for NVIDIA GPUs too).

  python main.py --config=configs/enwik8_large.py --config.mode=compile \
      --config.compile.targets=h100:8,a100_40:8,v5p:2x2x2

For each target it compiles exactly what `train` would run there (the step builder of
span_lm/train/steps.py, the run's sharding, batch split and remat; the attention implementation
and matmul path the chip would take: kernels/target.py) and reports, as JSON and markdown:
compiled or the compiler's one-line reason; per-device memory (arguments, outputs, temporaries,
peak) against the chip's; XLA's FLOPs and bytes (TPU) and the roofline they imply; for GPUs the
registers, spills and shared memory ptxas reports per kernel; compile time.

Toolchains (optional extras, pip from the package index; see README "What fits where"):
  GPUs: `pip install "jax[cuda12]==<jax version>"` (CUDA plugin and ptxas)
  TPUs: `pip install "jax[tpu]==<jax version>"` (libtpu)
Each target compiles in a child process: the GPU and TPU plugins, their logging (ptxas reports
come through XLA's log) and their memory stay out of this one.
"""
import dataclasses
import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from span_lm.kernels import chips
from span_lm.tools import ptx as ptx_lib

DEFAULT_GPUS = 8  # per host, as the reference's experiments (8 GPUs)


@dataclasses.dataclass(frozen=True)
class Target:
  spec: str  # as given: h100:8, v5p:2x2x2
  chip: chips.Chip
  topology: str  # GPU: 1x1xN; TPU: libtpu's topology name
  chips: int  # chips in the topology


def parse_target(spec: str) -> Target:
  """'h100' (8 GPUs), 'h100:4', 'v5p' (its default topology), 'v5e:4x4', 'v5p:2x2x2'."""
  name, _, rest = spec.strip().partition(":")
  chip = chips.get(name)
  if chip.platform == "gpu":
    try:
      n = int(rest) if rest else DEFAULT_GPUS
    except ValueError:
      raise ValueError(f"compile target {spec!r}: GPUs take a count (h100:8)") from None
    if n < 1:
      raise ValueError(f"compile target {spec!r}: at least one GPU")
    return Target(spec, chip, f"1x1x{n}", n)
  topo = f"{chip.default_topology.split(':')[0]}:{rest}" if rest else chip.default_topology
  dims = topo.split(":")[1].split("x")
  if not all(d.isdigit() and int(d) > 0 for d in dims):
    raise ValueError(f"compile target {spec!r}: a TPU topology is AxB or AxBxC (v5p:2x2x2)")
  return Target(spec, chip, topo, math.prod(int(d) for d in dims))


def parse_targets(specs: str) -> list[Target]:
  out = [parse_target(s) for s in specs.split(",") if s.strip()]
  if not out:
    raise ValueError("config.compile.targets is empty: name chips, e.g. h100:8,v5p:2x2x2")
  return out


def missing_toolchain(platform: str) -> str:
  """'' when the compiler for `platform` is installed, else the one line saying what to install."""
  import jax  # pylint: disable=g-import-not-at-top
  v = jax.__version__
  if platform == "gpu":
    if any(importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin")):
      return ""
    return (f"compiling for NVIDIA GPUs needs the CUDA toolchain (plugin and ptxas, about 5 GB): "
            f"pip install \"jax[cuda12]=={v}\"  (or: pip install -e .[gpu-compile])")
  if importlib.util.find_spec("libtpu"):
    return ""
  return (f"compiling for TPUs needs libtpu (about 0.5 GB): pip install \"jax[tpu]=={v}\"  "
          f"(or: pip install -e .[tpu-compile])")


def child_env(platform: str) -> dict:
  env = dict(os.environ)
  env["JAX_PLATFORMS"] = "cpu"  # the host runs nothing; the target is compiled for only
  env["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"  # or the CUDA plugin stops at cuInit
  env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"  # several compiles at once (libtpu's lockfile)
  env.setdefault("TPU_ACCELERATOR_TYPE", "v5p-8")  # quiets libtpu's host probing; not the target
  env.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  if platform == "gpu":  # ptxas' per-kernel report (registers, spills, shared memory) in the log
    env["TF_CPP_MIN_LOG_LEVEL"] = "0"
    env["TF_CPP_VMODULE"] = "subprocess_compilation=2"
  env.pop("XLA_FLAGS", None)  # e.g. a host device count meant for CPU runs
  # The GPU compiler's logs carry C++ stack traces; LLVM symbolizes each one by running
  # llvm-symbolizer over the CUDA plugin (seen four at a time in the compile tests' children
  # where llvm-symbolizer is installed). Raw addresses are enough in a compile log.
  env["LLVM_DISABLE_SYMBOLIZATION"] = "1"
  if platform == "gpu":  # ptxas as a process, whose report XLA logs (jax >= 0.11's default, the
    # nvJitLink/nvPTXCompiler libraries, compile the same PTX but log no report); with a
    # --xla_dump_to added, the kernels' PTX dumped. jax >= 0.11 dumps it per emitter only, and
    # only the 'ptx' emitter's: `.*` also wrote every fusion's IR after every MLIR pass (0.5 GB for
    # configs/text8.py's step; enwik8_large's H100 compile ran past 11 minutes and 14 GB).
    import jax  # pylint: disable=g-import-not-at-top
    env["XLA_FLAGS"] = ("--xla_gpu_enable_libnvptxcompiler=false --xla_gpu_enable_libnvjitlink=false"
                        + (" --xla_dump_emitter_re=^ptx$" if jax.__version_info__ >= (0, 11) else ""))
  env["PYTHONPATH"] = os.pathsep.join(
      [os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))] +
      [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
  return env


# ---------------------------------------------------------------------------- ptxas' reports

_PTXAS_FN = re.compile(r"Compiling entry function '([^']+)' for '(sm_\w+)'")
_PTXAS_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_USED = re.compile(r"Used (\d+) registers(?:.*?, (\d+) bytes smem)?")


def parse_ptxas(log: str) -> list[dict]:
  """Per compiled kernel: name, arch, registers, spill store/load bytes, static shared memory
  (ptxas -v as XLA logs it). Triton kernels' dynamic shared memory is reported by XLA's error
  when it overflows; static smem here is what ptxas sees."""
  out, cur = [], None
  for line in log.splitlines():
    m = _PTXAS_FN.search(line)
    if m:
      cur = {"kernel": m.group(1), "arch": m.group(2), "registers": None, "spill_store": 0,
             "spill_load": 0, "stack": 0, "smem": 0}
      out.append(cur)
      continue
    if cur is None:
      continue
    m = _PTXAS_SPILL.search(line)
    if m:
      cur["stack"], cur["spill_store"], cur["spill_load"] = map(int, m.groups())
      continue
    m = _PTXAS_USED.search(line)
    if m:
      cur["registers"] = int(m.group(1))
      if m.group(2):
        cur["smem"] = int(m.group(2))
  return out


# --------------------------------------------------------------------------- the child's work

def _vocab(config) -> tuple[int, str]:
  if config.vocab_size is not None:
    return config.vocab_size, "config"
  from span_lm.data import sources  # pylint: disable=g-import-not-at-top
  return sources.vocab_size_offline(config.data)


def _one_line(e: BaseException) -> str:
  text = str(e).strip()
  for pat in (r"RESOURCE_EXHAUSTED[^\n]*", r"Shared memory size limit exceeded[^\n]*",
              r"Ran out of memory[^\n]*", r"INTERNAL[^\n]*", r"INVALID_ARGUMENT[^\n]*"):
    m = re.search(pat, text)
    if m:
      return m.group(0)[:400]
  first = text.splitlines()[0] if text else type(e).__name__
  return f"{type(e).__name__}: {first[:400]}"


def _memory(compiled, capacity: int) -> dict:
  m = compiled.memory_analysis()
  if m is None:
    return {}
  mem = {k: int(getattr(m, f"{k}_size_in_bytes", 0) or 0)
         for k in ("argument", "output", "alias", "temp", "generated_code")}
  peak = getattr(m, "peak_memory_in_bytes", 0) or 0
  mem["peak"] = int(peak) or mem["argument"] + mem["output"] - mem["alias"] + mem["temp"]
  mem["capacity"] = capacity
  mem["fits"] = mem["peak"] <= capacity
  return mem


_GEMM_CALL = re.compile(r"custom-call\((.*?)\),\s*custom_call_target=\"(__cublas\$[^\"]*)\"")
_OPERAND_TYPE = re.compile(r"\b(f16|bf16|f32|f64|f8e4m3fn|f8e5m2|s8)\[")
_DEFINITION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*\(?(f16|bf16|f32|f64|s8|s32|pred)\[",
                         re.MULTILINE)
_NAME = re.compile(r"%?([\w.\-]+)\s*$")


def gemm_dtypes(hlo_text: str) -> dict:
  """Matmuls of an optimized GPU program by how they run: cuBLAS calls (`__cublas$gemm`,
  `__cublas$lt$matmul`) by their operands' dtype ('f16 x f16': tensor cores on V100/T4), and dots
  left to XLA's own fusions (Triton GEMMs and loop emitters) by theirs. What the compile mode
  reports as `gemms`: the check that a float16 model's matmuls reach the float16 tensor cores."""
  # operands print as names (`custom-call(%a, %b)`) or with their types: each name's type is
  # that of the instruction (or parameter) defining it
  defined = dict(_DEFINITION.findall(hlo_text))

  def operand_types(args: str) -> list:
    types = []
    for arg in args.split(","):
      found = _OPERAND_TYPE.findall(arg)
      name = _NAME.search(arg)
      if found:
        types.append(found[0])
      elif name and name.group(1) in defined:
        types.append(defined[name.group(1)])
    return types[:2]

  out: dict = {}
  for m in _GEMM_CALL.finditer(hlo_text):
    key = f"cublas {' x '.join(operand_types(m.group(1)))}"
    out[key] = out.get(key, 0) + 1
  for line in hlo_text.splitlines():
    if " dot(" in line:
      key = f"fused dot {' x '.join(operand_types(line.split(' dot(', 1)[1].split(')', 1)[0]))}"
      out[key] = out.get(key, 0) + 1
  return out


def _cost(compiled) -> dict:
  try:
    c = compiled.cost_analysis()
  except Exception:  # pylint: disable=broad-except
    return {}
  if isinstance(c, (list, tuple)):
    c = c[0] if c else None
  if not c:
    return {}
  return {"flops": float(c.get("flops", 0.0)), "bytes": float(c.get("bytes accessed", 0.0))}


def _compile_step(kind: str, compiler, plan, state, batch, *, cfg, data, n: int, chip,
                  per_chip: int, split: int, log: list, device_memory: int, sds, rows,
                  replicated) -> dict:
  """One step kind ('train', else the eval step) compiled: its row of memory, FLOPs, XLA's cost
  and roofline, or the one-line error that stopped it."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from span_lm.model import costs as costs_lib  # pylint: disable=g-import-not-at-top
  r: dict[str, Any] = {}
  t1 = time.perf_counter()
  try:
    if kind == "train":
      compiled = compiler.train(plan, state, batch)
      tokens = data.batch * data.block
      ours = costs_lib.train_step_flops(cfg, plan, data.batch, data.block) / n
    else:
      eb = {"x": sds((data.eval_batch, data.block), jnp.int32, rows),
            "y": sds((data.eval_batch, data.block), jnp.int32, rows),
            "reset": sds((), jnp.bool_, replicated)}
      compiled = compiler.eval(plan, state["params"], state["eval_caches"], eb)
      tokens = data.eval_batch * data.block
      ours = 2 * sum(costs_lib.forward_macs(cfg, plan, data.block, data.eval_batch).values()) / n
  except Exception as e:  # pylint: disable=broad-except
    r.update(compiled=False, error=_one_line(e), compile_s=time.perf_counter() - t1)
    return r
  r["attention"] = compiler.compilations[-1]["attention"]
  r["attention_log"] = [line for line in log if line.startswith("attention:")]
  r.update(compiled=True, compile_s=time.perf_counter() - t1,
           memory=_memory(compiled, device_memory), tokens=tokens,
           matmul_flops=ours)
  if chip.platform == "gpu":
    try:
      r["gemms"] = gemm_dtypes(compiled.as_text())
    except Exception as e:  # pylint: disable=broad-except
      r["gemms"] = {"error": _one_line(e)}
  cost = _cost(compiled)
  scale = split if kind == "train" else 1  # XLA counts the batch-split loop body once
  if cfg.sparse.scan_layers:  # and the layer scan's: scaling the whole step is an upper bound
    scale *= cfg.n_layers // cfg.sparse.scan_period  # on its bytes (docs/targets.md)
  if cost:
    r["xla"] = dict(cost, loop_scale=scale)
  r["roofline"] = roofline(chip, cfg.dtype, per_chip, ours, cost, scale, tokens)
  return r


def compile_target(config, tgt: Target) -> dict:
  """Compiles the train and eval steps for one target in this process (the child).
  config: a RunConfig (a ConfigDict is checked first)."""
  from span_lm import config as config_lib  # pylint: disable=g-import-not-at-top
  from span_lm.model import plan as plan_lib  # pylint: disable=g-import-not-at-top
  from span_lm.train import optimizer as optimizer_lib  # pylint: disable=g-import-not-at-top
  from span_lm.train import steps as steps_lib  # pylint: disable=g-import-not-at-top

  config = config_lib.checked(config)
  chip = tgt.chip
  row: dict[str, Any] = {"target": tgt.spec, "chip": chip.name, "platform": chip.platform,
                         "topology": tgt.topology, "chips": tgt.chips}
  t0 = time.perf_counter()
  devices, per_chip = _topology_devices(tgt, row)
  vocab, vocab_from = _vocab(config)
  cfg = config.model_for(vocab)
  row.update(vocab=vocab, vocab_from=vocab_from, dtype=cfg.dtype)
  d = config.data
  split = config.optim.batch_split
  tx, _ = optimizer_lib.make_optimizer(config.optim)
  plan = plan_lib.full_plan(cfg) if config.compile.plan == "full" else plan_lib.initial_plan(cfg)
  row["plan"] = config.compile.plan
  row["attention_keys"] = plan.attention_keys()
  log = []
  try:  # train's own builder: its mesh, state rule, batch sharding and checks
    options = steps_lib.StepOptions(
        batch=d.batch, eval_batch=d.eval_batch, batch_split=split, fsdp=config.dist.fsdp,
        devices=devices, whole_pieces=True, log=log.append, capacity=row["device_memory"],
        loss_scale_period=config.train.loss_scale_period)
    compiler = steps_lib.build(cfg, tx, options)
  except ValueError as e:  # a batch (or fsdp) that does not split over the devices
    row["error"] = str(e)
    return row
  _compile_steps(config, chip, cfg, tx, plan, compiler, devices, per_chip, log, row)
  row["total_s"] = time.perf_counter() - t0
  return row


def _topology_devices(tgt: Target, row: dict) -> tuple[list, int]:
  """The target's devices (no hardware: the compiler's topology description) and devices per
  chip; their count, kind and memory each go into `row`."""
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  chip = tgt.chip
  if chip.platform == "gpu":
    topo = topologies.get_topology_desc(platform="cuda", topology=tgt.topology,
                                        target_config=chips.gpu_target_config(chip))
  else:
    topo = topologies.get_topology_desc(topology_name=tgt.topology, platform="tpu")
  devices = list(topo.devices)
  n = len(devices)
  per_chip = max(1, n // tgt.chips)  # TPU topologies may list TensorCores, not chips
  row.update(devices=n, device_kind=devices[0].device_kind,
             device_memory=chip.memory_bytes // per_chip)
  return devices, per_chip


def _compile_steps(config, chip, cfg, tx, plan, compiler, devices, per_chip, log, row) -> None:
  """Under the chip's kernel choices: the attention it would run, its kernels' rooflines, and
  each of config.compile.steps compiled on the abstract state (rows of `row`)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from span_lm import kernels  # pylint: disable=g-import-not-at-top
  from span_lm.kernels import target as target_lib  # pylint: disable=g-import-not-at-top
  from span_lm.model import ARCHS  # pylint: disable=g-import-not-at-top
  from span_lm.train import loss_scale as loss_scale_lib  # pylint: disable=g-import-not-at-top
  from span_lm.train import sharding as sharding_lib  # pylint: disable=g-import-not-at-top
  from span_lm.train import steps as steps_lib  # pylint: disable=g-import-not-at-top
  d, n = config.data, len(devices)
  steps = [s.strip() for s in config.compile.steps.split(",") if s.strip()]
  layout = compiler.layout
  replicated, rows = layout.replicated, layout.rows
  # float16 (or train.loss_scale=dynamic): the step with its loss scale, as train runs it
  loss_scale = (float(config.train.loss_scale_init) if loss_scale_lib.enabled(
      config.train.loss_scale, cfg.dtype) else None)
  row["loss_scale"] = loss_scale is not None
  with target_lib.compiling_for(chip.platform, chip.cc, chip.device_kind,
                               device=devices[0] if chip.platform == "gpu" else None):
    spec = cfg.attn_spec
    impl = kernels.select(spec, d.block, max(cfg.context, d.block))
    row["attention"], row["attention_why"] = ARCHS[cfg.arch].attention(
        cfg, d.block, max(cfg.context, d.block))
    row["kernels_roofline"] = kernel_roofline(
        chip, cfg, lambda span: impl.schedule_cost(spec, d.batch // n, d.block, cfg.context, span))
    abstract = jax.eval_shape(lambda: steps_lib.init_state(cfg, tx, plan, d.batch, d.eval_batch,
                                                           config.seed, loss_scale=loss_scale))
    state = sharding_lib.with_shardings(abstract, layout.state_shardings(abstract))
    sds = lambda shape, dt, sh: jax.ShapeDtypeStruct(shape, dt, sharding=sh)
    batch = {"x": sds((d.batch, d.block), jnp.int32, rows),
             "y": sds((d.batch, d.block), jnp.int32, rows),
             "reset": sds((), jnp.bool_, replicated)}
    for kind in steps:
      row[kind] = _compile_step(kind, compiler, plan, state, batch, cfg=cfg, data=d, n=n,
                                chip=chip, per_chip=per_chip, split=config.optim.batch_split,
                                log=log, device_memory=row["device_memory"], sds=sds, rows=rows,
                                replicated=replicated)


def roofline(chip: chips.Chip, dtype: str, per_chip: int, matmul_flops: float, cost: dict,
             scale: int, tokens: int) -> dict:
  """Seconds per step if bound by compute (matmul FLOPs / peak) or by HBM traffic (XLA's bytes,
  times the batch-split pieces / bandwidth), per device, and the tokens/s of the binding one."""
  # float32 models: XLA's default matmul precision, TF32 tensor cores on GPUs that have them
  key = "bfloat16" if dtype != "float32" else ("tf32" if "tf32" in chip.peak_flops else "float32")
  peak = chip.peak_flops[key] / per_chip
  bw = chip.hbm_bytes_per_s / per_chip
  out = {"compute_s": matmul_flops / peak}
  if cost.get("bytes"):
    out["hbm_s"] = cost["bytes"] * scale / bw
  bound = max(out.values())
  out["bound"] = "hbm" if out.get("hbm_s", 0) > out["compute_s"] else "compute"
  out["tokens_per_s"] = tokens / bound if bound else None
  return out


LEARNED_SPAN = 314  # the paper's average learned span on text8 with spans up to 8192


def kernel_roofline(chip: chips.Chip, cfg, cost_at) -> list[dict]:
  """Per fused GPU kernel, one layer of the step on one device, every head at the full span and
  at the paper's average learned span: FLOPs and HBM bytes of the tile schedule (an interval:
  each input once .. every block as the programs load it, L2 catching nothing), the compute and
  HBM times at the chip's peaks, and which binds ('either' when the time in between depends on
  the cache). [] where no such kernel runs (TPU: XLA's cost analysis sees its kernel)."""
  out = []
  spans = [(f"span {cfg.context}", None)]  # None: every distance up to the window
  if cfg.spans != "fixed":
    spans.append((f"learned span {LEARNED_SPAN}", LEARNED_SPAN))
  for label, span in spans:
    cost = cost_at(span)
    if not cost:
      return []
    key = "bfloat16" if cfg.dtype != "float32" else ("tf32" if "tf32" in chip.peak_flops
                                                     else "float32")
    for kernel, c in cost.items():
      t_mm = c["flops"] / chip.peak_flops[key]
      lo, hi = (c[k] / chip.hbm_bytes_per_s for k in ("bytes_min", "bytes"))
      bound = "compute" if t_mm >= hi else "HBM" if t_mm < lo else "either"
      out.append(dict(spans=label, kernel=kernel, flops=c["flops"], bytes_min=c["bytes_min"],
                      bytes=c["bytes"], compute_s=t_mm, hbm_min_s=lo, hbm_max_s=hi, bound=bound))
  return out


# ------------------------------------------------------------------------------ the parent

def _suggest(row: dict) -> str:
  return ("try --config.optim.batch_split=" + str(2 * max(1, row.get("batch_split", 1))) +
          ", --config.model.remat=layer, or more chips")


def report(config) -> dict:
  """The compile mode: every target in its own child process; JSON and markdown written to
  config.compile.out (default: config.workdir, else ./compile_report). config: a RunConfig (a
  ConfigDict is checked first)."""
  from span_lm import config as config_lib  # pylint: disable=g-import-not-at-top
  from span_lm import run_dir  # pylint: disable=g-import-not-at-top
  config = config_lib.checked(config)
  targets = parse_targets(config.compile.targets)
  missing = {missing_toolchain(t.chip.platform) for t in targets} - {""}
  if missing:
    raise ValueError(" ; ".join(sorted(missing)))
  out_dir = config.compile.out or config.workdir or "compile_report"
  os.makedirs(out_dir, exist_ok=True)
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    with open(run_dir.config_path(tmp), "w") as f:
      f.write(config.to_json_best_effort(indent=1))
    for tgt in targets:
      row = _child_row(config, tgt, tmp, out_dir)
      rows.append(row)
      print(format_row(row), flush=True)
  result = {"config": config.source.get("config_name", ""), "rows": rows,
            "model": {"n_layers": config.model.n_layers, "d_model": config.model.d_model,
                      "span": config.model.context,
                      "dtype": config.model.dtype,
                      "batch": config.data.batch, "block": config.data.block,
                      "batch_split": config.optim.batch_split, "remat": config.model.remat}}
  with open(os.path.join(out_dir, "compile_report.json"), "w") as f:
    json.dump(result, f, indent=1)
  md = markdown(result)
  with open(os.path.join(out_dir, "compile_report.md"), "w") as f:
    f.write(md + "\n")
  print(f"wrote {os.path.join(out_dir, 'compile_report.md')} and compile_report.json")
  return result


def _child_row(config, tgt: Target, tmp: str, out_dir: str) -> dict:
  """One target compiled in a child process (the run config in `tmp`): its row, or the child's
  last line when it failed (its whole output kept in out_dir); for GPUs, ptxas' and the PTX's
  facts per kernel."""
  out_json = os.path.join(tmp, "row.json")
  log_path = os.path.join(tmp, "child.log")
  t0 = time.perf_counter()
  env = child_env(tgt.chip.platform)
  dump = os.path.join(tmp, "dump")
  if tgt.chip.platform == "gpu":  # the PTX, for what our kernels do (tools/ptx.py)
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + f" --xla_dump_to={dump}"
  with open(log_path, "w") as log:
    proc = subprocess.run([sys.executable, "-m", "span_lm.tools.compile", tmp, tgt.spec,
                           out_json], env=env, stdout=log,
                          stderr=subprocess.STDOUT, check=False)
  text = open(log_path, errors="replace").read()
  if proc.returncode == 0 and os.path.exists(out_json):
    row = json.load(open(out_json))
    os.remove(out_json)
  else:
    tail = [l for l in text.splitlines() if l.strip()][-1:] or ["no output"]
    log_keep = os.path.join(out_dir, f"{tgt.spec.replace(':', '_')}.log")
    with open(log_keep, "w") as f:  # the whole traceback, for a bug report
      f.write(text)
    row = {"target": tgt.spec, "chip": tgt.chip.name, "platform": tgt.chip.platform,
           "error": f"the compiler process failed (status {proc.returncode}): {tail[0][:300]}"
                    f" (its output: {log_keep})"}
  row["wall_s"] = time.perf_counter() - t0
  row["batch_split"] = config.optim.batch_split
  if tgt.chip.platform == "gpu":
    facts = {f["kernel"]: f for f in ptx_lib.dumped_kernels(dump, "span_attention")}
    row["kernels"] = sorted(  # by name: ptxas logs them in the order its threads finish
        [dict(k, ptx=facts[k["kernel"]]) if k["kernel"] in facts else k for k in parse_ptxas(text)],
        key=lambda k: (k["kernel"], json.dumps(k, sort_keys=True, default=str)))
    shutil.rmtree(dump, ignore_errors=True)
  return row


def failures(result: dict) -> list[str]:
  """'target step: why' for every step of a report that did not compile or does not fit."""
  out = []
  for row in result["rows"]:
    if "error" in row:
      out.append(f"{row['target']}: {row['error'][:200]}")
      continue
    for kind in ("train", "eval"):
      r = row.get(kind)
      if r is None:
        continue
      if not r.get("compiled"):
        out.append(f"{row['target']} {kind}: not compiled ({str(r.get('error', ''))[:200]})")
      elif not r["memory"]["fits"]:
        out.append(f"{row['target']} {kind}: needs {_gib(r['memory']['peak'])} GiB of "
                   f"{_gib(r['memory']['capacity'])} per device")
  return out


def _gib(x) -> str:
  return f"{x / 2**30:.1f}"


def format_row(row: dict) -> str:
  """One line per step: target, compiled or why, peak/capacity, roofline."""
  head = f"{row['target']:>12}"
  if "error" in row:
    return f"{head}: not compiled: {row['error']}"
  parts = []
  for kind in ("train", "eval"):
    r = row.get(kind)
    if not r:
      continue
    if not r["compiled"]:
      hint = f" ({_suggest(row)})" if "memory" in r["error"].lower() or \
          "RESOURCE_EXHAUSTED" in r["error"] else ""
      parts.append(f"{kind}: FAILED {r['error']}{hint}")
      continue
    m, rf = r["memory"], r["roofline"]
    fit = "fits" if m.get("fits") else f"DOES NOT FIT ({_suggest(row)})"
    tps = f", bound {rf['tokens_per_s'] / 1e3:.0f}k tok/s ({rf['bound']})" if rf.get(
        "tokens_per_s") else ""
    attn = r.get("attention", row.get("attention", "?"))
    parts.append(f"{kind} (attention {attn}): peak {_gib(m['peak'])} of {_gib(m['capacity'])} GiB "
                 f"per device, {fit}{tps}, compiled in {r['compile_s']:.0f}s")
    parts += r.get("attention_log", [])
  why = f" [attention: {row['attention_why']}]" if row.get("attention_why") else ""
  return f"{head}: " + "; ".join(parts) + why


def markdown(result: dict) -> str:
  lines = ["| target | devices | attention | step | compiled | peak GiB / device | of | args | "
           "temps | compute ms | HBM ms | bound tok/s | compile s |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  kern = []
  for row in result["rows"]:
    if "error" in row:
      lines.append(f"| {row['target']} | | | | no: {row['error']} | | | | | | | | |")
      continue
    for kind in ("train", "eval"):
      r = row.get(kind)
      if not r:
        continue
      if not r["compiled"]:
        lines.append(f"| {row['target']} | {row['devices']} | {r.get('attention', row.get('attention', ''))} | {kind} "
                     f"| no: {r['error']} | | | | | | | | {r['compile_s']:.0f} |")
        continue
      m, rf = r["memory"], r["roofline"]
      hbm = f"{rf['hbm_s'] * 1e3:.1f}" if "hbm_s" in rf else "n/a"
      lines.append(
          f"| {row['target']} | {row['devices']} | {r.get('attention', row.get('attention', ''))} "
          f"| {kind} | yes | "
          f"{_gib(m['peak'])}{'' if m['fits'] else ' (too big)'} | {_gib(m['capacity'])} | "
          f"{_gib(m['argument'])} | {_gib(m['temp'])} | {rf['compute_s'] * 1e3:.1f} | {hbm} | "
          f"{(rf['tokens_per_s'] or 0) / 1e3:.0f}k | {r['compile_s']:.0f} |")
    for k in row.get("kernels", []):
      if "span_attention" in k["kernel"] or k["spill_store"] or k["spill_load"]:
        f = k.get("ptx", {})
        facts = (f"{f['wgmma']} wgmma / {f['mma']} mma | {f['cp_async']} | "
                 f"{f['loop_prefetch'] or '-'} | {f['read_back'] or 'none'}") if f else "| | |"
        kern.append(f"| {row['target']} | {k['kernel'][:60]} | {k['arch']} | {k['registers']} | "
                    f"{k['spill_store']} / {k['spill_load']} | {k['smem']} | {facts} |")
  roof = [f"| {row['target']} | {k['spans']} | {k['kernel']} | {k['flops'] / 1e9:.0f} | "
          f"{k['bytes_min'] / 1e9:.2f} .. {k['bytes'] / 1e9:.2f} | {k['compute_s'] * 1e3:.3f} | "
          f"{k['hbm_min_s'] * 1e3:.3f} .. {k['hbm_max_s'] * 1e3:.3f} | {k['bound']} |"
          for row in result["rows"] for k in row.get("kernels_roofline", [])]
  out = "\n".join(lines)
  if roof:
    out += ("\n\nFused attention kernels, one layer per device (tile schedule; HBM bytes from each "
            "input once to every block as loaded):\n\n| target | spans | kernel | GFLOP | HBM GB | "
            "compute ms | HBM ms | bound |\n|---|---|---|---|---|---|---|---|\n" + "\n".join(roof))
  if kern:
    out += ("\n\nGPU kernels (ptxas: ours, and XLA's that spill; for ours the PTX: tensor-core "
            "instructions, asynchronous copies, parameters loaded a tile ahead in a loop, buffers "
            "read back):\n\n| target | kernel | arch | registers | spill stores / loads B | "
            "static smem B | tensor-core ops | cp.async | prefetched | read back |\n"
            "|---|---|---|---|---|---|---|---|---|---|\n" + "\n".join(kern))
  return out


def _child(argv) -> int:
  config_dir, spec, out_json = argv
  from span_lm import run_dir  # pylint: disable=g-import-not-at-top
  config = run_dir.load_saved(config_dir)
  row = compile_target(config, parse_target(spec))
  with open(out_json, "w") as f:
    json.dump(row, f, indent=1, default=float)
  return 0


if __name__ == "__main__":
  sys.exit(_child(sys.argv[1:]))

"""A source tree's user-visible behaviour captured as text files, so that `diff -r` of two captures
proves a refactor left it unchanged (issue 58, "behaviour unchanged, proven"):

  python -m bench.refactor_proof --tree /tmp/before --out /tmp/proof_before
  python -m bench.refactor_proof --tree /work/main --out /tmp/proof_after
  diff -r /tmp/proof_before /tmp/proof_after && echo identical

Everything runs in child processes with cwd=TREE, PYTHONPATH=TREE and JAX_PLATFORMS=cpu (each
child checks it imported TREE's span_lm), through what users use and what stays put while the
internals move: main.py's command line, configs/*.py, span_lm.config.load_config,
ModelConfig.from_config, span_lm.model.build_model (with model/plan.py's full_plan and
model/caches.py's init_caches, the model's own inputs). Parts (--parts):
  messages  every case of bench/refactor_proof_cases.json (bad values of every leaf of the run
            config, cross-field and command-line mistakes) run as `python main.py ...`: stdout,
            stderr and the exit status; a valid case trains 0 steps and adds its config.json's hash
  params    per configs/*.py and variant: the parameter tree (path, shape, dtype; eval_shape of
            init at the config's sizes) and the run config as config.json holds it
  jaxprs    make_jaxpr of forward+loss and of its gradient, small models of the paper's kinds, for
            every attention.impl / sparse.impl that runs on a CPU
  hlo       bench/hlo_fingerprint.py's stripped HLO of the compiled CPU train step
  compile   (not by default; --python with libtpu and the CUDA plugin) each paper config's
            deviceless compile report, timings and paths removed (--configs narrows it)
The cases file is made once from the tree before a change (`--make-cases --tree BEFORE`), so that
both trees run the same list.
"""
import argparse
import concurrent.futures
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES_FILE = os.path.join(REPO, "bench", "refactor_proof_cases.json")
DEFAULT_PARTS = ("messages", "params", "jaxprs", "hlo")
BASE_CONFIG = "configs/tiny.py:smoke"  # the messages' base: small, packaged data, trains at once
# A valid case ends right after the run is built and its config.json written.
STOP = ["--config.train.steps=0", "--config.train.full_eval_at_end=False"]
PAPER_CONFIGS = ("enwik8_large", "enwik8_pers", "wiki103_pers", "enwik8_sparse_fixed", "enwik8",
                 "cifar10_sparse", "text8_large", "text8")
FIRST_TARGET_ONLY = ("text8", "text8_large", "enwik8_large", "enwik8_pers")  # as CI's stage

# ---- children ------------------------------------------------------------------------------------

_CHECK_TREE = """
import importlib.util, os, sys
_origin = importlib.util.find_spec("span_lm").origin
if not os.path.realpath(_origin).startswith(os.path.realpath(os.getcwd()) + os.sep):
  raise SystemExit(f"span_lm comes from {_origin}, not from the tree {os.getcwd()}")
"""


def _env(tree: str) -> dict:
  env = dict(os.environ, PYTHONPATH=tree, JAX_PLATFORMS="cpu", PYTHONHASHSEED="0")
  for k in ("XLA_FLAGS", "SPAN_LM_DEBUG", "PYTHONSTARTUP"):
    env.pop(k, None)
  return env


def _child(tree: str, script: str, args: list[str], python: str = sys.executable,
           timeout: float | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
  """`script` (after the tree check) run by `python` in the tree."""
  cmd = ["nice", "-n", "19", python, "-c", _CHECK_TREE + script, *args]
  return subprocess.run(cmd, cwd=tree, env=env or _env(tree), capture_output=True, text=True,
                        timeout=timeout, check=False)


def _checked(out: subprocess.CompletedProcess, what: str) -> str:
  if out.returncode:
    raise SystemExit(f"{what} failed ({out.returncode}):\n{out.stdout[-3000:]}\n"
                     f"{out.stderr[-5000:]}")
  return out.stdout


def _normalize(text: str, tree: str, tmp: str = "") -> str:
  """Output without what names this run rather than the behaviour: paths, timings, addresses."""
  for path, name in ((tmp, "<TMP>"), (os.path.realpath(tree), "<TREE>"),
                     (os.path.abspath(tree), "<TREE>")):
    if path:
      text = text.replace(path, name)
  text = text.replace("\r", "\n")
  text = re.sub(r"\[\d+:\d+(<[^\]]*)?(, [^\]]*)?\]", "[<time>]", text)  # progress bars
  text = re.sub(r" at 0x[0-9a-f]+", "", text)
  # absl's log prefix (time, thread) and a traceback's or log line's line numbers
  text = re.sub(r"^([IWEF])\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ ([\w.]+):\d+\]", r"\1 \2]", text,
                flags=re.M)
  text = re.sub(r'^(\s*File "[^"]+", line )\d+', r"\1N", text, flags=re.M)
  text = re.sub(r"could not start run \w+ of", "could not start run <id> of", text)  # wandb's
  text = re.sub(r"\b\d+(\.\d+)?\s?(s|ms|min|step/s|it/s)\b(?=[ ,;)\]]|$)", "<time>", text,
                flags=re.M)
  lines, out = text.splitlines(), []
  for line in lines:
    line = line.rstrip()
    if line and (not out or out[-1] != line):  # a progress bar redrawn: once
      out.append(line)
  return "\n".join(out) + "\n"


# ---- the cases (made once, from the tree before) -------------------------------------------------

_LEAVES = """
import json, sys
from ml_collections import config_dict
from span_lm import config as config_lib
c = config_lib.load_config(sys.argv[1])
out = []
def walk(node, prefix):
  for k in sorted(node.keys()):
    ref = node._fields[k]
    if isinstance(ref, config_dict.ConfigDict):
      walk(ref, prefix + k + ".")
      continue
    kind = ref.get_type() if isinstance(ref, config_dict.FieldReference) else type(ref)
    value = node[k]
    out.append([prefix + k, getattr(kind, "__name__", str(kind)), repr(value)])
walk(c, "")
print(json.dumps(out))
"""

# Wrong types and out-of-range values per kind of field, as a user writes them after '='.
BAD_VALUES = {
    "int": ["0", "-1", "x", "True", "1.5"],
    "float": ["-1.0", "nan", "inf", "x"],
    "str": ["nope", "5"],
    "tuple": ["()", "(1,)", "('a',)"],
    "bool": ["yes", "2"],
}


# Directories a run writes to: their bad values stay in the case's scratch folder, never the tree.
PATH_LEAVES = ("workdir", "train.compilation_cache", "data.data_dir", "compile.out")
PATH_BAD_VALUES = ["", "{W}/5"]


def _cross_cases() -> list[tuple[str, list[str]]]:
  """Cross-field and command-line mistakes (span_lm/config.py, model/config.py, model/archs.py,
  optim_config.py, precision_config.py, kernels.check, main.py), by name -> main.py arguments."""
  base = [f"--config={BASE_CONFIG}", "--config.workdir={W}"]
  b = lambda *a: base + STOP + list(a)
  sparse = ["--config=configs/cifar10_sparse.py:smoke", "--config.workdir={W}"] + STOP
  return [
      ("valid_tiny_smoke", b()),
      ("valid_tiny_smoke_fixed", ["--config=configs/tiny.py:smoke,fixed", "--config.workdir={W}"]
       + STOP),
      ("valid_tiny_smoke_dynamic", b("--config.model.span.mode=dynamic")),
      ("valid_tiny_smoke_pers", b("--config.model.pers_mem=8", "--config.model.d_ff=0")),
      ("valid_cifar10_sparse_smoke_flags", sparse + ["--config.data.dataset=synthetic"]),
      # main.py's own command line
      ("cli_no_config_no_workdir", []),
      ("cli_workdir_without_run", ["--config.workdir={W}", "--config.mode=eval"]),
      ("cli_missing_config_file", ["--config=configs/nope.py", "--config.workdir={W}"]),
      ("cli_config_is_directory", ["--config=configs", "--config.workdir={W}"]),
      ("cli_unknown_variant", ["--config=configs/tiny.py:nope", "--config.workdir={W}"]),
      ("cli_extra_argument", b("extra")),
      ("cli_unknown_top_field", b("--config.nope=1")),
      ("cli_unknown_model_field", b("--config.model.nope=1")),
      ("cli_unknown_data_field_typo", b("--config.data.blok=3")),
      ("cli_unknown_nested_field", b("--config.model.span.nope=1")),
      ("cli_section_set_as_value", b("--config.model.span=512")),
      ("cli_section_set_as_value_data", b("--config.data=5")),
      ("cli_unknown_mode", b("--config.mode=nope")),
      ("cli_mode_train_no_workdir", [f"--config={BASE_CONFIG}"] + STOP),
      ("cli_mode_verify_no_workdir", [f"--config={BASE_CONFIG}", "--config.mode=verify"]),
      ("cli_mode_verify_empty_workdir", b("--config.mode=verify")),
      ("cli_mode_import_no_workdir", [f"--config={BASE_CONFIG}", "--config.mode=import"]),
      ("cli_mode_import_no_source", b("--config.mode=import")),
      ("cli_mode_import_missing_source", b("--config.mode=import", "--config.import_from=nope.pt")),
      ("cli_mode_import_missing_dir_no_config", ["--config.mode=import",
                                                 "--config.import_from={W}/nope",
                                                 "--config.workdir={W}"]),
      ("cli_mode_export_no_target", b("--config.mode=export")),
      ("cli_mode_export_no_checkpoint", b("--config.mode=export", "--config.export_to={W}/x.pt")),
      ("cli_mode_eval_no_checkpoint", b("--config.mode=eval")),
      ("cli_mode_spans_no_checkpoint", b("--config.mode=spans")),
      ("cli_mode_sample_no_checkpoint", b("--config.mode=sample")),
      ("cli_mode_flops_fresh", b("--config.mode=flops", "--config.tools.xla=False")),
      ("cli_mode_compile_bad_target", b("--config.mode=compile", "--config.compile.targets=nope")),
      ("cli_mode_compile_empty_targets", b("--config.mode=compile", "--config.compile.targets=")),
      ("cli_mode_compile_bad_topology", b("--config.mode=compile",
                                          "--config.compile.targets=v5p:2xq")),
      ("cli_mode_compile_bad_plan", b("--config.mode=compile", "--config.compile.plan=nope")),
      ("cli_mode_compile_bad_steps", b("--config.mode=compile", "--config.compile.steps=train,x")),
      # moved fields of config.model (its flat names before the sections)
      *[(f"moved_{name}", b(f"--config.model.{name}={value}")) for name, value in (
          ("span_mode", "fixed"), ("ramp", "32"), ("span_loss", "0.0"), ("attn_impl", "cpu"),
          ("attn_block", "32"), ("plan_granularity", "64"), ("adapt_io_div", "2"),
          ("sparse_pattern", "fixed"), ("scan_layers", "True"), ("adapt_io", "True"))],
      ("moved_span_on_sparse", sparse + ["--config.model.span=512"]),
      # data and the data file
      ("data_align_not_dividing_block", b("--config.data.align=3")),
      ("data_batch_not_divisible_by_split", b("--config.data.batch=7",
                                              "--config.optim.batch_split=2")),
      ("data_split_fractions_over_one", b("--config.data.split_fractions=(0.5,0.5,0.5)")),
      ("data_split_fractions_two", b("--config.data.split_fractions=(0.5,0.5)")),
      ("data_split_bytes_decreasing", b("--config.data.split_bytes=(10,5)")),
      ("data_dataset_file_without_path", b("--config.data.dataset=file")),
      ("data_path_missing", b("--config.data.path=nope.txt")),
      ("data_path_directory", b("--config.data.path={W}")),
      ("data_path_too_small", b("--config.data.path={DATA_SMALL}")),
      ("data_path_split_bytes_past_end", b("--config.data.path={DATA_SMALL}",
                                           "--config.data.split_bytes=(10,5000)")),
      ("data_path_valid", b("--config.data.path={DATA_LARGE}")),
      ("data_path_valid_bytes_vocab", b("--config.data.path={DATA_LARGE}",
                                        "--config.data.file_vocab=bytes")),
      ("data_synthetic_length_short", b("--config.data.dataset=synthetic",
                                        "--config.data.synthetic_length=10")),
      ("data_vocab_size_too_small", b("--config.model.vocab_size=5")),
      ("data_block_not_multiple_of_fused_tile", b("--config.model.attention.impl=pallas_interpret",
                                                  "--config.data.block=48")),
      # model cross-field checks
      ("model_heads_not_dividing_d_model", b("--config.model.n_heads=3")),
      ("model_no_ff_without_pers_mem", b("--config.model.d_ff=0")),
      ("model_span_below_ramp", b("--config.model.span.size=16", "--config.model.span.ramp=32")),
      ("model_doc_boundary_past_vocab", b("--config.model.doc_boundary=100000")),
      ("model_doc_boundary_sparse", sparse + ["--config.model.doc_boundary=0"]),
      ("model_pers_mem_sparse", sparse + ["--config.model.pers_mem=4"]),
      ("model_adapt_io_sparse", sparse + ["--config.model.adapt_io.enabled=True"]),
      ("model_sparse_qk_ratio", sparse + ["--config.model.sparse.qk_ratio=0.01"]),
      ("model_sparse_scan_odd_layers", sparse + ["--config.model.sparse.scan_layers=True",
                                                 "--config.model.sparse.combine=interleaved",
                                                 "--config.model.n_layers=3"]),
      ("model_scan_layers_span", b("--config.model.sparse.scan_layers=True")),
      ("model_sparse_c_past_stride", sparse + ["--config.model.sparse.pattern=fixed",
                                               "--config.model.sparse.c=1000"]),
      ("model_sparse_pos_data_no_shape", sparse + ["--config.model.sparse.pos=data",
                                                   "--config.model.sparse.data_shape=()"]),
      ("model_sparse_data_shape_small", sparse + ["--config.model.sparse.pos=data",
                                                  "--config.model.sparse.data_shape=(2,2)"]),
      ("model_sparse_impl_pallas_cpu", sparse + ["--config.model.sparse.impl=pallas"]),
      ("model_sparse_impl_splash_cpu", sparse + ["--config.model.sparse.impl=splash"]),
      ("model_adapt_io_cutoffs_past_vocab", b("--config.model.adapt_io.enabled=True",
                                              "--config.model.adapt_io.cutoffs=(100,100000)")),
      ("model_adapt_io_div_large", b("--config.model.adapt_io.enabled=True",
                                     "--config.model.adapt_io.cutoffs=(20,100)",
                                     "--config.model.adapt_io.div=1000")),
      ("kernel_pallas_on_cpu", b("--config.model.attention.impl=pallas")),
      ("kernel_pallas_tpu_on_cpu", b("--config.model.attention.impl=pallas_tpu")),
      ("kernel_xla_alias", b("--config.model.attention.impl=xla")),
      ("kernel_tiles_not_dividing", b("--config.model.attention.tiles=128,4,2")),
      ("kernel_tiles_bad", b("--config.model.attention.tiles=3,4,2")),
      ("kernel_fused_block_not_dividing_span", b("--config.model.attention.impl=pallas_interpret",
                                                 "--config.model.attention.block=48")),
      ("kernel_fused_dh", b("--config.model.attention.impl=pallas_tpu_interpret",
                            "--config.model.n_heads=8")),
      # optimizer and precision
      ("optim_momentum_zero", b("--config.optim.name=momentum", "--config.optim.momentum=0.0")),
      ("optim_weight_decay_adagrad", b("--config.optim.weight_decay=0.1")),
      ("optim_cosine_no_decay", b("--config.optim.schedule=cosine")),
      ("optim_cosine_decay_below_warmup", b("--config.optim.schedule=cosine",
                                            "--config.optim.warmup=100",
                                            "--config.optim.decay_steps=50")),
      ("precision_loss_scale_init_not_pow2", b("--config.train.loss_scale=dynamic",
                                               "--config.train.loss_scale_init=3.0")),
      ("precision_float16_cpu", b("--config.model.dtype=float16")),
      # train, faults, observability, distribution
      ("train_profile_start_only", b("--config.train.profile_start=5")),
      ("train_profile_steps_only", b("--config.train.profile_steps=5")),
      ("train_init_from_missing", b("--config.train.init_from=nope")),
      ("train_init_from_empty_dir", b("--config.train.init_from={W}")),
      ("train_wandb", b("--config.train.wandb=proj")),
      ("dist_process_id_past_count", b("--config.dist.num_processes=2",
                                       "--config.dist.process_id=3")),
      ("dist_cpu_devices_not_dividing", b("--config.dist.cpu_devices=3")),
      ("dist_coordinator_no_port", b("--config.dist.coordinator=host")),
      ("dist_local_device_ids_bad", b("--config.dist.local_device_ids=a,b")),
      ("dist_fsdp_two_cpu", b("--config.dist.fsdp=2", "--config.dist.cpu_devices=1")),
  ]


def make_cases(tree: str) -> list[dict]:
  """Every leaf of BASE_CONFIG's run config with each bad value of its kind, and _cross_cases."""
  leaves = json.loads(_checked(_child(tree, _LEAVES, [BASE_CONFIG]), "reading the schema"))
  cases = []
  for name, kind, value in leaves:
    kind = {"NoneType": "str"}.get(kind, kind)
    if kind == "list":
      kind = "tuple"
    bads = PATH_BAD_VALUES if name in PATH_LEAVES else BAD_VALUES.get(kind, BAD_VALUES["str"])
    for bad in bads:
      argv = [f"--config={BASE_CONFIG}", "--config.workdir={W}"] + STOP
      if name != "workdir":
        argv.append(f"--config.{name}={bad}")
      else:
        argv[1] = f"--config.workdir={bad}"
      cases.append({"id": f"leaf/{name}={bad}", "leaf": name, "kind": kind, "default": value,
                    "argv": argv})
  cases += [{"id": f"cross/{n}", "argv": a} for n, a in _cross_cases()]
  return cases


# ---- part: messages ------------------------------------------------------------------------------

# One warm interpreter per shard: jax and the libraries imported once, then each case in a fork
# that runs TREE/main.py as __main__ with its own argv, stdout and stderr (a fresh absl flag set
# each time). GLIBC_TUNABLES is set as main.py's one re-execution sets it, so none happens.
_RUNNER = r"""
import json, os, runpy, signal, sys, tempfile, time, traceback
import absl.app, absl.flags, jax, jax.numpy, flax.linen, optax, ml_collections
from ml_collections import config_flags
cases, out_path, tmp = json.load(open(sys.argv[1])), sys.argv[2], sys.argv[3]
timeout = float(sys.argv[4])
results = {}
for case in cases:
  w = os.path.join(tmp, "w" + str(len(results)))
  os.makedirs(w)
  data = os.path.dirname(tmp)  # the data files, beside the shards' folders
  subs = {"{W}": os.path.join(w, "run"), "{DATA_SMALL}": os.path.join(data, "small.txt"),
          "{DATA_LARGE}": os.path.join(data, "large.txt")}
  argv = []
  for a in case["argv"]:
    for k, v in subs.items():
      a = a.replace(k, v)
    argv.append(a)
  so, se = os.path.join(w, "stdout"), os.path.join(w, "stderr")
  pid = os.fork()
  if pid == 0:
    code = 1
    try:
      fo, fe = os.open(so, os.O_WRONLY | os.O_CREAT), os.open(se, os.O_WRONLY | os.O_CREAT)
      os.dup2(fo, 1)
      os.dup2(fe, 2)
      sys.argv = ["main.py"] + argv
      runpy.run_path("main.py", run_name="__main__")
      code = 0
    except SystemExit as e:
      if e.code is None:
        code = 0
      elif isinstance(e.code, int):
        code = e.code
      else:
        print(e.code, file=sys.stderr)
        code = 1
    except BaseException:
      traceback.print_exc()
      code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
  t0 = time.time()
  while True:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
      rc = os.waitstatus_to_exitcode(status)
      break
    if time.time() - t0 > timeout:
      os.kill(pid, signal.SIGKILL)
      os.waitpid(pid, 0)
      rc = "timeout"
      break
    time.sleep(0.05)
  config_json = os.path.join(w, "run", "config.json")
  results[case["id"]] = {"argv": argv, "stdout": open(so, errors="replace").read(),
                         "stderr": open(se, errors="replace").read(), "exit": rc,
                         "config_json": open(config_json).read() if os.path.isfile(config_json)
                         else None, "w": os.path.join(w, "run")}
  print(case["id"], rc, flush=True)
json.dump(results, open(out_path, "w"))
"""


def _write_data_files(tmp: str) -> None:
  """The data files cases name: one too small for a batch, one that holds the smoke run."""
  with open(os.path.join(tmp, "small.txt"), "w") as f:
    f.write("a small file\n" * 20)
  words = ["span", "attention", "adaptive", "memory", "persistent", "sparse", "model", "token"]
  with open(os.path.join(tmp, "large.txt"), "w") as f:
    for i in range(40000):
      f.write(" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(1 + i % 9)) + "\n")


def _top_level(tree: str) -> set[str]:
  return set(os.listdir(tree))


def part_messages(tree: str, out: str, jobs: int, timeout: float, only: str = "") -> dict:
  before = _top_level(tree)
  try:
    return _messages(tree, out, jobs, timeout, only)
  finally:
    made = sorted(_top_level(tree) - before)
    if made:  # a case that wrote a relative path: the capture ran, but the tree needs cleaning
      print(f"warning: the messages' cases made {made} in {tree}", file=sys.stderr)


def _messages(tree: str, out: str, jobs: int, timeout: float, only: str) -> dict:
  cases = json.load(open(CASES_FILE))
  if only:
    cases = [c for c in cases if re.search(only, c["id"])]
  tmp = tempfile.mkdtemp(prefix="proof_msg_")
  try:
    _write_data_files(tmp)
    shards = [cases[i::jobs] for i in range(jobs)]
    env = _env(tree)
    env["GLIBC_TUNABLES"] = "glibc.malloc.hugetlb=1"
    env["SPAN_LM_HUGE_PAGES_EXEC"] = "1"  # as the re-executed process has it

    def run_shard(i):
      d = os.path.join(tmp, f"shard{i}")
      os.makedirs(d)
      json.dump(shards[i], open(os.path.join(d, "cases.json"), "w"))
      res = os.path.join(d, "results.json")
      o = _child(tree, _RUNNER, [os.path.join(d, "cases.json"), res, d, str(timeout)], env=env)
      _checked(o, f"messages shard {i}")
      return json.load(open(res))

    results = {}
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
      for r in pool.map(run_shard, range(len(shards))):
        results.update(r)
    groups: dict[str, list[str]] = {}
    for case in cases:
      r = results[case["id"]]
      norm = lambda s, r=r: _normalize(s.replace(r["w"], "<WORKDIR>"), tree, tmp)
      block = [f"== {case['id']}", "argv: " + norm(" ".join(case["argv"])).strip(),
               f"exit: {r['exit']}"]
      block += ["stdout: " + l for l in norm(r["stdout"]).splitlines() if l]
      block += ["stderr: " + l for l in norm(r["stderr"]).splitlines() if l]
      if r["config_json"] is not None:
        cj = norm(r["config_json"])
        block.append("config.json: sha256 " + hashlib.sha256(cj.encode()).hexdigest()[:16])
        if case["id"].startswith("cross/valid_"):
          block += ["config.json| " + l for l in cj.splitlines()]
      group = case["id"].split("/")[0] + "/" + re.split(r"[=.]", case["id"].split("/", 1)[1])[0]
      groups.setdefault(group, []).append("\n".join(block))
    os.makedirs(os.path.join(out, "messages"), exist_ok=True)
    for group, blocks in groups.items():
      name = group.replace("/", "_") + ".txt"
      with open(os.path.join(out, "messages", name), "w") as f:
        f.write("\n\n".join(blocks) + "\n")
    return {"cases": len(cases), "valid": sum(1 for r in results.values() if r["exit"] == 0),
            "timeouts": sum(1 for r in results.values() if r["exit"] == "timeout")}
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


# ---- part: params --------------------------------------------------------------------------------

_PARAMS = r"""
import dataclasses, glob, importlib, json, os, sys
import jax, jax.numpy as jnp
from span_lm import config as config_lib
from span_lm.model import build_model
from span_lm.model.config import ModelConfig
from span_lm.model import plan as plan_lib, caches as caches_lib
out_dir = sys.argv[1]
names = sorted(os.path.basename(p)[:-3] for p in glob.glob("configs/*.py"))
count = 0
for name in names:
  module = importlib.import_module("configs." + name)
  if not hasattr(module, "get_config"):
    continue
  for variant in [None] + sorted(getattr(module, "VARIANTS", {})):
    path = f"configs/{name}.py" + (f":{variant}" if variant else "")
    lines = []
    try:
      c = config_lib.load_config(path)
      # as the run directory's config.json is written (span_lm/train/loop.py)
      js = (c.to_json_best_effort(indent=2) if hasattr(c, "to_json_best_effort") else
            json.dumps(dataclasses.asdict(c), indent=2, default=str))
      # vocab_size 0 is the dataset's: wikitext-103's word vocabulary, else bytes
      known = 267735 if c.data.dataset == "wikitext103" else 256
      vocab = int(c.model.vocab_size) or known
      lines.append(f"# {path}; vocab_size {vocab}" + (f" (0 in the config: {known} here)"
                                                      if not c.model.vocab_size else ""))
      cfg = ModelConfig.from_config(c.model, vocab_size=vocab)
      plan = plan_lib.full_plan(cfg)
      shapes = jax.eval_shape(lambda: build_model(cfg, plan).init(
          jax.random.key(0), jnp.zeros((1, 1), jnp.int32), caches_lib.init_caches(cfg, plan, 1)))
      total = 0
      for kp, leaf in jax.tree_util.tree_flatten_with_path(shapes)[0]:
        lines.append(f"{jax.tree_util.keystr(kp)} {tuple(leaf.shape)} {leaf.dtype}")
        total += leaf.size
      lines.append(f"# {total} parameters")
    except Exception as e:
      js = None
      lines.append(f"error: {type(e).__name__}: {e}")
    stem = name + (f"__{variant}" if variant else "")
    open(os.path.join(out_dir, stem + ".params.txt"), "w").write("\n".join(lines) + "\n")
    if js is not None:
      open(os.path.join(out_dir, stem + ".config.json"), "w").write(js + "\n")
    count += 1
print(count)
"""


def part_params(tree: str, out: str) -> dict:
  d = os.path.join(out, "params")
  os.makedirs(d, exist_ok=True)
  n = _checked(_child(tree, _PARAMS, [d]), "params").strip().splitlines()[-1]
  for name in os.listdir(d):
    p = os.path.join(d, name)
    text = open(p).read()
    open(p, "w").write(_normalize(text, tree) if name.endswith(".txt") else text)
  return {"configs": int(n)}


# ---- part: jaxprs --------------------------------------------------------------------------------

SPAN_IMPLS = ("reference", "cpu", "pallas_interpret", "pallas_tpu_interpret")
SPARSE_IMPLS = ("jnp", "dense", "splash_interpret", "pallas_interpret")
_SMALL = {"model.n_layers": 2, "model.d_model": 64, "model.n_heads": 2, "model.d_ff": 128,
          "data.block": 64}
_SMALL_SPAN = dict(_SMALL, **{"model.span.size": 128, "model.attention.block": 32})
_SMALL_SPARSE = dict(_SMALL, **{"model.sparse.context": 64, "model.sparse.stride": 16,
                                "model.sparse.c": 4, "model.attention.block": 32})
# name -> (config, overrides, "span" | "sparse"): the paper's kinds of model, shrunk.
JAXPR_MODELS = {
    "tiny_adaptive": ("configs/tiny.py", _SMALL_SPAN, "span"),
    "enwik8_adaptive": ("configs/enwik8.py", _SMALL_SPAN, "span"),
    "tiny_fixed": ("configs/tiny.py:fixed", _SMALL_SPAN, "span"),
    "tiny_dynamic": ("configs/tiny.py", dict(_SMALL_SPAN, **{"model.span.mode": "dynamic"}),
                     "span"),
    "enwik8_pers": ("configs/enwik8_pers.py", dict(_SMALL_SPAN, **{"model.pers_mem": 32}),
                    "span"),
    "enwik8_sparse_fixed": ("configs/enwik8_sparse_fixed.py", _SMALL_SPARSE, "sparse"),
    "cifar10_sparse": ("configs/cifar10_sparse.py:smoke", {}, "sparse"),
}

_JAXPRS = r"""
import json, os, sys
import jax, jax.numpy as jnp
from span_lm import config as config_lib
from span_lm.model import build_model
from span_lm.model.config import ModelConfig
from span_lm.model import plan as plan_lib, caches as caches_lib
jobs, out_dir = json.loads(sys.argv[1]), sys.argv[2]
for name, path, overrides in jobs:
  try:
    c = config_lib.load_config(path, overrides)
    vocab = int(c.model.vocab_size) or 256
    cfg = ModelConfig.from_config(c.model, vocab_size=vocab)
    plan = plan_lib.full_plan(cfg)
    model = build_model(cfg, plan)
    b, m = 2, int(c.data.block)
    caches = caches_lib.init_caches(cfg, plan, b)
    x = (jnp.arange(b * m, dtype=jnp.int32).reshape(b, m) * 7) % vocab
    y = (x + 1) % vocab
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), x[:1, :1],
                                               caches_lib.init_caches(cfg, plan, 1)))["params"]
    def loss(params, x, y, caches, key):
      logp, _, aux = model.apply({"params": params}, x, caches, train=True, rngs={"dropout": key})
      ll = jnp.take_along_axis(logp, y[..., None], axis=-1)[..., 0]
      return -jnp.mean(ll) + aux["span_loss"]
    args = (params, x, y, caches, jax.random.key(1))
    text = str(jax.make_jaxpr(loss)(*args))
    grad = str(jax.make_jaxpr(jax.grad(loss))(*args))
  except Exception as e:
    text = grad = f"error: {type(e).__name__}: {e}\n"
  open(os.path.join(out_dir, name + ".loss.jaxpr"), "w").write(text + "\n")
  open(os.path.join(out_dir, name + ".grad.jaxpr"), "w").write(grad + "\n")
  print(name, len(text), len(grad), flush=True)
"""


def jaxpr_jobs() -> list[tuple[str, str, dict]]:
  jobs = []
  for name, (path, overrides, kind) in JAXPR_MODELS.items():
    field = "model.attention.impl" if kind == "span" else "model.sparse.impl"
    for impl in SPAN_IMPLS if kind == "span" else SPARSE_IMPLS:
      jobs.append((f"{name}__{impl}", path, dict(overrides, **{field: impl})))
  return jobs


def part_jaxprs(tree: str, out: str, jobs: int) -> dict:
  d = os.path.join(out, "jaxprs")
  os.makedirs(d, exist_ok=True)
  todo = jaxpr_jobs()
  shards = [todo[i::jobs] for i in range(jobs)]
  with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
    for o in pool.map(lambda s: _child(tree, _JAXPRS, [json.dumps(s), d]), shards):
      _checked(o, "jaxprs")
  errors = 0
  for name in sorted(os.listdir(d)):
    p = os.path.join(d, name)
    text = _normalize(open(p).read(), tree)
    errors += text.startswith("error:")
    open(p, "w").write(text)
  return {"cases": len(todo), "files": 2 * len(todo), "errors": errors // 2}


# ---- part: hlo -----------------------------------------------------------------------------------


def part_hlo(tree: str, out: str) -> dict:
  d = os.path.join(out, "hlo")
  cmd = ["nice", "-n", "19", sys.executable, "-m", "bench.hlo_fingerprint", "--tree",
         os.path.abspath(tree), "--out", d]
  env = dict(os.environ, PYTHONPATH=REPO)
  env.pop("XLA_FLAGS", None)
  o = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=False)
  text = _checked(o, "hlo_fingerprint")
  with open(os.path.join(d, "hashes.txt"), "w") as f:
    f.write(text)
  return {"cases": len(text.splitlines())}


# ---- part: compile -------------------------------------------------------------------------------


def _sorted_kernels(text: str) -> str:
  """The report with each target's GPU kernels in one order (by name; ptxas logs them as its
  threads finish, so two compiles of one program list them differently): the JSON's 'kernels'
  lists sorted, the markdown's kernel table rows sorted."""
  try:
    report = json.loads(text)
  except ValueError:  # the markdown: sort the rows of its GPU kernel table
    blocks = text.split("\n\n")
    for i, b in enumerate(blocks):
      if b.startswith("| target | kernel | arch |"):
        lines = b.rstrip("\n").split("\n")
        blocks[i] = "\n".join(lines[:2] + sorted(lines[2:])) + b[len(b.rstrip("\n")):]
    return "\n\n".join(blocks)
  for row in report.get("rows", []):
    if "kernels" in row:
      row["kernels"] = sorted(row["kernels"], key=lambda k: json.dumps(k, sort_keys=True))
  return json.dumps(report, indent=1)


def _strip_report(text: str, tree: str, workdir: str) -> str:
  """A compile report (span_lm/tools/compile.py) without its timings and paths: the seconds of
  each compile, target and report in the JSON, the markdown's 'compile s' column; its GPU
  kernels in one order."""
  text = _sorted_kernels(text.replace(workdir, "<WORKDIR>"))
  text = re.sub(r'"(compile_s|total_s|wall_s)": [0-9.eE+-]+', r'"\1": "<time>"', text)
  text = re.sub(r"^(\|.*\| (train|eval) \|.*\| )\d+ \|$", r"\1<time> |", text, flags=re.M)
  return _normalize(text, tree)


def _compile_one(tree: str, d: str, python: str, c: str) -> dict:
  """One config's compile report into d/CONFIG.txt (as .ci/compile_paper_configs runs it)."""
  targets = "h100:8" if c in FIRST_TARGET_ONLY else "h100:8,v5p:2x2x2"
  w = tempfile.mkdtemp(prefix=f"proof_compile_{c}_")
  try:
    t0 = time.time()
    cmd = ["nice", "-n", "19", python, "main.py", f"--config=configs/{c}.py",
           "--config.mode=compile", f"--config.compile.targets={targets}",
           "--config.compile.steps=train", f"--config.workdir={w}"]
    o = subprocess.run(cmd, cwd=tree, env=_env(tree), capture_output=True, text=True,
                       check=False)
    files = sorted(os.listdir(w))
    with open(os.path.join(d, f"{c}.txt"), "w") as f:
      f.write(f"exit: {o.returncode}\n")
      for name in files:  # a failed target's .log (a traceback): named only
        text = ("" if name.endswith(".log") or not os.path.isfile(os.path.join(w, name)) else
                _strip_report(open(os.path.join(w, name)).read(), tree, w))
        f.write(f"== {name}\n" + text)
      if o.returncode:
        f.write("stderr tail:\n" + _normalize(o.stderr[-3000:].replace(w, "<WORKDIR>"), tree))
    r = {"exit": o.returncode, "files": files, "s": round(time.time() - t0)}
    print(f"compile {c}: {r}", flush=True)
    return r
  finally:
    shutil.rmtree(w, ignore_errors=True)


def part_compile(tree: str, out: str, python: str, configs: list[str], jobs: int) -> dict:
  """The configs' reports, `jobs` at a time (CI: two); other configs' files in the folder stay,
  so that it runs config by config."""
  d = os.path.join(out, "compile")
  os.makedirs(d, exist_ok=True)
  with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
    return dict(zip(configs, pool.map(lambda c: _compile_one(tree, d, python, c), configs)))


# ---- main ----------------------------------------------------------------------------------------


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--tree", default=REPO, help="the source tree to capture")
  p.add_argument("--out", help="the capture's folder (made; parts in it are replaced)")
  p.add_argument("--parts", nargs="+", default=list(DEFAULT_PARTS),
                 choices=list(DEFAULT_PARTS) + ["compile"])
  p.add_argument("--make-cases", action="store_true",
                 help=f"write {os.path.relpath(CASES_FILE, REPO)} from --tree's schema, and stop")
  p.add_argument("--only", default="", help="messages: only the cases whose id matches this regex")
  p.add_argument("--jobs", type=int, default=2, help="child processes at once")
  p.add_argument("--timeout", type=float, default=120.0, help="messages: seconds per case")
  p.add_argument("--python", default=sys.executable,
                 help="compile: a python with libtpu and the CUDA plugin (.venv-tpu)")
  p.add_argument("--configs", nargs="+", default=list(PAPER_CONFIGS), help="compile: configs")
  args = p.parse_args()
  tree = os.path.abspath(args.tree)
  if args.make_cases:
    cases = make_cases(tree)
    with open(CASES_FILE, "w") as f:
      json.dump(cases, f, indent=1)
      f.write("\n")
    print(f"{len(cases)} cases -> {CASES_FILE}")
    return
  if not args.out:
    p.error("--out is required")
  os.makedirs(args.out, exist_ok=True)
  summary = {}
  for part in args.parts:
    if part != "compile":  # compile runs config by config (--configs)
      shutil.rmtree(os.path.join(args.out, part), ignore_errors=True)
    t0 = time.time()
    if part == "messages":
      r = part_messages(tree, args.out, args.jobs, args.timeout, args.only)
    elif part == "params":
      r = part_params(tree, args.out)
    elif part == "jaxprs":
      r = part_jaxprs(tree, args.out, args.jobs)
    elif part == "hlo":
      r = part_hlo(tree, args.out)
    else:
      r = part_compile(tree, args.out, args.python, args.configs, args.jobs)
    summary[part] = dict(r, seconds=round(time.time() - t0))
    print(f"{part}: {json.dumps(summary[part])}", flush=True)
  # timings vary, so they are reported here and kept out of the capture
  print(json.dumps(summary, indent=1))


if __name__ == "__main__":
  main()

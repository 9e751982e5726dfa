"""train/cpu_host.py: the CPU host split into devices, and keep_freed_memory (a step's large
temporaries reused, not faulted back in)."""
import json
import os
import subprocess
import sys

import pytest

import synthetic_run
from span_lm import config as config_lib
from span_lm.train import cpu_host

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Modes: keep (cpu_host.keep_freed_memory called directly), system (glibc defaults), run_on /
# run_off (what main.py does: loop.Run with config.dist.cpu_keep_freed_memory True / False, in a
# fresh process).
# Then each call of a jitted function writes a 16 MiB temporary (a dot's output, read by a dot),
# below the 32 MiB above which chunks are mmap'd (and returned) either way.
SCRIPT = r"""
import json, resource, sys
from span_lm.train import cpu_host
mode = sys.argv[1]
kept = cpu_host.keep_freed_memory()[0] if mode == "keep" else mode == "run_on"
if mode.startswith("run_"):
  import synthetic_run
  from span_lm import config as config_lib
  from span_lm.train import loop
  ov = dict(synthetic_run.SMALL, workdir=sys.argv[2],
            **{"dist.cpu_keep_freed_memory": mode == "run_on"})
  loop.Run(config_lib.load_config("configs/tiny.py:smoke", ov))
import jax, jax.numpy as jnp, numpy as np
a = jnp.asarray(np.random.default_rng(0).standard_normal((8192, 8)), jnp.float32)
b = jnp.asarray(np.random.default_rng(1).standard_normal((8, 512)), jnp.float32)
f = jax.jit(lambda a, b: (a @ b).T @ a)
for _ in range(5):
  out = np.asarray(f(a, b))
faults = []  # per call: with the settings the heap still grows now and then (fragmentation)
for _ in range(20):
  r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  out = np.asarray(f(a, b))
  faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0)
print("RESULT " + json.dumps({"kept": kept, "faults": sorted(faults)[10],
                              "out": out[:4, 0].tolist()}))
"""


def _run(mode, workdir=""):
  path = os.pathsep.join([REPO, os.path.join(REPO, "tests"), os.environ.get("PYTHONPATH", "")])
  env = dict(os.environ, PYTHONPATH=path, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)  # as a CPU training run
  out = subprocess.run([sys.executable, "-c", SCRIPT, mode, workdir], env=env, capture_output=True,
                       text=True, timeout=300, check=True, cwd=REPO)
  return json.loads(out.stdout.split("RESULT ")[-1])


@pytest.mark.skipif(cpu_host._glibc() is None, reason="needs glibc (Linux)")  # pylint: disable=protected-access
def test_buffers_are_reused_not_faulted_in():
  kept, system = _run("keep"), _run("system")
  assert kept["kept"] and not system["kept"]
  assert kept["out"] == system["out"]  # same results
  # 16 MiB is 4096 pages: with the settings a typical (median) call reuses earlier pages.
  assert kept["faults"] < 1000, kept
  if system["faults"] > 3000:  # this glibc faults the buffer in on every call by default
    assert kept["faults"] < system["faults"] / 20, (kept, system)


@pytest.mark.skipif(cpu_host._glibc() is None, reason="needs glibc (Linux)")  # pylint: disable=protected-access
def test_training_run_applies_it_on_cpu_unless_configured_off(tmp_path):
  on, off = _run("run_on", str(tmp_path / "on")), _run("run_off", str(tmp_path / "off"))
  assert on["out"] == off["out"]
  assert on["faults"] < 1000, on
  if off["faults"] > 3000:
    assert on["faults"] < off["faults"] / 20, (on, off)


def test_backend_started_is_false_until_jax_starts():
  """Run applies the settings only in a fresh process (not in a notebook or a test session)."""
  code = ("from span_lm.train import cpu_host as d; a = d.backend_started(); import jax; "
          "jax.devices(); print('RESULT', a, d.backend_started())")
  env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
             JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=300, check=True)
  assert out.stdout.split("RESULT")[-1].split() == ["False", "True"]


# Freed large buffers interleaved with small live ones, as a step's temporaries: a heap that
# serves every size (no mmap) keeps the holes resident, so its peak exceeds glibc's defaults.
PEAK_SCRIPT = r"""
import json, resource, sys
from span_lm.train import cpu_host
if sys.argv[1] == "keep":
  assert cpu_host.keep_freed_memory()[0]
import numpy as np
live = []
for mib in (40, 80, 120, 40, 80, 120):
  big = np.ones(mib << 18, np.float32)  # mib MiB, every page touched
  live.append(np.ones(1 << 14, np.float32))  # 64 KiB that outlives it
  del big
print("RESULT " + json.dumps({"maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


@pytest.mark.skipif(cpu_host._glibc() is None, reason="needs glibc (Linux)")  # pylint: disable=protected-access
def test_peak_resident_memory_is_not_raised():
  peak = {}
  for mode in ("keep", "system"):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, mode], env=env, capture_output=True,
                         text=True, timeout=120, check=True, cwd=REPO)
    peak[mode] = json.loads(out.stdout.split("RESULT ")[-1])["maxrss_mib"]
  # glibc's defaults: the interpreter and numpy (~30-60 MiB) plus the largest buffer (120 MiB).
  assert peak["keep"] <= peak["system"] + 8, peak


def test_choose_cpu_devices():
  assert cpu_host.choose_cpu_devices(0, 2, (16, 8)) == 2
  assert cpu_host.choose_cpu_devices(0, 16, (64, 8)) == 8  # the most that divide every batch
  assert cpu_host.choose_cpu_devices(0, 64, (64, 64)) == cpu_host.AUTO_MAX_CPU_DEVICES
  assert cpu_host.choose_cpu_devices(0, 6, (12, 6)) == 6
  assert cpu_host.choose_cpu_devices(0, 4, (6, 3)) == 3
  assert cpu_host.choose_cpu_devices(0, 8, (7, 8)) == 1
  assert cpu_host.choose_cpu_devices(4, 2, (16, 8)) == 4  # an explicit request stands


def test_setup_cpu_devices_decisions():
  cfg = config_lib.load_config("configs/tiny.py:smoke",
                               dict(synthetic_run.SMALL, workdir="/tmp/unused"))
  n, why = cpu_host.setup_cpu_devices(cfg, {"XLA_FLAGS": "--xla_force_host_platform_device_count=3"})
  assert n is None and "XLA_FLAGS" in why
  n, why = cpu_host.setup_cpu_devices(cfg, {"JAX_PLATFORMS": "cuda"})
  assert n is None and "accelerator" in why
  n, why = cpu_host.setup_cpu_devices(cfg, {"JAX_PLATFORMS": "cpu", "JAX_COORDINATOR_ADDRESS": "h:1"})
  assert n is None and "multi-process" in why
  cfg.dist.cpu_devices = 1
  assert cpu_host.setup_cpu_devices(cfg, {"JAX_PLATFORMS": "cpu"})[0] is None
  cfg.dist.cpu_devices = 0
  cfg.model.dtype = "bfloat16"
  n, why = cpu_host.setup_cpu_devices(cfg, {"JAX_PLATFORMS": "cpu"})
  assert n is None and "one device for bfloat16" in why
  assert cpu_host.keeps_one_cpu_device(cfg)
  cfg.model.arch = "sparse"  # its matmuls are plain einsums: one device per core still
  assert not cpu_host.keeps_one_cpu_device(cfg)
  cfg.model.arch = "span"
  cfg.model.dtype = "float32"
  cfg.dist.cpu_devices = 2  # this process's backend is running: its devices are kept
  import jax  # pylint: disable=g-import-not-at-top
  jax.devices()
  n, why = cpu_host.setup_cpu_devices(cfg, {"JAX_PLATFORMS": "cpu"})
  assert n is None and "already" in why and jax.device_count() == 8


def test_huge_pages_env_adds_the_tunable_and_keeps_the_users():
  if cpu_host.huge_pages_env({}) is None:
    pytest.skip("not glibc, or the kernel's transparent huge pages are off")
  assert cpu_host.huge_pages_env({})["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
  env = cpu_host.huge_pages_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "A": "1"})
  assert env == {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1", "A": "1"}
  assert cpu_host.huge_pages_env({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}) is None  # theirs


# A jitted function whose 64 MiB temporary (above the 32 MiB mmap threshold: a fresh mmap every
# call) is written by one dot and read by another, as a training step's large temporaries.
FAULTS_SCRIPT = r"""
import json, os, resource
import jax, jax.numpy as jnp, numpy as np
a = jnp.asarray(np.random.default_rng(0).standard_normal((16384, 8)), jnp.float32)
b = jnp.asarray(np.random.default_rng(1).standard_normal((8, 1024)), jnp.float32)
f = jax.jit(lambda a, b: (a @ b).T @ a)
for _ in range(3):
  out = np.asarray(f(a, b))
faults = []
for _ in range(10):
  r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  out = np.asarray(f(a, b))
  faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0)
print("RESULT " + json.dumps({"faults": sorted(faults)[5], "out": out[:4, 0].tolist(),
                              "tunables": os.environ.get("GLIBC_TUNABLES", "")}))
"""


def test_huge_pages_fault_a_large_temporary_in_with_a_fraction_of_the_faults():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  env.pop("GLIBC_TUNABLES", None)
  huge = cpu_host.huge_pages_env(env)
  if huge is None:
    pytest.skip("not glibc, or the kernel's transparent huge pages are off")
  results = {}
  for name, e in (("system", env), ("huge", huge)):
    out = subprocess.run([sys.executable, "-c", FAULTS_SCRIPT], env=e, capture_output=True,
                         text=True, timeout=300, check=True, cwd=REPO)
    results[name] = json.loads(out.stdout.split("RESULT ")[-1])
  system, huge = results["system"], results["huge"]
  assert huge["tunables"] == "glibc.malloc.hugetlb=1" and system["tunables"] == ""
  assert huge["out"] == system["out"]
  assert huge["faults"] < 2000, huge  # 64 MiB in 2 MiB pages: 32 faults (40 measured)
  with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
    madvise = "[madvise]" in f.read()
  if madvise:  # no huge pages unless asked for: 64 MiB in 4 KiB pages, 16,384 faults
    assert system["faults"] > 8000 and huge["faults"] < system["faults"] / 4, (huge, system)


def _main_lines(tmp_path, *flags):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
  env.pop("GLIBC_TUNABLES", None)
  proc = subprocess.run([sys.executable, "main.py", "--config=configs/tiny.py:smoke",
                         f"--config.workdir={tmp_path}", "--config.train.steps=1",
                         "--config.train.full_eval_at_end=False", "--config.train.tensorboard=False",
                         *flags], env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc.stdout


@pytest.mark.slow
def test_main_reexecutes_itself_with_huge_pages_unless_configured_off(tmp_path):
  if cpu_host.huge_pages_env({}) is None:
    pytest.skip("not glibc, or the kernel's transparent huge pages are off")
  line = "CPU host: malloc with transparent huge pages (glibc.malloc.hugetlb=1)"
  assert line in _main_lines(tmp_path / "on")
  assert line not in _main_lines(tmp_path / "off", "--config.dist.cpu_huge_pages=False")

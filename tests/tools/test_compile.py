"""The compile mode (span_lm/tools/compile.py) and the per-chip facts it reads (kernels/chips.py).

Without the toolchains (CI's main environment) the mode must say in one line what to install;
with them (`pytest -m compile`, run by .ci/run in a second environment that has libtpu, and by
hand where the CUDA plugin is installed) it compiles a small config for real, deviceless."""
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from model_helpers import build, replaced
from span_lm import kernels
from span_lm.kernels import chips
from span_lm.kernels.span import cost as kernel_cost
from span_lm.kernels.span import gpu_tiles
from span_lm.kernels import target as target_lib
from span_lm.tools import compile as compile_lib

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HAS_TPU = importlib.util.find_spec("libtpu") is not None
HAS_CUDA = any(importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin"))

# ptxas -v as XLA logs it (TF_CPP_VMODULE=subprocess_compilation=2), two kernels interleaved
# with XLA's own log lines, as a real deviceless A100 compile printed them.
PTXAS_LOG = """\
I1126 14:26:48.948611   13247 subprocess_compilation.cc:356] ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'span_attention_fwd' for 'sm_80'
ptxas info    : Function properties for span_attention_fwd
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 128 registers, used 1 barriers, 448 bytes cmem[0]
I1126 14:26:48.985025   13248 subprocess_compilation.cc:182] Looking for ptxas
I1126 14:26:58.507807   13248 subprocess_compilation.cc:349] ptxas warning : Registers are spilled
ptxas info    : Compiling entry function 'span_attention_bwd_q' for 'sm_80'
ptxas info    : Function properties for span_attention_bwd_q
    6664 bytes stack frame, 9360 bytes spill stores, 9644 bytes spill loads
ptxas info    : Used 32 registers, used 1 barriers, 6664 bytes cumulative stack size, 520 bytes cmem[0]
ptxas info    : Compiling entry function 'fusion_3' for 'sm_80'
ptxas info    : Used 40 registers, used 1 barriers, 4096 bytes smem, 368 bytes cmem[0]
"""


def test_parse_ptxas_reads_every_kernel():
  ks = compile_lib.parse_ptxas(PTXAS_LOG)
  assert [k["kernel"] for k in ks] == ["span_attention_fwd", "span_attention_bwd_q", "fusion_3"]
  assert ks[0] == dict(kernel="span_attention_fwd", arch="sm_80", registers=128, spill_store=0,
                       spill_load=0, stack=0, smem=0)
  assert (ks[1]["registers"], ks[1]["spill_store"], ks[1]["spill_load"]) == (32, 9360, 9644)
  assert ks[2]["smem"] == 4096


# One kernel's PTX as jax 0.12 writes it (`ld.param::entry.b64`; jax 0.10.2 writes
# `ld.param.u64`): parameter 0 read by a plain load and by an asynchronous copy, parameter 1
# written, parameter 2 read and written (a read-back).
_PTX_SNIPPET = """
.visible .entry span_attention_fwd(
	.param .u64 .ptr .align 32 span_attention_fwd_param_0,
	.param .u64 .ptr .align 32 span_attention_fwd_param_1,
	.param .u64 .ptr .align 32 span_attention_fwd_param_2
)
{
	ld.param{kind} 	%rd41, [span_attention_fwd_param_0];
	ld.param{kind} 	%rd43, [span_attention_fwd_param_1];
	ld.param{kind} 	%rd44, [span_attention_fwd_param_2];
	cvta.to.global.u64 	%rd42, %rd41;
	mul.wide.s32 	%rd54, %r95, 2;
	add.s64 	%rd24, %rd42, %rd54;
	ld.global.v4.b32 { %r46, %r47, %r48, %r49 }, [ %rd24 + 0 ];
	cp.async.cg.shared.global [ %r73 + 0 ], [ %rd24 + 0 ], 0x10, %p1;
	cvta.to.global.u64 	%rd60, %rd43;
	@%p2 st.global.b32 [ %rd60 + 0 ], { %r46 };
	cvta.to.global.u64 	%rd61, %rd44;
	ld.global.b32 { %r50 }, [ %rd61 + 0 ];
	st.global.b32 [ %rd61 + 0 ], { %r50 };
	ret;
}
"""


@pytest.mark.parametrize("kind", [".u64", "::entry.b64"])
def test_ptx_reader_follows_addresses_to_parameters_on_both_jax_lines(kind):
  """tools/ptx.py (the compile mode's GPU-kernel facts, the PTX tests' read-back check) traces
  every global address to the kernel parameter it derives from, in either line's PTX dialect:
  jax 0.12's `ld.param::entry` left all 42 of the forward kernel's addresses unresolved."""
  from span_lm.tools import ptx  # pylint: disable=g-import-not-at-top
  f = ptx.kernel_facts(_PTX_SNIPPET.replace("{kind}", kind))
  assert (f["kernel"], f["unresolved"]) == ("span_attention_fwd", 0), f
  assert (f["reads"], f["reads_async"], f["writes"]) == ([0, 2], [0], [1, 2]), f
  assert f["read_back"] == [2] and f["cp_async"] == 1, f


def test_targets_parse_and_bad_names_are_one_line():
  t = compile_lib.parse_target("h100")
  assert (t.chip.name, t.topology, t.chips) == ("h100", "1x1x8", 8)
  assert compile_lib.parse_target("a100:4").chip.name == "a100_80"
  assert compile_lib.parse_target("v5p").topology == "v5p:2x2x2"
  assert compile_lib.parse_target("v5e:4x4").chips == 16
  with pytest.raises(ValueError, match="unknown chip 'b9000'"):
    compile_lib.parse_target("b9000")
  with pytest.raises(ValueError, match="topology"):
    compile_lib.parse_target("v5p:2xx2")
  with pytest.raises(ValueError, match="empty"):
    compile_lib.parse_targets(" , ")


def test_gpu_target_config_describes_the_chip():
  text = chips.gpu_target_config(chips.get("a100_80"))
  assert "core_count: 108" in text and "shared_memory_per_block_optin: 166912" in text
  assert "major: 8 minor: 0" in text and 'platform_name: "CUDA"' in text
  assert "ACCELERATED_FEATURES" in chips.gpu_target_config(chips.get("h100"))  # sm_90a
  with pytest.raises(ValueError):
    chips.gpu_target_config(chips.get("v5p"))


def test_one_table_of_peaks_for_the_gpu_suite_and_the_rooflines():
  assert chips.peak_tflops("NVIDIA H100 80GB HBM3")["bfloat16"] == pytest.approx(989.4)
  assert chips.peak_tflops("NVIDIA H100 PCIe")["matched"] == "h100_pcie"
  assert chips.peak_tflops("NVIDIA A100-SXM4-40GB")["matched"] == "a100_40"
  assert chips.peak_tflops("Tesla V100-SXM2-16GB")["float32"] == pytest.approx(15.7)
  assert chips.peak_tflops("cpu") is None
  rf = compile_lib.roofline(chips.get("v5p"), "bfloat16", 2, 459e12, {"bytes": 2.765e12}, 2,
                            1000)
  # v5p devices here are TensorCores (2 per chip): half the chip's peak and bandwidth each.
  assert rf["compute_s"] == pytest.approx(2.0) and rf["hbm_s"] == pytest.approx(4.0)
  assert rf["bound"] == "hbm" and rf["tokens_per_s"] == pytest.approx(250)


def test_fused_kernel_tiles_per_target_fit_the_block():
  assert gpu_tiles.tiles(None, 64, "float32", 64) == (64, 4, 2)  # interpret mode: the block
  for cc in (8.0, 9.0):
    for dh in (64, 96):
      for dtype in ("bfloat16", "float32"):
        tile, warps, stages = gpu_tiles.tiles(cc, dh, dtype, 64)
        # 64-row tiles in bf16 (float32 on the A100: 32, registers), pipelined, key tiles dividing
        assert tile == (64 if dtype == "bfloat16" or cc >= 9 else 32), (cc, dh, dtype)
        assert warps in (4, 8) and stages >= 2
        assert tile % gpu_tiles.key_tile(cc, dh, dtype, tile) == 0
  assert gpu_tiles.tiles(9.0, 64, "bfloat16", 16)[0] == 16  # never above attn_block


def test_gpu_kernel_roofline_counts_the_visited_tiles():
  """The fused GPU kernels' schedule cost (the compile mode's per-kernel roofline): forward FLOPs
  equal an independent count of the (query block, key block) tiles with a visited distance, a
  learned span costs less than the full one, and the byte interval is ordered."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  b, h, m, w, dh, t = 2, 4, 256, 1024, 64, 32
  for span, win in ((None, w), (100.0, 100 + 32 + 1)):
    cost = kernel_cost.schedule_cost(b, h, m, w, dh, "bfloat16", t, span=span, ramp=32)
    tiles = 0
    for i0 in range(0, m, t):
      for t0 in range(0, w + m, t):
        dist = w + np.arange(i0, i0 + t)[:, None] - np.arange(t0, t0 + t)[None, :]
        tiles += bool(((dist >= 1) & (dist <= win)).any())
    assert cost["fwd"]["flops"] == b * h * tiles * 2 * 2 * t * t * dh  # q k^T and p v
    assert cost["position"]["flops"] == 4 * 2 * b * h * m * (w + 1) * dh  # four XLA matmuls
    assert all(c["bytes_min"] <= c["bytes"] for c in cost.values())
  cfg = build({"vocab_size": 11, "d_model": 512, "n_heads": 8, "span.size": 8192,
               "span.mode": "adaptive", "dtype": "bfloat16"})
  with target_lib.compiling_for("cuda", 9.0):
    rows = compile_lib.kernel_roofline(
        chips.get("h100"), cfg,
        lambda span: kernels.IMPLS["pallas"].schedule_cost(cfg.attn_spec, 8, 512, 8192, span))
  assert [(r["spans"], r["kernel"]) for r in rows][:4] == [
      ("span 8192", "fwd"), ("span 8192", "bwd_q"), ("span 8192", "bwd_kv"),
      ("span 8192", "position")]
  assert len(rows) == 8 and rows[4]["flops"] < rows[0]["flops"] / 10
  assert rows[7]["flops"] == rows[3]["flops"]  # the position matmuls span the whole window
  assert all(r["bound"] in ("compute", "HBM", "either") for r in rows)
  assert kernels.IMPLS["reference"].schedule_cost(cfg.attn_spec, 8, 512, 8192, None) is None


def test_steps_lift_ptxas_register_cap_only_where_the_fused_gpu_kernel_runs():
  """ptxas' occupancy floor (docs/kernels.md, the 32-register cap) for a GPU step with the fused
  kernel; nothing for the reference path, the CPU or a TPU."""
  cfg = build({"vocab_size": 11, "d_model": 128, "n_heads": 2, "span.size": 128,
               "attention.block": 64, "plan.granularity": 64})
  with target_lib.compiling_for("cuda", 8.0):
    with_impl = lambda impl: replaced(cfg, **{"attention.impl": impl}).attn_spec
    assert kernels.compiler_options(with_impl("pallas")) == {
        "xla_gpu_ptx_compiler_extra_flags": "--minnctapersm=1"}
    assert kernels.compiler_options(with_impl("reference")) == {}
    # auto: the XLA path while the kernel is untimed
    assert kernels.compiler_options(cfg.attn_spec) == {}
  with target_lib.compiling_for("gpu", 7.0):  # V100: the reference path
    assert kernels.compiler_options(cfg.attn_spec) == {}
  with target_lib.compiling_for("tpu", kind="TPU v5"):
    assert kernels.compiler_options(cfg.attn_spec) == {}
  assert kernels.compiler_options(cfg.attn_spec) == {}


@pytest.mark.skipif(HAS_TPU and HAS_CUDA, reason="both toolchains installed")
def test_missing_toolchain_is_one_line(tmp_path):
  target = "v5p:2x2x2" if not HAS_TPU else "h100:1"
  r = subprocess.run([sys.executable, "main.py", "--config=configs/tiny.py",
                      "--config.mode=compile", f"--config.compile.targets={target}",
                      f"--config.compile.out={tmp_path}"], cwd=REPO, capture_output=True,
                     text=True, timeout=300, check=False)
  assert r.returncode == 1, r.stderr
  lines = [l for l in r.stderr.splitlines() if l.strip()]
  assert len(lines) == 1 and "pip install" in lines[0] and "jax[" in lines[0], r.stderr


@pytest.mark.compile
@pytest.mark.skipif(not HAS_TPU, reason="needs libtpu: pip install -e .[tpu-compile]")
def test_compile_mode_for_a_tpu_topology(tmp_path):
  """The real train and eval steps of a small config compiled for a v5e-4, no TPU here."""
  r = subprocess.run([sys.executable, "main.py", "--config=configs/tiny.py",
                      "--config.mode=compile", "--config.compile.targets=v5e:2x2",
                      "--config.model.dtype=bfloat16", f"--config.compile.out={tmp_path}"],
                     cwd=REPO, capture_output=True, text=True, timeout=900, check=False)
  assert r.returncode == 0, r.stdout + r.stderr
  report = json.load(open(tmp_path / "compile_report.json"))
  row = report["rows"][0]
  # tiny has no dropout or persistent memory: the fused Mosaic kernel runs its attention
  assert row["platform"] == "tpu" and row["devices"] == 4 and row["attention"] == "pallas_tpu"
  for kind in ("train", "eval"):
    step = row[kind]
    assert step["compiled"] and step["memory"]["fits"], step
    assert 0 < step["memory"]["peak"] < 16 * 2**30
    assert step["xla"]["flops"] > 0 and step["roofline"]["tokens_per_s"] > 0
  assert "| v5e:2x2 | 4 | pallas_tpu | train | yes |" in open(tmp_path / "compile_report.md").read()


@pytest.mark.compile
@pytest.mark.skipif(not HAS_TPU, reason="needs libtpu: pip install -e .[tpu-compile]")
def test_layer_scan_bytes_are_scaled_to_an_upper_bound(tmp_path):
  """XLA's cost analysis counts a loop body once: with the sparse model's layer scan, its FLOPs
  fall to about one layer's. The compile mode scales the step's bytes by the scan length, which
  must bound the unrolled step's bytes from above (the roofline never looks faster than it is)."""
  got = {}
  for scan in (False, True):
    out = tmp_path / str(scan)
    r = subprocess.run([sys.executable, "main.py", "--config=configs/cifar10_sparse.py:smoke",
                        "--config.mode=compile", "--config.compile.targets=v5e:2x2",
                        "--config.model.n_layers=4", f"--config.model.sparse.scan_layers={scan}",
                        "--config.data.batch=4", "--config.data.eval_batch=4",
                        "--config.compile.steps=train", f"--config.compile.out={out}"],
                       cwd=REPO, capture_output=True, text=True, timeout=900, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    row = json.load(open(out / "compile_report.json"))["rows"][0]
    assert row["attention"] == "sparse splash", row  # what the sparse layers run on the TPU
    got[scan] = row["train"]
  unrolled, scanned = got[False], got[True]
  assert scanned["xla"]["loop_scale"] == 4 and unrolled["xla"]["loop_scale"] == 1
  assert scanned["xla"]["flops"] < 0.6 * unrolled["xla"]["flops"]  # the body, counted once
  assert scanned["matmul_flops"] == unrolled["matmul_flops"]  # ours counts every layer
  assert 4 * scanned["xla"]["bytes"] >= unrolled["xla"]["bytes"]
  assert scanned["roofline"]["hbm_s"] >= unrolled["roofline"]["hbm_s"]


@pytest.mark.compile
@pytest.mark.skipif(not HAS_CUDA, reason="needs the CUDA plugin: pip install -e .[gpu-compile]")
def test_compile_mode_for_an_h100(tmp_path):
  """A bf16 model with the fused kernel compiled for one H100: ptxas' report of our kernels and
  what their PTX does; `auto` there is the XLA path (the kernel is untimed), and says why."""
  r = subprocess.run([sys.executable, "main.py", "--config=configs/tiny.py",
                      "--config.mode=compile", "--config.compile.targets=h100:1",
                      "--config.model.dtype=bfloat16", "--config.compile.steps=train",
                      "--config.model.attention.impl=pallas", f"--config.compile.out={tmp_path}"],
                     cwd=REPO, capture_output=True, text=True, timeout=900, check=False)
  assert r.returncode == 0, r.stdout + r.stderr
  row = json.load(open(tmp_path / "compile_report.json"))["rows"][0]
  assert row["attention"] == "pallas" and row["train"]["compiled"]
  ours = {k["kernel"]: k for k in row["kernels"] if k["kernel"].startswith("span_attention")}
  assert set(ours) == {"span_attention_fwd", "span_attention_bwd_q", "span_attention_bwd_kv"}
  assert all(k["arch"] == "sm_90a" and k["registers"] > 0 for k in ours.values())
  assert {k["kernel"] for k in row["kernels_roofline"]} == {"fwd", "bwd_q", "bwd_kv", "position"}
  for k in ours.values():  # the PTX: tensor cores, asynchronous copies, nothing read back
    assert k["ptx"]["wgmma"] > 0 and k["ptx"]["cp_async"] > 0 and not k["ptx"]["read_back"]
  md = (tmp_path / "compile_report.md").read_text()
  assert "tensor-core ops" in md and "wgmma" in md
  auto = subprocess.run([sys.executable, "main.py", "--config=configs/tiny.py",
                         "--config.mode=compile", "--config.compile.targets=h100:1",
                         "--config.model.dtype=bfloat16", "--config.compile.steps=eval",
                         f"--config.compile.out={tmp_path / 'auto'}"],
                        cwd=REPO, capture_output=True, text=True, timeout=900, check=False)
  assert auto.returncode == 0, auto.stdout + auto.stderr
  row = json.load(open(tmp_path / "auto" / "compile_report.json"))["rows"][0]
  assert row["attention"] == "reference" and "untimed" in row["attention_why"]
  assert "untimed" in auto.stdout


@pytest.mark.compile
@pytest.mark.skipif(not HAS_CUDA, reason="needs the CUDA plugin: pip install -e .[gpu-compile]")
@pytest.mark.parametrize("target", ["h100", "a100_80"])
def test_fused_kernel_fits_shared_memory_for_every_head_size_and_dtype(target):
  """The tiles the door picks (gpu_tiles.TILES) compile within the target's shared memory; with
  the single 64/4/2 tile of before, head size 128 (the large models' 96) and float32 did not."""
  r = subprocess.run([sys.executable, "-m", "bench.kernel_sweep", "--targets", target, "--dtypes",
                      "bfloat16", "float32", "--head_dims", "64", "128", "--tiles", "0"],
                     cwd=REPO, capture_output=True, text=True, timeout=1200, check=False)
  assert r.returncode == 0, r.stderr[-2000:]
  lines = [l for l in r.stdout.splitlines() if l.startswith(target)]
  assert len(lines) == 4 and all(": ok " in l for l in lines), r.stdout


@pytest.mark.compile
@pytest.mark.parametrize("target,impl", [
    pytest.param("h100:1", "pallas", marks=pytest.mark.skipif(
        not HAS_CUDA, reason="needs the CUDA plugin: pip install -e .[gpu-compile]")),
    pytest.param("v5e:2x2", "pallas_tpu", marks=pytest.mark.skipif(
        not HAS_TPU, reason="needs libtpu: pip install -e .[tpu-compile]"))])
def test_compile_mode_with_document_boundaries(tmp_path, target, impl):
  """model.doc_boundary: the span model's train step with segment ids (documents) through the
  fused kernel of each target, compiled deviceless."""
  r = subprocess.run([sys.executable, "main.py", "--config=configs/tiny.py",  # block 128: TPU tiles
                      "--config.model.n_layers=2",
                      "--config.mode=compile", f"--config.compile.targets={target}",
                      "--config.model.dtype=bfloat16", "--config.compile.steps=train",
                      f"--config.model.attention.impl={impl}", "--config.model.doc_boundary=0",
                      f"--config.compile.out={tmp_path}"],
                     cwd=REPO, capture_output=True, text=True, timeout=900, check=False)
  assert r.returncode == 0, r.stdout + r.stderr
  row = json.load(open(tmp_path / "compile_report.json"))["rows"][0]
  assert row["attention"] == impl and row["train"]["compiled"], row
  assert row["train"]["memory"]["fits"], row["train"]["memory"]


@pytest.mark.compile
@pytest.mark.skipif(not HAS_TPU, reason="needs libtpu: pip install -e .[tpu-compile]")
@pytest.mark.parametrize("pattern,combine", [("fixed", "merged"), ("strided", "merged"),
                                             ("strided", "split")])
def test_splash_masks_compile_in_the_kernel_for_a_tpu(pattern, combine):
  """The Sparse Transformer's masks evaluated inside splash's kernel (floor division and
  remainder by the stride on its index tiles) lower through Mosaic for a deviceless TPU, forward
  and backward, and no mask array reaches the kernel."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  from span_lm.kernels.sparse import splash_sparse  # pylint: disable=g-import-not-at-top
  from span_lm.model import sparse  # pylint: disable=g-import-not-at-top
  heads = sparse.layer_heads(pattern, combine, 4, 0, 96, 8)
  topo = topologies.get_topology_desc(topology_name="v5e:2x2", platform="tpu")
  mesh = jax.sharding.Mesh(topo.devices[:1], ("x",))
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  f = lambda q, k, v: jnp.sum(splash_sparse.block_sparse_attention(q, k, v, heads)
                              .astype(jnp.float32) ** 2)
  x = jax.ShapeDtypeStruct((1, 4, 1024, 64), jnp.bfloat16, sharding=rep)
  with target_lib.compiling_for("tpu", None, "TPU v5 lite"):
    compiled = jax.jit(jax.grad(f, (0, 1, 2))).lower(x, x, x).compile()
  text = compiled.as_text()
  assert "tpu_custom_call" in text
  assert not re.search(r"s32\[\d+,512,512\]", text)  # no partial mask blocks (block 512)

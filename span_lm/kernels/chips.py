"""Per-chip facts, written once: peak FLOP/s, memory, HBM bandwidth, and for NVIDIA GPUs what a
deviceless compile needs to stand in for the device (compute capability, SMs, shared memory).

Used by training (train/telemetry.py: MFU against the dense peak; train/oom.py: the device's
memory), by the compile mode (span_lm/tools/compile.py: rooflines, memory fit, the GPU target
description) and by bench/ (harness.py's MFU). It sits here beside target.py, below all of them:
hardware facts import nothing of the package. Numbers are the vendors' data sheets, dense (no
sparsity). V100 and T4 have no bf16 units: their bfloat16 entry is fp16's (the low-precision
peak, which model.dtype=float16 reaches; XLA emulates bf16 there).
"""
import dataclasses

GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Chip:
  name: str  # the compile target's name: h100, a100_80, v5p, ...
  platform: str  # gpu | tpu
  device_kind: str  # what jax reports (GPU: the substring to match)
  memory_bytes: int  # HBM per chip
  hbm_bytes_per_s: float
  peak_flops: dict  # by dtype: bfloat16, float32 (no tensor cores), tf32 (GPUs that have it)
  # GPUs only (for the text GpuTargetConfigProto of a deviceless compile):
  compute_capability: tuple[int, int] | None = None
  sm_count: int = 0
  fpus_per_sm: int = 0
  shared_memory_per_block_optin: int = 0
  shared_memory_per_sm: int = 0
  l2_bytes: int = 0
  clock_ghz: float = 0.0
  # TPUs only: TensorCores per chip (a topology's devices may be chips or cores).
  cores_per_chip: int = 1
  default_topology: str = ""

  @property
  def cc(self) -> float | None:
    return None if self.compute_capability is None else float("%d.%d" % self.compute_capability)


T = 1e12
_GPUS = (
    Chip("h100", "gpu", "H100", 80 * GiB, 3.35e12,
         {"bfloat16": 989.4 * T, "float32": 66.9 * T, "tf32": 494.7 * T},
         (9, 0), 132, 128, 232448, 233472, 50 << 20, 1.98),
    Chip("h100_pcie", "gpu", "H100 PCIe", 80 * GiB, 2.0e12,
         {"bfloat16": 756.0 * T, "float32": 51.2 * T, "tf32": 378.0 * T},
         (9, 0), 114, 128, 232448, 233472, 50 << 20, 1.755),
    Chip("h100_nvl", "gpu", "H100 NVL", 94 * 10**9, 3.9e12,
         {"bfloat16": 835.0 * T, "float32": 60.0 * T, "tf32": 418.0 * T},
         (9, 0), 132, 128, 232448, 233472, 50 << 20, 1.785),
    Chip("h200", "gpu", "H200", 141 * 10**9, 4.8e12,
         {"bfloat16": 989.4 * T, "float32": 66.9 * T, "tf32": 494.7 * T},
         (9, 0), 132, 128, 232448, 233472, 50 << 20, 1.98),
    Chip("a100_80", "gpu", "A100-SXM4-80GB", 80 * GiB, 2.039e12,
         {"bfloat16": 312.0 * T, "float32": 19.5 * T, "tf32": 156.0 * T},
         (8, 0), 108, 64, 166912, 167936, 40 << 20, 1.41),
    Chip("a100_40", "gpu", "A100-SXM4-40GB", 40 * GiB, 1.555e12,
         {"bfloat16": 312.0 * T, "float32": 19.5 * T, "tf32": 156.0 * T},
         (8, 0), 108, 64, 166912, 167936, 40 << 20, 1.41),
    Chip("v100_32", "gpu", "V100-SXM2-32GB", 32 * GiB, 0.9e12,
         {"bfloat16": 125.0 * T, "float32": 15.7 * T},
         (7, 0), 80, 64, 98304, 98304, 6 << 20, 1.53),
    Chip("v100_pcie", "gpu", "V100-PCIE", 16 * GiB, 0.9e12,
         {"bfloat16": 112.0 * T, "float32": 14.0 * T},
         (7, 0), 80, 64, 98304, 98304, 6 << 20, 1.38),
    Chip("v100_16", "gpu", "V100-SXM2-16GB", 16 * GiB, 0.9e12,
         {"bfloat16": 125.0 * T, "float32": 15.7 * T},
         (7, 0), 80, 64, 98304, 98304, 6 << 20, 1.53),
    # T4 (Turing, sm_75): 16 GB GDDR6 of which the driver shows 15360 MiB; 65 TFLOP/s float16
    # tensor cores (the 'bfloat16' entry, as V100's: no bf16 units), 8.1 float32; 64 KiB shared
    # memory per SM; 4 MiB L2; 1.59 GHz boost.
    Chip("t4", "gpu", "T4", 15 * GiB, 0.32e12,
         {"bfloat16": 65.0 * T, "float32": 8.1 * T},
         (7, 5), 40, 64, 65536, 65536, 4 << 20, 1.59),
)
_TPUS = (
    Chip("v4", "tpu", "TPU v4", 32 * GiB, 1.2e12, {"bfloat16": 275 * T, "float32": 275 * T / 3},
         cores_per_chip=2, default_topology="v4:2x2x2"),
    Chip("v5e", "tpu", "TPU v5 lite", 16 * GiB, 0.819e12,
         {"bfloat16": 197 * T, "float32": 197 * T / 3}, default_topology="v5e:4x4"),
    Chip("v5p", "tpu", "TPU v5", 95 * GiB, 2.765e12,
         {"bfloat16": 459 * T, "float32": 459 * T / 3}, cores_per_chip=2,
         default_topology="v5p:2x2x2"),
    Chip("v6e", "tpu", "TPU v6 lite", 32 * GiB, 1.64e12,
         {"bfloat16": 918 * T, "float32": 918 * T / 3}, default_topology="v6e:2x4"),
)
# TPU float32 matmuls run as several bf16 passes (XLA's default precision is one pass; exact
# float32 takes about three or six): the float32 peak above is an estimate, so say so.
CHIPS = {c.name: c for c in _GPUS + _TPUS}
ALIASES = {"a100": "a100_80", "v100": "v100_32", "v5litepod": "v5e", "trillium": "v6e"}


def get(name: str) -> Chip:
  key = ALIASES.get(name.lower(), name.lower())
  if key not in CHIPS:
    raise ValueError(f"unknown chip {name!r}: choose one of {', '.join(CHIPS)}")
  return CHIPS[key]


def for_device_kind(device_kind: str) -> Chip | None:
  """The chip a jax device_kind names (first, most specific match), or None."""
  kind = device_kind.lower()
  for chip in sorted(CHIPS.values(), key=lambda c: -len(c.device_kind)):
    if chip.device_kind.lower() in kind:
      return chip
  for chip in CHIPS.values():  # "NVIDIA A100-PCIE-40GB" and the like: by family
    if chip.platform == "gpu" and chip.device_kind.split("-")[0].lower() in kind:
      return chip
  return None


def gpu_target_config(chip: Chip) -> str:
  """A text GpuTargetConfigProto describing `chip` for jax.experimental.topologies (deviceless
  GPU compilation): the fields XLA's GPU compiler and Triton read, from the table above."""
  if chip.platform != "gpu":
    raise ValueError(f"{chip.name} is not a GPU")
  major, minor = chip.compute_capability
  ext = "ACCELERATED_FEATURES" if major >= 9 else "NONE"  # sm_90a: wgmma, TMA
  return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {chip.shared_memory_per_sm}
  threads_per_core_limit: 2048
  core_count: {chip.sm_count}
  fpus_per_core: {chip.fpus_per_sm}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(chip.hbm_bytes_per_s)}
  l2_cache_size: {chip.l2_bytes}
  clock_rate_ghz: {chip.clock_ghz}
  device_memory_size: {chip.memory_bytes}
  shared_memory_per_block_optin: {chip.shared_memory_per_block_optin}
  cuda_compute_capability {{ major: {major} minor: {minor} feature_extension: {ext} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  thread_dim_limit_x: 1024
  thread_dim_limit_y: 1024
  thread_dim_limit_z: 64
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 10 patch: 0 }}
device_description_str: "NVIDIA {chip.device_kind}"
"""


def peak_tflops(device_kind: str) -> dict | None:
  """Dense peak TFLOP/s by dtype for a jax device_kind (bench/harness.py's MFU), or None."""
  chip = for_device_kind(device_kind)
  if chip is None:
    return None
  return dict({k: v / T for k, v in chip.peak_flops.items()}, matched=chip.name)

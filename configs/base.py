"""Shared defaults: the reference's enwik8_small run (experiments/enwik8_small.sh) shapes.

Every run config starts from `get_base_config()` and changes what differs. Field meanings:

model.*   architecture (span_lm.model.config.ModelConfig mirrors these fields)
data.*    dataset and batching (block = M, batch = B streams)
optim.*   optimizer (the reference's Adagrad with per-tensor step clipping by default)
train.*   loop lengths, logging, checkpointing
"""
import ml_collections
from ml_collections import config_dict


def get_base_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.workdir = config_dict.placeholder(str)  # run directory; resume is automatic
  c.seed = 42
  c.mode = "train"  # train | eval | import | export
  # mode=import: a reference (facebookresearch/adaptive-span) .pt checkpoint to convert into an
  # Orbax checkpoint in workdir; mode=export: where to write workdir's latest checkpoint in the
  # reference's format (span_lm/tools/reference_checkpoint.py).
  c.import_from = config_dict.placeholder(str)
  c.export_to = config_dict.placeholder(str)

  c.model = m = ml_collections.ConfigDict()
  m.vocab_size = 0  # 0: taken from the dataset's vocabulary
  m.d_model = 256
  m.n_layers = 8
  m.n_heads = 4
  m.d_ff = 1024
  m.span = 1024  # S, the maximum attention span
  m.span_mode = "adaptive"  # fixed | adaptive | dynamic
  m.ramp = 32  # R, width of the soft mask ramp
  m.span_init = 0.0  # initial z' (adaptive)
  m.span_loss = 2e-6  # L1 span penalty coefficient
  m.span_cache = True  # shrink each layer's cache with its span (reference: adapt_span_cache)
  m.dynamic_bias_init = -4.0  # b in z_t = S sigmoid(v.x_t + b)
  m.pers_mem = 0  # N persistent key/value vectors per head (all-attention); 0: off
  m.dropout = 0.0
  m.emb_dropout = 0.0
  m.dtype = "float32"  # compute dtype: float32 | bfloat16 (params stay float32)
  m.remat = "none"  # none | layer: recompute each layer in the backward pass
  # What a recomputed layer keeps from the forward pass (jax.checkpoint_policies): nothing_saveable
  # (least memory), dots_saveable, dots_with_no_batch_dims_saveable, everything_saveable.
  m.remat_policy = "nothing_saveable"
  m.plan_granularity = 64  # span-plan bucket size (reference: 64)
  m.plan_margin = 64  # extra window kept beyond the learned span (reference: 64)
  m.plan_shrink_patience = 1000  # steps a smaller plan must persist before shrinking
  # Headroom of a plan: windows cover plan_growth x the needed tokens (then rounded up to the
  # granularity), so a span that keeps growing recompiles every ~50 % of growth, not every 64 tokens.
  m.plan_growth = 1.5
  m.head_grouping = True  # group heads by span bucket (False: per-layer max, as the reference)
  m.attn_chunk = 0  # query chunk for banded attention; 0: automatic
  # xla | pallas (fused kernel, GPUs: spans are runtime values, key blocks outside them skipped)
  # | pallas_interpret (the same kernel on CPU, slow: for tests)
  m.attn_impl = "xla"
  m.attn_block = 64  # pallas: query/key tile
  m.adapt_io = False  # adaptive input + adaptive softmax (reference --adapt-io)
  m.adapt_io_cutoffs = (20000, 40000, 200000)  # cluster boundaries in the frequency-sorted vocab
  m.adapt_io_div = 4  # cluster i has dimension d_model // div**i
  m.adapt_io_tied = False  # share the input and output cluster tables (reference --adapt-io-tied)
  # Sparse Transformer (arch='sparse'; span_lm/model/sparse*.py): span is the context length n,
  # span_mode must be 'fixed'. See configs/enwik8_sparse_fixed.py and configs/cifar10_sparse.py.
  m.arch = "span"  # span | sparse
  m.sparse_pattern = "fixed"  # fixed | strided | local | dense
  m.sparse_combine = "merged"  # merged (eq. 7) | interleaved (eq. 6) | split (eq. 8)
  m.sparse_stride = 128  # l
  m.sparse_c = 32  # fixed: summary positions per block
  m.sparse_distinct = True  # fixed: each head's summary is its own c-sub-block
  m.sparse_impl = "fast"  # fast (O(n sqrt n)) | dense (masked n x n reference)
  m.sparse_prenorm = True  # pre-activation residual blocks (eqs. 9-14); False: post-LN
  m.sparse_act = "gelu"  # gelu | relu
  m.sparse_init_scale = True  # W_p, W_2 init scaled by 1/sqrt(2N)
  m.sparse_pos = "attn"  # attn (row/column of width l) | data (sparse_data_shape) | none
  m.sparse_data_shape = ()  # sparse_pos='data': e.g. (32, 32, 3)
  m.sparse_qk_ratio = 1.0  # 0.5: half-size query/key projections

  c.data = d = ml_collections.ConfigDict()
  d.dataset = "enwik8"  # enwik8 | text8 | wikitext103 | file | synthetic | cifar10
  d.data_dir = "data_cache"
  d.path = config_dict.placeholder(str)  # local raw file; overrides dataset when set
  d.split_fractions = (0.9, 0.05, 0.05)  # train/valid/test fractions for a local file
  d.split_bytes = ()  # explicit (train_end, valid_end) byte offsets for a local file
  d.file_vocab = "reference"  # local file: reference (newline -> <eos>, first-appearance ids) | bytes
  d.vocab_order = "auto"  # auto (frequency for wikitext103, else first appearance) | first | frequency
  d.block = 256  # M
  d.align = 1  # records of this many tokens: streams and restart offsets keep to their boundaries
  d.batch = 64  # B
  d.eval_batch = 8  # streams for the full evaluation
  d.synthetic_distance = 64  # D for the synthetic source
  d.synthetic_vocab = 16
  d.synthetic_noise = 0.1
  d.synthetic_length = 2_000_000
  d.synthetic_seed = 0

  c.optim = o = ml_collections.ConfigDict()
  o.name = "adagrad"  # adagrad (reference) | sgd | momentum | adam
  o.lr = 0.07
  o.momentum = 0.0
  o.grad_clip = 0.03  # adagrad: per-tensor step clip; sgd/adam: global-norm clip; 0: off
  o.warmup = 8000
  o.batch_split = 1  # gradient accumulation pieces (the reference's memory knob)
  o.weight_decay = 0.0  # adam only: decoupled (AdamW) decay of weight matrices
  o.schedule = "warmup"  # warmup (linear, then constant) | cosine (warmup, then cosine to 0)
  o.decay_steps = 0  # cosine: the update where the rate reaches 0 (usually train.steps)

  c.train = t = ml_collections.ConfigDict()
  t.steps = 150_000
  t.log_every = 100
  t.eval_every = 1000  # the reference's "iteration" (nbatches)
  t.eval_batches = 0  # 0: ceil(eval_every / 10), as the reference
  t.checkpoint_every = 1000
  t.max_to_keep = 3
  # Checkpoint (run directory or checkpoint path) whose parameters and optimizer state start this
  # run, e.g. the "+20k steps at lr/10" fine-tuning phases (the configs' `finetune` variants). The
  # step counter restarts at 0 in the new workdir, so `steps` is this phase's length. None: scratch.
  t.init_from = config_dict.placeholder(str)
  t.full_eval_at_end = True
  t.eval_drop_last = False  # True reproduces the reference's dropping of the partial last block
  t.tensorboard = True
  # Persistent XLA compilation cache: restarts and span-plan changes seen before do not recompile
  # from scratch. Empty string: off.
  t.compilation_cache = "~/.cache/span_lm/xla"
  t.compilation_cache_min_secs = 1.0  # only compilations slower than this are written to it
  # A non-finite loss or gradient: the update is never applied (checked inside the jitted step).
  # stop: end the run with an error, the last checkpoint untouched; skip: drop that update, count
  # it (metrics 'skipped') and go on.
  t.nonfinite = "stop"
  t.preemption = True  # SIGTERM / the preemption sync point: checkpoint the current step, stop
  t.debug_nan_at_step = 0  # testing aid: make the loss of this step (1-based) NaN; 0: off

  # Multi-process runs (span_lm/train/distributed.py, launch/README.md).
  c.dist = ds = ml_collections.ConfigDict()
  ds.mode = "auto"  # auto (when a coordinator, SLURM step or TPU pod is detected) | on | off
  ds.coordinator = ""  # host:port of process 0; "": JAX_COORDINATOR_ADDRESS or auto-detection
  ds.num_processes = 0  # 0: from JAX_NUM_PROCESSES or auto-detection
  ds.process_id = -1  # -1: from JAX_PROCESS_ID or auto-detection
  ds.local_device_ids = ""  # comma-separated device ids this process uses; "": all (JAX default)
  ds.init_timeout = 300  # seconds to wait for the other processes
  # FSDP-style: >1 makes the mesh ('data', 'fsdp') with this many devices on 'fsdp', over which
  # parameters and optimizer state are split (logical axis 'embed'); batches use every device.
  ds.fsdp = 1
  # CPU hosts: split the host into this many JAX devices and train data-parallel over them (XLA:CPU
  # runs most of one device's work on one thread). 0: auto (one per core, at most 8, reduced to
  # divide the batches; only when no accelerator plugin is installed); 1: off. XLA_FLAGS'
  # --xla_force_host_platform_device_count, when set, wins.
  ds.cpu_devices = 0
  # CPU-only runs: glibc malloc keeps freed heap memory for reuse (one arena, no trim; buffers above
  # 32 MiB still mmap'd and returned), so steps reuse pages instead of faulting some back in, and
  # peak resident memory stays at or below glibc's defaults (span_lm/train/host_memory.py,
  # docs/benchmarks.md). False: glibc's defaults (also kept when JAX already runs in the process).
  ds.cpu_keep_freed_memory = True

  # Inspecting a run (span_lm/tools): --config.mode=spans | flops | sample, on config.workdir.
  c.tools = tl = ml_collections.ConfigDict()
  tl.step = config_dict.placeholder(int)  # checkpoint step to inspect; None: the latest
  tl.text = config_dict.placeholder(str)  # spans, dynamic span (Fig. 5): the text; None: valid split
  tl.xla = True  # flops: also compile the train step and report XLA's cost and memory analyses
  c.sample = s = ml_collections.ConfigDict()
  s.prompt = ""  # text to continue ("": start a new line)
  s.length = 200  # tokens to generate
  s.temperature = 1.0  # 0: greedy
  s.top_k = 0  # draw among the k most likely tokens; 0: all
  s.seed = 0
  return c

"""Import and export of facebookresearch/adaptive-span checkpoints (torch.save dicts).

A reference checkpoint holds `model` (the state_dict of a DataParallel model: keys start with
`module.`), `optimizer` (torch's optimizer state_dict), `iter_no`, `logger` and maybe
`scheduler_iter`. Import maps every tensor onto span_lm's parameter tree (the map is in the
docstrings of span_lm/model/transformer.py and adaptive_io.py), checks every shape against the
config, carries the optimizer buffers over (Adagrad `sum`, Adam `exp_avg`/`exp_avg_sq`, SGD
`momentum_buffer`, and the step count) and writes an Orbax checkpoint that `main.py` evaluates,
resumes or fine-tunes. Export is the inverse, for the round trip and for users going back.

torch's optimizer state_dict lists parameters by index in `model.parameters()` order: module by
module, depth first, each module's own parameters before its children's, in registration order,
shared parameters once. From the reference's module definitions (models.py, adaptive_span.py,
persistent_memory.py, adaptive_io.py) that is:
  key_pe; in_emb; out_emb; then per layer: attn.attn.adaptive_span._mask.current_val,
  attn.attn.persistent_memory.key/.val, attn.proj_query, proj_out, proj_val, proj_key,
  norm1.weight/.bias, ff.fc1.weight/.bias, ff.fc2.weight/.bias, norm2.weight/.bias.
`reference_entries` builds that order; a file whose state_dict order disagrees is refused.
Token ids must be the reference's (span_lm.data prepares them in its order); only the
vocabulary size can be checked here.
"""
import collections
import dataclasses
import logging
import os
import re
from typing import Any

import jax
import numpy as np
import optax

from span_lm import config as config_lib
from span_lm.model import adaptive_io
from span_lm.model import caches as caches_lib
from span_lm.model import plan as plan_lib
from span_lm.train import planner as planner_lib
from span_lm.model.config import ModelConfig
from span_lm.tools import torch_format
from span_lm.train import optimizer as optimizer_lib

log = logging.getLogger("span_lm")


def _echo(msg: str) -> None:
  if jax.process_index() == 0:
    print(msg, flush=True)
  log.info(msg)


PREFIX = "module."


@dataclasses.dataclass(frozen=True)
class Entry:
  """One state_dict key: where it lives in span_lm and how its layout differs.

  kind: 'copy' (same array), 'T' (torch Linear weight, the transposed kernel), 'key_pe'
  ((1, Dh, S) <-> (Dh, S)), 'span' ((H, 1, 1) <-> (H,)), 'buffer' (the mask template,
  recomputed). alias_of: another key holding the same tensor (not a parameter of its own).
  """
  key: str
  path: tuple[str, ...] | None
  kind: str = "copy"
  alias_of: str | None = None

  @property
  def is_param(self) -> bool:
    return self.kind != "buffer" and self.alias_of is None


def _to_span_lm(kind: str, a: np.ndarray) -> np.ndarray:
  if kind == "T":
    return a.T
  if kind in ("key_pe", "span"):
    return a.reshape(a.shape[1:] if kind == "key_pe" else a.shape[:1])
  return a


def _to_reference(kind: str, a: np.ndarray) -> np.ndarray:
  if kind == "T":
    return a.T
  if kind == "key_pe":
    return a[None]
  if kind == "span":
    return a[:, None, None]
  return a


def reference_entries(cfg: ModelConfig) -> list[Entry]:
  """The reference's state_dict keys for `cfg`, in its order (parameters, buffers, aliases)."""
  out = [Entry("key_pe", ("key_pe",), "key_pe")]
  if cfg.adapt_io.enabled:
    n = len(adaptive_io.cluster_bounds(cfg))
    out += [Entry(f"in_emb.emb_layers.{i}.weight", ("in_emb", f"emb_{i}")) for i in range(n)]
    out += [Entry(f"in_emb.emb_projs.{i}", ("in_emb", f"proj_{i}"), "T") for i in range(n)]
    if n > 1:
      out += [Entry("out_emb.cluster_proj.weight", ("out_emb", "cluster_kernel"), "T"),
              Entry("out_emb.cluster_proj.bias", ("out_emb", "cluster_bias"))]
    for i in range(n):
      w = f"out_emb.out_layers.{i}.weight"
      out.append(Entry(w, None, alias_of=f"in_emb.emb_layers.{i}.weight") if cfg.adapt_io.tied
                 else Entry(w, ("out_emb", f"emb_{i}")))
      out.append(Entry(f"out_emb.out_layers.{i}.bias", ("out_emb", f"bias_{i}")))
    for i in range(n):
      p = f"out_emb.out_projs.{i}"
      out.append(Entry(p, None, alias_of=f"in_emb.emb_projs.{i}") if cfg.adapt_io.tied
                 else Entry(p, ("out_emb", f"proj_{i}"), "T"))
  else:
    out += [Entry("in_emb.weight", ("in_emb", "embedding")),
            Entry("out_emb.weight", ("out_emb", "kernel"), "T"),
            Entry("out_emb.bias", ("out_emb", "bias"))]
  for i in range(cfg.n_layers):
    r, p = f"layers.{i}.", (f"layers_{i}",)
    mask = f"{r}attn.attn.adaptive_span._mask."
    if cfg.span.mode == "adaptive":
      out += [Entry(mask + "current_val", p + ("attn", "span_ratio"), "span"),
              Entry(mask + "mask_template", None, "buffer")]
    if cfg.pers_mem:
      pm = f"{r}attn.attn.persistent_memory."
      out += [Entry(pm + "key", p + ("attn", "pers_key")),
              Entry(pm + "val", p + ("attn", "pers_val"))]
      if cfg.span.mode == "adaptive":  # the same AdaptiveSpan module, registered twice
        out += [Entry(pm + "adaptive_span._mask.current_val", None, "span", mask + "current_val"),
                Entry(pm + "adaptive_span._mask.mask_template", None, "buffer")]
    out += [Entry(f"{r}attn.{n}.weight", p + ("attn", n, "kernel"), "T")
            for n in ("proj_query", "proj_out", "proj_val", "proj_key")]
    out += [Entry(f"{r}norm1.weight", p + ("norm1", "scale")),
            Entry(f"{r}norm1.bias", p + ("norm1", "bias"))]
    if not cfg.pers_mem:
      for n in ("fc1", "fc2"):
        out += [Entry(f"{r}ff.{n}.weight", p + ("ff", n, "kernel"), "T"),
                Entry(f"{r}ff.{n}.bias", p + ("ff", n, "bias"))]
      out += [Entry(f"{r}norm2.weight", p + ("norm2", "scale")),
              Entry(f"{r}norm2.bias", p + ("norm2", "bias"))]
  return out


# ---------------------------------------------------------------------------- shapes and checks


def strip_prefix(state_dict) -> "collections.OrderedDict[str, np.ndarray]":
  """Drops DataParallel's `module.` prefix (keys without it are kept as they are)."""
  return collections.OrderedDict(
      (k[len(PREFIX):] if k.startswith(PREFIX) else k, np.asarray(v))
      for k, v in state_dict.items())


def infer_model(sd) -> dict[str, Any]:
  """ModelConfig fields read off the state_dict's shapes (what a config must agree with), by
  their dotted names in config.model ('span.size')."""
  def need(key):
    if key not in sd:
      raise ValueError(f"not an adaptive-span state_dict: no '{key}' "
                       f"(keys start {list(sd)[:5]})")
    return sd[key].shape

  layers = sorted({int(m.group(1)) for k in sd if (m := re.match(r"layers\.(\d+)\.", k))})
  if layers != list(range(len(layers))) or not layers:
    raise ValueError(f"the state_dict's layers are {layers}, not 0..n-1")
  kpe = need("key_pe")
  if len(kpe) != 3 or kpe[0] != 1:
    raise ValueError(f"key_pe has shape {kpe}, expected (1, head_dim, span)")
  out = {"n_layers": len(layers), "span.size": kpe[2]}
  if "in_emb.emb_layers.0.weight" in sd:
    n = len([k for k in sd if re.fullmatch(r"in_emb\.emb_layers\.\d+\.weight", k)])
    rows = [sd[f"in_emb.emb_layers.{i}.weight"].shape[0] for i in range(n)]
    dims = [sd[f"in_emb.emb_layers.{i}.weight"].shape[1] for i in range(n)]
    out.update({"adapt_io.enabled": True, "vocab_size": sum(rows),
                "d_model": need("in_emb.emb_projs.0")[0],
                "adapt_io.cutoffs": tuple(int(c) for c in np.cumsum(rows)[:-1])})
    if n > 1:
      out["adapt_io.div"] = dims[0] // dims[1]
    if "out_emb.out_layers.0.weight" in sd:  # tied: the same tensors under both names
      same = lambda a, b: a in sd and np.array_equal(sd[a], sd[b])
      out["adapt_io.tied"] = all(
          same(f"out_emb.out_layers.{i}.weight", f"in_emb.emb_layers.{i}.weight")
          and same(f"out_emb.out_projs.{i}", f"in_emb.emb_projs.{i}") for i in range(n))
  else:
    v, d = need("in_emb.weight")
    out.update({"adapt_io.enabled": False, "vocab_size": v, "d_model": d})
  out["n_heads"] = out["d_model"] // kpe[1] if kpe[1] and out["d_model"] % kpe[1] == 0 else None
  out["span.mode"] = ("adaptive" if "layers.0.attn.attn.adaptive_span._mask.current_val" in sd
                      else "fixed")
  pk = "layers.0.attn.attn.persistent_memory.key"
  out["pers_mem"] = sd[pk].shape[-1] if pk in sd else 0
  if not out["pers_mem"] and "layers.0.ff.fc1.weight" in sd:
    out["d_ff"] = sd["layers.0.ff.fc1.weight"].shape[0]
  return out


def check_fits(sd, cfg: ModelConfig) -> None:
  """Refuses (ValueError naming config fields and keys) a state_dict that `cfg` cannot hold."""
  found = infer_model(sd)
  problems = []
  for field, value in found.items():
    mine = cfg
    for part in field.split("."):
      mine = getattr(mine, part)
    if field == "span.mode" and mine == "dynamic":
      problems.append("config.model.span.mode='dynamic' has no reference counterpart; the "
                      f"checkpoint's spans are {value!r}")
    elif field in ("adapt_io.cutoffs", "adapt_io.div", "adapt_io.tied") and \
        not cfg.adapt_io.enabled:
      continue
    elif mine != value:
      problems.append(f"config.model.{field}={mine!r}, the checkpoint has {value!r}")
  if problems:
    raise ValueError("the reference checkpoint does not fit the config:\n  "
                     + "\n  ".join(problems))
  entries = reference_entries(cfg)
  expected = _expected_shapes(cfg, entries)
  bad = [f"{k}: checkpoint {tuple(sd[k].shape)}, config needs {expected[k]}"
         for k in expected if k in sd and tuple(sd[k].shape) != expected[k]]
  missing = [e.key for e in entries if e.key not in sd and e.is_param]
  extra = [k for k in sd if k not in expected]
  if bad or missing or extra:
    lines = bad + [f"{k}: missing" for k in missing] + [f"{k}: unexpected" for k in extra]
    raise ValueError(f"the reference checkpoint does not fit the config ({len(lines)} problems):"
                     "\n  " + "\n  ".join(lines[:20]))
  for e in entries:
    if e.alias_of and e.key in sd and not np.array_equal(sd[e.key], sd[e.alias_of]):
      raise ValueError(f"{e.key} should be the same tensor as {e.alias_of} but differs"
                       + (" (set config.model.adapt_io.tied=False)" if "out_emb" in e.key else ""))
  order = [k for k in sd if k in {e.key for e in entries if e.is_param}]
  if order != [e.key for e in entries if e.is_param]:
    raise ValueError("the state_dict's parameters are not in the reference's order, so its "
                     "optimizer state cannot be matched to them")


def _expected_shapes(cfg: ModelConfig, entries) -> dict[str, tuple]:
  from span_lm.model.transformer import SpanTransformer  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  model = SpanTransformer(cfg)
  shapes = jax.eval_shape(lambda: model.init(
      jax.random.key(0), jnp.zeros((1, 1), jnp.int32), caches_lib.init_caches(cfg, None, 1)))
  params = shapes["params"]
  out = {}
  for e in entries:
    if e.kind == "buffer":
      out[e.key] = (cfg.span.size,)
    elif e.alias_of:
      out[e.key] = None
    else:
      shape = tuple(_get(params, e.path).shape)
      out[e.key] = {"T": shape[::-1], "key_pe": (1, *shape), "span": (*shape, 1, 1)}.get(e.kind,
                                                                                      shape)
  for e in entries:
    if e.alias_of:
      out[e.key] = out[e.alias_of]
  return out


def _get(tree, path):
  for p in path:
    tree = tree[p]
  return tree


def _set(tree, path, value):
  for p in path[:-1]:
    tree = tree.setdefault(p, {})
  tree[path[-1]] = value


# ------------------------------------------------------------------------------- the mapping


def to_span_lm(sd, cfg: ModelConfig) -> dict:
  """A (prefix-stripped, checked) reference state_dict -> span_lm params (float32 numpy)."""
  params: dict = {}
  for e in reference_entries(cfg):
    if e.is_param:
      _set(params, e.path, np.asarray(_to_span_lm(e.kind, sd[e.key]), np.float32))
  return params


def to_reference(params, cfg: ModelConfig, prefix: str = PREFIX) -> collections.OrderedDict:
  """span_lm params -> the reference's state_dict (buffers and aliases included, its order)."""
  out = collections.OrderedDict()
  for e in reference_entries(cfg):
    if e.kind == "buffer":
      a = np.linspace(1 - cfg.span.size, 0, cfg.span.size, dtype=np.float32)
    elif e.alias_of:
      a = out[prefix + e.alias_of]
    else:
      a = _to_reference(e.kind, np.asarray(_get(params, e.path), np.float32))
    out[prefix + e.key] = np.ascontiguousarray(a)
  return out


_BUFFERS = {"adagrad": ("sum",), "adam": ("exp_avg", "exp_avg_sq"),
            "momentum": ("momentum_buffer",)}


def optimizer_buffers(opt_sd, cfg: ModelConfig, params) -> tuple[str | None, int, dict]:
  """(kind, step, {buffer name: tree like params}) from a torch optimizer state_dict.

  kind: 'adagrad' | 'adam' | 'momentum', or None when the file holds no optimizer state.
  A parameter without state (never updated) gets zeros.
  """
  if not opt_sd or not opt_sd.get("state"):
    return None, 0, {}
  entries = [e for e in reference_entries(cfg) if e.is_param]
  ids = [i for g in opt_sd["param_groups"] for i in g["params"]]
  if len(ids) != len(entries):
    raise ValueError(f"the optimizer state covers {len(ids)} parameters, the model has "
                     f"{len(entries)}")
  states = [opt_sd["state"].get(i, {}) for i in ids]
  names = set().union(*(set(s) for s in states)) - {"step"}
  if not names:  # plain SGD keeps no state
    return None, 0, {}
  kind = next((k for k, b in _BUFFERS.items() if set(b) == names), None)
  if kind is None:
    raise ValueError(f"unsupported optimizer state buffers {sorted(names)}")
  steps = {int(np.asarray(s["step"])) for s in states if "step" in s}
  if len(steps) > 1:
    log.warning("optimizer steps differ across parameters (%s); using the largest", sorted(steps))
  bufs = {}
  for name in _BUFFERS[kind]:
    tree: dict = {}
    for e, s in zip(entries, states):
      p = _get(params, e.path)
      a = (_to_span_lm(e.kind, np.asarray(s[name], np.float32)) if name in s
           else np.zeros_like(p))
      if a.shape != p.shape:
        raise ValueError(f"optimizer {name} of {e.key} has shape {a.shape}, the parameter "
                         f"{p.shape}")
      _set(tree, e.path, a)
    bufs[name] = tree
  return kind, max(steps, default=0), bufs


def fill_opt_state(opt_state, kind: str, step: int, bufs: dict):
  """`opt_state` (from tx.init) with the imported buffers and step count put in place."""
  used = set()

  def count_like(c):
    return np.asarray(step, np.asarray(c).dtype)

  def fill(node):
    if isinstance(node, optimizer_lib.ReferenceAdagradState) and kind == "adagrad":
      used.add(kind)
      return node._replace(count=count_like(node.count), sum=bufs["sum"])
    if isinstance(node, optax.ScaleByAdamState) and kind == "adam":
      used.add(kind)
      return node._replace(count=count_like(node.count), mu=bufs["exp_avg"],
                           nu=bufs["exp_avg_sq"])
    if isinstance(node, optax.TraceState) and kind == "momentum":
      used.add(kind)
      return node._replace(trace=bufs["momentum_buffer"])
    if isinstance(node, optax.ScaleByScheduleState):
      return node._replace(count=count_like(node.count))
    if isinstance(node, tuple) and not hasattr(node, "_fields"):
      return tuple(fill(x) for x in node)
    return node

  out = fill(opt_state)
  if kind not in used:
    raise ValueError(f"the checkpoint's optimizer state is {kind}'s; the config's optimizer cannot "
                     f"take it (set config.optim.name={kind!r})")
  return out


def reference_optimizer(opt_state, cfg: ModelConfig, optim_cfg) -> dict:
  """torch's optimizer state_dict for span_lm's opt_state (parameters indexed in order)."""
  entries = [e for e in reference_entries(cfg) if e.is_param]
  found = {}

  def walk(node):
    if isinstance(node, optimizer_lib.ReferenceAdagradState):
      found.update(step=node.count, sum=node.sum)
    elif isinstance(node, optax.ScaleByAdamState):
      found.update(step=node.count, exp_avg=node.mu, exp_avg_sq=node.nu)
    elif isinstance(node, optax.TraceState):
      found.update(momentum_buffer=node.trace)
    elif isinstance(node, optax.ScaleByScheduleState):
      found.setdefault("step", node.count)
    elif isinstance(node, tuple) and not hasattr(node, "_fields"):
      for x in node:
        walk(x)

  walk(opt_state)
  step = int(np.asarray(found.pop("step", 0)))
  state = {}
  for i, e in enumerate(entries):
    st = {"step": step}
    for name, tree in found.items():
      a = np.asarray(_get(tree, e.path), np.float32)
      st[name] = np.ascontiguousarray(_to_reference(e.kind, a))
    state[i] = st
  group = {"params": list(range(len(entries))), "lr": float(optim_cfg.lr),
           "initial_lr": float(optim_cfg.lr)}
  if optim_cfg.name == "adagrad":
    group.update(lr_decay=0, weight_decay=0, initial_accumulator_value=0,
                 grad_clip=float(optim_cfg.grad_clip))
  elif optim_cfg.name == "adam":
    group.update(betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False)
  else:
    group.update(momentum=float(optim_cfg.momentum), dampening=0, weight_decay=0, nesterov=False)
  return {"state": state, "param_groups": [group]}


# ------------------------------------------------------------------------- whole checkpoints


def read(path) -> tuple[collections.OrderedDict, dict, dict]:
  """(prefix-stripped model state_dict, optimizer state_dict or {}, the rest) of a file.

  Takes a full reference checkpoint or a bare state_dict.
  """
  obj = torch_format.load(path)
  if not isinstance(obj, dict):
    raise ValueError(f"{path}: holds a {type(obj).__name__}, not a checkpoint dict")
  if "model" in obj:
    rest = {k: v for k, v in obj.items() if k not in ("model", "optimizer")}
    return strip_prefix(obj["model"]), obj.get("optimizer") or {}, rest
  return strip_prefix(obj), {}, {}


def import_reference(config) -> dict[str, Any]:
  """mode=import: config.import_from (a reference .pt) -> an Orbax checkpoint in config.workdir.

  Refuses a checkpoint that does not fit config.model, a vocabulary of another size than the
  dataset's, an optimizer state the config's optimizer cannot take, and an existing, non-empty
  `<workdir>/checkpoints`. Returns a summary dict.
  """
  from span_lm.train import run as run_lib  # pylint: disable=g-import-not-at-top
  config = config_lib.checked(config)
  src, workdir = config.import_from, config.workdir
  ckpt_dir = os.path.join(workdir, "checkpoints")
  if os.path.exists(ckpt_dir) and (not os.path.isdir(ckpt_dir) or os.listdir(ckpt_dir)):
    raise FileExistsError(f"{ckpt_dir} already exists and is not empty; import into a new "
                          "config.workdir (existing checkpoints are never overwritten)")
  sd, opt_sd, rest = read(src)
  found = infer_model(sd)
  check_fits(sd, config.model_for(found["vocab_size"]))
  run = run_lib.Run(config)  # loads the dataset: its vocabulary must be the checkpoint's
  try:
    cfg = run.model_cfg
    if run.splits.vocab_size != found["vocab_size"] or cfg.vocab_size != found["vocab_size"]:
      raise ValueError(f"the checkpoint's vocabulary has {found['vocab_size']} tokens, the dataset "
                       f"{run.splits.name} {run.splits.vocab_size} (config.model.vocab_size="
                       f"{cfg.vocab_size}); token ids must follow the reference's vocabulary")
    check_fits(sd, cfg)
    params = to_span_lm(sd, cfg)
    kind, step, bufs = optimizer_buffers(opt_sd, cfg, params)
    step = step or int(rest.get("scheduler_iter", 0))  # torch SGD keeps no step count
    plan = plan_lib.plan_from_params(cfg, params)
    plan_lib.check_plan(cfg, params, plan)
    state = _imported_state(run, config.seed, plan, params, (kind, step, bufs), src)
    meta = _imported_meta(config, cfg, plan, step, src, kind, rest)
    run.ckpt.save(step, state, meta, force=True)
  finally:
    run.ckpt.close()  # waits for the save to commit
  if jax.process_index() == 0:
    with open(os.path.join(workdir, "config.json"), "w") as f:
      f.write(config.to_json_best_effort(indent=2))
  _echo(f"imported {src} -> {ckpt_dir} step {step} ({cfg.n_layers} layers, vocab "
        f"{cfg.vocab_size}, optimizer state: {kind or 'fresh'}); span plan {plan.describe()}")
  return {"step": step, "optimizer": kind, "directory": ckpt_dir, "plan": plan}


def _imported_state(run, seed: int, plan, params, optimizer: tuple, src: str):
  """The train state on the host (no compilation), placed on the run's shardings: zeros where
  init_state would put zeros, the imported params and optimizer state (`optimizer`: kind, step
  and buffers; kind None: a fresh one), and init_state's rng for this seed."""
  kind, step, bufs = optimizer
  _, abstract, shardings = run.abstract_state(plan)
  opt_state = jax.device_get(run.tx.init(params))
  if kind is not None:
    opt_state = fill_opt_state(opt_state, kind, step, bufs)
  else:
    _echo(f"{src} has no optimizer state: the optimizer starts fresh")
  state = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), abstract)
  state.update(step=np.asarray(step, np.int32), params=params, opt_state=opt_state,
               rng=jax.random.key_data(jax.random.split(jax.random.key(seed))[1]))
  if jax.tree.structure(state) != jax.tree.structure(abstract):
    raise AssertionError("the imported state's tree differs from the model's")  # a bug here
  return jax.device_put(state, shardings)


def _imported_meta(config, cfg, plan, step: int, src: str, kind, rest: dict) -> dict:
  """The checkpoint's metadata: the planner and data streams as a fresh run's, and where the
  parameters came from (the file, its optimizer kind, the reference's own iteration counts)."""
  from span_lm.data import batching  # pylint: disable=g-import-not-at-top
  planner = planner_lib.SpanPlanner(cfg, plan)
  return {"step": step, "planner": planner.state_dict(),
          "data": {"train": batching.StreamState().to_dict(),
                   "valid": batching.StreamState().to_dict()},
          "model_cfg": dataclasses.asdict(cfg), "config": config.to_dict(),
          "imported_from": {"path": os.path.abspath(src), "optimizer": kind,
                            **{k: v for k, v in rest.items()
                               if k in ("iter_no", "scheduler_iter")}}}


def export_reference(config, use_torch: bool | None = None) -> str:
  """mode=export: the latest checkpoint of config.workdir -> config.export_to, reference format.

  Writes with torch.save when torch is installed (use_torch=None), else with the torch-free
  writer; both load with torch.load. Never overwrites an existing file.
  """
  from span_lm.train import run as run_lib  # pylint: disable=g-import-not-at-top
  config = config_lib.checked(config)
  dest = config.export_to
  if os.path.exists(dest):
    raise FileExistsError(f"{dest} already exists; choose another config.export_to")
  run = run_lib.Run(config)
  try:
    if run.ckpt.latest_step() is None:
      raise FileNotFoundError(f"no checkpoint in {run.ckpt.directory} to export")
    state, meta = run.restore()
  finally:
    run.ckpt.close()
  state = jax.device_get(state)
  cfg, step = run.model_cfg, int(meta["step"])
  obj = {"iter_no": max(step // config.train.eval_every - 1, 0),
         "model": to_reference(state["params"], cfg),
         "optimizer": reference_optimizer(state["opt_state"], cfg, config.optim),
         "logger": {}}
  if config.optim.warmup > 0:
    obj["scheduler_iter"] = step
  if use_torch is None:
    try:
      import torch  # pylint: disable=g-import-not-at-top,unused-import
      use_torch = True
    except ImportError:
      use_torch = False
  torch_format.save(obj, dest, use_torch=use_torch)
  _echo(f"exported {run.ckpt.directory} step {step} -> {dest}")
  return dest

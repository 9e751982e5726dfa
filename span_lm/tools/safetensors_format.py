"""A trained run as a directory anyone can read: model.safetensors + config.json + README.md.

`--config.mode=export --config.export_to=DIR` (export_format 'safetensors', the default unless
DIR ends in .pt) writes the latest checkpoint's parameters (as trained, or cast to
--config.tools.dtype) with the safetensors library; `--config.mode=import --config.import_from=DIR`
makes them an Orbax checkpoint of a new run (fresh optimizer state, the export's step and span
plan), and `--config.train.init_from=DIR` starts a training phase from them (both read the
directory with span_lm/train/from_export.py). Reading a file never runs code: the header is
validated first (span_lm/layers/safetensors_io.py), then against the shapes config.json's model
implies, before any tensor is read.

Tensor names (flat_name: the parameter path, `name_N` keys written `name.N`), span model:
  key_pe                                  (head_dim, S)   position embeddings of the keys
  in_emb.embedding                        (V, D)          token embedding
  layers.{i}.attn.proj_query|proj_key|proj_val|proj_out.kernel  (D, D)  x @ kernel
  layers.{i}.attn.span_ratio              (H,)            z' (adaptive): span z = S clip(z', 0, 1)
  layers.{i}.attn.span_predictor.kernel|bias  (D, H), (H,)  dynamic spans
  layers.{i}.attn.pers_key, pers_val      (H, head_dim, N), (H, N, head_dim)  pers_mem = N > 0
  layers.{i}.norm1.scale|bias             (D,)            post-attention LayerNorm
  layers.{i}.ff.fc1.kernel|bias           (D, F), (F,)    feed-forward (absent when N > 0)
  layers.{i}.ff.fc2.kernel|bias           (F, D), (D,)
  layers.{i}.norm2.scale|bias             (D,)            post-feed-forward LayerNorm (N == 0)
  out_emb.kernel|bias                     (D, V), (V,)    output softmax
adaptive input/softmax (adapt_io): in_emb.emb.{c} (V_c, D/div^c), in_emb.proj.{c} (D/div^c, D);
  out_emb.emb.{c}, out_emb.proj.{c} (absent when tied), out_emb.bias.{c}, out_emb.cluster_kernel
  (D, clusters - 1), out_emb.cluster_bias. Sparse Transformer: layers.{i}.attn.query|key|value|
  proj.kernel|bias, layers.{i}.ff..., layers.{i}.norm1|norm2, norm_out, pos_emb.{k}, in_emb,
  out_emb; with sparse.scan_layers the blocks stack under layers.block.{k}.* with a leading
  n_layers axis. examples/read_safetensors.py computes a span model's log-probabilities from these.
"""
import datetime
import importlib.metadata
import json
import os
import shutil

import numpy as np

from span_lm import config as config_lib
from span_lm.layers import safetensors_io as sio
from span_lm.model import config as model_config
from span_lm.train.from_export import (CONFIG_NAME, FORMAT, FORMAT_VERSION, check_fits,
                                       check_vocabulary, export_dir, params_like, plain,
                                       read_checked, read_config)

README_NAME = "README.md"
FORMATS = ("safetensors", "pt")


def version() -> str:
  try:
    return importlib.metadata.version("span_lm")
  except importlib.metadata.PackageNotFoundError:
    return "unknown"


# ---- which format --------------------------------------------------------------------------------


def export_format(config) -> str:
  """'pt' or 'safetensors' for mode=export: config.export_format, else by export_to's suffix."""
  fmt = config.export_format or ""
  dest = str(config.export_to)
  if not fmt:
    return "pt" if dest.endswith(".pt") else "safetensors"
  if fmt not in FORMATS:
    raise ValueError(f"config.export_format={fmt!r}: choose one of {FORMATS} (or leave it unset: "
                     ".pt paths are the reference's format, other paths a safetensors directory)")
  if fmt == "safetensors" and dest.endswith(".pt"):
    raise ValueError(f"config.export_to={dest!r}: export_format='safetensors' writes a directory "
                     "(model.safetensors, config.json, README.md); name one without .pt")
  return fmt


def import_source(path) -> str:
  """'safetensors' (an export directory) or 'pt' (a file); a directory of anything else is
  refused in one line."""
  if export_dir(path):
    return "safetensors"
  if os.path.isdir(path):
    raise ValueError(f"config.import_from={path!r}: a directory without {sio.FILE_NAME}; import "
                     "takes a directory written by --config.mode=export (model.safetensors + "
                     "config.json) or a reference .pt file")
  if str(path).endswith(".safetensors"):
    raise ValueError(f"config.import_from={path!r}: a bare .safetensors file; import needs the "
                     f"directory --config.mode=export wrote ({sio.FILE_NAME} beside its "
                     f"{CONFIG_NAME}, which says what model the tensors are)")
  return "pt"


# ---- export --------------------------------------------------------------------------------------


def last_full_evaluation(workdir: str) -> dict | None:
  """The run's last full evaluation of valid and test (metrics.jsonl: a training run's final
  full_valid/full_test, or mode=eval's eval_valid/eval_test), or None."""
  from span_lm.train import metrics as metrics_lib  # pylint: disable=g-import-not-at-top
  rows = [r for r in metrics_lib.read_metrics(workdir)
          if r.get("split") in ("full_valid", "full_test", "eval_valid", "eval_test")]
  valid = [r for r in rows if r["split"].endswith("_valid")]
  if not valid:
    return None
  last = valid[-1]
  kind = last["split"].split("_")[0]
  test = [r for r in rows if r["split"] == f"{kind}_test" and r["step"] == last["step"]]
  out = {"step": int(last["step"]), "source": f"metrics.jsonl {kind}_valid/{kind}_test",
         "valid_bpc": last.get("bpc"), "valid_loss": last.get("loss"),
         "valid_tokens": last.get("tokens"),
         "test_bpc": test[-1].get("bpc") if test else None,
         "test_loss": test[-1].get("loss") if test else None,
         "test_tokens": test[-1].get("tokens") if test else None}
  return out


def _fingerprints(meta: dict) -> dict | None:
  """The checkpoint's content fingerprints of the parameters (meta['fingerprints'], issue 54's
  per-leaf digests) keyed by tensor name where the leaf maps to one, or None."""
  fp = meta.get("fingerprints")
  if not isinstance(fp, dict) or not isinstance(fp.get("leaves"), dict):
    return None
  leaves = {k: v for k, v in fp["leaves"].items() if str(k).startswith("params/")}
  by_name = {}
  for key, digest in leaves.items():
    try:
      by_name[sio.flat_name(tuple(key.split("/")[1:]))] = digest
    except ValueError:
      pass
  return {"algorithm": fp.get("algorithm"), "leaves": leaves, "tensors": by_name,
          "note": "digests of the checkpoint's float32 leaves as saved (span_lm/train/"
                  "checkpoint.py); a tensor exported in another dtype differs from its digest"}


def _vocabulary(codec) -> dict:
  return {"kind": codec.kind, "size": len(codec.vocab), "tokens": list(codec.vocab),
          "eos": "<eos>",
          "encoding": {"bytes": "token i is the byte int(tokens[i]) (UTF-8 text); a newline is "
                                "<eos> where the vocabulary has no '10'",
                       "chars": "one token per character; space is '_', newline <eos>",
                       "words": "space-separated words; newline is <eos>"}[codec.kind]}


def _spans(cfg, params) -> dict | None:
  if cfg.arch != "span" or cfg.span.mode != "adaptive":
    return None
  from span_lm.tools import spans_report  # pylint: disable=g-import-not-at-top
  spans = spans_report.head_spans(cfg, params)
  windows = spans_report.head_windows(cfg, params)
  return {"max_span": cfg.span.size, "ramp": cfg.span.ramp,
          "spans": [[round(float(s), 3) for s in row] for row in spans],
          "windows": [[int(w) for w in row] for row in windows],
          "meaning": "spans: z = S clip(z', 0, 1) tokens per layer and head; windows: "
                     "min(S, ceil(z) + ramp), the distances each head's soft mask reaches"}


def _run_config(config) -> dict:
  d = plain(config.to_dict())
  d.update(mode="train", workdir=None, import_from=None, export_to=None)
  d.get("train", {})["init_from"] = None
  return d


def export(config) -> str:
  """mode=export, format safetensors: config.workdir's latest checkpoint -> the directory
  config.export_to (refused if it exists and is not empty). Returns the directory."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from span_lm.tools import restore as restore_lib  # pylint: disable=g-import-not-at-top
  from span_lm.model import config as model_config  # pylint: disable=g-import-not-at-top
  sio.library()
  config = config_lib.checked(config)
  dest = os.fspath(config.export_to)
  if os.path.exists(dest) and (not os.path.isdir(dest) or os.listdir(dest)):
    raise FileExistsError(f"{dest} already exists; choose another config.export_to (an export "
                          "never overwrites)")
  dtype = restore_lib.tools_field(config, "dtype")
  if dtype is not None and dtype not in ("float32", "bfloat16", "float16"):
    raise ValueError(f"config.tools.dtype={dtype!r}: choose float32, bfloat16 or float16 (or "
                     "leave it unset: the parameters' own dtype)")
  restored = restore_lib.restore(config, restore_lib.tools_field(config, "step"))
  cfg, meta = restored.model_cfg, restored.meta
  params = jax.device_get(restored.params)
  flat = {k: np.asarray(v) for k, v in sio.flatten(params).items()}
  if dtype is not None:
    flat = {k: np.asarray(jnp.asarray(v).astype(dtype)) for k, v in flat.items()}
  dtypes = {v.dtype.name for v in flat.values()}
  if len(dtypes) != 1:
    raise ValueError(f"the parameters have several dtypes {sorted(dtypes)}; pass "
                     "--config.tools.dtype=float32 to export them in one")
  (tensor_dtype,) = dtypes
  evaluation = last_full_evaluation(config.workdir)
  data = {
      "format": FORMAT, "format_version": FORMAT_VERSION, "span_lm_version": version(),
      "architecture": cfg.arch, "model_type": f"span_lm-{cfg.arch}",
      "model": plain(model_config.saved(cfg)), "dtype": tensor_dtype,
      "trained_dtype": sorted({np.asarray(v).dtype.name for v in jax.tree.leaves(params)})[0],
      "n_parameters": int(sum(v.size for v in flat.values())),
      "vocabulary": _vocabulary(restored.codec), "dataset": restored.splits.name,
      "spans": _spans(cfg, params), "planner": plain(meta.get("planner")),
      "step": restored.step, "evaluation": evaluation,
      "fingerprints": _fingerprints(meta),
      "exported": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "run_config": _run_config(config),
  }
  if jax.process_index() == 0:  # one writer; every process restored the same parameters
    write_dir(dest, flat, data)
  _echo(f"exported {config.workdir} step {restored.step} -> {dest} ({len(flat)} tensors, "
        f"{tensor_dtype}, {data['n_parameters']:,} parameters)")
  return dest


def write_dir(dest: str, flat: dict, data: dict) -> str:
  """Writes the export directory `dest` (absent or empty) from {name: numpy array} and the
  config.json dict: into a temporary sibling, renamed into place when complete."""
  tmp = f"{dest.rstrip(os.sep)}.partial-{os.getpid()}"
  shutil.rmtree(tmp, ignore_errors=True)
  os.makedirs(tmp)
  try:
    path = os.path.join(tmp, sio.FILE_NAME)
    sio.library().numpy.save_file(flat, path, metadata={"format": "np", "span_lm": CONFIG_NAME})
    os.chmod(path, 0o644)  # the library writes 0600; an export is meant to be shared
    with open(os.path.join(tmp, CONFIG_NAME), "w", encoding="utf-8") as f:
      json.dump(data, f, indent=1)
      f.write("\n")
    with open(os.path.join(tmp, README_NAME), "w", encoding="utf-8") as f:
      f.write(model_card(data, flat))
    if os.path.isdir(dest):
      os.rmdir(dest)  # empty (the caller checked)
    os.replace(tmp, dest)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return dest


def _echo(msg):
  from span_lm.train import metrics as metrics_lib  # pylint: disable=g-import-not-at-top
  metrics_lib.say(msg)


def _fmt(x, digits=4):
  return "n/a" if x is None else f"{x:.{digits}f}"


def model_card(data: dict, flat: dict) -> str:
  """The README.md of an export: what the model is, its full evaluation, its spans, loading."""
  lines = [f"# span_lm {data['architecture']} language model ({data['dataset']}, step "
           f"{data['step']})", ""]
  lines += [_card_model(data), ""]
  lines += _card_training(data)
  lines += _card_evaluation(data)
  lines += _card_spans(data)
  lines += _card_files(flat)
  return "\n".join(lines)


def _card_model(data: dict) -> str:
  """The card's first paragraph: the architecture, its sizes, the parameters and vocabulary."""
  m, arch = data["model"], data["architecture"]
  if arch == "span":
    span = m["span"]
    what = (f"A Transformer language model with {span['mode']} attention span (Sukhbaatar et al. "
            f"2019, \"Adaptive Attention Span in Transformers\"): {m['n_layers']} layers, "
            f"d_model {m['d_model']}, {m['n_heads']} heads, maximum span S = {span['size']} "
            f"tokens, ramp R = {span['ramp']}")
    what += (f", {m['pers_mem']} persistent memory vectors per head in place of the "
             "feed-forward" if m["pers_mem"] else f", feed-forward {m['d_ff']}")
    if m["adapt_io"]["enabled"]:
      what += f", adaptive input/softmax (cutoffs {m['adapt_io']['cutoffs']})"
  else:
    sp = m["sparse"]
    what = (f"A Sparse Transformer (Child et al. 2019): {m['n_layers']} layers, d_model "
            f"{m['d_model']}, {m['n_heads']} heads, context {sp['context']}, {sp['pattern']} "
            f"pattern, stride {sp['stride']}")
  return (what + f". {data['n_parameters']:,} parameters, stored as {data['dtype']} "
          f"(trained in {data['trained_dtype']}); vocabulary: {data['vocabulary']['size']} "
          f"tokens ({data['vocabulary']['kind']}). Trained with span_lm "
          f"{data['span_lm_version']}.")


def _card_training(data: dict) -> list[str]:
  """How the model was trained, where config.json's run_config says ([] where it has none)."""
  m, arch = data["model"], data["architecture"]
  rc = data.get("run_config") or {}
  if not (rc.get("data") and rc.get("optim")):
    return []
  d, o = rc["data"], rc["optim"]
  return ["## Training", "",
          f"{data['dataset']}: {data['step']} steps of {d.get('batch')} streams x "
          f"{d.get('block')} tokens; optimizer {o.get('name')} (lr {o.get('lr')}, warmup "
          f"{o.get('warmup')}, grad_clip {o.get('grad_clip')}); seed {rc.get('seed')}; "
          f"span penalty {m['span']['loss'] if arch == 'span' else 'n/a'}, dropout "
          f"{m['dropout']}. The whole configuration is config.json's run_config (import "
          f"uses it).", ""]


def _card_evaluation(data: dict) -> list[str]:
  """The run's last full evaluation as a table, or the line saying there was none."""
  ev = data["evaluation"]
  lines = ["## Evaluation", ""]
  if not ev:
    return lines + ["No full evaluation was recorded for this run (train with "
                    "train.full_eval_at_end, or run --config.mode=eval before exporting).", ""]
  unit = "bpc" if data["vocabulary"]["kind"] in ("bytes", "chars") else "bits per token"
  lines += [f"The run's last full evaluation (step {ev['step']}, {ev['source']}):", "",
            f"| split | {unit} | tokens |", "|---|---|---|",
            f"| valid | {_fmt(ev['valid_bpc'])} | {ev['valid_tokens'] or 'n/a'} |",
            f"| test | {_fmt(ev['test_bpc'])} | {ev['test_tokens'] or 'n/a'} |", ""]
  if ev["step"] != data["step"]:
    lines += [f"Note: evaluated at step {ev['step']}; these weights are step {data['step']}.",
              ""]
  return lines


def _card_spans(data: dict) -> list[str]:
  """The learned windows per layer and head ([] for a model without learned spans)."""
  if not data["spans"]:
    return []
  windows = data["spans"]["windows"]
  return (["## Learned spans", "", "Window ceil(z) + R per layer and head (tokens; the "
           "distances each head's soft mask reaches; all of them in config.json):", ""]
          + ["| layer | " + " | ".join(f"h{h}" for h in range(len(windows[0]))) + " |",
             "|---|" + "---|" * len(windows[0])]
          + [f"| {i} | " + " | ".join(str(w) for w in row) + " |" for i, row in
             enumerate(windows)]
          + [""])


def _card_files(flat: dict) -> list[str]:
  """The export's two files and how to load them, with span_lm and without."""
  return ["## Files", "",
          f"- `model.safetensors`: {len(flat)} tensors; names are parameter paths "
          "(`layers.0.attn.proj_query.kernel`; the table is in span_lm/tools/"
          "safetensors_format.py). Kernels are (in, out): y = x @ kernel.",
          "- `config.json`: the model config, the vocabulary, learned spans, the span plan, the "
          "step, the evaluation, content fingerprints (null when the checkpoint had none) and "
          "the training run's config.", "",
          "## Loading", "",
          "With span_lm (a new run directory holding this model as its checkpoint; then "
          "evaluate, sample or fine-tune it):", "", "```",
          "python main.py --config.workdir=RUN --config.mode=import "
          "--config.import_from=THIS_DIR",
          "python main.py --config.workdir=RUN --config.mode=eval", "```", "",
          "Without span_lm (numpy and safetensors only; no code runs when the file is read):",
          "", "```python", "from safetensors.numpy import load_file",
          "tensors = load_file('model.safetensors')  # {name: numpy array}", "```", "",
          "span_lm's examples/read_safetensors.py computes a span model's log-probabilities "
          "from these two files alone.", ""]


# ---- import --------------------------------------------------------------------------------------


def import_export(config) -> dict:
  """mode=import of an export directory: a new run in config.workdir whose checkpoint holds its
  parameters (step and span plan as exported; a fresh optimizer state)."""
  import jax  # pylint: disable=g-import-not-at-top
  import ml_collections  # pylint: disable=g-import-not-at-top
  from span_lm.data import batching  # pylint: disable=g-import-not-at-top
  from span_lm.model import config as model_config  # pylint: disable=g-import-not-at-top
  from span_lm.model import plan as plan_lib  # pylint: disable=g-import-not-at-top
  from span_lm.train import planner as planner_lib  # pylint: disable=g-import-not-at-top
  from span_lm.train import run as run_lib  # pylint: disable=g-import-not-at-top
  config = config_lib.checked(config)
  directory = export_dir(config.import_from)
  ckpt_dir = os.path.join(config.workdir, "checkpoints")
  if os.path.exists(ckpt_dir) and (not os.path.isdir(ckpt_dir) or os.listdir(ckpt_dir)):
    raise FileExistsError(f"{ckpt_dir} already exists and is not empty; import into a new "
                          "config.workdir (existing checkpoints are never overwritten)")
  data, file_cfg, tensors = read_checked(directory)  # before the run builds anything
  check_fits(config.model_for(file_cfg.vocab_size), data, directory)
  run = run_lib.Run(config)
  try:
    cfg = run.model_cfg
    check_vocabulary(run, data, directory)
    planner = planner_lib.SpanPlanner(cfg)
    if data.get("planner"):
      planner.load_state_dict(data["planner"])
    planner.changes = 0
    step = int(data["step"])
    _, abstract, shardings = run.abstract_state(planner.plan)
    params = params_like(tensors, abstract["params"])
    plan_lib.check_plan(cfg, params, planner.plan)
    state = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), abstract)
    state.update(step=np.asarray(step, np.int32), params=params,
                 opt_state=jax.device_get(run.tx.init(params)),
                 rng=jax.random.key_data(jax.random.split(jax.random.key(config.seed))[1]))
    if "loss_scale" in abstract:
      from span_lm.train import loss_scale as loss_scale_lib  # pylint: disable=g-import-not-at-top
      state["loss_scale"] = jax.device_get(loss_scale_lib.init(run.loss_scale))
    state = jax.device_put(state, shardings)
    meta = {"step": step, "planner": planner.state_dict(),
            "data": {"train": batching.StreamState().to_dict(),
                     "valid": batching.StreamState().to_dict()},
            "model_cfg": model_config.saved(cfg), "config": config.to_dict(),
            "loss_scale": "loss_scale" in abstract,
            "imported_from": {"path": os.path.abspath(directory), "format": FORMAT,
                              "dtype": data["dtype"], "fingerprints": data.get("fingerprints")}}
    run.ckpt.save(step, state, meta, force=True)
  finally:
    run.ckpt.close()
  if jax.process_index() == 0:  # the new run's config: `main.py --config.workdir=RUN` trains it
    saved = ml_collections.ConfigDict(config.to_dict())
    saved.mode, saved.import_from = "train", None
    with open(os.path.join(config.workdir, "config.json"), "w") as f:
      f.write(saved.to_json_best_effort(indent=2))
  _echo(f"imported {directory} -> {ckpt_dir} step {step} ({len(tensors)} tensors, "
        f"{data['dtype']}; the optimizer starts fresh); span plan {planner.plan.describe()}")
  return {"step": step, "directory": ckpt_dir, "plan": planner.plan, "format": "safetensors"}


# ---- `--config=span_lm/tools/safetensors_format.py:DIR`: the export's training config ----------


def get_config(arg: str | None = None):
  """The run config an export was trained with (config.json's run_config), set to import it:
  what main.py uses for --config.mode=import --config.import_from=DIR without --config."""
  from span_lm import run_dir  # pylint: disable=g-import-not-at-top
  directory = export_dir(arg or "")
  if directory is None:
    raise ValueError(f"{arg!r} is not an export directory (model.safetensors + config.json)")
  data = read_config(directory)
  run_config = data.get("run_config")
  if not isinstance(run_config, dict) or "model" not in run_config:
    raise ValueError(f"{os.path.join(directory, CONFIG_NAME)} holds no run_config; pass "
                     "--config=configs/FILE.py with the model's settings")
  config, _ = run_dir.upgrade(run_config)
  config.mode = "import"
  config.import_from = directory
  config.lock()
  return config


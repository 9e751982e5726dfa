"""An export directory read back (model.safetensors + config.json, as --config.mode=export writes
it; span_lm/tools/safetensors_format.py has the writer and the table of tensor names): checked
before a tensor is read, and made the start of a run: `init_from` for train.init_from=DIR.

It lives in train/ because the run loop needs it (train.init_from); the import mode
(safetensors_format.import_export) reads exports through it too.
"""
import json
import os

import numpy as np

from span_lm.layers import safetensors_io as sio

CONFIG_NAME = "config.json"
FORMAT = "span_lm.safetensors"
FORMAT_VERSION = 1


def export_dir(path) -> str | None:
  """The export directory `path` names (the directory, or its model.safetensors), else None."""
  path = os.fspath(path)
  if os.path.isdir(path) and os.path.isfile(os.path.join(path, sio.FILE_NAME)):
    return path
  if os.path.basename(path) == sio.FILE_NAME and os.path.isfile(path):
    return os.path.dirname(path) or "."
  return None


# ---- config.json and the tensors, checked --------------------------------------------------------


def read_config(directory) -> dict:
  """The export's config.json, checked to be one (one line otherwise)."""
  path = os.path.join(directory, CONFIG_NAME)
  try:
    if os.path.getsize(path) > sio.MAX_HEADER:
      raise ValueError(f"{path}: {os.path.getsize(path):,} bytes, too large for an export's "
                       "config.json")
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
  except FileNotFoundError:
    raise FileNotFoundError(f"{path}: no such file; {directory} is not a span_lm export "
                            f"(model.safetensors needs its {CONFIG_NAME})") from None
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ValueError(f"{path} is not JSON ({e})") from None
  if not isinstance(data, dict) or data.get("format") != FORMAT:
    raise ValueError(f"{path} is not a span_lm export's config (no \"format\": \"{FORMAT}\")")
  if data.get("format_version") != FORMAT_VERSION:
    raise ValueError(f"{path}: format_version {data.get('format_version')!r}; this span_lm "
                     f"reads version {FORMAT_VERSION}")
  for key in ("model", "dtype", "vocabulary", "step"):
    if key not in data:
      raise ValueError(f"{path} has no {key!r} entry")
  return data


def model_config(data: dict):
  from span_lm.model.config import ModelConfig  # pylint: disable=g-import-not-at-top
  try:
    return ModelConfig.from_config(data["model"])
  except (TypeError, ValueError) as e:
    raise ValueError(f"{CONFIG_NAME}: its model is not valid here: {e}") from None


def expected_tensors(model_cfg, dtype: str) -> dict[str, tuple[tuple[int, ...], str]]:
  """{name: (shape, dtype)} of the parameters `model_cfg` has (no array is allocated)."""
  import jax  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from span_lm.train import steps as steps_lib  # pylint: disable=g-import-not-at-top
  params = jax.eval_shape(lambda: steps_lib.init_state(model_cfg, optax.sgd(0.0), None, 1, 1, 0)
                          )["params"]
  return {k: (tuple(v.shape), dtype) for k, v in sio.flatten(params).items()}


def read_checked(directory) -> tuple[dict, object, dict]:
  """(config.json, ModelConfig, {name: numpy array}) of an export directory; every refusal is
  one line, made before a tensor is read."""
  sio.library()
  data = read_config(directory)
  cfg = model_config(data)
  dtype = str(data["dtype"])
  if dtype not in sio.DTYPES.values():
    raise ValueError(f"{CONFIG_NAME}: dtype {dtype!r} is not a safetensors float dtype")
  expected = expected_tensors(cfg, dtype)
  tensors = sio.read_tensors(os.path.join(directory, sio.FILE_NAME), expected)
  verify_fingerprints(data, tensors, directory)
  return data, cfg, tensors


def verify_fingerprints(data: dict, tensors: dict, directory: str = "") -> int:
  """Checks the tensors against config.json's fingerprints of the checkpoint they came from,
  where this span_lm knows the algorithm (span_lm/train/fingerprint.py) and the dtype is the
  checkpoint's; returns how many were checked. A difference is one line (a damaged file)."""
  fp = data.get("fingerprints")
  if not isinstance(fp, dict) or not isinstance(fp.get("tensors"), dict):
    return 0
  try:
    from span_lm.train import fingerprint as fingerprint_lib  # pylint: disable=g-import-not-at-top
  except ImportError:
    return 0
  if fp.get("algorithm") != fingerprint_lib.ALGORITHM or data.get("dtype") != data.get(
      "trained_dtype"):
    return 0
  checked = {k: v for k, v in fp["tensors"].items() if k in tensors}
  bad = sorted(k for k, v in checked.items() if fingerprint_lib.fingerprint_numpy(tensors[k]) != v)
  if bad:
    raise ValueError(f"{directory or 'the export'}: tensor(s) {', '.join(bad[:5])} differ from "
                     f"the fingerprints config.json holds of the checkpoint: the file is damaged "
                     f"(or was changed after export)")
  return len(checked)


# ---- into a run ----------------------------------------------------------------------------------


def plain(x):
  """x with JSON's types only (numpy scalars as Python's, anything else unknown as its str)."""
  if isinstance(x, dict):
    return {str(k): plain(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [plain(v) for v in x]
  if isinstance(x, (np.integer, np.floating)):
    return x.item()
  if x is None or isinstance(x, (str, int, float, bool)):
    return x
  return str(x)


def check_fits(run_cfg, data: dict, directory: str) -> None:
  """The run's model must be the export's (identity fields, and what changes its outputs)."""
  from span_lm import run_dir  # pylint: disable=g-import-not-at-top
  from span_lm.model.config import saved  # pylint: disable=g-import-not-at-top
  from span_lm.train import restore as train_restore  # pylint: disable=g-import-not-at-top
  try:
    train_restore.check_meta(run_cfg, {"model_cfg": data["model"]}, directory)
    diff = []
  except ValueError as e:  # its fields, one per line after the first
    diff = [l.strip().replace(": checkpoint ", ": export ") for l in str(e).splitlines()[1:]]
  mine = run_dir.flatten(plain(saved(run_cfg)))
  theirs = run_dir.flatten(data["model"])
  diff += [f"{k}: export {theirs.get(k)!r}, config {mine[k]!r}"
           for k in ("span.size", "span.ramp", "doc_boundary")
           if theirs.get(k) != mine[k] and not any(d.startswith(f"{k}:") for d in diff)]
  if diff:
    raise ValueError(f"the model in {directory} differs from the config's: {'; '.join(diff)} "
                     f"(leave --config out to use the export's own config)")


def check_vocabulary(run, data: dict, directory: str) -> None:
  tokens = list(data["vocabulary"].get("tokens") or [])
  if list(run.splits.vocab) != tokens:
    raise ValueError(f"the dataset {run.splits.name}'s vocabulary ({run.splits.vocab_size} "
                     f"tokens) is not the one {directory} was trained on ({len(tokens)} tokens, "
                     f"{data.get('dataset')}); token ids would mean other tokens")


def params_like(tensors: dict, abstract_params):
  """The tensors as the run's parameter tree, in its dtypes (unchanged when they agree)."""
  import jax  # pylint: disable=g-import-not-at-top
  flat = sio.flatten(abstract_params)
  out = {k: np.asarray(tensors[k]).astype(v.dtype, copy=False) for k, v in flat.items()}
  tree = sio.unflatten(out)
  return jax.tree.map(lambda _, x: x, abstract_params, tree)


def init_from(run, planner, path: str):
  """train.init_from=DIR of an export: a fresh state (optimizer too) holding its parameters and
  its span plan (step, data position and caches start anew)."""
  import jax  # pylint: disable=g-import-not-at-top
  from span_lm.train import metrics as metrics_lib  # pylint: disable=g-import-not-at-top
  directory = export_dir(path)
  data, _, tensors = read_checked(directory)
  check_fits(run.model_cfg, data, directory)
  check_vocabulary(run, data, directory)
  if data.get("planner"):
    planner.load_state_dict(data["planner"])
  planner.changes = 0
  state = run.init_state(planner.plan)
  _, abstract, shardings = run.abstract_state(planner.plan)
  params = jax.device_put(params_like(tensors, abstract["params"]), shardings["params"])
  state = dict(state, params=params, opt_state=jax.jit(
      run.tx.init, out_shardings=shardings["opt_state"])(params))
  metrics_lib.say(f"initialised from {directory} step {data['step']} (params and span plan; "
                  "the optimizer starts fresh)")
  return state

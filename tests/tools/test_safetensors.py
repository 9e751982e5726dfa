"""Safetensors export and import (span_lm/tools/safetensors_format.py, span_lm/train/
from_export.py, span_lm/layers/safetensors_io.py, examples/read_safetensors.py).

Fast: the names; the layer's save/load; every hostile file refused in one line before the library
reads it (nothing of a claimed 2^40 bytes is allocated); the example's log-probabilities against
span_lm's model on the same file; the format dispatch. Slow: real tiny runs of every architecture
exported, imported (bit-exact parameters, equal evaluation), main.py's import without --config
and train.init_from from an export.
"""
import copy
import importlib.util
import json
import os
import pathlib
import struct
import subprocess
import sys
import tracemalloc

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import reference_numpy as ref
import synthetic_run
from model_helpers import make_cfg
from span_lm import cli
from span_lm import layers
from span_lm.layers import safetensors_io as sio
from span_lm.model import caches as caches_lib
from span_lm.model.transformer import SpanTransformer
from span_lm.tools import safetensors_format as sf
from span_lm.train import from_export as fe

REPO = pathlib.Path(__file__).resolve().parents[2]


def _example():
  spec = importlib.util.spec_from_file_location("read_safetensors",
                                                REPO / "examples" / "read_safetensors.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def f32(tree):
  return jax.tree.map(lambda a: np.asarray(a, np.float32), tree)


def write_export(directory, cfg, params, vocab=None, dtype="float32"):
  """An export directory of `params` as mode=export writes it (config.json with the entries the
  readers use), without a training run."""
  vocab = vocab or [str(i) for i in range(cfg.vocab_size)]
  flat = {k: np.asarray(v).astype(dtype) for k, v in sio.flatten(params).items()}
  data = {"format": fe.FORMAT, "format_version": fe.FORMAT_VERSION, "span_lm_version": "test",
          "architecture": cfg.arch, "model": fe.plain(__import__("dataclasses").asdict(cfg)),
          "dtype": dtype, "trained_dtype": "float32",
          "n_parameters": sum(v.size for v in flat.values()),
          "vocabulary": {"kind": "words", "size": len(vocab), "tokens": vocab, "eos": "<eos>"},
          "dataset": "test", "spans": None, "planner": None, "step": 3, "evaluation": None,
          "fingerprints": None}
  return sf.write_dir(str(directory), flat, data)


# ------------------------------------------------------------------------------------------ names


def test_names_are_the_paths_and_read_back():
  cases = {("layers_3", "attn", "proj_query", "kernel"): "layers.3.attn.proj_query.kernel",
           ("in_emb", "emb_0"): "in_emb.emb.0", ("key_pe",): "key_pe",
           ("layers", "block_0", "ff", "fc1", "bias"): "layers.block.0.ff.fc1.bias",
           ("a_1_2",): "a_1.2", ("pos_emb_10",): "pos_emb.10"}
  for path, name in cases.items():
    assert sio.flat_name(path) == name
    assert sio.tree_path(name) == path
  for bad in [("a.b",), ("layers", "3"), ("",)]:
    with pytest.raises(ValueError, match="cannot be a safetensors name"):
      sio.flat_name(bad)


@pytest.mark.parametrize("kw", [
    {"span.mode": "adaptive"}, {"span.mode": "dynamic", "pers_mem": 2},
    {"adapt_io.enabled": True, "adapt_io.cutoffs": (4, 8), "adapt_io.div": 2},
    {"adapt_io.enabled": True, "adapt_io.cutoffs": (4, 8), "adapt_io.tied": True},
    {"arch": "sparse", "sparse.stride": 4, "sparse.c": 2},
    {"arch": "sparse", "sparse.stride": 4, "sparse.c": 2, "sparse.scan_layers": True}])
def test_the_name_table_names_every_tensor(kw):
  """Every part of every tensor name appears in safetensors_format's table (its docstring): a
  parameter added or renamed in the model without the table fails here."""
  import re  # pylint: disable=g-import-not-at-top
  words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", sf.__doc__))
  cfg = make_cfg(**kw)
  names = fe.expected_tensors(cfg, "float32")
  assert names
  for name in names:
    unnamed = [p for p in name.split(".") if not p.isdigit() and p not in words]
    assert not unnamed, f"{name}: {unnamed} not in the table of span_lm/tools/safetensors_format.py"


def test_fingerprints_are_copied_by_tensor_name():
  meta = {"fingerprints": {"algorithm": "sha256", "leaves": {
      "params/layers_0/attn/span_ratio": "ab", "opt_state/0/sum": "cd", "step": "ef"}}}
  fp = sf._fingerprints(meta)  # pylint: disable=protected-access
  assert fp["algorithm"] == "sha256"
  assert fp["tensors"] == {"layers.0.attn.span_ratio": "ab"}
  assert fp["leaves"] == {"params/layers_0/attn/span_ratio": "ab"}
  assert sf._fingerprints({}) is None  # pylint: disable=protected-access


# -------------------------------------------------------------------------------------- the layer


class _Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    for _ in range(2):
      x = x + layers.AdaptiveSpanAttention(num_heads=2, max_span=8, span_init=0.3)(x)
    return nn.Dense(5)(x)


def test_layer_parameters_save_and_load_bit_exact(tmp_path):
  x = jax.random.normal(jax.random.key(0), (1, 6, 8))
  model = _Block()
  params = model.init(jax.random.key(1), x)["params"]
  params = jax.tree.map(lambda p: p + 0.01 * jax.random.normal(jax.random.key(2), p.shape),
                        params)  # span ratios off their init, so a mix-up shows
  path = layers.save_safetensors(params, tmp_path / "layer.safetensors")
  header, _ = sio.read_header(path)
  assert "AdaptiveSpanAttention.0.span_ratio" in header
  assert "AdaptiveSpanAttention.1.query.kernel" in header
  back = layers.load_safetensors(path, like=jax.eval_shape(lambda: params))
  jax.tree.map(np.testing.assert_array_equal, back, jax.device_get(params))
  np.testing.assert_array_equal(model.apply({"params": back}, x),
                                model.apply({"params": params}, x))
  assert jax.tree.structure(layers.load_safetensors(path)) == jax.tree.structure(
      jax.tree.map(np.asarray, dict(params)))
  other = _Block().init(jax.random.key(1), jnp.zeros((1, 6, 8)))["params"]
  other = dict(other, Dense_0={"kernel": jnp.zeros((8, 6)), "bias": jnp.zeros(6)})
  with pytest.raises(sio.SafetensorsError, match=r"Dense\.0\.bias' has shape \(5,\), the model "
                     r"needs \(6,\)") as e:
    layers.load_safetensors(path, like=other)
  assert "\n" not in str(e.value)


# -------------------------------------------------------------------------------- hostile files


def _raw(header: dict, data: bytes, header_len=None) -> bytes:
  h = json.dumps(header).encode()
  return struct.pack("<Q", len(h) if header_len is None else header_len) + h + data


def _good():
  a = np.arange(6, dtype=np.float32).reshape(2, 3)
  b = np.arange(4, dtype=np.float32)
  header = {"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
            "b": {"dtype": "F32", "shape": [4], "data_offsets": [24, 40]}}
  return header, a.tobytes() + b.tobytes()


def _with(change):
  header, data = _good()
  header = copy.deepcopy(header)
  change(header)
  return _raw(header, data)


HOSTILE = {
    "overlapping offsets": (_with(lambda h: h["b"].update(data_offsets=[20, 36])), "overlap"),
    "out-of-range offsets": (_with(lambda h: h["b"].update(data_offsets=[24, 4000])),
                             "run past the 40 data bytes"),
    "2^40-byte tensor": (_with(lambda h: h["b"].update(shape=[2 ** 38],
                                                       data_offsets=[24, 24 + 2 ** 40])),
                         "run past"),
    "2^40-byte header": (_raw(*_good(), header_len=2 ** 40),
                         "claims a header of 1,099,511,627,776"),
    "bytes that are not shape x dtype": (_with(lambda h: h["b"].update(shape=[5])),
                                         "needs 20 bytes"),
    "a hole between tensors": (_with(lambda h: h["b"].update(data_offsets=[28, 44], shape=[4])),
                               "run past|belong to no tensor"),
    "unknown dtype": (_with(lambda h: h["a"].update(dtype="F8_E9")), "unknown dtype"),
    "negative shape": (_with(lambda h: h["a"].update(shape=[-2, 3])), "non-negative"),
    "header not JSON": (struct.pack("<Q", 4) + b"{{{{" + bytes(40), "not JSON"),
    "header a list": (_raw([], b""), "not an object"),
    "truncated": (b"\x10\x00\x00", "too short"),
    "a name twice": (struct.pack("<Q", 122) + (
        b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
        b'"a":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}}').ljust(122) + bytes(16),
                     "more than once"),
    "entry with an extra field": (_with(lambda h: h["a"].update(code="x")), "exactly dtype"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_file_is_refused_in_one_line_before_the_library_reads(tmp_path, monkeypatch,
                                                                         case):
  raw, why = HOSTILE[case]
  path = tmp_path / "model.safetensors"
  path.write_bytes(raw)
  lib = sio.library()
  monkeypatch.setattr(lib.numpy, "load_file", lambda *a, **k: pytest.fail("the library read it"))
  tracemalloc.start()
  try:
    with pytest.raises(sio.SafetensorsError, match=why) as e:
      sio.read_tensors(path)
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  assert "\n" not in str(e.value)
  assert peak < 1 << 20  # nothing of a claimed size was allocated


def test_the_model_card_says_what_a_reader_needs(tmp_path):
  cfg = make_cfg(**{"span.mode": "adaptive"})
  params = f32(ref.random_params(cfg, np.random.default_rng(3)))
  directory = write_export(tmp_path / "exp", cfg, params)
  data = json.loads(pathlib.Path(directory, "config.json").read_text())
  data.update(
      evaluation={"step": 3, "source": "metrics.jsonl full_valid/full_test", "valid_bpc": 1.23456,
                  "test_bpc": 1.5, "valid_tokens": 100, "test_tokens": 90},
      spans={"windows": [[5, 9, 12, 4], [16, 4, 4, 7]]},
      run_config={"seed": 7, "data": {"batch": 8, "block": 64},
                  "optim": {"name": "adagrad", "lr": 0.07, "warmup": 200, "grad_clip": 0.03},
                  "train": {}})
  card = sf.model_card(data, sio.flatten(params))
  assert "adaptive attention span" in card and "2 layers, d_model 16, 4 heads" in card
  assert "| valid | 1.2346 | 100 |" in card and "| test | 1.5000 | 90 |" in card
  assert "| 1 | 16 | 4 | 4 | 7 |" in card  # layer 1's windows
  assert "3 steps of 8 streams x 64 tokens; optimizer adagrad (lr 0.07" in card
  assert "--config.mode=import --config.import_from=THIS_DIR" in card
  data["evaluation"] = None
  assert "No full evaluation was recorded" in sf.model_card(data, sio.flatten(params))


def test_the_well_formed_file_reads(tmp_path):
  path = tmp_path / "model.safetensors"
  path.write_bytes(_raw(*_good()))
  got = sio.read_tensors(path, {"a": ((2, 3), "float32"), "b": ((4,), "float32")})
  np.testing.assert_array_equal(got["a"], np.arange(6, dtype=np.float32).reshape(2, 3))


def _export_cfg():
  return make_cfg(**{"span.mode": "adaptive", "vocab_size": 7})


def _tamper(directory, flat_change=None, config_change=None):
  """Rewrites an export's model.safetensors (through the library: a well-formed file) and/or its
  config.json."""
  lib = sio.library()
  path = os.path.join(directory, sio.FILE_NAME)
  if flat_change:
    flat = dict(lib.numpy.load_file(path))
    flat_change(flat)
    lib.numpy.save_file(flat, path)
  if config_change:
    cpath = os.path.join(directory, fe.CONFIG_NAME)
    data = json.loads(pathlib.Path(cpath).read_text())
    config_change(data)
    pathlib.Path(cpath).write_text(json.dumps(data))


MISMATCHED = {
    "a missing tensor": (lambda f: f.pop("layers.1.norm1.bias"), None,
                         "missing layers.1.norm1.bias"),
    "an extra tensor": (lambda f: f.update(extra=np.zeros(2, np.float32)), None,
                        "unexpected extra"),
    "another shape": (lambda f: f.update({"key_pe": np.zeros((4, 15), np.float32)}), None,
                      r"'key_pe' has shape \(4, 15\), the model needs \(4, 16\)"),
    "another dtype": (lambda f: f.update({"out_emb.bias": np.zeros(7, np.float16)}), None,
                      "'out_emb.bias' is float16, the model declares float32"),
    "a config of another model": (None, lambda d: d["model"].update(d_model=32),
                                  r"shape \(7, 16\), the model needs \(7, 32\)"),
    "a config that is not an export's": (None, lambda d: d.pop("format"),
                                         "not a span_lm export"),
    "a config of an invalid model": (None, lambda d: d["model"].update(n_heads=5),
                                     "n_heads=5: must divide"),
}


@pytest.mark.parametrize("case", sorted(MISMATCHED))
def test_a_file_that_is_not_the_configs_model_is_refused_in_one_line(tmp_path, monkeypatch, case):
  flat_change, config_change, why = MISMATCHED[case]
  cfg = _export_cfg()
  directory = write_export(tmp_path / "exp", cfg, f32(ref.random_params(
      cfg, np.random.default_rng(0))))
  _tamper(directory, flat_change, config_change)
  monkeypatch.setattr(sio.library().numpy, "load_file",
                      lambda *a, **k: pytest.fail("the library read it"))
  with pytest.raises(ValueError, match=why) as e:
    fe.read_checked(directory)
  assert "\n" not in str(e.value)


def test_a_tensor_that_differs_from_its_fingerprint_is_refused(tmp_path):
  fingerprint = pytest.importorskip("span_lm.train.fingerprint")  # issue 54's digests
  cfg = _export_cfg()
  params = f32(ref.random_params(cfg, np.random.default_rng(0)))
  directory = write_export(tmp_path / "exp", cfg, params)
  digests = {k: fingerprint.fingerprint_numpy(v) for k, v in sio.flatten(params).items()}
  _tamper(directory, config_change=lambda d: d.update(fingerprints={
      "algorithm": fingerprint.ALGORITHM, "tensors": digests}))
  data, _, tensors = fe.read_checked(directory)
  assert fe.verify_fingerprints(data, tensors) == len(digests)

  def flip(flat):
    flat["layers.0.attn.span_ratio"] = flat["layers.0.attn.span_ratio"] + np.float32(1e-3)
  _tamper(directory, flat_change=flip)
  with pytest.raises(ValueError, match=r"layers\.0\.attn\.span_ratio differ from the "
                     "fingerprints") as e:
    fe.read_checked(directory)
  assert "\n" not in str(e.value)


def test_main_refuses_a_hostile_import_in_one_line_before_building_the_run(tmp_path, capsys,
                                                                           monkeypatch):
  cfg = _export_cfg()
  directory = write_export(tmp_path / "exp", cfg, f32(ref.random_params(
      cfg, np.random.default_rng(0))))
  path = os.path.join(directory, sio.FILE_NAME)
  raw = bytearray(pathlib.Path(path).read_bytes())
  n = struct.unpack("<Q", raw[:8])[0]
  header = json.loads(raw[8:8 + n])
  header["key_pe"]["data_offsets"][1] += 2 ** 40
  pathlib.Path(path).write_bytes(_raw(header, bytes(raw[8 + n:])))
  from span_lm.train import run as run_lib  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(run_lib, "Run", lambda *a, **k: pytest.fail("a run was built"))
  config = synthetic_run.config_for(tmp_path / "run", {"mode": "import",
                                                       "import_from": directory})
  assert cli.main(config) == cli.EXIT_ERROR
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "'key_pe'" in err[0] and "out of range" in err[0], err


def test_import_refuses_another_model_or_vocabulary_in_one_line(tmp_path, monkeypatch):
  from span_lm.model.config import ModelConfig  # pylint: disable=g-import-not-at-top
  from span_lm.train import run as run_lib  # pylint: disable=g-import-not-at-top
  config = synthetic_run.config_for(tmp_path / "run")
  cfg = ModelConfig.from_config(config.model, vocab_size=16)
  params = sio.unflatten({k: np.zeros(shape, np.float32)  # the run's model, in zeros
                          for k, (shape, _) in fe.expected_tensors(cfg, "float32").items()})
  other = make_cfg(vocab_size=16)
  small = write_export(tmp_path / "small", other, f32(ref.random_params(
      other, np.random.default_rng(0))))
  real_run = run_lib.Run
  monkeypatch.setattr(run_lib, "Run", lambda *a, **k: pytest.fail("a run was built"))
  with pytest.raises(ValueError, match=r"differs from the config's: d_model: export 16, config "
                     r"32; n_heads: export 4, config 2;.* span.size: export 16, config 64") as e:
    cli.run(synthetic_run.config_for(tmp_path / "a", {"mode": "import", "import_from": small}))
  assert "\n" not in str(e.value)
  monkeypatch.setattr(run_lib, "Run", real_run)
  words = write_export(tmp_path / "words", cfg, params, [f"w{i}" for i in range(16)])
  with pytest.raises(ValueError, match="is not the one .* was trained on") as e:
    cli.run(synthetic_run.config_for(tmp_path / "b", {"mode": "import", "import_from": words}))
  assert "\n" not in str(e.value)
  assert not os.listdir(tmp_path / "b" / "checkpoints")


def test_without_the_library_the_mode_is_refused_naming_pip(tmp_path, monkeypatch, capsys):
  monkeypatch.setitem(sys.modules, "safetensors", None)
  monkeypatch.setitem(sys.modules, "safetensors.numpy", None)
  with pytest.raises(ImportError, match=r"pip install 'safetensors"):
    sio.library()
  cfg = _export_cfg()
  (tmp_path / "exp").mkdir()
  (tmp_path / "exp" / sio.FILE_NAME).write_bytes(_raw(*_good()))
  config = synthetic_run.config_for(tmp_path / "run", {"mode": "import",
                                                       "import_from": str(tmp_path / "exp")})
  del cfg
  assert cli.main(config) == cli.EXIT_ERROR
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "pip install 'safetensors" in err[0], err


def test_a_saved_null_field_takes_a_value_from_the_command_line(tmp_path):
  """A run's config.json holds export_to: null; main.py's --config.export_to=DIR on it (no
  --config) needs the field's type back to parse DIR."""
  from span_lm import run_dir  # pylint: disable=g-import-not-at-top
  work = tmp_path / "run"
  work.mkdir()
  (work / "config.json").write_text(synthetic_run.config_for(work).to_json_best_effort())
  config = run_dir.load_saved(str(work))
  assert config.export_to is None and config.tools.step is None
  assert config.get_ref("export_to").get_type() is str
  assert config.tools.get_ref("step").get_type() is int
  config.export_to, config.tools.step = "out", 3  # what the flag parser does, type-checked
  with pytest.raises(TypeError):
    config.tools.step = "three"


def test_formats_are_chosen_by_suffix_and_refused_in_one_line(tmp_path):
  pick = lambda **kw: sf.export_format(synthetic_run.config_for(tmp_path, kw))
  assert pick(export_to="m.pt") == "pt"
  assert pick(export_to="exported") == "safetensors"
  assert pick(export_to="m.bin", export_format="pt") == "pt"
  with pytest.raises(ValueError, match="writes a directory"):
    pick(export_to="m.pt", export_format="safetensors")
  with pytest.raises(ValueError, match="choose one of"):
    pick(export_to="x", export_format="onnx")
  (tmp_path / "empty").mkdir()
  with pytest.raises(ValueError, match="a directory without model.safetensors"):
    sf.import_source(tmp_path / "empty")
  (tmp_path / "w.safetensors").write_bytes(b"")
  with pytest.raises(ValueError, match="a bare .safetensors file"):
    sf.import_source(tmp_path / "w.safetensors")
  assert sf.import_source(tmp_path / "m.pt") == "pt"


# ----------------------------------------------------------------- the example: numpy + safetensors


@pytest.mark.parametrize("kw", [{"span.mode": "adaptive"}, {"span.mode": "fixed"},
                                {"span.mode": "adaptive", "pers_mem": 3, "d_ff": 0}])
def test_the_example_computes_span_lms_log_probabilities(tmp_path, kw):
  cfg = make_cfg(vocab_size=9, **kw)
  params = f32(ref.random_params(cfg, np.random.default_rng(1)))
  vocab = [f"w{i}" for i in range(8)] + ["<eos>"]
  directory = write_export(tmp_path / "exp", cfg, params, vocab)
  text = "w1 w2 w3 w0 w7\nw5 w5 w6 w2 w1 w4 w3"
  ids, logp = _example().log_probs(directory, text)
  assert list(ids[:6]) == [1, 2, 3, 0, 7, 8]  # the newline is <eos>
  _, _, tensors = fe.read_checked(directory)
  back = sio.unflatten(tensors)
  model = SpanTransformer(cfg)
  want, _, _ = model.apply({"params": back}, jnp.asarray(ids[None], jnp.int32),
                           caches_lib.init_caches(cfg, None, 1))
  np.testing.assert_allclose(logp, np.asarray(want[0], np.float64), rtol=0, atol=1e-5)


def test_the_example_runs_without_span_lm_or_jax(tmp_path):
  cfg = make_cfg(vocab_size=9, **{"span.mode": "adaptive", "pers_mem": 2})
  vocab = [f"w{i}" for i in range(8)] + ["<eos>"]
  directory = write_export(tmp_path / "exp", cfg, f32(ref.random_params(
      cfg, np.random.default_rng(2))), vocab)
  text = "w1 w2 w3 w0 w7 w5"
  probe = ("import runpy, sys\n"
           "for m in ('span_lm', 'jax', 'flax', 'torch'): sys.modules[m] = None  # unimportable\n"
           f"sys.argv = ['read_safetensors.py', {directory!r}, {text!r}]\n"
           f"runpy.run_path({str(REPO / 'examples' / 'read_safetensors.py')!r}, "
           "run_name='__main__')\n")
  p = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True,
                     text=True, timeout=300)
  assert p.returncode == 0, p.stderr[-2000:]
  ids, logp = _example().log_probs(directory, text)
  bits = -logp[np.arange(len(ids) - 1), ids[1:]].mean() / np.log(2)
  assert p.stdout.strip().splitlines()[-1] == f"bits per token over 5 tokens: {bits:.4f}"


def test_the_example_refuses_what_it_cannot_run(tmp_path):
  cfg = make_cfg(**{"span.mode": "dynamic"})
  directory = write_export(tmp_path / "exp", cfg, f32(ref.random_params(
      cfg, np.random.default_rng(1))))
  with pytest.raises(SystemExit, match="span mode 'dynamic'"):
    _example().log_probs(directory, "1 2")


# -------------------------------------------------------------- real runs, every architecture

ARCHS = {
    "span": {},
    "pers_mem": {"model.pers_mem": 4},
    "adaptive_io": {"model.adapt_io.enabled": True, "model.adapt_io.cutoffs": (4, 8),
                    "model.adapt_io.div": 2},
    "sparse": {"model.arch": "sparse", "model.sparse.context": 16, "model.sparse.stride": 4,
               "model.sparse.c": 2},
}


def _params_of(workdir):
  from span_lm.tools import restore as restore_lib  # pylint: disable=g-import-not-at-top
  from span_lm import run_dir  # pylint: disable=g-import-not-at-top
  config = run_dir.load_saved(str(workdir))
  return jax.device_get(restore_lib.restore(config).params)


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_export_import_is_bit_exact_and_evaluates_the_same(tmp_path, arch):
  extra = ARCHS[arch]
  run = tmp_path / "run"
  cli.run(synthetic_run.config_for(run, extra))
  exp = tmp_path / "exp"
  out = cli.run(synthetic_run.config_for(run, extra, {"mode": "export", "export_to": str(exp)}))
  assert out == str(exp) and sorted(os.listdir(exp)) == ["README.md", "config.json",
                                                         "model.safetensors"]
  data = json.loads((exp / "config.json").read_text())
  metrics = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
  full = {r["split"]: r for r in metrics if r["split"].startswith("full_")}
  assert data["evaluation"]["valid_bpc"] == full["full_valid"]["bpc"]
  assert data["evaluation"]["test_bpc"] == full["full_test"]["bpc"]
  assert f"{full['full_test']['bpc']:.4f}" in (exp / "README.md").read_text()
  assert data["step"] == 6 and data["architecture"] == ("sparse" if arch == "sparse" else "span")
  assert data["fingerprints"] is None or "tensors" in data["fingerprints"]
  assert len(data["vocabulary"]["tokens"]) == data["model"]["vocab_size"]
  if arch == "span":
    assert np.asarray(data["spans"]["windows"]).shape == (2, 2)
  exported = _params_of(run)
  header, _ = sio.read_header(exp / "model.safetensors")
  assert set(header) == set(sio.flatten(exported))

  imported = tmp_path / "imported"
  res = cli.run(synthetic_run.config_for(imported, extra, {"mode": "import",
                                                           "import_from": str(exp)}))
  assert res["step"] == 6
  jax.tree.map(np.testing.assert_array_equal, _params_of(imported), exported)
  mine = cli.run(synthetic_run.config_for(run, extra, {"mode": "eval"}))
  theirs = cli.run(synthetic_run.config_for(imported, extra, {"mode": "eval"}))
  for split in ("valid", "test"):
    assert theirs[split]["loss"] == mine[split]["loss"], split

  if arch in ("span", "pers_mem"):  # the example on the trained model, from the files alone
    text = " ".join(data["vocabulary"]["tokens"][i % 16] for i in range(40))
    ids, logp = _example().log_probs(str(exp), text)
    cfg = fe.model_config(data)
    want, _, _ = SpanTransformer(cfg).apply(
        {"params": exported}, jnp.asarray(ids[None], jnp.int32),
        caches_lib.init_caches(cfg, None, 1))
    np.testing.assert_allclose(logp, np.asarray(want[0], np.float64), rtol=0, atol=1e-5)


@pytest.mark.slow
def test_main_import_without_config_bfloat16_export_and_init_from(tmp_path):
  run = tmp_path / "run"
  cli.run(synthetic_run.config_for(run))
  exp = tmp_path / "exp"
  env = dict(os.environ, PYTHONPATH=str(REPO))
  main = lambda *a: subprocess.run([sys.executable, str(REPO / "main.py"), *a], cwd=REPO,
                                   env=env, capture_output=True, text=True, timeout=600)
  p = main(f"--config.workdir={run}", "--config.mode=export", f"--config.export_to={exp}")
  assert p.returncode == 0, p.stderr[-2000:]
  p = main(f"--config.workdir={run}", "--config.mode=export", f"--config.export_to={exp}")
  assert p.returncode == 1 and p.stderr.strip().splitlines()[-1].startswith("error: ")
  p = main(f"--config.workdir={tmp_path / 'new'}", "--config.mode=import",
           f"--config.import_from={exp}")  # no --config: the export's own
  assert p.returncode == 0, p.stderr[-2000:]
  jax.tree.map(np.testing.assert_array_equal, _params_of(tmp_path / "new"), _params_of(run))
  saved = json.loads((tmp_path / "new" / "config.json").read_text())
  assert (saved["mode"], saved["import_from"]) == ("train", None)  # `--config.workdir=new` trains

  half = tmp_path / "half"
  cli.run(synthetic_run.config_for(run, {"mode": "export", "export_to": str(half),
                                         "tools.dtype": "bfloat16"}))
  header, _ = sio.read_header(half / "model.safetensors")
  assert {t["dtype"] for t in header.values()} == {"BF16"}
  _, _, tensors = fe.read_checked(str(half))
  want = {k: np.asarray(jnp.asarray(v).astype(jnp.bfloat16)) for k, v in
          sio.flatten(_params_of(run)).items()}
  for k, v in want.items():
    np.testing.assert_array_equal(tensors[k], v, err_msg=k)

  phase = tmp_path / "phase2"
  out = cli.run(synthetic_run.config_for(phase, {"train.init_from": str(exp), "train.steps": 1,
                                                 "optim.lr": 1e-30}))  # a step that moves nothing
  assert out["step"] == 1
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-20),
               _params_of(phase), _params_of(run))

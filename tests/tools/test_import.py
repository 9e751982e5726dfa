"""Reference-checkpoint import/export (span_lm/tools): mapping, optimizer state, refusals, CLI.

The reference checkpoints here are written key by key from the reference's module definitions
(facebookresearch/adaptive-span models.py: torch Linear stores weight = kernel.T; key_pe is
(1, Dh, S); span ratios are (H, 1, 1)), with torch.save when torch is installed and with the
torch-free writer otherwise, so CI without torch still tests the mapping. The imported model is
checked against the independent numpy forward pass of tests/reference_numpy.py.
"""
import collections
import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import reference_numpy as ref
from model_helpers import build
from span_lm import cli
from span_lm import config as config_lib
from span_lm.model.transformer import SpanTransformer
from span_lm.tools import reference_checkpoint as rc
from span_lm.tools import torch_format
from span_lm.train import optimizer as optimizer_lib
from span_lm.train.checkpoint import Checkpointer

try:
  import torch  # pylint: disable=g-import-not-at-top
except ImportError:
  torch = None


def make_cfg(**kw):
  return build({"vocab_size": 11, "d_model": 16, "n_layers": 2, "n_heads": 4, "d_ff": 24,
                "span.size": 16, "span.mode": "adaptive", "span.ramp": 4, "span.loss": 0.0,
                "pers_mem": 0}, **kw)


def f32(tree):
  return jax.tree.map(lambda a: np.asarray(a, np.float32), tree)


def reference_state_dict(cfg, p):
  """The reference's state_dict (DataParallel keys) holding span_lm params `p`, key by key."""
  sd = collections.OrderedDict()
  sd["key_pe"] = p["key_pe"][None]
  sd["in_emb.weight"] = p["in_emb"]["embedding"]
  sd["out_emb.weight"] = p["out_emb"]["kernel"].T
  sd["out_emb.bias"] = p["out_emb"]["bias"]
  for i in range(cfg.n_layers):
    a, r = p[f"layers_{i}"], f"layers.{i}."
    mask = r + "attn.attn.adaptive_span._mask."
    if cfg.span.mode == "adaptive":
      sd[mask + "current_val"] = a["attn"]["span_ratio"][:, None, None]
      sd[mask + "mask_template"] = np.linspace(1 - cfg.span.size, 0, cfg.span.size)
    if cfg.pers_mem:
      sd[r + "attn.attn.persistent_memory.key"] = a["attn"]["pers_key"]
      sd[r + "attn.attn.persistent_memory.val"] = a["attn"]["pers_val"]
      if cfg.span.mode == "adaptive":  # the reference registers the same module there too
        for n in ("current_val", "mask_template"):
          sd[f"{r}attn.attn.persistent_memory.adaptive_span._mask.{n}"] = sd[mask + n]
    for n in ("proj_query", "proj_out", "proj_val", "proj_key"):
      sd[f"{r}attn.{n}.weight"] = a["attn"][n]["kernel"].T
    sd[r + "norm1.weight"], sd[r + "norm1.bias"] = a["norm1"]["scale"], a["norm1"]["bias"]
    if not cfg.pers_mem:
      for n in ("fc1", "fc2"):
        sd[f"{r}ff.{n}.weight"] = a["ff"][n]["kernel"].T
        sd[f"{r}ff.{n}.bias"] = a["ff"][n]["bias"]
      sd[r + "norm2.weight"], sd[r + "norm2.bias"] = a["norm2"]["scale"], a["norm2"]["bias"]
  return collections.OrderedDict(("module." + k, np.ascontiguousarray(v, np.float32))
                                 for k, v in sd.items())


def parameter_keys(sd):
  """model.parameters() order: state_dict order without buffers and second names."""
  return [k for k in sd if not k.endswith("mask_template")
          and ".persistent_memory.adaptive_span." not in k]


def adagrad_state(sd, step):
  """torch Adagrad's state_dict with distinguishable `sum` buffers (sum_i = w_i**2 + i)."""
  keys = parameter_keys(sd)
  state = {i: {"step": step, "sum": sd[k] ** 2 + i} for i, k in enumerate(keys)}
  return {"state": state, "param_groups": [{"params": list(range(len(keys))), "lr": 0.07}]}


def write(obj, path, legacy=False):
  """As the reference saves (torch.save when torch is here; else the torch-free writer)."""
  torch_format.save(obj, path, use_torch=torch is not None and not legacy, legacy=legacy)
  return str(path)


def apply(cfg, params, tokens, caches):
  model = SpanTransformer(cfg)
  return jax.jit(lambda p, t, c: model.apply({"params": p}, t, c))(params, tokens, caches)


# ------------------------------------------------------------------------------------- mapping


@pytest.mark.parametrize("kw, legacy", [
    (dict(), False),
    ({"span.mode": "fixed"}, True),  # the pre-1.6 file format of the published models
    (dict(pers_mem=5, d_ff=0, n_layers=1), False),
])
def test_import_places_every_tensor_and_matches_numpy_forward(tmp_path, kw, legacy):
  cfg = make_cfg(**kw)
  rng = np.random.default_rng(0)
  known = f32(ref.random_params(cfg, rng))
  sd = reference_state_dict(cfg, known)
  path = write({"iter_no": 3, "model": sd, "optimizer": adagrad_state(sd, 7), "logger": {}},
               tmp_path / "ref.pt", legacy)
  got_sd, opt_sd, rest = rc.read(path)
  rc.check_fits(got_sd, cfg)
  params = rc.to_span_lm(got_sd, cfg)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), params, known)
  assert rest["iter_no"] == 3 and opt_sd["param_groups"][0]["lr"] == 0.07

  tokens = rng.integers(cfg.vocab_size, size=(2, 8))
  caches = tuple(rng.normal(size=(2, cfg.span.size, cfg.d_model)) for _ in range(cfg.n_layers))
  logp, _, _ = apply(cfg, params, tokens, tuple(jnp.asarray(c, jnp.float32) for c in caches))
  want, _, _ = ref.forward(cfg, known, tokens, caches)
  np.testing.assert_allclose(np.asarray(logp, np.float64), want, rtol=2e-5, atol=2e-5)


def test_import_without_module_prefix_and_export_round_trip():
  cfg = make_cfg(pers_mem=3, d_ff=0)
  known = f32(ref.random_params(cfg, np.random.default_rng(1)))
  bare = collections.OrderedDict((k[len("module."):], v)
                                 for k, v in reference_state_dict(cfg, known).items())
  back = rc.to_span_lm(rc.strip_prefix(bare), cfg)
  exported = rc.to_reference(back, cfg)
  assert list(exported) == list(reference_state_dict(cfg, known))  # keys and order
  again = rc.to_span_lm(rc.strip_prefix(exported), cfg)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), again, known)


def test_optimizer_state_lands_on_its_parameter():
  cfg = make_cfg(pers_mem=3, d_ff=0)
  known = f32(ref.random_params(cfg, np.random.default_rng(2)))
  sd = rc.strip_prefix(reference_state_dict(cfg, known))
  kind, step, bufs = rc.optimizer_buffers(adagrad_state(reference_state_dict(cfg, known), 9),
                                          cfg, known)
  assert (kind, step) == ("adagrad", 9)
  tx, _ = optimizer_lib.make_optimizer({"name": "adagrad", "lr": 0.07, "grad_clip": 0.03})
  state = rc.fill_opt_state(tx.init(known), kind, step, bufs)
  assert isinstance(state, optimizer_lib.ReferenceAdagradState) and int(state.count) == 9
  ordered = parameter_keys(reference_state_dict(cfg, known))
  i = ordered.index("module.layers.1.attn.proj_val.weight")
  np.testing.assert_array_equal(state.sum["layers_1"]["attn"]["proj_val"]["kernel"],
                                (sd["layers.1.attn.proj_val.weight"] ** 2 + i).T)
  i = ordered.index("module.layers.0.attn.attn.adaptive_span._mask.current_val")
  np.testing.assert_array_equal(state.sum["layers_0"]["attn"]["span_ratio"],
                                known["layers_0"]["attn"]["span_ratio"] ** 2 + i)
  # And back: export writes the same buffers in the same order.
  opt = rc.reference_optimizer(state, cfg, config_lib.load_config("configs/tiny.py").optim)
  for j, k in enumerate(ordered):
    np.testing.assert_array_equal(opt["state"][j]["sum"], sd[k[len("module."):]] ** 2 + j)
  # A config with another optimizer cannot take Adagrad's buffers.
  adam, _ = optimizer_lib.make_optimizer({"name": "adam", "lr": 1e-3})
  with pytest.raises(ValueError, match="optim.name='adagrad'"):
    rc.fill_opt_state(adam.init(known), kind, step, bufs)


def test_refuses_a_checkpoint_that_does_not_fit():
  cfg = make_cfg()
  known = f32(ref.random_params(cfg, np.random.default_rng(3)))
  sd = rc.strip_prefix(reference_state_dict(cfg, known))
  for field, value in (("d_ff", 32), ("n_heads", 2), ("span.size", 32), ("n_layers", 3),
                       ("pers_mem", 4), ("vocab_size", 12)):
    with pytest.raises(ValueError, match=rf"config\.model\.{field}={value}"):
      rc.check_fits(sd, make_cfg(**{field: value}))
  with pytest.raises(ValueError, match=r"config\.model\.span\.mode='fixed'"):
    rc.check_fits(sd, make_cfg(**{"span.mode": "fixed"}))
  bad = collections.OrderedDict(sd, **{"layers.0.ff.fc1.bias": np.zeros(23, np.float32)})
  with pytest.raises(ValueError, match=r"layers\.0\.ff\.fc1\.bias: checkpoint \(23,\)"):
    rc.check_fits(bad, cfg)
  extra = collections.OrderedDict(sd, **{"layers.0.extra": np.zeros(1, np.float32)})
  with pytest.raises(ValueError, match=r"layers\.0\.extra: unexpected"):
    rc.check_fits(extra, cfg)
  swapped = collections.OrderedDict(sorted(sd.items()))
  with pytest.raises(ValueError, match="order"):
    rc.check_fits(swapped, cfg)


# --------------------------------------------------------------------------- real torch files


@pytest.mark.skipif(torch is None, reason="torch is not installed (optional)")
@pytest.mark.parametrize("legacy", [False, True])
def test_torch_free_reader_reads_torch_save(tmp_path, legacy):
  t = torch.randn(4, 5)
  obj = {"model": collections.OrderedDict(w=t, wt=t.t(), part=t[1:3, 2:], same=t,
                                          bf=torch.randn(3).bfloat16(), n=torch.arange(3)),
         "optimizer": {"state": {0: {"step": torch.tensor(4.0), "sum": t}}}, "iter_no": 2}
  torch.save(obj, tmp_path / "t.pt", _use_new_zipfile_serialization=not legacy)
  got = torch_format.load(tmp_path / "t.pt", allow_torch=False)
  for k, v in obj["model"].items():
    np.testing.assert_array_equal(got["model"][k], v.float().numpy())
  assert list(got["model"]) == list(obj["model"]) and got["iter_no"] == 2
  assert int(got["optimizer"]["state"][0]["step"]) == 4


@pytest.mark.skipif(torch is None, reason="torch is not installed (optional)")
@pytest.mark.parametrize("legacy", [False, True])
def test_torch_loads_the_torch_free_writer(tmp_path, legacy):
  a = np.arange(12, dtype=np.float32).reshape(3, 4)
  torch_format.save({"model": collections.OrderedDict(a=a.T), "step": 3}, tmp_path / "o.pt",
                    legacy=legacy)
  got = torch.load(tmp_path / "o.pt", weights_only=True)
  np.testing.assert_array_equal(got["model"]["a"].numpy(), a.T)
  assert got["step"] == 3


@pytest.mark.skipif(torch is None, reason="torch is not installed (optional)")
def test_parameter_order_is_torchs(tmp_path):
  """torch modules registered as the reference's (models.py, adaptive_span.py,
  persistent_memory.py): model.parameters() and the optimizer's indices are what span_lm assumes."""
  nn = torch.nn
  cfg = make_cfg(pers_mem=3, d_ff=0)

  class Mask(nn.Module):
    def __init__(self):
      super().__init__()
      self.current_val = nn.Parameter(torch.rand(cfg.n_heads, 1, 1))
      self.register_buffer("mask_template", torch.linspace(1 - cfg.span.size, 0, cfg.span.size))

  class Span(nn.Module):
    def __init__(self):
      super().__init__()
      self._mask = Mask()

  class Pers(nn.Module):
    def __init__(self):
      super().__init__()
      self.key = nn.Parameter(torch.randn(cfg.n_heads, cfg.head_dim, cfg.pers_mem))
      self.val = nn.Parameter(torch.randn(cfg.n_heads, cfg.pers_mem, cfg.head_dim))
      self.dropout = nn.Dropout(0.1)
      self.adaptive_span = None

  class SeqAttention(nn.Module):
    def __init__(self):
      super().__init__()
      self.dropout = nn.Dropout(0.1)
      self.adaptive_span = Span()
      self.persistent_memory = Pers()
      self.persistent_memory.adaptive_span = self.adaptive_span

  class MultiHead(nn.Module):
    def __init__(self):
      super().__init__()
      self.attn = SeqAttention()
      d = cfg.d_model
      for n in ("proj_query", "proj_out", "proj_val", "proj_key"):
        setattr(self, n, nn.Linear(d, d, bias=False))

  class Layer(nn.Module):
    def __init__(self):
      super().__init__()
      self.attn = MultiHead()
      self.norm1 = nn.LayerNorm(cfg.d_model)
      self.ff = None

  class Seq(nn.Module):
    def __init__(self):
      super().__init__()
      self.in_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
      self.out_emb = nn.Linear(cfg.d_model, cfg.vocab_size)
      self.key_pe = nn.Parameter(torch.randn(1, cfg.head_dim, cfg.span.size))
      self.layers = nn.ModuleList(Layer() for _ in range(cfg.n_layers))

  model = nn.DataParallel(Seq())
  opt = torch.optim.Adagrad(model.parameters(), lr=0.07)
  for i, p in enumerate(model.parameters()):
    p.grad = torch.full_like(p, float(i + 1))
  opt.step()
  torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "iter_no": 0},
             tmp_path / "m.pt")
  sd, opt_sd, _ = rc.read(tmp_path / "m.pt")
  rc.check_fits(sd, cfg)
  params = rc.to_span_lm(sd, cfg)
  kind, step, bufs = rc.optimizer_buffers(opt_sd, cfg, params)
  assert (kind, step) == ("adagrad", 1)
  names = [n[len("module."):] for n, _ in model.named_parameters()]
  entries = {e.key: e for e in rc.reference_entries(cfg)}
  for i, name in enumerate(names):  # sum = grad**2 = (i + 1)**2 everywhere, if the order holds
    leaf = rc._get(bufs["sum"], entries[name].path)  # pylint: disable=protected-access
    np.testing.assert_array_equal(leaf, np.full(leaf.shape, (i + 1.0) ** 2, np.float32),
                                  err_msg=name)


# -------------------------------------------------------------------------------- main.py modes


def _config(tmp_path, mode, **overrides):
  base = {"workdir": str(tmp_path / "run"), "mode": mode, "data.synthetic_length": 20_000,
          "data.synthetic_vocab": 11, "data.block": 8, "data.batch": 8, "data.eval_batch": 8,
          "model.n_layers": 1, "model.d_model": 16, "model.n_heads": 4, "model.d_ff": 24,
          "model.span.size": 16, "model.span.ramp": 4, "model.span.init": 0.0, "model.span.loss": 0.0,
          "train.log_every": 1, "train.eval_every": 2, "train.eval_batches": 1,
          "train.checkpoint_every": 2, "train.tensorboard": False, "train.full_eval_at_end": False}
  base.update(overrides)
  c = config_lib.load_config("configs/synthetic.py", base)
  config_lib.validate(c)
  return c


@pytest.mark.slow
def test_main_import_eval_resume_export(tmp_path):
  cfg = make_cfg(n_layers=1)
  known = f32(ref.random_params(cfg, np.random.default_rng(4)))
  sd = reference_state_dict(cfg, known)
  src = write({"iter_no": 0, "model": sd, "optimizer": adagrad_state(sd, 5), "logger": {}},
              tmp_path / "ref.pt")
  out = cli.run(_config(tmp_path, "import", import_from=src))
  assert out["step"] == 5 and out["optimizer"] == "adagrad"
  with Checkpointer(str(tmp_path / "run" / "checkpoints")) as ckpt:
    assert ckpt.all_steps() == [5]
    meta = ckpt.restore_meta()
  assert meta["data"]["train"] == {"pos": 0, "restarts": 0} and meta["step"] == 5

  res = cli.run(_config(tmp_path, "eval"))  # what main.py --config.mode=eval runs
  assert res["step"] == 5 and np.isfinite(res["test"]["loss"])

  with pytest.raises(FileExistsError, match="never overwritten"):  # not over a checkpoint
    cli.run(_config(tmp_path, "import", import_from=src))

  dest = cli.run(_config(tmp_path, "export", export_to=str(tmp_path / "back.pt")))
  back, back_opt, rest = rc.read(dest)
  assert list(back) == [k[len("module."):] for k in sd]
  for k, v in sd.items():
    np.testing.assert_array_equal(back[k[len("module."):]], v, err_msg=k)
  for i, st in adagrad_state(sd, 5)["state"].items():
    np.testing.assert_array_equal(back_opt["state"][i]["sum"], st["sum"])
    assert int(back_opt["state"][i]["step"]) == 5
  with pytest.raises(FileExistsError):
    cli.run(_config(tmp_path, "export", export_to=dest))

  trained = cli.run(_config(tmp_path, "train", **{"train.steps": 6}))  # resumes at step 5
  assert trained["step"] == 6 and int(trained["state"]["opt_state"].count) == 6


def test_main_import_refuses_other_vocabulary(tmp_path):
  cfg = make_cfg(vocab_size=12, n_layers=1)
  sd = reference_state_dict(cfg, f32(ref.random_params(cfg, np.random.default_rng(5))))
  src = write({"model": sd}, tmp_path / "ref.pt")
  with pytest.raises(ValueError, match="vocabulary has 12 tokens"):
    cli.run(_config(tmp_path, "import", import_from=src))
  assert not os.listdir(tmp_path / "run" / "checkpoints")


# ----------------------------------------- committed files written by torch.save itself (no torch)
# bench/golden_trajectory.py wrote these with torch 2.13 through the reference's own
# utils.save_checkpoint (zip) and torch.save(..., _use_new_zipfile_serialization=False) (legacy),
# after 3 Adagrad steps of a 1-layer model; expected.npz holds their tensors as numpy arrays.
TORCH_FILES = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "golden" / "torch_files"


def _expected(case):
  f = np.load(TORCH_FILES / "expected.npz")
  return {k[len(case) + 1:]: f[k] for k in f.files if k.startswith(case + "/")}


@pytest.mark.parametrize("fmt", ["zip", "legacy"])
@pytest.mark.parametrize("case", ["adaptive", "pers"])
def test_reads_real_torch_save_files(case, fmt):
  obj = torch_format.load(TORCH_FILES / f"{case}_{fmt}.pt", allow_torch=False)
  exp = _expected(case)
  assert set(obj) == {"iter_no", "model", "optimizer", "logger", "scheduler_iter"}
  assert obj["iter_no"] == int(exp["iter_no"])
  assert obj["scheduler_iter"] == int(exp["scheduler_iter"])
  assert obj["logger"] == json.loads(str(exp["logger"]))
  model_keys = [k[len("model/"):] for k in exp if k.startswith("model/")]
  assert list(obj["model"]) == model_keys and model_keys[0].startswith("module.")
  for k in model_keys:
    assert obj["model"][k].dtype == np.float32
    np.testing.assert_array_equal(obj["model"][k], exp["model/" + k])
  state = obj["optimizer"]["state"]
  assert sorted(state) == list(range(len(state))) == obj["optimizer"]["param_groups"][0]["params"]
  for i, st in state.items():
    np.testing.assert_array_equal(st["sum"], exp[f"optimizer/{i}/sum"])
    assert float(st["step"]) == float(exp[f"optimizer/{i}/step"]) == 3.0
  assert obj["optimizer"]["param_groups"][0]["grad_clip"] == 0.03


@pytest.mark.parametrize("fmt", ["zip", "legacy"])
@pytest.mark.parametrize("case", ["adaptive", "pers"])
def test_real_torch_files_import_and_export_round_trip(tmp_path, case, fmt):
  """Importer: shapes, order and optimizer buffers of torch's own files; exporter: writes the
  same checkpoint back (same format), which reads back equal to the torch-written original."""
  path = TORCH_FILES / f"{case}_{fmt}.pt"
  original = torch_format.load(path, allow_torch=False)
  sd, opt_sd, rest = rc.read(path)
  found = rc.infer_model(sd)
  assert found["pers_mem"] == (4 if case == "pers" else 0) and found["span.mode"] == "adaptive"
  cfg = make_cfg(**{k: v for k, v in found.items() if k in ("vocab_size", "d_model", "n_layers",
                                                          "n_heads", "d_ff", "pers_mem")},
                 **{"span.size": found["span.size"], "span.ramp": 8})
  rc.check_fits(sd, cfg)  # includes: the state_dict lists parameters in torch's order
  params = rc.to_span_lm(sd, cfg)
  attn = params["layers_0"]["attn"]
  np.testing.assert_array_equal(
      attn["span_ratio"], sd["layers.0.attn.attn.adaptive_span._mask.current_val"].reshape(-1))
  kind, step, bufs = rc.optimizer_buffers(opt_sd, cfg, params)
  assert (kind, step) == ("adagrad", 3)
  optim_cfg = config_lib.load_config("configs/tiny.py").optim
  optim_cfg.update(name="adagrad", lr=0.07, grad_clip=0.03, warmup=4)
  tx, _ = optimizer_lib.make_optimizer(optim_cfg)
  opt_state = rc.fill_opt_state(jax.device_get(tx.init(params)), kind, step, bufs)

  model = rc.to_reference(params, cfg)
  optimizer = rc.reference_optimizer(opt_state, cfg, optim_cfg)
  out = tmp_path / f"export_{fmt}.pt"
  torch_format.save({"iter_no": rest["iter_no"], "model": model, "optimizer": optimizer,
                     "logger": rest["logger"], "scheduler_iter": rest["scheduler_iter"]},
                    out, legacy=fmt == "legacy")
  back = torch_format.load(out, allow_torch=False)
  assert set(back) == set(original)
  assert list(back["model"]) == list(original["model"])
  for k, v in original["model"].items():
    if k.endswith("mask_template"):  # a buffer, recomputed (np.linspace vs torch.linspace)
      np.testing.assert_allclose(back["model"][k], v, rtol=0, atol=1e-5)
    else:
      np.testing.assert_array_equal(back["model"][k], v)
  assert sorted(back["optimizer"]["state"]) == sorted(original["optimizer"]["state"])
  for i, st in original["optimizer"]["state"].items():
    np.testing.assert_array_equal(back["optimizer"]["state"][i]["sum"], st["sum"])
    assert float(back["optimizer"]["state"][i]["step"]) == float(st["step"])
  g, g0 = back["optimizer"]["param_groups"][0], original["optimizer"]["param_groups"][0]
  for k in ("params", "initial_lr", "grad_clip", "lr_decay", "weight_decay",
            "initial_accumulator_value"):
    assert g[k] == g0[k], k
  assert back["logger"] == original["logger"] and back["iter_no"] == original["iter_no"]
  if fmt == "legacy":  # the same container: the legacy stream's magic number first
    assert out.read_bytes()[:12] == path.read_bytes()[:12]
  else:
    import zipfile  # pylint: disable=g-import-not-at-top
    assert zipfile.is_zipfile(out) and zipfile.is_zipfile(path)

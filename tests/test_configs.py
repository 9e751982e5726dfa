"""Run configs: every file and variant loads and validates, reference runs match the paper table,
bad values fail early with a message naming the field, and the absl --config path works."""
import dataclasses
import importlib
import json
import math
import os
import pathlib
import subprocess
import sys

from absl import flags
from ml_collections.config_flags import config_flags
import pytest

from span_lm import config as config_lib

REPO = pathlib.Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO / "configs"


def _config_modules():
  """Names of the configs/*.py files that define a run (have get_config)."""
  if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
  names = []
  for p in sorted(CONFIG_DIR.glob("*.py")):
    if p.stem in ("__init__", "base"):
      continue
    if hasattr(importlib.import_module(f"configs.{p.stem}"), "get_config"):
      names.append(p.stem)
  return names


MODULES = _config_modules()
ALL_SPECS = [f"configs/{m}.py" + (f":{v}" if v else "")
             for m in MODULES
             for v in [None, *getattr(importlib.import_module(f"configs.{m}"), "VARIANTS", {})]]


@pytest.fixture(autouse=True)
def _in_repo_root(monkeypatch):
  monkeypatch.chdir(REPO)  # configs name files relative to the repository root


def _load(spec, tmp_path, **overrides):
  return config_lib.load_config(spec, {"workdir": str(tmp_path / "run"), **overrides})


def test_expected_files_exist():
  for name in ("enwik8_small", "enwik8", "enwik8_large", "text8", "text8_large",
               "enwik8_pers_small", "enwik8_pers", "wiki103_pers", "tiny", "synthetic"):
    assert name in MODULES


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_every_config_loads_and_validates(spec, tmp_path):
  c = _load(spec, tmp_path)
  if c.data.path is not None and not pathlib.Path(c.data.path).exists():
    pytest.skip(f"{c.data.path} is absent (a config names a local file that is not here)")
  config_lib.validate(c)


# (layers, D, FF, heads, S, block, batch, dropout, emb_dropout, span loss, N, steps, warmup)
TABLE = {
    "enwik8_small": (8, 256, 1024, 4, 1024, 256, 64, 0.0, 0.0, 2e-6, 0, 150_000, 8000),
    "enwik8": (12, 512, 2048, 8, 8192, 512, 64, 0.3, 0.0, 5e-7, 0, 600_000, 32_000),
    "text8": (12, 512, 2048, 8, 8192, 512, 64, 0.3, 0.0, 5e-7, 0, 900_000, 32_000),
    "enwik8_large": (24, 768, 4096, 8, 8192, 512, 64, 0.4, 0.0, 5e-7, 0, 150_000, 32_000),
    "text8_large": (24, 768, 4096, 8, 8192, 512, 64, 0.4, 0.0, 5e-7, 0, 250_000, 32_000),
    "enwik8_pers_small": (18, 512, None, 8, 8192, 512, 64, 0.3, 0.0, 1e-7, 1024, 450_000, 32_000),
    "enwik8_pers": (36, 512, None, 8, 8192, 512, 64, 0.4, 0.0, 1e-7, 2048, 200_000, 32_000),
    "wiki103_pers": (36, 512, None, 8, 2048, 256, 64, 0.3, 0.1, 5e-7, 2048, 800_000, 8000),
}
DATASET = {"text8": "text8", "text8_large": "text8", "wiki103_pers": "wikitext103"}
FINETUNE_STEPS = {"enwik8_large": 20_000, "text8_large": 20_000, "enwik8_pers_small": 30_000,
                  "enwik8_pers": 10_000, "wiki103_pers": 50_000}


@pytest.mark.parametrize("run", sorted(TABLE))
def test_reference_run_matches_table(run, tmp_path):
  c = _load(f"configs/{run}.py", tmp_path)
  layers, d, ff, heads, span, block, batch, drop, emb_drop, span_loss, n, steps, warmup = TABLE[run]
  m = c.model
  assert (m.n_layers, m.d_model, m.n_heads, m.span.size) == (layers, d, heads, span)
  if ff is not None:
    assert m.d_ff == ff
  assert (m.dropout, m.emb_dropout, m.pers_mem) == (drop, emb_drop, n)
  assert math.isclose(m.span.loss, span_loss)
  assert m.span.mode == "adaptive" and m.span.cache and m.span.ramp == 32 and m.span.init == 0.0
  assert (c.data.block, c.data.batch, c.data.eval_batch) == (block, batch, 8)
  assert c.data.dataset == DATASET.get(run, "enwik8") and c.data.path is None
  assert (c.train.steps, c.optim.warmup, c.train.eval_every) == (steps, warmup, 1000)
  if run == "wiki103_pers":
    assert (c.optim.name, c.optim.lr, c.optim.grad_clip) == ("adam", 2.5e-4, 1.0)
  else:
    assert (c.optim.name, c.optim.lr, c.optim.grad_clip) == ("adagrad", 0.07, 0.03)
  assert c.train.init_from is None


@pytest.mark.parametrize("run", sorted(FINETUNE_STEPS))
def test_finetune_variant(run, tmp_path):
  c = _load(f"configs/{run}.py", tmp_path)
  f = _load(f"configs/{run}.py:finetune", tmp_path, **{"train.init_from": str(tmp_path)})
  assert math.isclose(f.optim.lr, c.optim.lr / 10)
  assert (f.train.steps, f.optim.warmup) == (FINETUNE_STEPS[run], 0)
  assert f.model.to_dict() == c.model.to_dict() and f.data.to_dict() == c.data.to_dict()
  config_lib.validate(f)
  f.train.init_from = str(tmp_path / "missing")
  with pytest.raises(FileNotFoundError, match=r"config\.train\.init_from"):
    config_lib.validate(f)


@pytest.mark.parametrize("spec, mode, span, span_loss", [
    ("configs/enwik8_small.py:fixed", "fixed", 1024, 0.0),
    ("configs/enwik8.py:fixed", "fixed", 2048, 0.0),
    ("configs/text8.py:fixed", "fixed", 2048, 0.0),
    ("configs/enwik8.py:dynamic", "dynamic", 1024, 2e-6),
    ("configs/text8.py:dynamic", "dynamic", 1024, 2e-6),
    ("configs/text8.py:adaptive1024", "adaptive", 1024, 2e-6),
    ("configs/tiny.py:smoke,fixed", "fixed", 128, 0.0),
])
def test_span_variants(spec, mode, span, span_loss, tmp_path):
  c = _load(spec, tmp_path)
  assert (c.model.span.mode, c.model.span.size, c.model.span.loss) == (mode, span, span_loss)
  if mode == "dynamic":
    assert c.model.span.dynamic_bias_init == -4.0


def test_tiny_and_smoke(tmp_path):
  c = _load("configs/tiny.py", tmp_path)
  m = c.model
  assert (m.n_layers, m.d_model, m.d_ff, m.n_heads, m.span.size, m.span.ramp) == (4, 256, 1024, 4, 1024, 32)
  assert (m.span.mode, m.span.loss, m.span.cache, m.dropout) == ("adaptive", 2e-6, True, 0.0)
  assert (c.data.block, c.data.batch) == (128, 16)
  assert (c.data.dataset, c.data.path, tuple(c.data.split_bytes)) == ("enwik8_head", None, ())
  o = c.optim
  assert (o.name, o.lr, o.warmup, o.grad_clip) == ("adagrad", 0.07, 200, 0.03)
  assert (c.train.steps, c.train.eval_every, c.train.checkpoint_every) == (1250, 250, 250)
  s = _load("configs/tiny.py:smoke", tmp_path)
  assert (s.model.n_layers, s.model.d_model, s.model.span.size) == (2, 64, 128)
  assert (s.data.block, s.data.batch, s.train.steps) == (64, 8, 50)
  assert s.data.path == c.data.path


def test_synthetic(tmp_path):
  c = _load("configs/synthetic.py", tmp_path)
  assert (c.data.dataset, c.data.synthetic_distance) == ("synthetic", 64)
  assert c.model.span.mode == "adaptive"
  assert c.model.span.size * c.model.span.init > c.data.synthetic_distance  # D starts inside the span
  assert 100 <= c.train.steps <= 1000


# One bad value per check: (field, value, text the message must contain).
BAD = [
    ("mode", "predict", "config.mode='predict'"),
    ("model.span.size", 0, "config.model.span.size=0"),
    ("model.n_heads", 3, "config.model.n_heads=3"),
    ("model.span.mode", "sliding", "config.model.span.mode"),
    ("model.dropout", 1.0, "config.model.dropout"),
    ("model.vocab_size", -1, "config.model.vocab_size=-1"),
    ("data.dataset", "ptb", "config.data.dataset='ptb'"),
    ("data.block", 0, "config.data.block=0: must be an integer >= 1"),
    ("data.batch", 0, "config.data.batch=0"),
    ("data.align", 0, "config.data.align=0"),
    ("data.align", 3, "config.data.align=3: must divide config.data.block"),
    ("model.attention.impl", "triton", "config.model.attention.impl='triton'"),
    ("data.eval_batch", 0, "config.data.eval_batch=0"),
    ("data.data_dir", "", "config.data.data_dir"),
    ("data.split_fractions", (0.9, 0.1, 0.1), "config.data.split_fractions"),
    ("data.split_fractions", (0.9, 0.0, 0.05), "config.data.split_fractions"),
    ("data.split_fractions", (0.9, 0.1), "config.data.split_fractions"),
    ("data.split_bytes", (5, 3), "config.data.split_bytes=(5, 3)"),
    ("data.split_bytes", (0, 3), "config.data.split_bytes"),
    ("data.split_bytes", (1, 2, 3), "config.data.split_bytes"),
    ("data.synthetic_distance", 0, "config.data.synthetic_distance=0"),
    ("data.synthetic_vocab", 1, "config.data.synthetic_vocab=1"),
    ("data.synthetic_noise", 1.0, "config.data.synthetic_noise"),
    ("data.synthetic_length", 0, "config.data.synthetic_length=0"),
    ("optim.name", "rmsprop", "config.optim.name='rmsprop'"),
    ("optim.lr", 0.0, "config.optim.lr=0.0"),
    ("optim.lr", -1.0, "config.optim.lr=-1.0"),
    ("optim.lr", float("nan"), "config.optim.lr=nan"),
    ("optim.momentum", 1.0, "config.optim.momentum=1.0"),
    ("optim.grad_clip", -0.1, "config.optim.grad_clip=-0.1"),
    ("optim.warmup", -1, "config.optim.warmup=-1"),
    ("optim.batch_split", 0, "config.optim.batch_split=0"),
    ("train.steps", -1, "config.train.steps=-1"),
    ("train.log_every", 0, "config.train.log_every=0"),
    ("train.eval_every", 0, "config.train.eval_every=0"),
    ("train.checkpoint_every", 0, "config.train.checkpoint_every=0"),
    ("train.eval_batches", -1, "config.train.eval_batches=-1"),
    ("train.max_to_keep", 0, "config.train.max_to_keep=0"),
    ("train.init_from", "", "config.train.init_from"),
    ("dist.cpu_devices", -1, "config.dist.cpu_devices=-1"),
    ("dist.cpu_devices", 3, "must divide the per-step batch"),
    ("dist.cpu_keep_freed_memory", None, "config.dist.cpu_keep_freed_memory=None"),
    ("dist.cpu_huge_pages", None, "config.dist.cpu_huge_pages=None"),
]


@pytest.mark.parametrize("field, value, text", BAD, ids=[f"{f}={v!r}" for f, v, _ in BAD])
def test_bad_value_names_the_field(field, value, text, tmp_path):
  c = _load("configs/enwik8_small.py", tmp_path)
  config_lib.validate(c)
  c.update_from_flattened_dict({field: value})
  with pytest.raises(ValueError) as e:
    config_lib.validate(c)
  assert text in str(e.value)


def test_batch_must_divide_by_batch_split(tmp_path):
  c = _load("configs/enwik8_small.py", tmp_path, **{"optim.batch_split": 3})
  with pytest.raises(ValueError, match=r"config\.data\.batch=64: .*batch_split=3"):
    config_lib.validate(c)
  c.data.batch = 63
  config_lib.validate(c)


def test_train_needs_workdir_but_eval_does_not():
  c = config_lib.load_config("configs/enwik8_small.py")
  with pytest.raises(ValueError, match=r"config\.workdir.*--config\.workdir=DIR"):
    config_lib.validate(c)
  c.mode = "eval"
  config_lib.validate(c)


def test_modes_are_extensible(tmp_path, monkeypatch):
  c = _load("configs/enwik8_small.py", tmp_path, mode="predict")
  with pytest.raises(ValueError, match=r"config\.mode='predict'"):
    config_lib.validate(c)
  monkeypatch.setattr(config_lib, "MODES", config_lib.MODES + ("predict",))
  config_lib.validate(c)


def test_missing_data_path(tmp_path):
  c = _load("configs/tiny.py", tmp_path, **{"data.path": str(tmp_path / "nope.bin")})
  with pytest.raises(ValueError, match=r"config\.data\.path=.*nope\.bin.*no such file") as e:
    config_lib.validate(c)
  assert isinstance(e.value, FileNotFoundError)


def test_file_dataset_needs_a_path(tmp_path):
  c = _load("configs/enwik8_small.py", tmp_path, **{"data.dataset": "file"})
  with pytest.raises(ValueError, match=r"config\.data\.path=None: .*'file'"):
    config_lib.validate(c)


def test_split_bytes_must_fit_the_file(tmp_path):
  f = tmp_path / "small.bin"
  f.write_bytes(b"x" * 1000)
  c = _load("configs/tiny.py", tmp_path, **{"data.path": str(f), "data.block": 4,
                                            "data.batch": 2, "data.split_bytes": (900, 1000)})
  with pytest.raises(ValueError, match=r"config\.data\.split_bytes=.*1000 bytes"):
    config_lib.validate(c)
  c.data.split_bytes = (800, 900)
  config_lib.validate(c)
  c.data.split_bytes = ()
  config_lib.validate(c)


def test_tiny_trains_on_any_file_that_holds_one_batch(tmp_path):
  """configs/tiny.py with --config.data.path: split by fractions; a short file is one line."""
  c = _load("configs/tiny.py", tmp_path, **{"data.path": str(tmp_path / "f.txt")})
  for size, ok in ((41_280, True), (41_279, False)):  # valid (5 %) must hold 16 x 129 tokens
    (tmp_path / "f.txt").write_bytes(b"x" * size)
    if ok:
      config_lib.validate(c)
    else:
      with pytest.raises(ValueError, match=r"^config\.data\.path='.*f\.txt': 41,279 bytes, but "
                                           r"this config needs a file of at least 41,280 bytes"):
        config_lib.validate(c)


def test_unknown_fields_are_rejected(tmp_path):
  c = _load("configs/enwik8_small.py", tmp_path)
  c.unlock()
  c.data.blocks = 12
  with pytest.raises(ValueError, match=r"config\.data has unknown fields \['blocks'\]"):
    config_lib.validate(c)
  del c.data["blocks"]
  c.model.spans = 3
  with pytest.raises(ValueError, match=r"config\.model has unknown fields \['spans'\]"):
    config_lib.validate(c)


def test_load_config_errors(tmp_path):
  with pytest.raises(ValueError, match="unknown config variant 'nope'"):
    config_lib.load_config("configs/tiny.py:nope")
  with pytest.raises(ValueError, match=r"config\.model\.dmodel is not a field"):
    config_lib.load_config("configs/tiny.py", {"model.dmodel": 3})
  with pytest.raises(ValueError, match=r"config\.model\.d_model='a'"):
    config_lib.load_config("configs/tiny.py", {"model.d_model": "a"})
  with pytest.raises(FileNotFoundError, match="missing.py"):
    config_lib.load_config("configs/missing.py")


def test_load_config_by_path_from_anywhere(tmp_path, monkeypatch):
  """A config file imports its siblings (`from configs import base`) through its own folder,
  from any working directory and with neither the repository nor configs/ on sys.path."""
  root = tmp_path / "site"
  root.mkdir()
  (root / "span_lm").symlink_to(REPO / "span_lm")  # the package alone, as if installed
  code = (
      "import sys\n"
      "from span_lm import config as cl\n"
      "path = list(sys.path)\n"
      f"c = cl.load_config({str(REPO / 'configs' / 'tiny.py')!r} + ':smoke', "
      "{'model.d_model': 32, 'optim.lr': 1})\n"
      "assert sys.path == path and not any(p.rstrip('/') == sys.argv[1] for p in sys.path)\n"
      "print(c.model.d_model, c.optim.lr, c.train.steps, sys.modules['configs'].__path__[0])\n")
  out = subprocess.run([sys.executable, "-c", code, str(REPO)], cwd=tmp_path,
                       env={"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(root),
                            "JAX_PLATFORMS": "cpu"},
                       capture_output=True, text=True, timeout=120, check=False)
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.split() == ["32", "1.0", "50", str(CONFIG_DIR)]
  monkeypatch.chdir(tmp_path)  # a relative path is the working directory's, as for --config
  with pytest.raises(FileNotFoundError, match="relative to"):
    config_lib.load_config("configs/tiny.py")


@pytest.mark.filterwarnings("ignore:the load_module:DeprecationWarning")  # inside config_flags
def test_absl_config_flag_in_process():
  argv = ["prog", "--config=configs/tiny.py:smoke", "--config.model.d_model=32",
          "--config.workdir=/tmp/x"]
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file("config", flag_values=fv, sys_argv=argv)
  fv(argv)
  assert (fv.config.model.d_model, fv.config.model.n_layers, fv.config.workdir) == (32, 2, "/tmp/x")


def test_absl_config_flag_subprocess():
  code = (
      "import sys\n"
      "from absl import flags\n"
      "from ml_collections.config_flags import config_flags\n"
      "_C = config_flags.DEFINE_config_file('config')\n"
      "flags.FLAGS(sys.argv)\n"
      "from span_lm import config as cl\n"
      "c = _C.value\n"
      "c.mode = 'eval'\n"
      "cl.validate(c)\n"
      "print(c.model.d_model, c.model.n_layers, c.train.steps)\n")
  out = subprocess.run(
      [sys.executable, "-c", code, "--config=configs/tiny.py:smoke", "--config.model.d_model=32"],
      cwd=REPO, capture_output=True, text=True, timeout=60, check=False)
  assert out.returncode == 0, out.stderr
  assert out.stdout.split() == ["32", "2", "50"]


def test_model_defaults_are_model_configs():
  """config.model's defaults are ModelConfig's: one set, so a run config and a ModelConfig built
  in Python describe the same model."""
  from span_lm.model.config import ModelConfig  # pylint: disable=g-import-not-at-top
  m = config_lib.base_config().model
  assert m.vocab_size == 0  # the dataset's vocabulary
  assert ModelConfig.from_config(m, vocab_size=7) == ModelConfig(vocab_size=7)
  assert set(m.keys()) == {f.name for f in dataclasses.fields(ModelConfig)}


def test_validated_once_per_command(tmp_path, monkeypatch):
  """main.py -> cli.run -> loop.train checks the config once; train() called directly (a notebook)
  checks it too."""
  from span_lm import cli  # pylint: disable=g-import-not-at-top
  from span_lm.train import loop  # pylint: disable=g-import-not-at-top
  calls = []
  validate = config_lib.validate
  monkeypatch.setattr(config_lib, "validate", lambda c: (calls.append(c.mode), validate(c))[1])
  c = _load("configs/synthetic.py", tmp_path, **{
      "train.steps": 0, "train.tensorboard": False, "train.full_eval_at_end": False,
      "train.compilation_cache": "", "data.synthetic_length": 4000, "data.block": 8,
      "data.batch": 8, "data.eval_batch": 8, "model.n_layers": 1, "model.d_model": 16,
      "model.d_ff": 16, "model.span.size": 16, "model.span.ramp": 4})
  cli.run(c)
  assert calls == ["train"]
  c.optim.lr = 0.0
  with pytest.raises(config_lib.ConfigError, match=r"config\.optim\.lr=0\.0"):
    loop.train(c)
  assert calls == ["train", "train"]


def test_a_saved_run_config_from_an_older_span_lm_takes_defaults_and_names_them(tmp_path, capsys):
  """A run's config.json written before a field existed still loads: the field takes its default;
  fields that can change results (not dist.*) are named on stderr, and saved values stand."""
  import json  # pylint: disable=g-import-not-at-top
  from span_lm import run_dir  # pylint: disable=g-import-not-at-top
  cfg = config_lib.load_config("configs/tiny.py:smoke", {"workdir": str(tmp_path),
                                                        "data.block": 48})
  data = json.loads(cfg.to_json())
  del data["dist"]["cpu_huge_pages"], data["data"]["align"], data["model"]["attention"]["impl"]
  (tmp_path / "config.json").write_text(json.dumps(data))
  capsys.readouterr()
  saved = run_dir.load_saved(str(tmp_path))
  config_lib.validate(saved)
  base = config_lib.base_config()
  assert saved.dist.cpu_huge_pages == base.dist.cpu_huge_pages
  assert saved.data.align == base.data.align and saved.model.attention.impl == base.model.attention.impl
  assert saved.data.block == 48  # what the run saved is kept
  err = capsys.readouterr().err
  assert "data.align" in err and "model.attention.impl" in err and "cpu_huge_pages" not in err


@pytest.mark.parametrize("text8,enwik8", [("text8", "enwik8"), ("text8_large", "enwik8_large")])
def test_text8_configs_are_enwik8_s_with_another_dataset(text8, enwik8):
  """CI compiles text8.py and text8_large.py for its first target only, as enwik8's steps with a
  smaller vocabulary (.ci/compile_paper_configs): that holds while nothing else differs but the
  run's length. Anything more, and they go back to every target (drop them from FIRST_ONLY)."""
  def flat(d, prefix=""):
    out = {}
    for k, v in d.items():
      out.update(flat(v, f"{prefix}{k}.") if hasattr(v, "items") else {prefix + k: v})
    return out
  a = flat(config_lib.load_config(f"configs/{text8}.py", {}).to_dict())
  b = flat(config_lib.load_config(f"configs/{enwik8}.py", {}).to_dict())
  assert {k for k in a.keys() | b.keys() if a.get(k) != b.get(k)} <= {"data.dataset",
                                                                       "train.steps"}


def _specs_that_validate(tmp_path):
  for spec in ALL_SPECS:
    c = _load(spec, tmp_path, mode="eval")
    if c.data.path is None or pathlib.Path(c.data.path).exists():
      yield spec, c


def test_base_config_is_the_sections_defaults():
  """base_config() is generated from RunConfig's fields: each section's dataclass defaults, a
  typed placeholder where the default is None, config.model from ModelConfig, in field order."""
  from span_lm import run_config  # pylint: disable=g-import-not-at-top
  from span_lm.model import config as model_config  # pylint: disable=g-import-not-at-top
  base = config_lib.base_config()
  top = [f for f in dataclasses.fields(run_config.RunConfig)
         if f.name not in ("vocab_from_data", "source")]
  assert list(json.loads(base.to_json())) == [f.name for f in top]
  assert base.model.to_dict() == model_config.config_defaults()
  for f in top:
    if f.name == "model":
      continue
    if f.name not in run_config.SECTIONS:
      assert base[f.name] == f.default, f.name
      continue
    fields = dataclasses.fields(run_config.SECTIONS[f.name])
    assert list(json.loads(base[f.name].to_json())) == [s.name for s in fields]
    for s in fields:
      assert base[f.name][s.name] == s.default, f"{f.name}.{s.name}"
      if s.default is None:  # a placeholder: --config.FIELD=V parses V as the field's type
        assert base[f.name].get_ref(s.name).get_type() in (str, int), f"{f.name}.{s.name}"
  assert base.get_ref("workdir").get_type() is str and base.get_ref("export_to").get_type() is str


def test_validate_returns_the_typed_config_that_records_as_given(tmp_path):
  """validate(ConfigDict) is the RunConfig: the same values, typed; what a run directory's
  config.json and a checkpoint's metadata record is byte for byte what the ConfigDict wrote."""
  from span_lm.model.config import ModelConfig  # pylint: disable=g-import-not-at-top
  n = 0
  for spec, c in _specs_that_validate(tmp_path):
    rc = config_lib.validate(c)
    assert isinstance(rc, config_lib.RunConfig) and isinstance(rc.model, ModelConfig)
    assert (rc.data.block, rc.optim.lr, rc.train.steps, rc.seed) == (
        c.data.block, c.optim.lr, c.train.steps, c.seed)
    assert rc.to_json_best_effort(indent=2) == c.to_json_best_effort(indent=2), spec
    assert rc.to_dict() == c.to_dict() and list(rc.to_dict()) == list(c.to_dict()), spec
    assert config_lib.checked(rc) is rc  # checked once: a RunConfig is not checked again
    n += 1
  assert n > 20


def test_the_model_is_built_once_and_settled_by_the_data(tmp_path):
  """validate builds the ModelConfig (vocab_size 1 standing in for the dataset's); the run
  settles the vocabulary on that one: the same model as building it from config.model with the
  dataset's vocabulary, and the same refusal where that vocabulary does not fit."""
  from span_lm.model.config import ModelConfig  # pylint: disable=g-import-not-at-top
  for spec, c in _specs_that_validate(tmp_path):
    rc = config_lib.validate(c)
    assert rc.vocab_from_data == (not c.model.vocab_size)
    for vocab in (16, 205, 267_735):
      try:
        want = ModelConfig.from_config(c.model, vocab_size=vocab)
      except ValueError as e:
        want = str(e)
      try:
        got = (dataclasses.replace(rc.model, vocab_size=vocab) if rc.vocab_from_data
               else rc.model)
      except ValueError as e:
        got = str(e)
      assert got == want, (spec, vocab)


SECTION_BAD = [
    ("Data", {"block": 0}, (1,), "config.data.block=0: must be an integer >= 1"),
    ("Data", {"batch": 65}, (2,),
     "config.data.batch=65: must be divisible by config.optim.batch_split=2"),
    ("Data", {"data_dir": ""}, (1,), "config.data.data_dir='': must be a non-empty directory path"),
    ("Optim", {"lr": 0.0}, (), "config.optim.lr=0.0: must be > 0"),
    ("Optim", {"name": "lion"}, (),
     "config.optim.name='lion': unknown optimizer; choose one of ('adagrad', 'sgd', 'momentum', "
     "'adam')"),
    ("Train", {"max_to_keep": 0}, ("train",),
     "config.train.max_to_keep=0: must be an integer >= 1"),
    ("Train", {"loss_scale_period": 0}, ("train",), "config.train.loss_scale_period=0: must be an "
     "integer >= 1 (finite steps in a row before the scale doubles)"),
    ("Train", {"profile_start": 3}, ("train",), "config.train.profile_start=3: profiling needs "
     "both: set --config.train.profile_steps too (the first step to trace, 1-based, and how many "
     "steps; 0 and 0: off)"),
    ("Dist", {"fsdp": 0}, (), "config.dist.fsdp=0: must be an integer >= 1"),
    ("Dist", {"coordinator": "host"}, (),
     "config.dist.coordinator='host': must be '' or host:port of process 0"),
    ("Compile", {"plan": "most"}, (),
     "config.compile.plan='most': choose one of ('full', 'initial')"),
]


@pytest.mark.parametrize("section, bad, context, message", SECTION_BAD,
                         ids=[f"{s}.{next(iter(b))}" for s, b, _, _ in SECTION_BAD])
def test_each_section_refuses_its_bad_values_in_one_line(section, bad, context, message):
  from span_lm import run_config  # pylint: disable=g-import-not-at-top
  cls = getattr(run_config, section)
  cls().check(*context)  # the defaults pass
  with pytest.raises(ValueError) as e:
    cls(**bad).check(*context)
  assert str(e.value) == message and "\n" not in str(e.value)


def test_a_run_takes_the_checked_config_as_it_is(tmp_path, monkeypatch):
  """Run(RunConfig) checks nothing again, and its model is validate's, the vocabulary settled by
  the dataset: the one ModelConfig of the run."""
  from span_lm.train import run as run_lib  # pylint: disable=g-import-not-at-top
  c = _load("configs/synthetic.py", tmp_path, **{
      "train.steps": 0, "train.tensorboard": False, "train.compilation_cache": "",
      "data.synthetic_length": 4000, "data.block": 8, "data.batch": 8, "data.eval_batch": 8,
      "model.n_layers": 1, "model.d_model": 16, "model.d_ff": 16, "model.span.size": 16,
      "model.span.ramp": 4})
  checked = config_lib.validate(c)
  monkeypatch.setattr(config_lib, "validate", lambda _: pytest.fail("checked a second time"))
  run = run_lib.Run(checked)
  try:
    assert run.config is checked and checked.vocab_from_data and checked.model.vocab_size == 1
    assert run.model_cfg == dataclasses.replace(checked.model,
                                                vocab_size=run.splits.vocab_size)
  finally:
    run.ckpt.close()

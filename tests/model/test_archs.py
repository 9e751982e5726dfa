"""span_lm.model.ARCHS: each record answers for its architecture what callers used to ask by name."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import pytest

from model_helpers import make_cfg
from span_lm import run_dir
from span_lm.model import ARCHS, build_model
from span_lm.model import caches as caches_lib
from span_lm.model import config as model_config
from span_lm.model import costs
from span_lm.model import plan as plan_lib
from span_lm.model.config import ModelConfig
from span_lm.model.sparse_transformer import SparseTransformer
from span_lm.model.transformer import SpanTransformer
from span_lm.train import restore

SPARSE = {"arch": "sparse", "sparse.context": 64, "sparse.stride": 8, "sparse.c": 2,
          "span.loss": 0.0}
# name -> (make_cfg changes, model class, context length)
CASES = {"span": ({}, SpanTransformer, 16), "sparse": (SPARSE, SparseTransformer, 64)}


def test_every_architecture_has_a_case_here():
  assert set(ARCHS) == set(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_record_builds_its_model_and_states_its_lengths(name):
  """build_model, the context, the full plan's caches and the FLOPs and memory counts all come
  from the record named by config.model.arch."""
  kw, model, context = CASES[name]
  cfg = make_cfg(**kw)
  arch = ARCHS[cfg.arch]
  assert arch.name == cfg.arch == name
  assert isinstance(build_model(cfg, plan_lib.full_plan(cfg)), model)
  assert cfg.context == arch.context(cfg) == context
  section, field = model_config.moved_to("span", name).split(".")  # the old flat `span` went
  assert getattr(getattr(cfg, section), field) == context  # to the context, S or n
  assert [lp.cache_len for lp in plan_lib.full_plan(cfg).layers] == (
      [cfg.context] * cfg.n_layers if arch.cache else [1] * cfg.n_layers)
  full = plan_lib.full_plan(cfg)
  assert costs.forward_macs(cfg, None, 16) == arch.forward_macs(cfg, full, 16)
  assert costs.activation_bytes(cfg, None, 2, 16) == arch.activation_bytes(cfg, full, 2, 16, True)
  assert costs.peak_activation_bytes(cfg, None, 2, 16) == sum(
      arch.activation_bytes(cfg, full, 2, 16, True).values()) + 16 * arch.widest_scores(
          cfg, full, 16) > 0
  flat = run_dir.flatten(model_config.saved(cfg))
  assert arch.identity(cfg).items() <= flat.items(), arch.identity(cfg)


def test_the_sparse_model_reads_no_span_and_records_the_fixed_one():
  """config.model.span is the span model's: the sparse model keeps it as set and reads none of
  it (plans, counts, parameters); its checkpoints record the fixed span of n, as they did when
  its config carried one, so checkpoints written before and after restore either way."""
  cfg = make_cfg(**SPARSE, **{"span.mode": "adaptive"})
  other = make_cfg(**{**SPARSE, "span.mode": "dynamic", "span.size": 512, "span.loss": 0.5})
  assert (cfg.span.mode, cfg.span.size) == ("adaptive", 1024)  # as set (the default S)
  assert (cfg.context, cfg.spans) == (other.context, other.spans) == (64, "fixed")
  for plan in (plan_lib.full_plan, plan_lib.initial_plan):
    assert plan(cfg) == plan(other) == plan_lib.full_plan(make_cfg(**SPARSE))
  assert costs.peak_activation_bytes(cfg, None, 2, 16) == costs.peak_activation_bytes(
      other, None, 2, 16)
  shapes = lambda c: jax.tree.map(jnp.shape, jax.eval_shape(
      lambda: build_model(c, plan_lib.full_plan(c)).init(
          jax.random.key(0), jnp.zeros((1, 4), jnp.int32),
          caches_lib.init_caches(c, plan_lib.full_plan(c), 1)))["params"])
  assert shapes(cfg) == shapes(other)
  assert (cfg.attn_spec.window, cfg.attn_spec.mode) == (64, "fixed")  # what the span door sees
  recorded = model_config.saved(cfg)
  assert recorded == model_config.saved(other)
  assert recorded["span"] == {**dataclasses.asdict(model_config.Span()), "size": 64,
                              "mode": "fixed", "loss": 0.0, "ramp": 4}
  assert ModelConfig.from_config(recorded).sparse == cfg.sparse
  meta = {"model_cfg": json.loads(json.dumps(recorded))}  # as a checkpoint holds it
  restore.check_meta(cfg, meta, "d")  # written now or before: one record
  with pytest.raises(ValueError, match="sparse.context: checkpoint 64, config 32"):
    restore.check_meta(make_cfg(**{**SPARSE, "sparse.context": 32}), meta, "d")


def test_the_sparse_record_refuses_what_it_lacks():
  cfg = make_cfg(**SPARSE)
  with pytest.raises(ValueError, match="kv_cache applies to the span Transformer only"):
    build_model(cfg, None, kv_cache=True)
  with pytest.raises(ValueError, match="no persistent memory"):
    make_cfg(**SPARSE, pers_mem=2)
  with pytest.raises(ValueError, match="document boundaries are for arch='span'"):
    make_cfg(**SPARSE, doc_boundary=3)
  with pytest.raises(ValueError, match="only arch='sparse' scans its layers"):
    make_cfg(**{"sparse.scan_layers": True})
  with pytest.raises(ValueError, match=r"choose one of \('span', 'sparse'\)"):
    ModelConfig.from_config(dict(vocab_size=11, d_model=16, n_heads=4, arch="other"))


@pytest.mark.parametrize("platform,cc,kind,want", [
    ("cpu", None, "", "jnp"), ("tpu", None, "TPU v5p", "splash"), ("gpu", 9.0, "", "pallas"),
    ("gpu", 7.0, "", "jnp")])
def test_the_attention_named_is_the_one_each_architecture_runs(platform, cc, kind, want):
  """The compile report and the step log name what the layers run: the sparse model's choice of
  kernels/sparse/door.py (they once named the span door's choice, which the sparse model never
  calls), the span model's kernels.choose."""
  from span_lm import kernels  # pylint: disable=g-import-not-at-top
  from span_lm.kernels import target  # pylint: disable=g-import-not-at-top
  with target.compiling_for(platform, cc, kind):
    sparse_cfg = make_cfg(**SPARSE, d_model=32, n_heads=2)  # head size 16: splash's lanes
    name, why = ARCHS["sparse"].attention(sparse_cfg, 64, 64)
    assert name == f"sparse {want}"
    assert bool(why) == (want == "jnp" and platform != "cpu"), why  # a kernel passed over: why
    if platform == "tpu":  # a head size splash cannot take: the jnp path, saying why
      assert ARCHS["sparse"].attention(make_cfg(**SPARSE, d_model=36, n_heads=2), 64, 64) == (
          "sparse jnp", "head size 18: splash needs a multiple of 8")
    span_cfg = make_cfg()
    assert ARCHS["span"].attention(span_cfg, 16, 16)[0] == kernels.choose(span_cfg.attn_spec, 16, 16)

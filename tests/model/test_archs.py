"""span_lm.model.ARCHS: each record answers for its architecture what callers used to ask by name."""
import dataclasses

import pytest

from model_helpers import make_cfg
from span_lm import run_dir
from span_lm.model import ARCHS, build_model
from span_lm.model import plan as plan_lib
from span_lm.model.config import ModelConfig
from span_lm.model.sparse_transformer import SparseTransformer
from span_lm.model.transformer import SpanTransformer
from span_lm.tools import flops

SPARSE = dict(arch="sparse", span=64, sparse_stride=8, sparse_c=2, span_loss=0.0)
# name -> (make_cfg changes, model class, context length)
CASES = {"span": ({}, SpanTransformer, 16), "sparse": (SPARSE, SparseTransformer, 64)}


def test_every_architecture_has_a_case_here():
  assert set(ARCHS) == set(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_record_builds_its_model_and_states_its_lengths(name):
  """build_model, the context, the full plan's caches and the FLOPs count all come from the
  record named by config.model.arch."""
  kw, model, context = CASES[name]
  cfg = make_cfg(**kw)
  arch = ARCHS[cfg.arch]
  assert arch.name == cfg.arch == name
  assert isinstance(build_model(cfg, plan_lib.full_plan(cfg)), model)
  assert cfg.context == arch.context(cfg) == context
  assert [lp.cache_len for lp in plan_lib.full_plan(cfg).layers] == (
      [cfg.context] * cfg.n_layers if arch.cache else [1] * cfg.n_layers)
  assert flops.forward_macs(cfg, None, 16) == arch.forward_macs(cfg, plan_lib.full_plan(cfg), 16)
  flat = run_dir.flatten(dataclasses.asdict(cfg))
  assert all(k in flat for k in arch.identity), arch.identity


def test_the_sparse_record_fixes_the_span_and_refuses_what_it_lacks():
  cfg = make_cfg(**SPARSE, span_mode="adaptive")
  assert (cfg.span.size, cfg.span.mode, cfg.span.loss) == (64, "fixed", 0.0)
  with pytest.raises(ValueError, match="kv_cache applies to the span Transformer only"):
    build_model(cfg, None, kv_cache=True)
  with pytest.raises(ValueError, match="no persistent memory"):
    make_cfg(**SPARSE, pers_mem=2)
  with pytest.raises(ValueError, match="document boundaries are for arch='span'"):
    make_cfg(**SPARSE, doc_boundary=3)
  with pytest.raises(ValueError, match="only arch='sparse' scans its layers"):
    make_cfg(scan_layers=True)
  with pytest.raises(ValueError, match=r"choose one of \('span', 'sparse'\)"):
    ModelConfig.from_config(dict(vocab_size=11, d_model=16, n_heads=4, arch="other"))

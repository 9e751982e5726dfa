"""The `flops` mode: a run's plan against the fixed-span model, XLA's view and the paper's
(span_lm/model/costs.py counts, span_lm/tools/flops.py reads XLA's; span_lm/tools/paper.py holds
the paper's numbers)."""
import json
import os

from span_lm.model import ARCHS
from span_lm.model import plan as plan_lib
from span_lm.model.config import ModelConfig
from span_lm.tools import flops as flops_lib
from span_lm.tools import paper


def _m(x: float) -> str:
  for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
    if x >= scale:
      return f"{x / scale:,.2f}{unit}"
  return f"{x:,.0f}"


def _mib(x: float) -> str:
  return f"{x / 2**20:,.1f} MiB"


def format_account(name: str, acc: dict) -> str:
  """A few readable lines for one `account` result."""
  pt, gen = acc["per_token_block"], acc["per_token_generation"]
  lines = [f"{name}: {acc['plan']}"]
  for what, t in ((f"blocks of {acc['block']}", pt),
                  ("generation (sample's ring decoder, one token; ring caches of "
                   f"{acc.get('generation_plan') or acc['plan']})", gen)):
    if t is None:
      continue
    lines.append(f"  per token, {what}: attention {_m(t['attention'])} MACs, k/v projection "
                 f"{_m(t['kv_proj'])}, other {_m(t['other'])}, total {_m(sum(t.values()))}")
  lines.append(f"  train step (batch {acc['batch']}): {acc['train_step_flops'] / 1e9:,.3f} GFLOP "
               f"(matmuls), activations kept {_mib(sum(acc['activation_bytes'].values()))}, "
               f"peak estimate {_mib(acc['peak_activation_bytes'])}")
  if "xla" in acc:
    x = acc["xla"]
    lines.append(f"  XLA: {x['flops'] / 1e9:,.3f} GFLOP in all, {x['dot_flops'] / 1e9:,.3f} in dots"
                 " "
                 f"(ours {acc['train_step_flops'] / x['dot_flops']:.4f}x of XLA's dots, "
                 f"{acc['train_step_flops'] / x['flops']:.3f}x of its total); temp buffers "
                 f"{_mib(x['temp_bytes'])} (our peak estimate "
                 f"{acc['peak_activation_bytes'] / max(x['temp_bytes'], 1):.2f}x)")
  return "\n".join(lines)


def flops_ratio_table(rows: list[tuple[str, dict]]) -> str:
  """Markdown: per-token MACs of several accounts side by side."""
  head = ("| model | attention MACs/token | k/v proj | other | total | vs first |\n"
          "|---|---|---|---|---|---|")
  base = sum(rows[0][1]["per_token_block"].values())
  body = []
  for name, acc in rows:
    pt = acc["per_token_block"]
    tot = sum(pt.values())
    body.append(f"| {name} | {_m(pt['attention'])} | {_m(pt['kv_proj'])} | {_m(pt['other'])} | "
                f"{_m(tot)} | {tot / base:.2f} |")
  return "\n".join([head] + body)


def _run_vocab(config, meta) -> tuple[int, str]:
  if meta is not None:
    return int(meta["model_cfg"]["vocab_size"]), "checkpoint"
  if config.vocab_size is not None:
    return config.vocab_size, "config"
  from span_lm.data import sources  # pylint: disable=g-import-not-at-top
  return sources.vocab_size_offline(config.data)


def _sample_plan(cfg: ModelConfig, ckpt_dir: str, step: int, plan):
  """The plan `sample` decodes with at checkpoint `step`: the tightest exact one for its span
  parameters (tools/restore.py's tight_plan), read with a params-only restore on one device."""
  if cfg.span.mode != "adaptive":
    return plan_lib.full_plan(cfg)
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from span_lm.model import build_model  # pylint: disable=g-import-not-at-top
  from span_lm.model import caches as caches_lib  # pylint: disable=g-import-not-at-top
  from span_lm.train import checkpoint as ckpt_lib  # pylint: disable=g-import-not-at-top
  abstract = jax.eval_shape(lambda: build_model(cfg, plan).init(
      jax.random.key(0), jnp.zeros((1, 1), jnp.int32), caches_lib.init_caches(cfg, plan, 1)))
  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one),
                        abstract["params"])
  with ckpt_lib.Checkpointer(ckpt_dir, max_to_keep=None) as ckpt:
    params = ckpt.restore_params(target, step)
  return plan_lib.plan_from_params(cfg, params)


def report(config) -> dict:
  """The `flops` mode: this run's plan against the fixed-span model, XLA's view, the paper's."""
  from span_lm.tools import restore as restore_lib  # pylint: disable=g-import-not-at-top
  from span_lm.train import checkpoint as ckpt_lib  # pylint: disable=g-import-not-at-top
  from span_lm import config as config_lib  # pylint: disable=g-import-not-at-top
  config = config_lib.checked(config)  # builds no run.Run
  meta = None
  ckpt_dir = os.path.join(config.workdir or "", "checkpoints")
  if config.workdir and os.path.isdir(ckpt_dir):
    with ckpt_lib.Checkpointer(ckpt_dir, max_to_keep=None) as ckpt:
      if ckpt.latest_step() is not None:
        meta = ckpt.restore_meta(restore_lib.tools_field(config, "step"))
  vocab, vocab_from = _run_vocab(config, meta)
  cfg = config.model_for(vocab)
  if not ARCHS[cfg.arch].banded:  # no spans, no plan: factorized attention against the dense one
    plan = gen_plan = plan_lib.full_plan(cfg)
    source = f"{cfg.sparse.combine} heads, stride {cfg.sparse.stride}"
    base_name, base_cfg = f"dense attention n={cfg.sparse.context}", cfg.replace(
        sparse=cfg.sparse.replace(pattern="dense"))
    mode = cfg.sparse.pattern
  else:
    if meta is not None:
      plan, source = plan_lib.plan_from_json(meta["planner"]["plan"]), f"step {meta['step']}"
      # sample decodes with the tightest exact plan
      gen_plan = _sample_plan(cfg, ckpt_dir, int(meta["step"]), plan)
    else:
      plan, source = plan_lib.initial_plan(cfg), "initial plan, no checkpoint"
      gen_plan = plan
    base_name, base_cfg = f"fixed span S={cfg.span.size}", cfg.replace(
        span=cfg.span.replace(mode="fixed"))
    mode = cfg.span.mode
  b, m = config.data.batch, config.data.block
  xla = bool(restore_lib.tools_field(config, "xla", True))
  rows = [(base_name, flops_lib.account(base_cfg, None, b, m, xla)),
          (f"this run ({mode}, {source})", flops_lib.account(cfg, plan, b, m, xla,
                                                             generation_plan=gen_plan))]
  print(f"vocabulary {vocab} ({vocab_from}); batch {b}, block {m}; MACs = multiply-adds")
  for name, acc in rows:
    print(format_account(name, acc))
  print(flops_ratio_table(rows))
  text, fig_path = paper.report(config.workdir or ".")
  print("\n" + text)
  out = {name: acc for name, acc in rows}
  json_path = restore_lib.out_path(config, "flops.json")
  with open(json_path, "w") as f:
    json.dump({"runs": out, "paper_table1": paper.table1()}, f, indent=1)
  print(f"wrote {json_path}\nwrote the paper's Figure 3 (its small text8 models' MACs per token "
        f"against the span, recounted from the paper's spans; not this run): "
        f"{os.path.abspath(fig_path)}")
  return {"runs": out, "json": json_path, "figure3": os.path.abspath(fig_path)}

"""The model's rules for the span attention door: the door (span_lm/kernels) reads a `Spec` and
nothing else, so what only a model config has (its architecture, the plan's granularity, the
span's size as config.model names it) is checked here, before the door is asked. Imports no jax:
the config validates with it."""
from typing import Any

from span_lm import kernels


def fused_misfit(cfg: Any) -> tuple[str, str]:
  """('', '') when the fused kernels tile the model's sizes, else (field of config.model, what it
  must be). cfg: a ModelConfig, or the run config's model section."""
  if cfg.arch != "span":
    return "arch", "must be 'span' (the sparse model has its own attention)"
  return kernels.tile_misfit(cfg.attention.block, (
      ("pers_mem", cfg.pers_mem), ("span.size", cfg.span.size),
      ("plan.granularity", cfg.plan.granularity)))


def check(cfg: Any, *, block: int | None = None, backend: str | None = None) -> None:
  """Raises a ValueError naming the config.model field where an explicit fused choice cannot run
  this model (its sizes, and the door's `check_attention`: the run's block length, the backend).
  cfg: a ModelConfig, or the run config's model section (old names included)."""
  name = cfg.attention.impl
  impl = kernels.IMPLS.get(name)
  if impl is None or not impl.fused:
    return
  field, why = fused_misfit(cfg)
  if field:
    value = cfg
    for part in field.split("."):
      value = getattr(value, part)
    raise ValueError(f"config.model.{field}={value!r}: {why} with attention.impl={name!r}")
  kernels.check_attention(cfg.attention, block=block, backend=backend)


def fit_fallback(cfg: Any) -> Any:
  """The model config to compile instead when a step of `cfg` does not fit in device memory
  (the door's `fit_fallback`: `auto`'s XLA path -> the fused kernel on a GPU), or None: also
  for a model the kernel cannot run (the sparse model, sizes it cannot tile)."""
  if fused_misfit(cfg)[0]:
    return None
  spec = kernels.fit_fallback(cfg.attn_spec)
  return None if spec is None else cfg.replace(attention=spec.attention)

"""Device mesh and shardings for data-parallel (and FSDP-style) training.

One 1-D mesh axis ('data'): batches and the per-sequence attention caches are split over it on their
leading (batch) dimension; parameters, optimizer state, step and rng are replicated. Which leaf gets
which sharding is a single rule function of (key path, leaf), so a different layout (FSDP, tensor
parallelism via Flax logical axis names) is a configuration change, not a rewrite. `Layout` is
the one place that picks between them (config.dist.fsdp).
"""
import dataclasses
import math
import re
from typing import Any, Callable, Optional, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from span_lm.model import config as model_config

DATA_AXIS = "data"
# State entries that hold per-sequence (batch-leading) arrays, sharded over the data axis.
CACHE_KEYS = ("caches", "eval_caches")
# Logical axis name -> mesh axis. Names not listed (e.g. 'embed', 'mlp') stay replicated.
LOGICAL_AXIS_RULES = (("batch", DATA_AXIS),)

ShardingRule = Callable[[tuple, Any, Mesh], jax.sharding.Sharding]


def make_mesh(num_devices: Optional[int] = None, axis: str = DATA_AXIS) -> Mesh:
  """A 1-D mesh over the first `num_devices` devices, with Auto axis types.

  Auto (classic GSPMD) rather than `jax.make_mesh`'s default Explicit types: under Explicit,
  Linen's `nn.Embed` fails on a batch sharded `P('data')`.
  """
  devices = jax.devices()
  if num_devices is None:
    num_devices = len(devices)
  if not 1 <= num_devices <= len(devices):
    raise ValueError(f"num_devices={num_devices}: must be in [1, {len(devices)}] (the available devices)")
  return Mesh(np.asarray(devices[:num_devices]), (axis,), axis_types=(jax.sharding.AxisType.Auto,))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def data_sharding(mesh: Mesh, ndim: int, axis: str | tuple[str, ...] = DATA_AXIS) -> NamedSharding:
  """Leading (batch) dim over the data axis (or axes), the rest replicated: P('data', None, ...)."""
  if ndim < 1:
    raise ValueError(f"data sharding needs an array with a leading batch dim, got ndim={ndim}")
  return NamedSharding(mesh, P(axis, *([None] * (ndim - 1))))


def _key_name(key) -> str:
  """Plain name of one pytree path entry (dict key, sequence index or attribute)."""
  for attr in ("key", "idx", "name"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def is_stacked(path: Sequence[Any]) -> bool:
  """A layer scan's stacked parameter (or a leaf mirroring one): under the scanned module
  (sparse_transformer, sparse.scan_layers=True), with a leading axis of one entry per step."""
  return any(_key_name(k) == model_config.SCANNED_LAYERS for k in path)


def path_str(path: Sequence[Any]) -> str:
  """'caches/0' style name for a pytree key path (used in error messages)."""
  return "/".join(_key_name(k) for k in path)


def _check_batch_dim(name: str, shape: Sequence[int], mesh: Mesh, axis: str) -> None:
  n = mesh.shape[axis]
  if len(shape) < 1 or shape[0] % n:
    raise ValueError(f"{name}: shape {tuple(shape)} has no leading batch dim divisible by the "
                     f"{n} devices of mesh axis '{axis}'")


# Logical axis names of the model's parameters, by the end of their path (optimizer-state leaves
# that mirror a parameter end with the same path and get the same names). Sharding parameters
# (FSDP, tensor parallelism) is then a matter of LOGICAL_AXIS_RULES, e.g. (("embed", "data"),).
PARAM_LOGICAL_AXES = (
    (r"in_emb/embedding$", ("vocab", "embed")),
    (r"out_emb/kernel$", ("embed", "vocab")),
    (r"out_emb/bias$", ("vocab",)),
    (r"key_pe$", ("head_dim", "span")),
    (r"proj_(query|key|val)/kernel$", ("embed", "heads")),
    (r"proj_out/kernel$", ("heads", "embed")),
    (r"fc1/kernel$", ("embed", "mlp")),
    (r"fc1/bias$", ("mlp",)),
    (r"fc2/kernel$", ("mlp", "embed")),
    (r"pers_key$", ("heads", "head_dim", "memory")),
    (r"pers_val$", ("heads", "memory", "head_dim")),
)


def logical_axes(path: tuple, ndim: int) -> tuple:
  """Logical axis names of a parameter-shaped leaf (None where nothing is named); a layer
  scan's stacked parameters (under 'layers/') have an unnamed leading layer axis."""
  name = path_str(path)
  stacked = int(is_stacked(path))
  for pattern, axes in PARAM_LOGICAL_AXES:
    if re.search(pattern, name) and len(axes) == ndim - stacked:
      return (None,) * stacked + axes
  return (None,) * ndim


def make_state_rule(rules: Sequence[tuple] = LOGICAL_AXIS_RULES) -> ShardingRule:
  """Caches over the data axis on dim 0; parameters (and optimizer state) by logical names."""
  mapping = dict(rules)

  def rule(path: tuple, leaf: Any, mesh: Mesh) -> NamedSharding:
    shape = np.shape(leaf)
    if path and _key_name(path[0]) in CACHE_KEYS:
      _check_batch_dim(path_str(path), shape, mesh, DATA_AXIS)
      return data_sharding(mesh, len(shape))
    if path and _key_name(path[0]) in ("params", "opt_state") and shape:
      spec = [mapping.get(a) if a is not None else None for a in logical_axes(path, len(shape))]
      for dim, axis in enumerate(spec):  # an axis that does not divide stays replicated
        if axis is not None and shape[dim] % mesh.shape[axis]:
          spec[dim] = None
      if any(a is not None for a in spec):
        return NamedSharding(mesh, P(*spec))
    return replicated(mesh)

  return rule


default_state_rule = make_state_rule()


def state_shardings(abstract_state: Any, mesh: Mesh, rule: ShardingRule = default_state_rule) -> Any:
  """The pytree of shardings for a training state, leaf by leaf from `rule(path, leaf, mesh)`.

  `abstract_state` is typically `jax.eval_shape(init_fn, ...)` (ShapeDtypeStructs); a dict-like
  with 'params', 'opt_state', 'step', 'rng', 'caches', 'eval_caches'.
  """
  return jax.tree_util.tree_map_with_path(lambda p, x: rule(p, x, mesh), abstract_state)


def with_shardings(abstract: Any, shardings: Any) -> Any:
  """ShapeDtypeStructs carrying `shardings` (what jit out_shardings / Orbax restore targets want)."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s),
                      abstract, shardings)


def shard_batch(x: Any, mesh: Mesh, axis: str | tuple[str, ...] = DATA_AXIS) -> Any:
  """Puts a host batch (array or pytree of arrays) onto the mesh: leading (batch) dims split over
  `axis` (a mesh axis or a tuple of them), 0-d leaves (the 'reset' flag) replicated.

  Single process: `x` is the global batch and B must divide by the axis size. Multi-process: `x`
  holds this process's rows (B divides by its share of the axis) and the global array is assembled
  with `jax.make_array_from_process_local_data`; a 0-d leaf must be the same in every process.
  """
  multi = jax.process_count() > 1
  axes = (axis,) if isinstance(axis, str) else tuple(axis)
  n = math.prod(mesh.shape[a] for a in axes)
  if multi:
    n = max(1, n // jax.process_count())

  def put(path, a):
    a = np.asarray(a)
    if a.ndim == 0:
      if multi:
        return jax.make_array_from_callback((), replicated(mesh), lambda idx: a[idx])
      return jax.device_put(a, replicated(mesh))
    if a.shape[0] % n:
      name = path_str(path) or "batch"
      raise ValueError(f"shard_batch: {name} has shape {a.shape}; its leading (batch) dim must be "
                       f"divisible by {n} ({'local ' if multi else ''}devices on mesh axis {axis!r})")
    sharding = data_sharding(mesh, a.ndim, axis)
    if multi:
      return jax.make_array_from_process_local_data(sharding, a)
    return jax.device_put(a, sharding)

  return jax.tree_util.tree_map_with_path(put, x)


# ------------------------------------------------------------------------- FSDP-style layout

FSDP_AXIS = "fsdp"
BATCH_AXES = (DATA_AXIS, FSDP_AXIS)  # batches and caches: over every device
# Parameters (and the optimizer state that mirrors them) split their model dimension over the
# 'fsdp' axis; GSPMD gathers each weight where it is used and reduce-scatters its gradient.
FSDP_RULES = (("batch", DATA_AXIS), ("embed", FSDP_AXIS))


def fsdp_mesh(fsdp: int, num_devices: int | None = None, devices: Sequence | None = None) -> Mesh:
  """A 2-D ('data', 'fsdp') mesh; consecutive devices (one host's, first) share a 'data' row.
  devices: these (e.g. a deviceless topology's) instead of the first num_devices."""
  if devices is None:
    n = len(jax.devices()) if num_devices is None else num_devices
    devices = jax.devices()[:n] if 1 <= n <= len(jax.devices()) else []
  else:
    n = len(devices)
  if not devices or n % fsdp:
    raise ValueError(f"config.dist.fsdp={fsdp} must divide the {n} devices")
  grid = np.asarray(devices).reshape(n // fsdp, fsdp)
  return Mesh(grid, BATCH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 2)


def fsdp_state_rule() -> ShardingRule:
  """Caches over all devices on their batch dim; params/optimizer state by logical names."""
  by_name = make_state_rule(FSDP_RULES)

  def rule(path, leaf, mesh):
    if path and _key_name(path[0]) in CACHE_KEYS:
      return NamedSharding(mesh, P(BATCH_AXES, *([None] * (np.ndim(leaf) - 1))))
    return by_name(path, leaf, mesh)

  return rule


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where a run's arrays live: the mesh, the state rule and the axes batches are split over.
  One constructor (`Layout.make`) chooses data parallel or FSDP for the loop, the compile mode
  and the benchmarks alike."""
  mesh: Mesh
  state_rule: ShardingRule
  batch_axes: str | tuple[str, ...]

  @classmethod
  def make(cls, fsdp: int = 1, num_devices: int | None = None,
           devices: Sequence | None = None) -> "Layout":
    """fsdp > 1: parameters and optimizer state sharded over a second mesh axis ('fsdp').
    devices: a mesh over these (a deviceless topology's) instead of the first num_devices."""
    if fsdp > 1:
      return cls(fsdp_mesh(fsdp, num_devices, devices), fsdp_state_rule(), BATCH_AXES)
    mesh = (make_mesh(num_devices) if devices is None else
            Mesh(np.asarray(devices), (DATA_AXIS,), axis_types=(jax.sharding.AxisType.Auto,)))
    return cls(mesh, default_state_rule, DATA_AXIS)

  @property
  def num_devices(self) -> int:
    return self.mesh.devices.size

  @property
  def replicated(self) -> NamedSharding:
    return replicated(self.mesh)

  @property
  def rows(self) -> NamedSharding:
    """A (B, M) batch: its rows over the batch axes."""
    return NamedSharding(self.mesh, P(self.batch_axes, None))

  @property
  def cache_rows(self) -> NamedSharding:
    """A (B, L, D) cache: its rows over the batch axes."""
    return NamedSharding(self.mesh, P(self.batch_axes, None, None))

  def state_shardings(self, abstract_state: Any) -> Any:
    return state_shardings(abstract_state, self.mesh, self.state_rule)

  def shard_batch(self, x: Any) -> Any:
    return shard_batch(x, self.mesh, self.batch_axes)

  def check_batches(self, batch: int, eval_batch: int, batch_split: int = 1,
                    processes: int = 1, whole_pieces: bool = False) -> None:
    """Every batch splits evenly over the devices and the processes, the training batch into
    batch_split pieces (the state carries both batches' caches, so both must). whole_pieces:
    each piece must split over the devices too (the compile mode: no device idles in a piece)."""
    n = self.num_devices
    if whole_pieces and (batch // batch_split) % n:
      raise ValueError(f"config.data.batch / optim.batch_split = {batch // batch_split} does not "
                       f"divide over {n} devices: choose a multiple of {n}")
    for field, b in (("batch", batch), ("eval_batch", eval_batch)):
      if b % n:
        raise ValueError(f"config.data.{field}={b} must be divisible by the {n} devices")
      if b % processes:
        raise ValueError(f"config.data.{field}={b} must be divisible by the {processes} processes")
    if batch % batch_split:
      raise ValueError(f"config.data.batch={batch} must be divisible by "
                       f"config.optim.batch_split={batch_split}")

"""Mesh and sharding helpers on the 8 fake CPU devices."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from span_lm.train import sharding


def _abstract_state(batch=8, length=4, dim=3):
  sds = jax.ShapeDtypeStruct
  return {
      "params": {"emb": sds((5, dim), jnp.float32), "out": {"w": sds((dim, 5), jnp.float32)}},
      "opt_state": ({"acc": sds((5, dim), jnp.float32)},),
      "step": sds((), jnp.int32),
      "rng": sds((2,), jnp.uint32),
      "caches": (sds((batch, length, dim), jnp.float32), sds((batch, length, dim), jnp.float32)),
      "eval_caches": (sds((batch, length, dim), jnp.float32),),
  }


def test_make_mesh_is_1d_auto():
  mesh = sharding.make_mesh()
  assert mesh.axis_names == ("data",) and mesh.shape["data"] == jax.device_count() == 8
  assert mesh.axis_types == (jax.sharding.AxisType.Auto,)
  mesh2 = sharding.make_mesh(2)
  assert list(mesh2.devices) == jax.devices()[:2]
  with pytest.raises(ValueError, match="num_devices"):
    sharding.make_mesh(9)


def test_replicated_and_data_sharding():
  mesh = sharding.make_mesh()
  assert sharding.replicated(mesh).spec == P()
  assert sharding.data_sharding(mesh, 3).spec == P("data", None, None)
  assert sharding.data_sharding(mesh, 1).spec == P("data")
  with pytest.raises(ValueError):
    sharding.data_sharding(mesh, 0)


def test_state_shardings_caches_on_data_rest_replicated():
  mesh = sharding.make_mesh(4)
  shardings = sharding.state_shardings(_abstract_state(), mesh)
  for path, s in jax.tree_util.tree_flatten_with_path(shardings)[0]:
    name = sharding.path_str(path)
    want = P("data", None, None) if name.split("/")[0] in ("caches", "eval_caches") else P()
    assert s.spec == want, name
    assert s.mesh is mesh
  # The abstract tree with shardings attached is a valid jit / restore target.
  target = sharding.with_shardings(_abstract_state(), shardings)
  assert target["caches"][1].sharding.spec == P("data", None, None)
  assert target["step"].sharding.spec == P()


def test_state_shardings_custom_rule_and_bad_cache_batch():
  mesh = sharding.make_mesh()
  with pytest.raises(ValueError, match="caches/0.*divisible"):
    sharding.state_shardings(_abstract_state(batch=6), mesh)

  def everything_replicated(path, leaf, mesh):
    return sharding.replicated(mesh)

  out = sharding.state_shardings(_abstract_state(batch=6), mesh, rule=everything_replicated)
  assert all(s.spec == P() for s in jax.tree.leaves(out))


def test_shard_batch_splits_over_devices():
  mesh = sharding.make_mesh()
  x = np.arange(8 * 5, dtype=np.int32).reshape(8, 5)
  y = sharding.shard_batch(x, mesh)
  assert y.sharding.spec == P("data", None)
  assert len(y.addressable_shards) == 8
  assert all(s.data.shape == (1, 5) for s in y.addressable_shards)
  np.testing.assert_array_equal(np.asarray(y), x)
  tree = sharding.shard_batch({"x": x, "y": x[:, 0]}, sharding.make_mesh(2))
  assert tree["y"].sharding.spec == P("data")


def test_shard_batch_rejects_indivisible_batch():
  mesh = sharding.make_mesh()
  with pytest.raises(ValueError, match=r"\(6, 5\).*divisible by 8"):
    sharding.shard_batch(np.zeros((6, 5), np.int32), mesh)


def test_shard_batch_is_what_a_run_puts_on_its_mesh():
  """A training batch (x, y and the 0-d reset flag) over the FSDP mesh's two axes: rows split over
  both, the flag replicated; loop.Run.put_batch is this function with the run's batch axes."""
  mesh = Mesh(np.asarray(jax.devices()).reshape(4, 2), ("data", "fsdp"),
              axis_types=(jax.sharding.AxisType.Auto,) * 2)
  x = np.arange(8 * 3, dtype=np.int32).reshape(8, 3)
  b = sharding.shard_batch({"x": x, "y": x + 1, "reset": np.asarray(True)}, mesh,
                           ("data", "fsdp"))
  assert b["x"].sharding.spec == P(("data", "fsdp"), None)
  assert all(s.data.shape == (1, 3) for s in b["y"].addressable_shards)
  np.testing.assert_array_equal(np.asarray(b["y"]), x + 1)
  assert b["reset"].sharding.is_fully_replicated and bool(b["reset"]) and b["reset"].ndim == 0


def test_params_carry_logical_axis_names_that_rules_map_to_the_mesh():
  mesh = sharding.make_mesh()
  tree = {"params": {"layers_0": {"attn": {"proj_key": {"kernel": np.zeros((16, 16))}}},
                     "in_emb": {"embedding": np.zeros((11, 16))}},
          "opt_state": ({"sum": {"layers_0": {"attn": {"proj_key": {"kernel": np.zeros((16, 16))}}}}},),
          "caches": (np.zeros((8, 4, 16)),)}
  assert sharding.logical_axes(("params", "in_emb", "embedding"), 2) == ("vocab", "embed")
  default = sharding.state_shardings(tree, mesh)
  assert default["params"]["in_emb"]["embedding"].is_fully_replicated
  fsdp = sharding.state_shardings(tree, mesh, sharding.make_state_rule((("embed", "data"),)))
  assert fsdp["params"]["layers_0"]["attn"]["proj_key"]["kernel"].spec == P("data", None)
  assert fsdp["opt_state"][0]["sum"]["layers_0"]["attn"]["proj_key"]["kernel"].spec == P("data", None)
  # 11 rows do not divide over 8 devices: that dimension stays replicated.
  assert fsdp["params"]["in_emb"]["embedding"].spec == P(None, "data")


@pytest.mark.parametrize("fsdp", [1, 2])
def test_layout_is_the_one_choice_between_data_parallel_and_fsdp(fsdp):
  """Layout.make picks mesh, state rule and batch axes together (loop, compile mode, benchmarks
  all go through it): with fsdp 2, caches split over both axes and a kernel's 'embed' dim over
  'fsdp'; with fsdp 1 the 1-D data mesh and replicated parameters."""
  layout = sharding.Layout.make(fsdp)
  assert layout.num_devices == 8
  tree = _abstract_state()
  tree["params"]["proj_key"] = {"kernel": jax.ShapeDtypeStruct((6, 4), jnp.float32)}
  sh = layout.state_shardings(tree)
  if fsdp == 1:
    assert layout.mesh.axis_names == ("data",) and layout.batch_axes == "data"
    assert sh["params"]["proj_key"]["kernel"].is_fully_replicated
  else:
    assert layout.mesh.axis_names == ("data", "fsdp") and layout.mesh.shape["fsdp"] == 2
    assert sh["params"]["proj_key"]["kernel"].spec == P("fsdp", None)
  assert sh["caches"][0].spec == P(layout.batch_axes, None, None) == layout.cache_rows.spec
  assert layout.rows.spec == P(layout.batch_axes, None)
  b = layout.shard_batch({"x": np.zeros((8, 3), np.int32), "reset": np.asarray(False)})
  assert b["x"].sharding.spec == layout.rows.spec and b["reset"].sharding.is_fully_replicated
  # a deviceless topology's devices give the same layout over exactly those devices
  same = sharding.Layout.make(fsdp, devices=jax.devices()[:4])
  assert same.num_devices == 4 and same.mesh.axis_names == layout.mesh.axis_names


def test_layout_refuses_batches_that_do_not_split():
  layout = sharding.Layout.make(1, num_devices=4)
  layout.check_batches(8, 4, batch_split=2, processes=2)
  with pytest.raises(ValueError, match=r"config.data.batch=6 must be divisible by the 4 devices"):
    layout.check_batches(6, 4)
  with pytest.raises(ValueError, match=r"config.data.eval_batch=2 must be divisible by the 4 dev"):
    layout.check_batches(8, 2)
  with pytest.raises(ValueError, match=r"config.data.batch=4 must be divisible by the 8 proc"):
    layout.check_batches(4, 8, processes=8)
  with pytest.raises(ValueError, match=r"config.data.batch=4 must be divisible by config.optim"):
    layout.check_batches(4, 4, batch_split=3)
  layout.check_batches(8, 4, batch_split=2)  # pieces of 4 rows: one per device
  with pytest.raises(ValueError, match=r"batch / optim.batch_split = 2 does not divide over 4"):
    layout.check_batches(8, 4, batch_split=4, whole_pieces=True)  # the compile mode's rule
  with pytest.raises(ValueError, match=r"config.dist.fsdp=3 must divide the 8 devices"):
    sharding.Layout.make(3)

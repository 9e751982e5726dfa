"""Leaf fingerprints (span_lm/train/fingerprint.py): the device computation equals the numpy
reference for every dtype a state holds, on any mesh and sharding, and any single changed word
changes it; 8 fake CPU devices."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from span_lm.train import fingerprint as fp
from span_lm.train import sharding


def _arrays(seed=0) -> dict:
  rng = np.random.default_rng(seed)
  return {
      "f32": rng.standard_normal((16, 24)).astype(np.float32),
      "bf16": np.asarray(jnp.asarray(rng.standard_normal((8, 6, 4)), jnp.bfloat16)),
      "f16": rng.standard_normal((8, 6)).astype(np.float16),
      "bool": rng.random((8, 3)) > 0.5,
      "i8": rng.integers(-128, 127, (8, 5)).astype(np.int8),
      "u8": rng.integers(0, 255, (16,)).astype(np.uint8),
      "u32": rng.integers(0, 2**32, (4, 2), dtype=np.uint64).astype(np.uint32),  # rng key data
      "i32": np.int32(-7),
      "scalar_f32": np.float32(2.0**15),
      "empty": np.zeros((0, 4), np.float32),
      "nan": np.array([np.nan, -np.nan, np.inf, 0.0, -0.0], np.float32),
  }


def test_device_fingerprints_equal_the_numpy_reference():
  arrays = _arrays()
  got = fp.fingerprints({k: jnp.asarray(v) for k, v in arrays.items()})
  assert got == {k: fp.fingerprint_numpy(v) for k, v in arrays.items()}
  assert all(len(v) == 16 and int(v, 16) >= 0 for v in got.values())
  assert len(set(got.values())) == len(got)  # no two leaves alike


def test_64_bit_leaves_are_two_words_each():
  with jax.enable_x64(True):
    rng = np.random.default_rng(1)
    arrays = {"f64": rng.standard_normal((4, 6)), "i64": rng.integers(-2**62, 2**62, (5,)),
              "u64": np.uint64(2**63 + 5)}
    got = fp.fingerprints({k: jnp.asarray(v) for k, v in arrays.items()})
    assert got == {k: fp.fingerprint_numpy(v) for k, v in arrays.items()}
    # The high word counts: two values with the same low word differ.
    assert fp.fingerprint_numpy(np.uint64(1)) != fp.fingerprint_numpy(np.uint64(1 + 2**32))


def _layouts(x: np.ndarray):
  """x on several meshes and shardings of the 8 devices (and on one device)."""
  devices = np.asarray(jax.devices())
  meshes = [Mesh(devices, ("a",)), Mesh(devices.reshape(4, 2), ("a", "b")),
            Mesh(devices.reshape(2, 4), ("a", "b")), Mesh(devices[:2], ("a",))]
  yield jax.device_put(x, jax.devices()[3])
  for mesh in meshes:
    for spec in (P(), P("a"), P(None, "a"), P("a", "b"), P("b", "a")):
      if any(name not in mesh.axis_names for name in spec if name) or len(spec) > x.ndim:
        continue
      if all(name is None or x.shape[d] % mesh.shape[name] == 0 for d, name in enumerate(spec)):
        yield jax.device_put(x, NamedSharding(mesh, spec))


@pytest.mark.parametrize("name", ["f32", "bf16", "bool", "i8"])
def test_a_fingerprint_is_the_same_on_every_mesh_and_sharding(name):
  x = _arrays()[name]
  want = fp.fingerprint_numpy(x)
  seen = set()
  for y in _layouts(x):
    seen.add(str(getattr(y.sharding, "spec", "one device")))
    assert fp.fingerprints({"x": y}) == {"x": want}, y.sharding
  assert len(seen) >= 3, seen


def test_a_state_and_the_same_state_resharded_have_the_same_fingerprints():
  """A training-like state laid out for 8 devices (data parallel, then FSDP) and for 2."""
  import optax  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(2)
  params = {"in_emb": {"embedding": rng.standard_normal((32, 16)).astype(np.float32)},
            "layers_0": {"ff": {"fc1": {"kernel": rng.standard_normal((16, 32)).astype(
                np.float32)}}, "span": np.full((2,), 0.25, np.float32)}}
  params = jax.tree.map(jnp.asarray, params)
  opt = optax.adam(1e-3)
  _, opt_state = opt.update(jax.tree.map(jnp.ones_like, params), opt.init(params), params)
  state = {"params": params, "opt_state": opt_state, "step": jnp.int32(5),
           "rng": jax.random.key_data(jax.random.key(0)),
           "caches": (jnp.asarray(rng.standard_normal((8, 4, 16)), jnp.bfloat16),)}
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
  first, specs = None, set()
  for n, fsdp in ((8, 1), (8, 2), (8, 4), (2, 1), (1, 1)):
    placed = jax.device_put(state, sharding.Layout.make(fsdp, n).state_shardings(abstract))
    specs.add(str(placed["params"]["layers_0"]["ff"]["fc1"]["kernel"].sharding.spec))
    got = fp.fingerprints(placed)
    first = first or got
    assert got == first, (n, fsdp)
  assert "P('fsdp', None)" in specs, specs  # parameters split by FSDP too
  host = jax.device_get(state)
  assert first == {p: fp.fingerprint_numpy(x) for p, x in zip(
      fp.leaf_paths(host), jax.tree.leaves(host))}


def test_every_single_bit_flip_changes_both_sums():
  for name in ("f32", "bf16", "i8", "u32"):
    x = np.ascontiguousarray(_arrays()[name])
    h = fp.fingerprint_numpy(x)
    raw = x.view(np.uint8).reshape(-1)
    for byte in range(raw.size):
      for bit in range(8):
        y = raw.copy()
        y[byte] ^= 1 << bit
        g = fp.fingerprint_numpy(y.view(x.dtype).reshape(x.shape))
        assert g[:8] != h[:8] and g[8:] != h[8:], (name, byte, bit)


def test_moved_and_swapped_data_is_detected():
  x = _arrays()["f32"]
  h = fp.fingerprint_numpy(x)
  assert fp.fingerprint_numpy(x[::-1]) != h  # rows in another order
  assert fp.fingerprint_numpy(np.roll(x, 1, axis=1)) != h
  y = x.copy()
  y[[0, 5]] = y[[5, 0]]  # two rows swapped (a chunk written in another's place)
  assert fp.fingerprint_numpy(y) != h
  assert fp.fingerprint_numpy(np.zeros_like(x)) != h
  # The same bits under another shape are another array.
  assert fp.fingerprint_numpy(x.reshape(24, 16)) == h  # (the shape is checked beside it)


def test_one_program_per_entry_and_a_new_cache_shape_compiles_only_the_caches():
  """Each top-level entry's leaves in one compiled program, reused by later calls; caches of a
  new span plan (new shapes) compile their own small program again, not the parameters'."""
  rng = np.random.default_rng(3)
  state = {"params": {f"layers_{i}": {"w": jnp.asarray(rng.standard_normal((8, 8)), jnp.float32)}
                      for i in range(4)},
           "step": jnp.int32(3),
           "caches": tuple(jnp.zeros((8, 16, 4)) for _ in range(4))}
  fp.fingerprints(state)
  size = fp._all_sums._cache_size  # pylint: disable=protected-access
  before = size()
  fp.fingerprints(jax.tree.map(lambda x: x + 1, state))
  assert size() == before
  wider = dict(state, caches=tuple(jnp.zeros((8, 32, 4)) for _ in range(4)))
  got = fp.fingerprints(wider)
  assert size() == before + 1  # the caches' program only
  assert got["params/layers_0/w"] == fp.fingerprint_numpy(state["params"]["layers_0"]["w"])

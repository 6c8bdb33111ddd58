"""lctx.loss.cross_entropy on an 8-device mesh: the values and gradients of one
device's run, and the unembedding's gradient reduce-scattered to the rows each
device holds (not all-reduced whole: its f32 [D, vocab] accumulator then stayed
live through the layers' backward, docs/benchmarks.md)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lctx import loss
from lctx.models.layers import RMSNormFn
from lctx.parallel import mesh as mesh_lib

B, T, E = 2, 64, 48


def _mesh(shape):
  devices = np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape)
  return Mesh(devices, mesh_lib.MESH_AXES)


def _inputs(d):
  k = jax.random.split(jax.random.key(0), 5)
  h = jax.random.normal(k[0], (B, T, d), jnp.float32)
  u = jax.random.normal(k[1], (d, E), jnp.float32) * 0.3
  t = jax.random.randint(k[2], (B, T), 0, E)
  w = (jax.random.uniform(k[3], (B, T)) > 0.2).astype(jnp.float32)
  scale = 1 + 0.1 * jax.random.normal(k[4], (d,))
  return h, u, t, w, scale


def _objective(mesh, t, w):
  def f(h, u, scale):
    norm = RMSNormFn(scale, 1e-5, "float32")
    s, z, n = loss.cross_entropy(mesh, h, norm, u, t, w, chunk_size=16, z_loss=1e-3)
    return (s + z) / n

  return f


def _on_mesh(mesh, h, u, t, w, scale):
  f = jax.jit(jax.value_and_grad(_objective(mesh, t, w), argnums=(0, 1, 2)))
  with jax.set_mesh(mesh):
    hs = jax.device_put(h, NamedSharding(mesh, P(mesh_lib.BATCH_AXES, mesh_lib.SEQ_AXES, None)))
    rows = ("fsdp", "context", "context_ulysses")
    split = u.shape[0] % np.prod([mesh.shape[a] for a in rows]) == 0
    us = jax.device_put(u, NamedSharding(mesh, P(rows if split else None, None)))
    return f(hs, us, scale), f.lower(hs, us, scale).compile().as_text()


@pytest.mark.parametrize(
  "shape, d",
  [
    ((1, 2, 1, 2, 2), 32),  # d_model splits 8 ways: rows gathered, gradient reduce-scattered
    ((2, 1, 1, 4, 1), 32),  # a data axis too
    ((1, 2, 1, 2, 2), 36),  # 36 rows do not split 8 ways: the whole table, as before
  ],
)
def test_cross_entropy_on_a_mesh_equals_one_device(shape, d):
  h, u, t, w, scale = _inputs(d)
  (value, grads), _ = _on_mesh(_mesh(shape), h, u, t, w, scale)
  value0, grads0 = jax.value_and_grad(_objective(_mesh((1,) * 5), t, w), argnums=(0, 1, 2))(
    h, u, scale
  )
  np.testing.assert_allclose(float(value), float(value0), rtol=1e-5)
  for g, g0 in zip(grads, grads0):
    np.testing.assert_allclose(np.asarray(g), np.asarray(g0), rtol=1e-4, atol=1e-6)


def test_the_unembedding_gradient_is_reduce_scattered_not_all_reduced():
  h, u, t, w, scale = _inputs(32)
  _, hlo = _on_mesh(_mesh((1, 2, 1, 2, 2)), h, u, t, w, scale)
  collectives = re.findall(r"= (\S+) (all-reduce|reduce-scatter)(?:-start)?\(", hlo)
  shapes = {(kind, s) for s, kind in collectives}
  # The f32 [32, 48] gradient is summed into the 4 rows each device holds...
  assert ("reduce-scatter", "f32[4,48]{1,0}") in shapes, sorted(shapes)
  # ...and no collective carries the whole table.
  lines = [x for x in hlo.splitlines() if re.search(r" (all-reduce|reduce-scatter)(-start)?\(", x)]
  whole = [
    x
    for x in lines
    if re.search(r"\[32,48\]|\[48,32\]", re.split(r" (?:all-reduce|reduce-scatter)", x)[0])
  ]
  assert not whole, whole

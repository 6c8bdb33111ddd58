"""Linear attention under context parallelism (lctx.parallel.linear_context) on the
8-device CPU mesh: equal to the single-device kernels (values and gradients) for every
strategy's mesh layout, zigzag on and off, and the packing property."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import mesh as make_test_mesh

from lctx.errors import ConfigError
from lctx.kernels.delta_rule import delta_rule
from lctx.kernels.short_conv import short_conv
from lctx.parallel.linear_context import (
  make_linear_fns,
  piece_table,
  prefix_permutes,
  ring_attention_bytes,
  state_exchange_bytes,
)
from lctx.parallel.mesh import mesh_shape
from lctx.parallel.validation import zigzag_ring_size
from lctx.parallel.zigzag import zigzag_inverse, zigzag_reorder

B, T, N, H, V, W = 2, 64, 4, 8, 6, 4
CHUNK = 8


def _layer(conv, rule, x, weight, bias, g, beta, seg):
  """A miniature GDN/KDA core: conv over q|k|v channels, L2 norm, delta rule."""
  y = conv(x, weight, bias, segment_ids=seg)
  q, k, v = jnp.split(y, [N * H, 2 * N * H], axis=-1)
  q, k = (a.reshape(*a.shape[:2], N, H) for a in (q, k))
  q, k = (a / jnp.sqrt(jnp.sum(a * a, -1, keepdims=True) + 1e-6) for a in (q, k))
  v = v.reshape(*v.shape[:2], N, V)
  return rule(q * H**-0.5, k, v, g, beta, seg)


def _single(x, weight, bias, g, beta, seg):
  conv = lambda x, w, b, segment_ids: short_conv(x, w, b, segment_ids=segment_ids)  # noqa: E731
  rule = lambda q, k, v, g, b, s: delta_rule(q, k, v, g, b, segment_ids=s, chunk_size=CHUNK)[0]  # noqa: E731
  return _layer(conv, rule, x, weight, bias, g, beta, seg)


def _cp(fns):
  conv = lambda x, w, b, segment_ids: fns.short_conv(x, w, b, segment_ids=segment_ids)  # noqa: E731
  rule = lambda q, k, v, g, b, s: fns.delta_rule(q, k, v, g, b, segment_ids=s)  # noqa: E731

  def run(x, weight, bias, g, beta, seg):
    return _layer(conv, rule, x, weight, bias, g, beta, seg)

  return run


def _inputs(per_channel, seed=0):
  rng = np.random.default_rng(seed)
  c = 2 * N * H + N * V
  x = rng.normal(size=(B, T, c)).astype(np.float32)
  weight = rng.normal(size=(W, c)).astype(np.float32) * 0.5
  bias = rng.normal(size=(c,)).astype(np.float32) * 0.1
  g = -rng.uniform(0.01, 0.3, size=(B, T, N, H) if per_channel else (B, T, N)).astype(np.float32)
  beta = rng.uniform(0.1, 0.9, size=(B, T, N)).astype(np.float32)
  wo = rng.normal(size=(B, T, N, V)).astype(np.float32)
  return x, weight, bias, g, beta, wo


def _packed_row():
  """Row 0: documents of 5, 20 (straddling several devices), 18 tokens, 3 padding, 18;
  row 1: one document then 7 padding."""
  seg = np.zeros((B, T), np.int32)
  bounds = [(0, 5, 1), (5, 25, 2), (25, 43, 3), (46, 64, 4)]
  for lo, hi, s in bounds:
    seg[0, lo:hi] = s
  seg[1, : T - 7] = 1
  return seg, bounds


def _value_and_grads(fn, x, weight, bias, g, beta, seg, wo):
  def loss(x, weight, bias, g, beta):
    return jnp.sum(fn(x, weight, bias, g, beta, seg) * wo)

  out = fn(x, weight, bias, g, beta, seg)
  return out, jax.grad(loss, argnums=(0, 1, 2, 3, 4))(x, weight, bias, g, beta)


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)


def _reorder(x, ring, inverse=False):
  return (zigzag_inverse if inverse else zigzag_reorder)(x, ring, axis=1)


SLOW = pytest.mark.slow
# (mesh, zigzag, per-channel decay): each strategy's layout (all_gather / ring /
# ulysses: context; usp: context x context_ulysses; with tensor and data beside).
CASES = [
  ("c8", True, False),
  ("t2c4", False, True),
  pytest.param("c8", False, False, marks=SLOW),
  pytest.param("c8", True, True, marks=SLOW),
  pytest.param("t2c4", True, False, marks=SLOW),
  pytest.param("d2c4", True, False, marks=SLOW),
  pytest.param("usp2x4", False, False, marks=SLOW),
  pytest.param("usp2x4", True, True, marks=SLOW),
  pytest.param("usp4x2", True, False, marks=SLOW),
]


@pytest.mark.parametrize("mesh_name,load_balance,per_channel", CASES)
def test_context_parallel_equals_single_device(mesh_name, load_balance, per_channel):
  mesh = make_test_mesh(mesh_name)
  x, weight, bias, g, beta, wo = _inputs(per_channel)
  seg, _ = _packed_row()
  want, want_grads = jax.jit(lambda *a: _value_and_grads(_single, *a))(
    x, weight, bias, g, beta, seg, wo
  )

  ring = zigzag_ring_size(mesh_shape(mesh))
  z = (lambda a: _reorder(a, ring)) if load_balance else (lambda a: a)  # noqa: E731
  fns = make_linear_fns(mesh, load_balance=load_balance)
  got, got_grads = jax.jit(lambda *a: _value_and_grads(_cp(fns), *a))(
    z(x), weight, bias, z(g), z(beta), z(seg), z(wo)
  )
  unz = (lambda a: _reorder(np.asarray(a), ring, inverse=True)) if load_balance else np.asarray  # noqa: E731
  assert _rel(unz(got), want) < 1e-5
  for name, gg, ww, seq in zip(
    ["x", "weight", "bias", "g", "beta"], got_grads, want_grads, [1, 0, 0, 1, 1]
  ):
    assert _rel(unz(gg) if seq else gg, ww) < 1e-5, name


@pytest.mark.parametrize(
  "mesh_name,load_balance", [("c8", True), pytest.param("usp2x4", False, marks=SLOW)]
)
def test_packed_documents_equal_alone(mesh_name, load_balance):
  """THE PACKING PROPERTY: a packed row under context parallelism gives each document
  the outputs and gradients it gets alone on one device."""
  mesh = make_test_mesh(mesh_name)
  x, weight, bias, g, beta, wo = _inputs(False, seed=4)
  seg, bounds = _packed_row()
  ring = zigzag_ring_size(mesh_shape(mesh))
  z = (lambda a: _reorder(a, ring)) if load_balance else (lambda a: a)  # noqa: E731
  unz = (lambda a: _reorder(np.asarray(a), ring, inverse=True)) if load_balance else np.asarray  # noqa: E731
  fns = make_linear_fns(mesh, load_balance=load_balance)
  got, (gx, _, _, gg, gb) = jax.jit(lambda *a: _value_and_grads(_cp(fns), *a))(
    z(x), weight, bias, z(g), z(beta), z(seg), z(wo)
  )
  got, gx, gg, gb = (unz(a) for a in (got, gx, gg, gb))
  assert np.all(got[seg == 0] == 0)
  for lo, hi, _ in bounds:
    doc = lambda a: a[:1, lo:hi]  # noqa: E731
    ones = np.ones((1, hi - lo), np.int32)
    alone, (ax, _, _, ag, ab) = _value_and_grads(
      _single, doc(x), weight, bias, doc(g), doc(beta), ones, doc(wo)
    )
    assert _rel(doc(got), alone) < 1e-5
    assert _rel(doc(gx), ax) < 1e-5 and _rel(doc(gg), ag) < 1e-5 and _rel(doc(gb), ab) < 1e-5
  # Padding gets no gradient through beta, and through g only rounding: a later
  # document's loss depends on differences of cumulative decays, whose cotangents
  # cancel in the cumulative sum's transpose up to float32 rounding.
  assert np.all(gb[seg == 0] == 0)
  assert np.abs(gg[seg == 0]).max() < 1e-6 * np.abs(gg).max()


def test_refusals():
  mesh = make_test_mesh("c8")
  fns = make_linear_fns(mesh, load_balance=True)
  x, weight, bias, *_ = _inputs(False)
  with pytest.raises(ConfigError, match=r"\[seq-divisible\]"):
    fns.short_conv(x[:, :40], weight, bias)
  with pytest.raises(ConfigError, match=r"\[conv-halo\]"):
    fns.short_conv(x[:, :32], weight, bias)  # pieces of 2 tokens < W - 1
  with pytest.raises(ConfigError, match=r"\[batch-divisible\]"):
    make_linear_fns(make_test_mesh("d2c4"), load_balance=False).short_conv(x[:1], weight, bias)


def test_state_exchange_bytes():
  got = state_exchange_bytes(
    batch=1, heads=2, key_dim=4, value_dim=3, ways=8, load_balance=True, conv_channels=5
  )
  summary = 1 * 2 * 4 * (4 + 3) * 4  # one piece's [C | A], float32
  assert got["summary_bytes"] == summary
  # Zigzag over 8: device d holds pieces d (slot 0) and 15 - d (slot 1). Offsets 1,
  # 2 and 4 pair slots (0, 0), (0, 1) and (1, 1): three ppermutes each; offset 8
  # only (0, 1). The ids' and the states' shifts (offset 1) take three each.
  ids, state = 1 * 4, 1 * 2 * 4 * 3 * 4
  assert prefix_permutes(piece_table({"context": 8}, True)) == [
    (1, 3),
    (1, 3),
    (2, 3),
    (4, 3),
    (8, 1),
    (1, 3),
  ]
  assert got["prefix_bytes"] == 3 * ids + (3 + 3 + 3 + 1) * summary + 3 * state
  assert got["halo_bytes"] == 7 * 2 * 1 * 3 * (5 + 1) * 4
  assert got["total"] == got["prefix_bytes"] + got["halo_bytes"]
  # Natural order (no load balance): one slot, one ppermute per shift.
  plain = state_exchange_bytes(batch=1, heads=2, key_dim=4, value_dim=3, ways=8, load_balance=False)
  assert plain["prefix_bytes"] == ids + 3 * summary + state
  # No sequence shards, no exchange.
  one = state_exchange_bytes(batch=1, heads=2, key_dim=4, value_dim=3, ways=1, load_balance=True)
  assert one["total"] == 0
  # Qwen3.5-like layer at 1M tokens on 64 devices: the exchange is a small fraction
  # of one ring-attention pass at the same length.
  lin = state_exchange_bytes(
    batch=1, heads=32, key_dim=128, value_dim=128, ways=64, load_balance=True, conv_channels=8192
  )
  ring = ring_attention_bytes(
    batch=1, tokens=2**20 // 64, kv_heads=8, head_dim=128, value_dim=128, ways=64
  )
  assert lin["total"] < ring

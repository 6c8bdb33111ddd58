"""Window-aware context parallelism for sliding layers (lctx/parallel/halo.py).

Values and q/k/v gradients of the window-aware call equal reference attention
(and so the strategy's plain call) under every strategy, with and without
zigzag; and what travels is counted from the traced program: a window no
longer than one chunk moves one halo (two with zigzag), not P - 1 chunks.
"""

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lctx.kernels import reference_attention
from lctx.parallel.mesh import mesh_shape
from lctx.parallel.validation import zigzag_ring_size
from lctx.parallel.zigzag import zigzag_inverse, zigzag_reorder

B, T = 2, 64


def _inputs(heads="gqa", seed=0):
  n, k, h, vd = helpers.HEADS[heads]
  ks = jax.random.split(jax.random.key(seed), 4)
  return tuple(
    jax.random.normal(key, shape)
    for key, shape in zip(ks, [(B, T, n, h), (B, T, k, h), (B, T, k, vd), (B, T, n, vd)])
  )


def _call(strategy, mesh, lb, window, window_aware):
  """The attention call on natural-order global arrays (zigzag done around it)."""
  fn = helpers.strategy_attention_fn(mesh, strategy, load_balance=lb, window_aware=window_aware)
  ring = zigzag_ring_size(mesh_shape(mesh))
  seg, pos = helpers.packed_segments(B, T)
  if lb:
    seg, pos = zigzag_reorder(seg, ring), zigzag_reorder(pos, ring)

  def call(q, k, v):
    if lb:
      q, k, v = (zigzag_reorder(x, ring) for x in (q, k, v))
    out = fn(q, k, v, segment_ids=seg, positions=pos, causal=True, window_size=window)
    return zigzag_inverse(out, ring) if lb else out

  return call


def _reference(window):
  seg, pos = helpers.packed_segments(B, T)

  def ref(q, k, v):
    return reference_attention(
      q, k, v, segment_ids=seg, q_positions=pos, kv_positions=pos, causal=True, window_size=window
    )

  return ref


SLOW = pytest.mark.slow
# (strategy, mesh, zigzag, window, heads): windows 4 and 5 fit a chunk (8 tokens
# per device on c8, 4 per zigzag chunk); 13 does not, and falls back to the ring.
CASES = [
  ("ring", "c8", False, 5, "gqa"),
  ("ring", "c8", True, 4, "gqa"),
  pytest.param("ring", "d2c4", True, 5, "mqa", marks=SLOW),
  ("ring", "c8", True, 13, "gqa"),
  ("all_gather", "c8", False, 5, "gqa"),
  pytest.param("all_gather", "d2c4", True, 5, "gqa", marks=SLOW),
  ("usp", "usp2x4", True, 5, "gqa"),
  pytest.param("usp", "usp4x2", False, 4, "mha", marks=SLOW),
  ("ulysses", "d2c4", False, 5, "mha"),  # windowed after its all-to-all, as before
]


@pytest.mark.parametrize("strategy,mesh_name,lb,window,heads", CASES)
def test_window_aware_matches_reference(strategy, mesh_name, lb, window, heads):
  q, k, v, w = _inputs(heads)
  mesh = helpers.mesh(mesh_name)
  got, got_vjp = jax.vjp(_call(strategy, mesh, lb, window, True), q, k, v)
  want, want_vjp = jax.vjp(_reference(window), q, k, v)
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
  for name, a, b in zip("qkv", got_vjp(w), want_vjp(w)):
    np.testing.assert_allclose(a, b, atol=5e-5, rtol=5e-5, err_msg=f"d{name}")


# ----------------------------------------------------------------------------
# What travels: ppermute / all_gather / all_to_all in the traced program,
# counted with their trip counts (scan lengths).
# ----------------------------------------------------------------------------
_COLLECTIVES = ("ppermute", "all_gather", "all_to_all")


def _collectives(jaxpr, times=1, out=None):
  """{primitive: [count, bytes]} over a jaxpr and every sub-jaxpr."""
  out = {} if out is None else out
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name in _COLLECTIVES:
      entry = out.setdefault(name, [0, 0])
      entry[0] += times
      entry[1] += times * sum(v.aval.size * v.aval.dtype.itemsize for v in eqn.invars)
    trip = eqn.params.get("length", 1) if name == "scan" else 1
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          _collectives(inner, times * trip, out)
  return out


def _traffic(strategy, mesh_name, lb, window, window_aware, grad=False):
  q, k, v, w = _inputs()
  call = _call(strategy, helpers.mesh(mesh_name), lb, window, window_aware)
  if grad:
    fn = jax.grad(lambda q, k, v: jnp.sum(call(q, k, v) * w), argnums=(0, 1, 2))
  else:
    fn = call
  return _collectives(jax.make_jaxpr(fn)(q, k, v).jaxpr)


@pytest.mark.parametrize("lb", [False, True])
def test_sliding_ring_hops_for_a_window_within_one_chunk(lb):
  """c8, 64 tokens: 8 per device (4 per zigzag chunk), window 4 (a halo of 3).
  The ring moves K, V, ids and positions P - 1 = 7 times; the sliding layer
  moves them once (from r - 1), with zigzag twice (from r - 1 and r + 1), and
  only the 3-token halo each time. (The test's zigzag reorder of global arrays
  is a gather, no ppermute.)"""
  window, per_hop = 4, 4  # k, v, segment ids, positions travel together
  plain = _traffic("ring", "c8", lb, window, False)["ppermute"]
  aware = _traffic("ring", "c8", lb, window, True)["ppermute"]
  assert plain[0] == 7 * per_hop
  hops = 2 if lb else 1
  assert aware[0] == hops * per_hop
  # Bytes: each halo is 3 of the 8 tokens a ring hop sends.
  assert aware[1] == pytest.approx(hops * plain[1] / 7 * 3 / 8)


def test_sliding_backward_moves_only_the_halo():
  plain = _traffic("ring", "c8", True, 4, False, grad=True)["ppermute"]
  aware = _traffic("ring", "c8", True, 4, True, grad=True)["ppermute"]
  # The plain ring's backward sends K/V/ids/positions and dK/dV around the ring
  # again; the halo's backward returns the two halos' dK/dV by the transposed ppermute.
  assert aware[1] * 10 < plain[1], (aware, plain)


def test_sliding_all_gather_gathers_nothing():
  plain = _traffic("all_gather", "c8", False, 5, False)
  aware = _traffic("all_gather", "c8", False, 5, True)
  assert plain["all_gather"][0] == 4 and "all_gather" not in aware
  assert aware["ppermute"][0] == 4  # one halo of k, v, ids, positions

"""Every context-parallel strategy matches reference attention: values and q/k/v grads.

8 fake CPU devices (tests/conftest.py). The default run keeps a representative
subset; the full matrix (strategy x mesh x causal x load balancing x heads) is
marked slow.
"""

import re

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lctx.kernels import reference_attention
from lctx.parallel import context_attention
from lctx.parallel.zigzag import zigzag_inverse, zigzag_reorder

AUTO = jax.sharding.AxisType.Auto
MESHES, HEADS = helpers.MESHES, helpers.HEADS
MATRIX_HEADS = ("mha", "gqa", "mqa", "mla", "mha16", "gqa16", "mla16")


def _inputs(heads, b=2, t=32, seed=0):
  n, k, h, vd = HEADS[heads]
  ks = jax.random.split(jax.random.key(seed), 4)
  return (
    jax.random.normal(ks[0], (b, t, n, h)),
    jax.random.normal(ks[1], (b, t, k, h)),
    jax.random.normal(ks[2], (b, t, k, vd)),
    jax.random.normal(ks[3], (b, t, n, vd)),
  )


def _check(fn, ref, q, k, v, w):
  """Compares forward values and the vjp of sum(out * w) w.r.t. q, k, v."""
  out, vjp = jax.vjp(fn, q, k, v)
  ref_out, ref_vjp = jax.vjp(ref, q, k, v)
  np.testing.assert_allclose(out, ref_out, atol=2e-5, rtol=2e-5)
  for name, a, b in zip("qkv", vjp(w), ref_vjp(w)):
    np.testing.assert_allclose(a, b, atol=5e-5, rtol=5e-5, err_msg=f"d{name}")


def _run_case(
  strategy, mesh_name, heads, causal, load_balance, packed=True, window=None, axis_type=AUTO, t=32
):
  mesh = helpers.mesh(mesh_name, axis_type)
  q, k, v, w = _inputs(heads, t=t)
  seg, pos = helpers.packed_segments(q.shape[0], q.shape[1], packed)
  kw = dict(segment_ids=seg, causal=causal, window_size=window)

  def ours(q, k, v):
    return context_attention(
      q, k, v, mesh=mesh, strategy=strategy, positions=pos, load_balance=load_balance, **kw
    )

  def ref(q, k, v):
    return reference_attention(q, k, v, q_positions=pos, kv_positions=pos, **kw)

  _check(ours, ref, q, k, v, w)


# Representative subset: every strategy, every mesh, causal and not, packing, GQA,
# MQA, MLA, load balancing on and off.
DEFAULT_CASES = [
  ("all_gather", "c8", "gqa", True, False),
  ("all_gather", "d2c4", "mqa", False, True),
  ("ulysses", "c8", "mha", True, False),
  ("ulysses", "t2c4", "mha", False, False),
  ("ring", "c8", "gqa", True, True),
  ("ring", "t2c4", "mqa", True, False),  # K/V replicated over tensor
  ("ring", "t2c4", "mla", False, False),
  ("usp", "usp2x4", "gqa", True, True),
  ("usp", "usp4x2", "mha", False, False),
]


@pytest.mark.parametrize("strategy,mesh_name,heads,causal,lb", DEFAULT_CASES)
def test_strategy_matches_reference(strategy, mesh_name, heads, causal, lb):
  _run_case(strategy, mesh_name, heads, causal, lb)


@pytest.mark.parametrize(
  "strategy,mesh_name,heads,causal,lb",
  [
    ("all_gather", "c8", "gqa16", True, True),
    ("ulysses", "c8", "mha16", True, False),
    ("ring", "c8", "gqa16", True, True),
    ("ring", "d2c4", "mla16", False, False),
    ("usp", "usp2x4", "gqa16", True, True),
  ],
)
def test_strategy_on_fused_cpu_kernel(strategy, mesh_name, heads, causal, lb):
  """float32 with head dims of 16/32: "auto" runs the fused C++ kernel inside the
  strategies (ring: its per-hop block forward/backward too)."""
  from lctx.kernels import cpu_build, cpu_fused

  if cpu_build.compiler() is None:
    pytest.skip("no C++ compiler on this machine")
  assert cpu_fused.available(), cpu_fused.unavailable_reason()
  mesh = helpers.mesh(mesh_name)
  q, k, v, _ = _inputs(heads, t=64)
  seg, pos = helpers.packed_segments(q.shape[0], q.shape[1], True)
  fn = lambda q, k, v: context_attention(  # noqa: E731
    q,
    k,
    v,
    mesh=mesh,
    strategy=strategy,
    positions=pos,
    load_balance=lb,
    segment_ids=seg,
    causal=causal,
  )
  jaxpr = str(jax.make_jaxpr(jax.grad(lambda *a: jnp.sum(fn(*a)), (0, 1, 2)))(q, k, v))
  assert "lctx_cpu_attention_fwd" in jaxpr and "lctx_cpu_attention_bwd" in jaxpr
  _run_case(strategy, mesh_name, heads, causal, lb, t=64)


def test_ring_sliding_window_and_explicit_mesh():
  _run_case("ring", "c8", "gqa", True, True, window=7, axis_type=jax.sharding.AxisType.Explicit)


def _valid(strategy, mesh_name, heads, lb):
  shape, names = MESHES[mesh_name]
  sizes = dict(zip(names, shape))
  c, u, tp = sizes.get("context", 1), sizes.get("context_ulysses", 1), sizes.get("tensor", 1)
  n, k, h, vd = HEADS[heads]
  if strategy in ("ring", "ulysses") and u > 1:
    return False
  if strategy == "usp" and u == 1:
    return False
  if strategy in ("ulysses", "usp"):
    a = c if strategy == "ulysses" else u
    if k == 1 or lb and strategy == "ulysses" or (n // tp) % a or (k // tp) % a:
      return False
  return not (k % tp and k != 1)


def _matrix():
  """strategy x mesh x heads, each with causal+balanced (where allowed), causal
  unbalanced and non-causal; all_gather is head-agnostic, so fewer meshes."""
  cases = []
  for s in ("all_gather", "ulysses", "ring", "usp"):
    meshes = ("c8", "t2c4", "usp2x4") if s == "all_gather" else MESHES
    for m in meshes:
      for h in MATRIX_HEADS:
        for c, lb in ((True, True), (True, False), (False, False)):
          case = (s, m, h, c, lb)
          if _valid(s, m, h, lb) and case not in DEFAULT_CASES:
            cases.append(case)
  return cases


FULL = _matrix()


@pytest.mark.slow
@pytest.mark.parametrize("strategy,mesh_name,heads,causal,lb", FULL)
def test_strategy_matrix(strategy, mesh_name, heads, causal, lb):
  _run_case(strategy, mesh_name, heads, causal, lb)


def test_attention_fn_in_jit_on_reordered_batch_sharded_over_data():
  """The train-step path: batch already in zigzag order, sharded over data."""
  mesh = helpers.mesh("d2c4")
  q, k, v, w = _inputs("gqa", b=4)
  seg, pos = helpers.packed_segments(4, 32, True)
  ring = 4
  zz = lambda x: zigzag_reorder(x, ring, axis=1)  # noqa: E731
  seg_z, pos_z = zz(seg), zz(pos)  # host numpy, like the data pipeline
  assert isinstance(seg_z, np.ndarray)
  # sub_chunks=2: the per-hop split that skips half-chunk pairs independently.
  attn = helpers.strategy_attention_fn(mesh, "ring", load_balance=True, sub_chunks=2)
  shard = lambda x: jax.device_put(x, NamedSharding(mesh, P("data")))  # noqa: E731
  qz, kz, vz, wz = (shard(zz(x)) for x in (q, k, v, w))

  @jax.jit
  def step(q, k, v, seg, pos):
    def loss(q, k, v):
      return jnp.sum(attn(q, k, v, segment_ids=seg, positions=pos) * wz)

    return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)

  val, grads = step(qz, kz, vz, shard(seg_z), shard(pos_z))

  def ref_loss(q, k, v):
    out = reference_attention(q, k, v, segment_ids=seg, q_positions=pos, kv_positions=pos)
    return jnp.sum(out * w)

  ref_val, ref_grads = jax.value_and_grad(ref_loss, argnums=(0, 1, 2))(q, k, v)
  np.testing.assert_allclose(val, ref_val, rtol=1e-5, atol=1e-4)
  for a, b in zip(grads, ref_grads):
    np.testing.assert_allclose(zigzag_inverse(np.asarray(a), ring), b, atol=5e-5, rtol=5e-5)


@pytest.mark.parametrize(
  "heads,causal,window,lb",
  [
    ("mla", True, None, True),  # value dim != q/k dim, zigzag
    ("gqa", True, 10, False),  # sliding window: many piece pairs skipped
    ("mqa", False, None, False),  # non-causal: every pair live
  ],
)
def test_ring_piece_pairs_match_reference(heads, causal, window, lb):
  """Each device chunk cut into 4 pieces per hop (the fori_loop over 16 piece
  pairs that long chunks use), against the reference: values and grads."""
  mesh = helpers.mesh("c8")
  q, k, v, w = _inputs(heads, t=128)
  seg, pos = helpers.packed_segments(2, 128, True)
  zz = (lambda x: zigzag_reorder(x, 8, axis=1)) if lb else (lambda x: x)  # noqa: E731
  unzz = (lambda x: zigzag_inverse(x, 8, axis=1)) if lb else (lambda x: x)  # noqa: E731
  attn = helpers.strategy_attention_fn(mesh, "ring", load_balance=lb, sub_chunks=4)

  def ours(q, k, v):
    return unzz(
      attn(
        zz(q),
        zz(k),
        zz(v),
        segment_ids=zz(seg),
        positions=zz(pos),
        causal=causal,
        window_size=window,
      )
    )

  def ref(q, k, v):
    return reference_attention(
      q, k, v, segment_ids=seg, q_positions=pos, kv_positions=pos, causal=causal, window_size=window
    )

  _check(ours, ref, q, k, v, w)


def _stacked_shapes(jaxpr_text, leading, lengths):
  """Shapes in a jaxpr whose leading dim is in `leading` and that carry a
  sequence axis of one of `lengths` (a per-iteration copy of a chunk)."""
  found = set()
  for m in re.finditer(r"\w+\[(\d+(?:,\d+)+)\]", jaxpr_text):
    dims = [int(d) for d in m.group(1).split(",")]
    if dims[0] in leading and any(d in lengths for d in dims[1:]):
      found.add(m.group(0))
  return sorted(found)


@pytest.mark.parametrize("remat", [False, True])
def test_ring_under_layer_scan_keeps_no_per_hop_copies(remat):
  """The ring inside a (remat'd) layer scan, differentiated: nothing is stacked
  per hop or per piece pair. Segment ids and positions are loop constants of
  the layer scan; without the barriers in lctx/parallel/ring.py jax's partial
  evaluation hoisted the masks, pieces and cond residuals of every (hop, pair)
  out of the loops as [hops, pairs, ...] arrays (f32 [15, 64, 8, 8192, 128] at
  Llama-8B on v5p)."""
  mesh = helpers.mesh("c8")
  t, pieces = 512, 2  # 64 tokens per device, pieces of 32: 7 hops x 4 pairs
  q, k, v, _ = _inputs("mha", b=1, t=t)
  seg, pos = helpers.packed_segments(1, t, True)
  attn = helpers.strategy_attention_fn(mesh, "ring", load_balance=False, sub_chunks=pieces)

  def layer(x):
    return attn(x, k, v, segment_ids=seg, positions=pos)

  if remat:
    layer = jax.checkpoint(layer)

  def loss(x):
    out, _ = jax.lax.scan(lambda c, _: (layer(c), None), x, None, length=2)
    return out.astype(jnp.float32).sum()

  text = str(jax.make_jaxpr(jax.grad(loss))(q))
  local = t // 8
  assert _stacked_shapes(text, {7, pieces * pieces}, {local, local // pieces}) == []

"""Block skipping, the ring block API, backends, validation and memory of flash attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lctx.kernels import (
  MASKED_LSE,
  AttentionOptions,
  attention_block_backward,
  attention_block_forward,
  blockwise_block_counts,
  flash_attention,
  reference_attention,
  splash_attention,
)
from lctx.kernels.masking import dense_mask, normalize_mask_args


def _qkv(b, t, s, n, kh, h, vd=None, seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 3)
  return (
    jax.random.normal(ks[0], (b, t, n, h)),
    jax.random.normal(ks[1], (b, s, kh, h)),
    jax.random.normal(ks[2], (b, s, kh, vd or h)),
  )


def _docs(t, lengths):
  ids = np.zeros(t, np.int32)
  start = 0
  for i, n in enumerate(lengths):
    ids[start : start + n] = i + 1
    start += n
  return ids


def _expected_counts(t, bq, bk, **mask_kw):
  """(live, partial) block pairs from the dense mask, computed independently."""
  causal = mask_kw.pop("causal", True)
  window = mask_kw.pop("window_size", None)
  m = normalize_mask_args(1, t, t, window_size=window, **mask_kw)
  vis = np.asarray(dense_mask(m, causal, window))[0]
  blocks = vis.reshape(t // bq, bq, t // bk, bk).transpose(0, 2, 1, 3)
  any_vis, all_vis = blocks.any(axis=(2, 3)), blocks.all(axis=(2, 3))
  return int(any_vis.sum()), int((any_vis & ~all_vis).sum())


@pytest.mark.parametrize("kind", ["causal", "packed", "window", "zigzag", "noncausal"])
def test_blocks_are_skipped(kind):
  """The forward loop counts the blocks it really computes; they must equal the
  blocks with any visible entry (fewer than all), and only partial ones masked."""
  t, bq = 512, 64
  kw = {
    "causal": {},
    "packed": dict(segment_ids=_docs(t, [128, 128, 64, 64, 100])),  # + 28 padding
    "window": dict(window_size=100),
    "zigzag": dict(
      q_positions=np.concatenate(
        [np.arange(0, 128), np.arange(384, 512), np.arange(128, 384)]
      ).astype(np.int32)
    ),
    "noncausal": dict(causal=False, segment_ids=_docs(t, [256, 256])),
  }[kind]
  if "q_positions" in kw:
    kw["kv_positions"] = kw["q_positions"]
  q, k, v = _qkv(1, t, t, 2, 1, 8)
  mask = {n: kw[n] for n in ("causal", "window_size") if n in kw}
  options = AttentionOptions(block_q=bq, block_kv=bq, **mask)
  inputs = {n: x for n, x in kw.items() if n not in mask}
  counts, out = jax.jit(lambda q, k, v: blockwise_block_counts(q, k, v, options=options, **inputs))(
    q, k, v
  )
  live, partial = _expected_counts(t, bq, bq, **dict(kw))
  assert live < (t // bq) ** 2
  assert (int(counts[0, 0]), int(counts[0, 1])) == (live, partial)
  np.testing.assert_allclose(out, reference_attention(q, k, v, **kw), atol=2e-5)


def test_dead_blocks_are_never_touched():
  """NaN in document 2's K/V: if any cross-document block were computed (even
  multiplied by zero), NaN would reach the other documents' outputs and grads."""
  t, b = 256, 32
  seg = _docs(t, [64, 64, 128])
  q, k, v = _qkv(1, t, t, 4, 2, 16)
  doc2 = jnp.asarray(seg == 2)[None, :, None, None]
  k = jnp.where(doc2, jnp.nan, k)
  v = jnp.where(doc2, jnp.nan, v)
  f = jax.jit(
    lambda q, k, v: flash_attention(
      q, k, v, segment_ids=seg, block_q=b, block_kv=b, backend="blockwise"
    )
  )
  out = f(q, k, v)
  other = seg != 2
  assert bool(jnp.all(jnp.isfinite(out[0, other])))
  assert not bool(jnp.all(jnp.isfinite(out[0, ~other])))  # the poison is real
  dq, dk = jax.jit(jax.grad(lambda q, k: jnp.sum(f(q, k, v)[0, other]), (0, 1)))(q, k)
  assert bool(jnp.all(jnp.isfinite(dq[0, other])))
  assert bool(jnp.all(jnp.isfinite(dk[0, other])))
  want = reference_attention(q, jnp.where(doc2, 0.0, k), jnp.where(doc2, 0.0, v), segment_ids=seg)
  np.testing.assert_allclose(out[0, other], want[0, other], atol=2e-5)


def test_ring_block_api_merges_to_full_attention():
  """Two visiting K/V halves, merged with lse, equal full attention; the backward
  against the global out/lse sums to the full gradients."""
  t = 96
  seg = np.stack([_docs(t, [40, 50]), _docs(t, [96])])
  pos = np.stack(
    [np.concatenate([np.arange(40), np.arange(50), np.zeros(6)]), np.arange(t)]
  ).astype(np.int32)
  q, k, v = _qkv(2, t, t, 4, 2, 16, vd=8)
  mask = dict(options=AttentionOptions(block_q=32, block_kv=16))
  halves = [slice(0, 48), slice(48, 96)]
  parts = [
    attention_block_forward(
      q,
      k[:, h],
      v[:, h],
      q_segment_ids=seg,
      kv_segment_ids=seg[:, h],
      q_positions=pos,
      kv_positions=pos[:, h],
      **mask,
    )
    for h in halves
  ]
  (o_a, l_a), (o_b, l_b) = parts
  lse = jnp.logaddexp(l_a, l_b)
  w_a = jnp.exp(l_a - lse).transpose(0, 2, 1)[..., None]
  w_b = jnp.exp(l_b - lse).transpose(0, 2, 1)[..., None]
  out = o_a * w_a + o_b * w_b
  lse = jnp.where(lse > MASKED_LSE / 2, lse, MASKED_LSE)
  ref_out, ref_lse = reference_attention(
    q, k, v, segment_ids=seg, q_positions=pos, kv_positions=pos, return_lse=True
  )
  np.testing.assert_allclose(out, ref_out, atol=2e-5)
  np.testing.assert_allclose(lse, ref_lse, atol=2e-5, rtol=1e-6)

  dout = jax.random.normal(jax.random.PRNGKey(5), out.shape)
  grads = [
    attention_block_backward(
      q,
      k[:, h],
      v[:, h],
      out,
      lse,
      dout,
      q_segment_ids=seg,
      kv_segment_ids=seg[:, h],
      q_positions=pos,
      kv_positions=pos[:, h],
      **mask,
    )
    for h in halves
  ]
  dq = grads[0][0] + grads[1][0]
  dk = jnp.concatenate([grads[0][1], grads[1][1]], axis=1)
  dv = jnp.concatenate([grads[0][2], grads[1][2]], axis=1)
  _, vjp = jax.vjp(
    lambda q, k, v: reference_attention(
      q, k, v, segment_ids=seg, q_positions=pos, kv_positions=pos
    ),
    q,
    k,
    v,
  )
  for got, want in zip((dq, dk, dv), vjp(dout)):
    np.testing.assert_allclose(got, want, atol=5e-5)


@pytest.mark.parametrize("backend", ["auto", "blockwise", "reference", "xla"])
def test_backends_agree_on_cpu(backend):
  t = 64
  seg = np.stack([_docs(t, [20, 30]), _docs(t, [64])])
  q, k, v = _qkv(2, t, t, 4, 2, 8)
  for kw in (dict(segment_ids=seg), dict(window_size=5, causal=False)):
    got = flash_attention(q, k, v, backend=backend, block_q=16, block_kv=16, **kw)
    np.testing.assert_allclose(got, reference_attention(q, k, v, **kw), atol=2e-5)


def test_splash_wrapper_in_interpret_mode():
  """The splash call (layout, GQA per kv head, segment ids, padding rows) run by
  the Pallas interpreter on CPU; the real TPU run is test_splash_on_tpu."""
  t = 256
  seg = np.stack([_docs(t, [100, 120]), _docs(t, [256])])
  q, k, v = _qkv(2, t, t, 4, 2, 16)
  got = splash_attention(
    q, k, v, segment_ids=seg, options=AttentionOptions(block_q=128, block_kv=128), interpret=True
  )
  np.testing.assert_allclose(got, reference_attention(q, k, v, segment_ids=seg), atol=2e-5)


@pytest.mark.tpu
def test_splash_on_tpu():
  t = 1024
  seg = np.stack([_docs(t, [300, 500]), _docs(t, [1024])])
  q, k, v = (x.astype(jnp.bfloat16) for x in _qkv(2, t, t, 8, 2, 128))
  f = lambda q, k, v: flash_attention(q, k, v, segment_ids=seg, backend="splash")  # noqa
  r = lambda q, k, v: reference_attention(q, k, v, segment_ids=seg)  # noqa
  np.testing.assert_allclose(
    f(q, k, v).astype(jnp.float32), r(q, k, v).astype(jnp.float32), atol=3e-2
  )
  g = jax.grad(lambda q: jnp.sum(f(q, k, v).astype(jnp.float32)))(q)
  gr = jax.grad(lambda q: jnp.sum(r(q, k, v).astype(jnp.float32)))(q)
  np.testing.assert_allclose(g.astype(jnp.float32), gr.astype(jnp.float32), atol=5e-2)


@pytest.mark.gpu
def test_cudnn_on_gpu():
  q, k, v = (x.astype(jnp.bfloat16) for x in _qkv(2, 1024, 1024, 8, 2, 64))
  got = flash_attention(q, k, v, backend="cudnn")
  want = reference_attention(q, k, v)
  np.testing.assert_allclose(got.astype(jnp.float32), want.astype(jnp.float32), atol=3e-2)
  got = flash_attention(q, k, v, backend="auto", segment_ids=np.ones((2, 1024), np.int32))
  np.testing.assert_allclose(got.astype(jnp.float32), want.astype(jnp.float32), atol=3e-2)


def test_bad_inputs_raise_clear_errors():
  q, k, v = _qkv(1, 32, 32, 3, 2, 8)
  with pytest.raises(ValueError, match="multiple of kv_heads"):
    flash_attention(q, k, v)
  q, k, v = _qkv(1, 32, 48, 4, 2, 8)
  with pytest.raises(ValueError, match="q_len == kv_len"):
    flash_attention(q, k, v, segment_ids=np.ones((1, 32), np.int32))
  with pytest.raises(ValueError, match="backend must be one of"):
    flash_attention(q, k, v, backend="magic")
  with pytest.raises(ValueError, match="window_size"):
    flash_attention(q, k, v, window_size=0)
  with pytest.raises(ValueError, match="backend='cudnn'"):
    flash_attention(q, k, v, backend="cudnn", return_lse=True)
  with pytest.raises(ValueError, match="multiples of 128"):
    flash_attention(q, k, v, backend="splash")
  q, k, v = _qkv(1, 128, 128, 4, 2, 8)
  with pytest.raises(ValueError, match="positions_in_order=True"):
    flash_attention(q, k, v, backend="splash", q_positions=np.arange(128))


def test_temp_memory_is_linear_in_length():
  """Compiled fwd+bwd temp bytes grow ~linearly for blockwise, ~quadratically for
  the dense reference (lowered from shapes only; nothing runs)."""

  def temp(fn, t):
    shapes = [
      jax.ShapeDtypeStruct((1, t, 4, 32), jnp.float32),
      jax.ShapeDtypeStruct((1, t, 2, 32), jnp.float32),
      jax.ShapeDtypeStruct((1, t, 2, 32), jnp.float32),
    ]
    g = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v)), (0, 1, 2)))
    return g.lower(*shapes).compile().memory_analysis().temp_size_in_bytes

  blockwise = lambda q, k, v: flash_attention(q, k, v, block_q=256, block_kv=256)  # noqa
  small, big = temp(blockwise, 2048), temp(blockwise, 8192)
  qkvo_bytes = 8192 * (4 + 2 + 2 + 4) * 32 * 4
  assert big < 3 * small * 4 / 2 and big < 16 * qkvo_bytes, (small, big, qkvo_bytes)
  assert temp(reference_attention, 8192) > 8192**2 * 4  # the dense scores


def test_kernel_runs_inside_shard_map():
  """The ring strategy calls the kernel per device inside shard_map: loop carries
  must be typed device-varying there. Each device attends within its own chunk."""
  from jax.sharding import PartitionSpec as P

  mesh = jax.make_mesh(
    (4,), ("context",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:4]
  )
  t, c = 128, 32
  q, k, v = _qkv(1, t, t, 4, 2, 16)
  pos = jnp.arange(t, dtype=jnp.int32)[None]
  blk = dict(options=AttentionOptions(block_q=16, block_kv=16))

  def local(q, k, v, pos):
    out, lse = attention_block_forward(
      q, k, v, q_segment_ids=None, kv_segment_ids=None, q_positions=pos, kv_positions=pos, **blk
    )
    dq, _, _ = attention_block_backward(
      q,
      k,
      v,
      out,
      lse,
      out,
      q_segment_ids=None,
      kv_segment_ids=None,
      q_positions=pos,
      kv_positions=pos,
      **blk,
    )
    gq = jax.grad(
      lambda q: jnp.sum(
        flash_attention(q, k, v, q_positions=pos, kv_positions=pos, block_q=16, block_kv=16) ** 2
      )
    )(q)
    return out, dq, gq

  spec = P(None, "context")
  out, dq, gq = jax.jit(
    jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec,) * 3)
  )(q, k, v, pos)
  chunks = [slice(i * c, (i + 1) * c) for i in range(t // c)]
  ref = [reference_attention(q[:, s], k[:, s], v[:, s]) for s in chunks]
  np.testing.assert_allclose(out, jnp.concatenate(ref, 1), atol=2e-5)
  ref_gq = [
    jax.grad(lambda q: jnp.sum(reference_attention(q, k[:, s], v[:, s]) ** 2))(q[:, s])
    for s in chunks
  ]
  np.testing.assert_allclose(gq, jnp.concatenate(ref_gq, 1), atol=5e-5)
  ref_dq = [
    jax.vjp(lambda q: reference_attention(q, k[:, s], v[:, s]), q[:, s])[1](r)[0]
    for s, r in zip(chunks, ref)
  ]
  np.testing.assert_allclose(dq, jnp.concatenate(ref_dq, 1), atol=5e-5)


@pytest.mark.parametrize("backend", ["blockwise", "cpu"])
def test_grads_inside_shard_map_with_replicated_kv(backend):
  """q sharded over `context`, K/V replicated: the custom_vjp's dK/dV must come back
  summed over the devices (typed like K/V), as plain autodiff would give."""
  from jax.sharding import PartitionSpec as P

  mesh = jax.make_mesh(
    (4,), ("context",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:4]
  )
  t = 128
  q, k, v = _qkv(1, t, t, 4, 2, 16)
  pos = jnp.arange(t, dtype=jnp.int32)[None]

  def loss(fn, q, k, v):
    def local(q, k, v, q_pos):
      return fn(q, k, v, q_positions=q_pos, kv_positions=pos)

    out = jax.shard_map(
      local,
      mesh=mesh,
      in_specs=(P(None, "context"), P(), P(), P(None, "context")),
      out_specs=P(None, "context"),
    )(q, k, v, pos)
    return jnp.sum(out * jnp.cos(out))

  kernel = lambda *a, **kw: flash_attention(
    *a,
    backend=backend,
    block_q=16,  # noqa: E731
    block_kv=64,
    **kw,
  )
  got = jax.jit(jax.grad(lambda *a: loss(kernel, *a), (0, 1, 2)))(q, k, v)
  want = jax.grad(
    lambda q, k, v: jnp.sum((lambda o: o * jnp.cos(o))(reference_attention(q, k, v))), (0, 1, 2)
  )(q, k, v)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, atol=5e-5)

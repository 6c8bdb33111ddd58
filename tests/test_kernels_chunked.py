"""Chunked cross-entropy and chunked MLP against their unchunked references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lctx.kernels import (
  chunked_cross_entropy,
  chunked_mlp,
  chunked_token_scores,
  reference_cross_entropy,
)


def _ce_inputs(dtype=jnp.float32, b=2, t=24, d=16, e=40, seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 4)
  hidden = jax.random.normal(ks[0], (b, t, d), dtype)
  unembed = (jax.random.normal(ks[1], (d, e)) / np.sqrt(d)).astype(dtype)
  targets = jax.random.randint(ks[2], (b, t), 0, e)
  mask = (jax.random.uniform(ks[3], (b, t)) > 0.3).astype(jnp.float32)
  return hidden, unembed, targets, mask


def _total(fn, **kw):
  def f(h, u, m, targets):
    s, z, w = fn(h, u, targets, m, **kw)
    return (s + z) / w

  return f


@pytest.mark.parametrize("chunk_size", [None, 7, 16, 48, 1000])
@pytest.mark.parametrize("z_loss", [0.0, 1e-2])
def test_chunked_ce_matches_reference(chunk_size, z_loss):
  h, u, tg, m = _ce_inputs()
  got = chunked_cross_entropy(h, u, tg, m, chunk_size=chunk_size, z_loss=z_loss)
  want = reference_cross_entropy(h, u, tg, m, z_loss=z_loss)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  if z_loss:
    assert float(got[1]) > 0
  fc = _total(chunked_cross_entropy, chunk_size=chunk_size, z_loss=z_loss)
  fr = _total(reference_cross_entropy, z_loss=z_loss)
  gc = jax.grad(fc, argnums=(0, 1, 2))(h, u, m, tg)
  gr = jax.grad(fr, argnums=(0, 1, 2))(h, u, m, tg)
  for a, b in zip(gc, gr):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_chunked_ce_mask_drops_tokens():
  h, u, tg, m = _ce_inputs()
  m = m.at[0].set(0.0)
  s1, _, w1 = chunked_cross_entropy(h, u, tg, m, chunk_size=5)
  h2 = h.at[0].set(123.0)  # masked tokens must not change the loss or get gradient
  s2, _, w2 = chunked_cross_entropy(h2, u, tg, m, chunk_size=5)
  np.testing.assert_allclose(s1, s2, rtol=1e-6)
  assert float(w1) == float(jnp.sum(m))
  g = jax.grad(lambda h: chunked_cross_entropy(h, u, tg, m, chunk_size=5)[0])(h)
  assert float(jnp.abs(g[0]).max()) == 0.0
  assert float(jnp.abs(g[1]).max()) > 0.0


def test_chunked_ce_bf16():
  h, u, tg, m = _ce_inputs(jnp.bfloat16)
  got = chunked_cross_entropy(h, u, tg, m, chunk_size=8, z_loss=1e-3)
  want = reference_cross_entropy(h, u, tg, m, z_loss=1e-3)
  assert all(x.dtype == jnp.float32 for x in got)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-3)
  gc = jax.grad(_total(chunked_cross_entropy, chunk_size=8), argnums=(0, 1))(h, u, m, tg)
  gr = jax.grad(_total(reference_cross_entropy), argnums=(0, 1))(h, u, m, tg)
  for a, b in zip(gc, gr):
    assert a.dtype == jnp.bfloat16
    np.testing.assert_allclose(a.astype(jnp.float32), b.astype(jnp.float32), rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("chunk_size", [None, 7, 16])
def test_chunked_ce_prologue_matches_reference_on_the_prologue_output(chunk_size):
  """A per-token prologue with a parameter (an RMSNorm, as the trainer's final
  norm): values and gradients for hidden, unembed and the parameter equal the
  reference loss of prologue(hidden)."""
  from lctx.models.layers import rms_norm

  h, u, tg, m = _ce_inputs()
  scale = 1.0 + 0.1 * jax.random.normal(jax.random.PRNGKey(5), (h.shape[-1],))

  def chunked(h, u, m, tg, scale):
    pro = lambda x: rms_norm(x, scale, 1e-5)  # noqa: E731
    s, z, w = chunked_cross_entropy(h, u, tg, m, chunk_size=chunk_size, z_loss=1e-2, prologue=pro)
    return (s + z) / w

  def reference(h, u, m, tg, scale):
    s, z, w = reference_cross_entropy(rms_norm(h, scale, 1e-5), u, tg, m, z_loss=1e-2)
    return (s + z) / w

  np.testing.assert_allclose(chunked(h, u, m, tg, scale), reference(h, u, m, tg, scale), rtol=1e-5)
  gc = jax.grad(chunked, argnums=(0, 1, 4))(h, u, m, tg, scale)
  gr = jax.grad(reference, argnums=(0, 1, 4))(h, u, m, tg, scale)
  for a, b in zip(gc, gr):
    assert float(jnp.abs(b).max()) > 0
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_chunked_ce_never_holds_full_logits():
  """The compiled backward's temp memory stays below one [tokens, E] f32 buffer."""
  b, t, d, e = 1, 2048, 32, 4096
  args = (
    jax.ShapeDtypeStruct((b, t, d), jnp.float32),
    jax.ShapeDtypeStruct((d, e), jnp.float32),
    jax.ShapeDtypeStruct((b, t), jnp.float32),
    jax.ShapeDtypeStruct((b, t), jnp.int32),
  )
  grad = lambda fn, **kw: jax.jit(jax.grad(_total(fn, **kw), argnums=(0, 1)))
  temp_c = (
    grad(chunked_cross_entropy, chunk_size=256)
    .lower(*args)
    .compile()
    .memory_analysis()
    .temp_size_in_bytes
  )
  temp_r = grad(reference_cross_entropy).lower(*args).compile().memory_analysis().temp_size_in_bytes
  full_logits = b * t * e * 4
  assert temp_r >= full_logits
  assert temp_c < full_logits / 4, (temp_c, full_logits)


def test_chunked_ce_bad_input():
  h, u, tg, m = _ce_inputs()
  with pytest.raises(ValueError, match="unembed"):
    chunked_cross_entropy(h, u.T, tg, m, chunk_size=4)
  with pytest.raises(ValueError, match="chunk_size"):
    chunked_cross_entropy(h, u, tg, m, chunk_size=0)


@pytest.mark.parametrize("chunk_size", [None, 5, 8, 100])
def test_chunked_mlp_matches_unchunked(chunk_size):
  ks = jax.random.split(jax.random.PRNGKey(1), 3)
  x = jax.random.normal(ks[0], (2, 24, 8))
  w_in = jax.random.normal(ks[1], (8, 32)) / np.sqrt(8)
  w_out = jax.random.normal(ks[2], (32, 8)) / np.sqrt(32)

  def mlp(params, x):
    return jax.nn.gelu(x @ params[0]) @ params[1]

  def loss(params, x, cs):
    return jnp.sum(jnp.sin(chunked_mlp(lambda xc: mlp(params, xc), x, cs)))

  np.testing.assert_allclose(
    chunked_mlp(lambda xc: mlp((w_in, w_out), xc), x, chunk_size),
    mlp((w_in, w_out), x),
    rtol=1e-5,
    atol=1e-5,
  )
  got = jax.grad(loss, argnums=(0, 1))((w_in, w_out), x, chunk_size)
  want = jax.grad(lambda p, x: jnp.sum(jnp.sin(mlp(p, x))), argnums=(0, 1))((w_in, w_out), x)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_chunked_mlp_never_holds_full_hidden():
  """Compiled fwd+bwd temp bytes stay below one [T, F] f32 buffer when chunked."""
  t, d, f = 8192, 32, 1024
  args = (
    jax.ShapeDtypeStruct((d, f), jnp.float32),
    jax.ShapeDtypeStruct((f, d), jnp.float32),
    jax.ShapeDtypeStruct((1, t, d), jnp.float32),
  )

  def temp(chunk_size):
    def loss(w_in, w_out, x):
      y = chunked_mlp(lambda xc: jax.nn.gelu(xc @ w_in) @ w_out, x, chunk_size)
      return jnp.sum(y**2)

    g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    return g.lower(*args).compile().memory_analysis().temp_size_in_bytes

  hidden_bytes = t * f * 4
  assert temp(None) >= hidden_bytes
  assert temp(256) < hidden_bytes / 3  # a few [256, F] chunk buffers


def test_chunked_mlp_moves_no_token_between_devices():
  """With the sequence sharded over 8 devices, the chunks (strided) are local to
  every device: the compiled forward and backward hold no collective over the
  activations (contiguous chunks made XLA all-gather or all-to-all them)."""
  import re

  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = jax.make_mesh((8,), ("c",), axis_types=(jax.sharding.AxisType.Auto,))
  sharded = NamedSharding(mesh, P(None, "c", None))
  w1, w2 = jnp.ones((64, 128)), jnp.ones((128, 64))

  def loss(x):
    y = chunked_mlp(lambda xc: jnp.tanh(xc @ w1) @ w2, x, 1024)
    return jax.lax.with_sharding_constraint(y, sharded).sum()

  x = jax.ShapeDtypeStruct((1, 8192, 64), jnp.float32, sharding=sharded)
  hlo = jax.jit(jax.grad(loss), out_shardings=sharded).lower(x).compile().as_text()
  found = {
    op: len(re.findall(op, hlo)) for op in ("all-to-all", "all-gather", "collective-permute")
  }
  assert not any(found.values()), found


@pytest.mark.parametrize("chunk_size", [None, 7, 48])
def test_chunked_token_scores_match_full_logits(chunk_size):
  hidden, unembed, targets, _ = _ce_inputs()
  scale = jnp.linspace(0.5, 1.5, hidden.shape[-1])
  full = np.asarray(jnp.einsum("BTD,DE->BTE", hidden * scale, unembed))  # [B, T, E] f32
  targets = targets.at[0, :5].set(jnp.asarray(full[0, :5].argmax(-1)))  # some matches
  x = full.astype(np.float64)
  lse = np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1)) + x.max(-1)
  want = np.take_along_axis(x, np.asarray(targets)[..., None], -1)[..., 0] - lse
  logp, correct = chunked_token_scores(
    hidden, unembed, targets, chunk_size=chunk_size, prologue=lambda h: h * scale
  )
  assert logp.shape == correct.shape == targets.shape
  np.testing.assert_allclose(np.asarray(logp), want, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(correct), full.argmax(-1) == np.asarray(targets))
  assert np.asarray(correct)[0, :5].all()

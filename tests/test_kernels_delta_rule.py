"""The chunked gated delta rule and the short conv against the float64 token-by-token
reference (values and gradients) and against transformers' torch fallbacks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lctx.kernels.delta_rule import delta_rule, delta_rule_reference, delta_rule_transition
from lctx.kernels.short_conv import short_conv

B, N, H, V = 2, 3, 8, 6


def _inputs(t, per_channel, seed=0, heads=N):
  """Random float64 numpy inputs: unit q/k, decays in [-1, -0.01], beta in (0.1, 0.9)."""
  rng = np.random.default_rng(seed)
  q = rng.normal(size=(B, t, heads, H))
  k = rng.normal(size=(B, t, heads, H))
  q /= np.linalg.norm(q, axis=-1, keepdims=True)
  k /= np.linalg.norm(k, axis=-1, keepdims=True)
  v = rng.normal(size=(B, t, heads, V))
  g = -rng.uniform(0.01, 1.0, size=(B, t, heads, H) if per_channel else (B, t, heads))
  beta = rng.uniform(0.1, 0.9, size=(B, t, heads))
  s0 = rng.normal(size=(B, heads, H, V))
  return q, k, v, g, beta, s0


def _packed(t):
  """Row 0: documents 1, 2, 3, padding, document 4; row 1: one document then padding."""
  seg = np.ones((B, t), np.int32)
  seg[0, 9:20] = 2
  seg[0, 20:27] = 3
  seg[0, 27:30] = 0
  seg[0, 30:] = 4
  seg[1, t - 5 :] = 0
  return seg


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)


def _loss_fn(fn, seg, chunk_size):
  def loss(q, k, v, g, beta, s0, wo, ws):
    o, s = fn(q, k, v, g, beta, segment_ids=seg, initial_state=s0, chunk_size=chunk_size)
    return jnp.sum(o * wo) + jnp.sum(s * ws)

  return loss


def _check_against_reference(t, per_channel, seg, chunk_size, use_s0=True):
  q, k, v, g, beta, s0 = _inputs(t, per_channel)
  rng = np.random.default_rng(1)
  wo, ws = rng.normal(size=(B, t, N, V)), rng.normal(size=s0.shape)
  args = [q, k, v, g, beta, s0 if use_s0 else None, wo, ws]
  argnums = (0, 1, 2, 3, 4, 5) if use_s0 else (0, 1, 2, 3, 4)
  with jax.enable_x64(True):
    a64 = [None if a is None else jnp.asarray(a, jnp.float64) for a in args]
    s64 = None if seg is None else jnp.asarray(seg)
    ro, rs = delta_rule_reference(*a64[:5], segment_ids=s64, initial_state=a64[5])
    rgrads = jax.grad(_loss_fn(delta_rule_reference, s64, 0), argnums)(*a64)
    ro, rs, rgrads = np.asarray(ro), np.asarray(rs), [np.asarray(x) for x in rgrads]
  a32 = [None if a is None else jnp.asarray(a, jnp.float32) for a in args]
  s32 = None if seg is None else jnp.asarray(seg)
  o, s = jax.jit(
    lambda *a: delta_rule(*a[:5], segment_ids=s32, initial_state=a[5], chunk_size=chunk_size)
  )(*a32[:6])
  assert o.dtype == jnp.float32 and s.dtype == jnp.float32
  assert _rel(o, ro) < 1e-4 and _rel(s, rs) < 1e-4
  grads = jax.jit(jax.grad(_loss_fn(delta_rule, s32, chunk_size), argnums))(*a32)
  for name, got, want in zip(["q", "k", "v", "g", "beta", "s0"], grads, rgrads):
    assert _rel(got, want) < 1e-4, name
  if seg is not None:  # padding outputs are exactly 0
    assert np.all(np.asarray(o)[seg == 0] == 0)
  return ro


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
def test_chunked_matches_float64_reference_packed(per_channel):
  # 37 tokens in chunks of 8: a ragged last chunk, and resets inside chunks.
  _check_against_reference(37, per_channel, _packed(37), chunk_size=8)


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
def test_chunked_matches_float64_reference_one_segment(per_channel):
  _check_against_reference(21, per_channel, None, chunk_size=16, use_s0=False)


def test_packed_documents_equal_alone():
  """Each document of a packed row gets the outputs it gets alone (from a zero state)."""
  t = 37
  seg = _packed(t)
  q, k, v, g, beta, _ = _inputs(t, False)
  f = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
  o, _ = delta_rule(f(q), f(k), f(v), f(g), f(beta), segment_ids=jnp.asarray(seg), chunk_size=8)
  for lo, hi in ((0, 9), (9, 20), (20, 27), (30, 37)):
    alone, _ = delta_rule(*(f(x[:1, lo:hi]) for x in (q, k, v, g, beta)), chunk_size=8)
    assert _rel(np.asarray(o)[:1, lo:hi], alone) < 1e-5


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
def test_packed_documents_isolated_to_the_bit(per_channel):
  """Changing one document (here: much faster decays, so its cumulative decay is
  large) leaves every other document's outputs, final state and gradients equal
  to the bit, also where they share a chunk with it."""
  t = 37
  seg = jnp.asarray(_packed(t))
  args = [jnp.asarray(x, jnp.float32) for x in _inputs(t, per_channel)[:5]]
  changed = list(args)
  other = (jnp.arange(t) >= 9) & (jnp.arange(t) < 20)  # document 2 of row 0
  other = (other[None, :] & (jnp.arange(B) == 0)[:, None]).reshape(
    B, t, *([1] * (args[3].ndim - 2))
  )
  changed[3] = jnp.where(other, args[3] * 40.0 - 3.0, args[3])
  changed[2] = jnp.where(other[..., :1] if per_channel else other[..., None], -args[2], args[2])
  wo = jnp.asarray(np.random.default_rng(2).normal(size=(B, t, N, V)), jnp.float32)

  def run(q, k, v, g, beta):
    o, s = delta_rule(q, k, v, g, beta, segment_ids=seg, chunk_size=16)
    return jnp.sum(o * wo), (o, s)

  grad = jax.jit(jax.grad(run, argnums=(0, 1, 2, 3, 4), has_aux=True))
  (ga, (oa, sa)), (gb, (ob, sb)) = grad(*args), grad(*changed)
  keep = np.ones((B, t), bool)
  keep[0, 9:20] = False
  np.testing.assert_array_equal(np.asarray(oa)[keep], np.asarray(ob)[keep])
  np.testing.assert_array_equal(sa, sb)  # row 0 ends in document 4, row 1 in padding
  for x, y in zip(ga, gb):
    np.testing.assert_array_equal(np.asarray(x)[keep], np.asarray(y)[keep])
  assert np.abs(np.asarray(oa)[0, 9:20] - np.asarray(ob)[0, 9:20]).max() > 1e-2


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
def test_transition(per_channel):
  t = 29
  q, k, v, g, beta, s0 = _inputs(t, per_channel, seed=3)
  g = g * 0.05  # slow decays: the map stays far from 0 over 29 tokens
  f = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
  a = delta_rule_transition(f(k), f(g), f(beta), chunk_size=8)
  assert a.shape == (B, N, H, H)
  _, with_s0 = delta_rule(f(q), f(k), f(v), f(g), f(beta), initial_state=f(s0), chunk_size=8)
  _, from_zero = delta_rule(f(q), f(k), f(v), f(g), f(beta), chunk_size=8)
  assert _rel(jnp.einsum("bnhk,bnkv->bnhv", a, f(s0)) + from_zero, with_s0) < 1e-5
  assert np.abs(np.asarray(a)).max() > 1e-3  # a real map, not a vanished one
  seg = np.ones((B, t), np.int32)
  seg[:, 20:] = 2
  a_reset = delta_rule_transition(f(k), f(g), f(beta), segment_ids=jnp.asarray(seg), chunk_size=8)
  assert np.all(np.asarray(a_reset) == 0)


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
def test_summary_is_final_state_and_transition(per_channel):
  """delta_rule_summary's one scan [C | A] against the two it replaces (final
  state from 0, transition), packed and with 2 q/k heads for 4 value heads,
  values and gradients."""
  from lctx.kernels.delta_rule import delta_rule_final_state, delta_rule_summary

  t, n = 29, 4
  q, k, v, g, beta, _ = _inputs(t, per_channel, seed=4, heads=n)
  f = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
  k2 = f(k[:, :, ::2])  # Q = 2
  seg = jnp.asarray(_packed(t))
  w = jnp.asarray(np.random.default_rng(5).normal(size=(B, n, H, V + H)), jnp.float32)

  def summary(k_, v_, g_, b_):
    return delta_rule_summary(k_, v_, g_, b_, segment_ids=seg, chunk_size=8)

  def two_scans(k_, v_, g_, b_):
    c = delta_rule_final_state(k_, k_, v_, g_, b_, segment_ids=seg, chunk_size=8)
    a = delta_rule_transition(k_, g_, b_, segment_ids=seg, chunk_size=8)
    return jnp.concatenate([c, a], axis=-1)

  args = (k2, f(v), f(g * 0.05), f(beta))
  got, want = jax.jit(summary)(*args), jax.jit(two_scans)(*args)
  assert got.shape == (B, n, H, V + H) and _rel(got, want) < 1e-5
  loss = lambda fn: lambda *a: jnp.sum(fn(*a) * w)  # noqa: E731
  g_got = jax.jit(jax.grad(loss(summary), (0, 1, 2, 3)))(*args)
  g_want = jax.jit(jax.grad(loss(two_scans), (0, 1, 2, 3)))(*args)
  for name, x, y in zip(["k", "v", "g", "beta"], g_got, g_want):
    assert _rel(x, y) < 1e-5, name


# ----------------------------------------------------------------------------
# Against transformers' torch fallbacks
# ----------------------------------------------------------------------------
torch = pytest.importorskip("torch")


def _t(x):
  return torch.tensor(np.asarray(x, np.float32))


@pytest.mark.parametrize(
  "fn_name", ["torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"]
)
def test_gdn_matches_transformers(fn_name):
  """Qwen3.5's GDN: 2 key heads serve 4 value heads (repeat_interleave); transformers
  scales q by H^-0.5 itself, lctx's op expects it done."""
  mod = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
  t, kh, vh = 45, 2, 4
  q, k, _, _, _, _ = _inputs(t, False, seed=5, heads=kh)
  _, _, v, g, beta, s0 = _inputs(t, False, seed=6, heads=vh)
  kwargs = dict(initial_state=_t(s0), output_final_state=True)
  if fn_name == "torch_chunk_gated_delta_rule":
    kwargs["chunk_size"] = 16
  ho, hs = getattr(mod, fn_name)(_t(q), _t(k), _t(v), _t(g), _t(beta), **kwargs)
  rep = lambda x: jnp.repeat(jnp.asarray(x, jnp.float32), vh // kh, axis=2)  # noqa: E731
  f = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
  o, s = delta_rule(
    rep(q) * H**-0.5, rep(k), f(v), f(g), f(beta), initial_state=f(s0), chunk_size=16
  )
  assert _rel(o, ho.numpy()) < 2e-4 and _rel(s, hs.numpy()) < 2e-4


@pytest.mark.parametrize(
  "fn_name", ["chunk_kimi_delta_attention", "recurrent_kimi_delta_attention"]
)
def test_kda_matches_transformers(fn_name):
  mod = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
  t = 45
  q, k, v, g, beta, s0 = _inputs(t, True, seed=7)
  kwargs = dict(initial_state=_t(s0), output_final_state=True)
  if fn_name == "chunk_kimi_delta_attention":
    kwargs["chunk_size"] = 16
  ho, hs = getattr(mod, fn_name)(_t(q), _t(k), _t(v), _t(g), _t(beta), **kwargs)
  f = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
  o, s = delta_rule(f(q) * H**-0.5, f(k), f(v), f(g), f(beta), initial_state=f(s0), chunk_size=16)
  assert _rel(o, ho.numpy()) < 2e-4 and _rel(s, hs.numpy()) < 2e-4


# ----------------------------------------------------------------------------
# Short conv
# ----------------------------------------------------------------------------
def _conv_inputs(t, c=5, w=4, seed=0):
  rng = np.random.default_rng(seed)
  return (
    rng.normal(size=(B, t, c)).astype(np.float32),
    rng.normal(size=(w, c)).astype(np.float32),
    rng.normal(size=(c,)).astype(np.float32),
  )


@pytest.mark.parametrize("activation", ["silu", None])
def test_short_conv_matches_transformers(activation):
  mod = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
  x, w, bias = _conv_inputs(19)
  conv = torch.nn.Conv1d(5, 5, 4, groups=5, padding=3, bias=True)
  with torch.no_grad():
    conv.weight.copy_(_t(w.T[:, None, :]))  # HF layout [C, 1, W]
    conv.bias.copy_(_t(bias))
    want = mod.causal_conv1d_fn(
      _t(x).transpose(1, 2), conv.weight.squeeze(1), conv.bias, activation=activation
    )
    plain = conv(_t(x).transpose(1, 2))[..., :19]
  got = short_conv(jnp.asarray(x), jnp.asarray(w), jnp.asarray(bias), activation=activation)
  assert _rel(got, want.transpose(1, 2).numpy()) < 1e-5
  if activation is None:
    assert _rel(got, plain.transpose(1, 2).numpy()) < 1e-5


def test_short_conv_segments_and_halo():
  t = 37
  seg = _packed(t)
  x, w, bias = _conv_inputs(t, seed=2)
  got = np.asarray(
    short_conv(jnp.asarray(x), jnp.asarray(w), jnp.asarray(bias), segment_ids=jnp.asarray(seg))
  )
  for lo, hi in ((0, 9), (9, 20), (20, 27), (30, 37)):
    alone = short_conv(jnp.asarray(x[:1, lo:hi]), jnp.asarray(w), jnp.asarray(bias))
    assert _rel(got[:1, lo:hi], alone) < 1e-6
  assert np.all(got[seg == 0] == 0)
  # A split row: the right part with the left part's last W-1 tokens as its halo.
  for cut in (12, 22, 31):
    right = short_conv(
      jnp.asarray(x[:, cut:]),
      jnp.asarray(w),
      jnp.asarray(bias),
      segment_ids=jnp.asarray(seg[:, cut:]),
      halo=jnp.asarray(x[:, cut - 3 : cut]),
      halo_segment_ids=jnp.asarray(seg[:, cut - 3 : cut]),
    )
    assert _rel(right, got[:, cut:]) < 1e-6


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
def test_default_chunk_values(per_channel):
  """The default 64-token chunks (the in-chunk solve by matmul squarings), values only."""
  t = 150
  q, k, v, g, beta, _ = _inputs(t, per_channel, seed=9)
  with jax.enable_x64(True):
    ro, rs = delta_rule_reference(*(jnp.asarray(x) for x in (q, k, v, g * 0.1, beta)))
    ro, rs = np.asarray(ro), np.asarray(rs)
  o, s = delta_rule(*(jnp.asarray(x, jnp.float32) for x in (q, k, v, g * 0.1, beta)))
  assert _rel(o, ro) < 1e-4 and _rel(s, rs) < 1e-4


@pytest.mark.parametrize("chunk_size", [32, 37])
@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
def test_large_chunks_match_float64_reference(per_channel, chunk_size):
  """Chunks above the solve's squaring block (16 rows), inverted by halves: equal
  halves (32 = 2 x 16) and unequal ones (37 = 18 + 19), values and gradients."""
  _check_against_reference(37, per_channel, _packed(37), chunk_size=chunk_size)


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
def test_two_level_scan_matches_float64_reference(per_channel):
  """37 packed tokens in chunks of 4: 10 chunks, scanned as 5 groups of 2."""
  from lctx.kernels.delta_rule import scan_group

  assert scan_group(10) == 2 and scan_group(7) == 1 and scan_group(8192) == 64
  _check_against_reference(37, per_channel, _packed(37), chunk_size=4)


def test_two_level_scan_keeps_fewer_states(monkeypatch):
  """The backward's compiled temporaries with groups of chunks, against one state
  per chunk (scan_group forced to 1): 512 chunks of [64, 64] float32 states."""
  from lctx.kernels import delta_rule as dr

  t, c, n, h = 4096, 8, 1, 64
  s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
  args = (s(1, t, n, h), s(1, t, n, h), s(1, t, n, h), s(1, t, n), s(1, t, n))

  def temp():
    loss = lambda *a: jnp.sum(dr.delta_rule(*a, chunk_size=c)[0])  # noqa: E731
    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
    return step.lower(*args).compile().memory_analysis().temp_size_in_bytes

  two_level = temp()
  monkeypatch.setattr(dr, "scan_group", lambda chunks: 1)
  one_level = temp()
  per_chunk_states = (t // c) * n * h * h * 4
  assert one_level - two_level > 0.75 * per_chunk_states, (one_level, two_level)


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
def test_grouped_key_heads_match_repeated_reference(per_channel):
  """q, k with Q = 2 heads for N = 4 value heads (value head j reads j // 2): values
  and gradients equal the float64 reference run on explicitly repeated q, k, whose
  q / k gradients are summed over each group."""
  t, q_heads, n, groups = 37, 2, 4, 2
  q, k, _, _, _, _ = _inputs(t, per_channel, seed=5, heads=q_heads)
  _, _, v, g, beta, s0 = _inputs(t, per_channel, seed=6, heads=n)
  seg = _packed(t)
  wo = np.random.default_rng(7).normal(size=(B, t, n, V))
  rep = lambda x: jnp.repeat(x, groups, axis=2)  # noqa: E731

  def loss(fn, repeat):
    def f(q, k, v, g, beta):
      q, k = (rep(q), rep(k)) if repeat else (q, k)
      o, s = fn(q, k, v, g, beta, segment_ids=jnp.asarray(seg), initial_state=s0_, chunk_size=8)
      return jnp.sum(o * wo_) + jnp.sum(s)

    return f

  with jax.enable_x64(True):
    s0_, wo_ = jnp.asarray(s0), jnp.asarray(wo)
    a64 = [jnp.asarray(x) for x in (q, k, v, g, beta)]
    ro, _ = delta_rule_reference(
      rep(a64[0]), rep(a64[1]), *a64[2:], segment_ids=jnp.asarray(seg), initial_state=s0_
    )
    rgrads = jax.grad(loss(delta_rule_reference, True), (0, 1, 2, 3, 4))(*a64)
    ro, rgrads = np.asarray(ro), [np.asarray(x) for x in rgrads]
  s0_, wo_ = jnp.asarray(s0, jnp.float32), jnp.asarray(wo, jnp.float32)
  a32 = [jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta)]
  o, _ = delta_rule(*a32, segment_ids=jnp.asarray(seg), initial_state=s0_, chunk_size=8)
  assert o.shape == (B, t, n, V) and _rel(o, ro) < 1e-4
  grads = jax.jit(jax.grad(loss(delta_rule, False), (0, 1, 2, 3, 4)))(*a32)
  for name, got, want in zip(["q", "k", "v", "g", "beta"], grads, rgrads):
    assert got.shape == want.shape and _rel(got, want) < 1e-4, name


def test_bf16_inputs_give_bf16_output_and_cotangents():
  """bf16 q, k, v: the output and the q / k / v cotangents stay bf16 (float32 only
  inside a chunk), within bf16 rounding of the float32 run."""
  t = 37
  q, k, v, g, beta, _ = _inputs(t, False, seed=11)
  f32 = [jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta)]
  bf = [x.astype(jnp.bfloat16) for x in f32[:3]] + f32[3:]
  o32, _ = delta_rule(*f32, chunk_size=8)
  o16, _ = delta_rule(*bf, chunk_size=8)
  assert o16.dtype == jnp.bfloat16 and _rel(o16, o32) < 3e-2
  grads = jax.grad(
    lambda *a: jnp.sum(delta_rule(*a, chunk_size=8)[0].astype(jnp.float32)), (0, 1, 2)
  )(*bf)
  assert all(x.dtype == jnp.bfloat16 for x in grads)
  jaxpr = str(jax.make_jaxpr(jax.grad(lambda *a: jnp.sum(delta_rule(*a, chunk_size=8)[0]), 2))(*bf))
  # The scan's stacked per-token outputs are bf16 [chunks, B, C, N, V], never f32.
  assert "f32[5,2,8,3,6]" not in jaxpr and "bf16[5,2,8,3,6]" in jaxpr

"""Flash attention (blockwise and fused-CPU backends) vs the dense reference:
values, lse, grads.

Every case differentiates a loss through both out and lse, so the lse cotangent
path (used by ring merges) is checked too.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lctx.kernels import (
  MASKED_LSE,
  flash_attention,
  reference_attention,
)

TOL = {  # (out/lse atol, grad atol relative to max |grad|)
  jnp.float32: (2e-5, 2e-5),
  jnp.bfloat16: (3e-2, 3e-2),
}


def _qkv(b, t, s, n, kh, h, vd, dtype, seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 3)
  q = jax.random.normal(ks[0], (b, t, n, h), jnp.float32).astype(dtype)
  k = jax.random.normal(ks[1], (b, s, kh, h), jnp.float32).astype(dtype)
  v = jax.random.normal(ks[2], (b, s, kh, vd), jnp.float32).astype(dtype)
  return q, k, v


def _packed_segments(t, lengths):
  """Row of ids 1, 2, ... with the given document lengths; the rest is padding 0."""
  ids = np.zeros(t, np.int32)
  start = 0
  for i, n in enumerate(lengths):
    ids[start : start + n] = i + 1
    start += n
  return ids


def _zigzag(t, p):
  """Positions in zigzag (load-balanced) order for p devices: chunks r, 2p-1-r."""
  chunks = np.arange(t).reshape(2 * p, t // (2 * p))
  order = [c for r in range(p) for c in (r, 2 * p - 1 - r)]
  return np.concatenate([chunks[c] for c in order]).astype(np.int32)


def _case(name):
  b, t, n, kh, h = 2, 96, 4, 2, 16
  seg = np.stack([_packed_segments(t, [30, 41, 10]), _packed_segments(t, [96])])
  cases = {
    "causal": dict(shape=(b, t, t, n, kh, h, h), kw={}),
    "noncausal": dict(shape=(b, t, t, n, kh, h, h), kw=dict(causal=False)),
    "packed_padding": dict(shape=(b, t, t, n, kh, h, h), kw=dict(segment_ids=seg)),
    "packed_noncausal": dict(shape=(b, t, t, n, kh, h, h), kw=dict(segment_ids=seg, causal=False)),
    "mha": dict(shape=(1, t, t, 3, 3, h, h), kw={}),
    "mqa": dict(shape=(b, t, t, 6, 1, h, h), kw=dict(segment_ids=seg)),
    "mla_head_dims": dict(shape=(b, t, t, n, kh, 24, 8), kw={}),
    "mla_head_dims16": dict(shape=(b, t, t, n, kh, 48, 32), kw=dict(segment_ids=seg)),
    # Lengths that are no multiple of any block or of the fused kernel's granules.
    "odd_lengths": dict(shape=(b, 37, 101, n, kh, h, h), kw=dict(causal=False)),
    "window": dict(shape=(b, t, t, n, kh, h, h), kw=dict(window_size=17)),
    "window_noncausal_packed": dict(
      shape=(b, t, t, n, kh, h, h), kw=dict(window_size=9, causal=False, segment_ids=seg)
    ),
    # q is the last 40 tokens of a 96-token context (decode/chunked prefill).
    "unequal_lengths": dict(
      shape=(b, 40, t, n, kh, h, h),
      kw=dict(q_positions=np.arange(56, 96, dtype=np.int32), segment_ids=(seg[:, 56:], seg)),
    ),
    "zigzag_positions": dict(
      shape=(b, t, t, n, kh, h, h), kw=dict(q_positions=_zigzag(t, 3), kv_positions=_zigzag(t, 3))
    ),
    "permuted_positions_packed": dict(
      shape=(1, t, t, n, kh, h, h),
      kw=dict(
        q_positions=np.random.RandomState(0).permutation(t).astype(np.int32),
        kv_positions=np.random.RandomState(0).permutation(t).astype(np.int32),
        segment_ids=seg[:1],
      ),
    ),
    "scale_and_visiting_block": dict(
      # a ring step: q block of tokens 64..95 against a kv block of 0..47
      shape=(b, 32, 48, n, kh, h, h),
      kw=dict(q_positions=np.arange(64, 96, dtype=np.int32), softmax_scale=0.3),
    ),
  }
  return cases[name]


def _loss(fn, **kw):
  def f(q, k, v):
    out, lse = fn(q, k, v, return_lse=True, **kw)
    lse = jnp.where(lse > MASKED_LSE / 2, lse, 0.0)
    w = jnp.cos(jnp.arange(out.size, dtype=jnp.float32).reshape(out.shape))
    return jnp.sum(out.astype(jnp.float32) * w) + 0.7 * jnp.sum(jnp.sin(lse))

  return f


def _values_and_grads(fn, q, k, v, **kw):
  """One jitted computation: (out, lse) and the grads of _loss w.r.t. q, k, v."""

  def both(q, k, v):
    return fn(q, k, v, return_lse=True, **kw), jax.grad(_loss(fn, **kw), (0, 1, 2))(q, k, v)

  return jax.jit(both)(q, k, v)


def _check(name, dtype, block_q, block_kv, backend="blockwise", **bwd_blocks):
  case = _case(name)
  q, k, v = _qkv(*case["shape"], dtype)
  kw = case["kw"]
  (out, lse), grads = _values_and_grads(
    flash_attention,
    q,
    k,
    v,
    block_q=block_q,
    block_kv=block_kv,
    backend=backend,
    **bwd_blocks,
    **kw,
  )
  # The reference runs in f32 on the same (possibly bf16-rounded) inputs.
  q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
  (ref_out, ref_lse), ref_grads = _values_and_grads(reference_attention, q32, k32, v32, **kw)
  atol, gtol = TOL[dtype]
  assert out.dtype == dtype and lse.dtype == jnp.float32
  assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
  np.testing.assert_allclose(out.astype(jnp.float32), ref_out, atol=atol, rtol=atol)
  np.testing.assert_allclose(lse, ref_lse, atol=atol, rtol=atol)
  for got, want, nm in zip(grads, ref_grads, "qkv"):
    assert got.dtype == dtype
    scale = float(jnp.max(jnp.abs(want))) + 1e-6
    np.testing.assert_allclose(
      got.astype(jnp.float32) / scale,
      want / scale,
      atol=gtol,
      err_msg=f"d{nm} ({name}, {dtype.__name__})",
    )


ALL_CASES = [
  "causal",
  "noncausal",
  "packed_padding",
  "packed_noncausal",
  "mha",
  "mqa",
  "mla_head_dims",
  "window",
  "window_noncausal_packed",
  "unequal_lengths",
  "zigzag_positions",
  "permuted_positions_packed",
  "scale_and_visiting_block",
]


@pytest.mark.parametrize("name", ALL_CASES)
def test_blockwise_matches_reference_f32(name):
  # Blocks that do not divide the lengths (96 = 3*32; 24 does not divide 40).
  _check(name, jnp.float32, block_q=32, block_kv=24)


@pytest.mark.parametrize(
  "name", ["causal", "packed_padding", "mqa", "mla_head_dims", "zigzag_positions", "window"]
)
def test_blockwise_matches_reference_bf16(name):
  _check(name, jnp.bfloat16, block_q=32, block_kv=32)


@pytest.mark.parametrize(
  "name", ["causal", "packed_padding", "mqa", "unequal_lengths", "window_noncausal_packed"]
)
def test_blockwise_backward_blocks_differ_from_forward(name):
  # The backward re-blocks q/k/v, out, lse and dout with its own sizes.
  _check(name, jnp.float32, block_q=32, block_kv=24, block_q_bwd=16, block_kv_bwd=40)


def test_single_block_and_default_blocks():
  _check("packed_padding", jnp.float32, block_q=512, block_kv=512)


def test_padding_rows_are_zero_with_masked_lse():
  case = _case("packed_padding")
  q, k, v = _qkv(*case["shape"], jnp.float32)
  seg = case["kw"]["segment_ids"]
  out, lse = jax.jit(
    lambda q, k, v: flash_attention(
      q, k, v, segment_ids=seg, return_lse=True, block_q=32, block_kv=32
    )
  )(q, k, v)
  pad = seg[0] == 0
  assert pad.sum() == 15
  assert float(jnp.abs(out[0, pad]).max()) == 0.0
  assert bool(jnp.all(lse[0][:, pad] == MASKED_LSE))
  g = jax.jit(
    jax.grad(lambda q: jnp.sum(flash_attention(q, k, v, segment_ids=seg, block_q=32, block_kv=32)))
  )(q)
  assert bool(jnp.all(jnp.isfinite(g))) and float(jnp.abs(g[0, pad]).max()) == 0.0


# --- the fused CPU kernel (backend="cpu", lctx/kernels/cpu_attention.cc) ----------

CPU_CASES = [c for c in ALL_CASES if c != "mla_head_dims"] + ["mla_head_dims16", "odd_lengths"]


def _need_cpu_kernel():
  from lctx.kernels import cpu_build, cpu_fused

  if cpu_build.compiler() is None:
    pytest.skip("no C++ compiler on this machine")
  assert cpu_fused.available(), cpu_fused.unavailable_reason()


@pytest.mark.parametrize("name", CPU_CASES)
def test_cpu_kernel_matches_reference(name):
  _need_cpu_kernel()
  # Several q and kv blocks per example (kv blocks are multiples of 64 keys).
  _check(name, jnp.float32, block_q=16, block_kv=64, backend="cpu")


@pytest.mark.parametrize(
  "name", ["causal", "packed_padding", "mqa", "window_noncausal_packed", "zigzag_positions"]
)
def test_cpu_kernel_backward_blocks_differ(name):
  _need_cpu_kernel()
  _check(name, jnp.float32, block_q=24, block_kv=128, backend="cpu", block_q_bwd=8, block_kv_bwd=64)


def test_cpu_kernel_padding_rows_and_auto_choice():
  _need_cpu_kernel()
  case = _case("packed_padding")
  q, k, v = _qkv(*case["shape"], jnp.float32)
  seg = case["kw"]["segment_ids"]
  fn = lambda q, k, v: flash_attention(q, k, v, segment_ids=seg, return_lse=True)  # noqa: E731
  # "auto" on CPU takes the fused kernel for float32 ...
  assert "lctx_cpu_attention_fwd" in str(jax.make_jaxpr(fn)(q, k, v))
  out, lse = jax.jit(fn)(q, k, v)
  pad = seg[0] == 0
  assert float(jnp.abs(out[0, pad]).max()) == 0.0
  assert bool(jnp.all(lse[0][:, pad] == MASKED_LSE))
  # ... and the blockwise kernel where the fused one does not apply (bf16).
  qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
  assert "lctx_cpu_attention_fwd" not in str(jax.make_jaxpr(fn)(qb, kb, vb))


def test_cpu_kernel_rejects_what_it_cannot_run():
  q, k, v = _qkv(1, 32, 32, 2, 2, 16, 16, jnp.bfloat16)
  with pytest.raises(ValueError, match="float32"):
    flash_attention(q, k, v, backend="cpu")
  q, k, v = _qkv(1, 32, 32, 2, 2, 24, 8, jnp.float32)
  with pytest.raises(ValueError, match="multiples of 16"):
    flash_attention(q, k, v, backend="cpu")
  q, k, v = _qkv(1, 32, 32, 2, 2, 16, 16, jnp.float32)
  with pytest.raises(ValueError, match="block sizes must be >= 1"):
    flash_attention(q, k, v, backend="cpu", block_kv_bwd=0)


def test_cpu_kernel_unavailable_falls_back_or_says_why(tmp_path):
  import subprocess
  import sys

  code = (
    "import jax, jax.numpy as jnp\n"
    "from lctx.kernels import flash_attention\n"
    "q = jnp.ones((1, 16, 2, 16))\n"
    "assert 'lctx_cpu' not in str(jax.make_jaxpr(flash_attention)(q, q, q))\n"
    "try:\n"
    "    flash_attention(q, q, q, backend='cpu')\n"
    "except RuntimeError as e:\n"
    "    print('ERR', e)\n"
  )
  env = dict(__import__("os").environ, LCTX_DISABLE_CPU_KERNEL="1", JAX_PLATFORMS="cpu")
  proc = subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert (
    "ERR backend='cpu': the fused CPU kernel is unavailable: disabled by "
    "LCTX_DISABLE_CPU_KERNEL" in proc.stdout
  )

"""Splash attention (TPU Pallas) on CPU through the Pallas interpreter, and compiled
for TPU slices on libtpu's compile-only devices.

Values and q/k/v gradients against `reference_attention`: the differentiable call
(lse and lse cotangents), the ring block API (a visiting zigzag block; the backward
against the GLOBAL out/lse), and every context-parallel strategy on the 8-device
CPU mesh with `kernel_backend='splash'` (zigzag load balancing, packing with
padding, windows, GQA, MQA). The interpreter is slow: the default run keeps a few
small cases; the strategy matrix is marked slow. Strategy 'none' (the local
plug-in, lctx/parallel/local.py) takes splash in a shard_map over the mesh. The
TPU compiles check that the train step (ring flagship, strategy 'none') calls the
Mosaic kernel and traces no blockwise kernel in attention, under conftest's
matmul precision 'highest'.
"""

import logging
import os

# Read when libtpu loads (the first topology call), so before any test runs.
from lctx.sizing import devices as devices_lib  # noqa: E402  (no jax import)

devices_lib.compile_only_env()

import gin  # noqa: E402
import helpers  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from lctx import configs, gin_utils, models  # noqa: E402
from lctx.kernels import flash, reference_attention, splash  # noqa: E402
from lctx.kernels.options import AttentionOptions  # noqa: E402
from lctx.kernels.splash_tiling import bwd_tiles, dq_partials_bytes  # noqa: E402
from lctx.parallel import context_attention  # noqa: E402
from lctx.parallel import mesh as mesh_lib  # noqa: E402
from lctx.parallel.local import local_attention_fn  # noqa: E402
from lctx.parallel.zigzag import zigzag_reorder  # noqa: E402
from lctx.sizing import compile as compile_lib  # noqa: E402
from lctx.sizing import tpu as tpu_lib  # noqa: E402
from lctx.trainer import TrainConfig, Trainer  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AUTO = jax.sharding.AxisType.Auto
MESHES, HEADS = helpers.MESHES, helpers.HEADS


def _qkv(heads, b, t, s=None, seed=0):
  n, kh, h, vd = HEADS[heads]
  ks = jax.random.split(jax.random.key(seed), 3)
  s = t if s is None else s
  return (
    jax.random.normal(ks[0], (b, t, n, h)),
    jax.random.normal(ks[1], (b, s, kh, h)),
    jax.random.normal(ks[2], (b, s, kh, vd)),
  )


def _close(got, want, atol, name=""):
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=atol, rtol=atol, err_msg=name)


# ---------------------------------------------------------------------------
# The layout and the kernel on one device
# ---------------------------------------------------------------------------


def test_token_order_is_the_zigzag_order():
  """TokenOrder.natural maps a zigzag array index to the token the reorder put there."""
  for z, length in ((1, 8), (4, 64), (3, 36)):
    nat = np.asarray(splash.TokenOrder(length, z).natural(jnp.arange(length)))
    np.testing.assert_array_equal(nat, zigzag_reorder(np.arange(length)[None], z)[0])
  assert np.array_equal(splash.TokenOrder(16).natural(np.arange(16)), np.arange(16))


# SMEM budgets for the block maps: the real one (one kernel call per kv run here),
# and one so small that every call is cut into 128-token (q piece, kv piece) calls.
MAP_BUDGETS = {"one_call": splash.MAX_BLOCK_MAP_BYTES, "tiled": 2}


@pytest.mark.parametrize("budget", MAP_BUDGETS)
def test_differentiable_call_with_lse_matches_reference(budget, monkeypatch):
  """flash_attention(backend='splash') on CPU (interpreted): causal sliding window,
  GQA, packed rows with padding, explicit positions through a natural-order layout;
  out, lse and the q/k/v gradients of a loss on both (lse cotangents). 'tiled':
  the same call as a loop of piece calls (one of them fully masked), as calls
  whose block maps outgrow SMEM run."""
  monkeypatch.setattr(splash, "MAX_BLOCK_MAP_BYTES", MAP_BUDGETS[budget])
  b, t = 2, 256
  q, k, v = _qkv("gqa16", b, t)
  seg, pos = helpers.packed_segments(b, t)
  kw = dict(segment_ids=seg, q_positions=pos, kv_positions=pos, window_size=100, return_lse=True)
  layout = splash.Layout(splash.TokenOrder(t))

  def fn(q, k, v):
    return flash.flash_attention(
      q, k, v, backend="splash", block_q=128, block_kv=128, layout=layout, **kw
    )

  cfg = splash._config(q, k, True, 100, None, (128, 128, None, None), layout, True)
  assert splash._tiles(cfg, t, t) == ((t, t) if budget == "one_call" else (128, 128))
  (out, lse), vjp = jax.vjp(jax.jit(fn), q, k, v)
  (ro, rl), rvjp = jax.vjp(lambda q, k, v: reference_attention(q, k, v, **kw), q, k, v)
  _close(out, ro, 2e-5, "out")
  _close(lse, rl, 2e-5, "lse")
  assert np.all(np.asarray(out)[0, t - t // 5 :] == 0)  # padding sees nothing
  w = jax.random.normal(jax.random.key(1), out.shape)
  wl = jax.random.normal(jax.random.key(2), lse.shape)
  for name, a, r in zip("qkv", vjp((w, wl)), rvjp((w, wl))):
    _close(a, r, 5e-5, "d" + name)


@pytest.mark.parametrize("budget", MAP_BUDGETS)
def test_ring_block_api_on_a_visiting_zigzag_block(budget, monkeypatch):
  """The ring's block steps on splash: device 1 of a zigzag ring of 2 holds chunks
  1 and 2 of 4 (128 tokens each); it sees its own block and the visiting block of
  device 0 (chunks 0 and 3: two kernel runs). Per-block (out, lse) merged equal the
  reference over both blocks; the block backward against the merged (global)
  out/lse, summed over blocks, equals the reference gradients. 'tiled': each run's
  256 q rows in two pieces (q longer than the kv run)."""
  monkeypatch.setattr(splash, "MAX_BLOCK_MAP_BYTES", MAP_BUDGETS[budget])
  order = splash.TokenOrder(512, 2)
  b, t = 2, 256
  q, k, v = _qkv("mqa16", b, 512)
  seg, pos = helpers.packed_segments(b, 512)
  zz = lambda x: zigzag_reorder(x, 2, axis=1)  # noqa: E731
  q, k, v, seg, pos = zz(q)[:, t:], zz(k), zz(v), zz(seg), zz(pos)
  blocks = [(t, slice(t, 2 * t)), (0, slice(0, t))]  # (kv start, rows): own, visiting
  kw = dict(causal=True, window_size=200, softmax_scale=None, block_q=128, block_kv=128)

  def block_kw(start, rows):
    return dict(
      q_segment_ids=seg[:, t:],
      kv_segment_ids=seg[:, rows],
      q_positions=pos[:, t:],
      kv_positions=pos[:, rows],
      layout=splash.Layout(order, jnp.int32(t), jnp.int32(start)),
      options=AttentionOptions(backend="splash", platform="cpu", **kw),
    )

  def fwd(s, r):
    f = lambda q, k, v: flash.attention_block_forward(q, k, v, **block_kw(s, r))  # noqa: E731
    return jax.jit(f)(q, k[:, r], v[:, r])

  parts = [fwd(s, r) for s, r in blocks]
  (o1, l1), (o2, l2) = parts
  lse = jnp.logaddexp(l1, l2)
  out = sum(o * jnp.exp(li - lse).transpose(0, 2, 1)[..., None] for o, li in parts)

  def ref(q, k, v):
    return reference_attention(
      q,
      k,
      v,
      segment_ids=(seg[:, t:], seg),
      q_positions=pos[:, t:],
      kv_positions=pos,
      causal=True,
      window_size=200,
      return_lse=True,
    )

  (ro, rl), rvjp = jax.vjp(ref, q, k, v)
  _close(out, ro, 2e-5, "out")
  _close(lse, rl, 2e-5, "lse")
  w = jax.random.normal(jax.random.key(3), out.shape)
  rdq, rdk, rdv = rvjp((w, jnp.zeros_like(rl)))

  def bwd(s, r):
    f = lambda *a: flash.attention_block_backward(*a, **block_kw(s, r))  # noqa: E731
    return jax.jit(f)(q, k[:, r], v[:, r], out, lse, w)

  dq = 0
  for s, r in blocks:
    dqb, dkb, dvb = bwd(s, r)
    dq = dq + dqb
    _close(dkb, rdk[:, r], 5e-5, f"dk rows {r}")
    _close(dvb, rdv[:, r], 5e-5, f"dv rows {r}")
  _close(dq, rdq, 5e-5, "dq")


def _dq_kernels(fn, *args) -> int:
  """How many of the library's separate dq kernels (the two-pass backward's second
  pass) the gradient of fn traces."""
  return str(jax.make_jaxpr(fn)(*args)).count("splash_mha_dq")


# Masks of the fused-backward checks: (causal, window, packed segment ids, zigzag P).
FUSED_MASKS = {
  "causal": (True, None, False, 1),
  "window": (True, 100, False, 1),
  "packed": (True, None, True, 1),
  "zigzag": (True, 70, True, 2),
}


@pytest.mark.parametrize("mask", FUSED_MASKS)
@pytest.mark.parametrize("fused", [True, False])
def test_fused_backward_matches_reference(mask, fused):
  """The fused dq+dkv backward (AttentionOptions.fused_bwd, the default) and the
  two-pass form against the reference: out, lse and the q/k/v gradients of a
  loss on both, for causal, sliding-window, packed (segment ids with padding)
  and zigzag-ordered (a layout of ring size 2, the whole sequence in one call)
  masks. The fused form traces no dq kernel; the two-pass form one per call."""
  causal, window, packed, z = FUSED_MASKS[mask]
  b, t = 2, 256
  q, k, v = _qkv("gqa16", b, t, seed=7)
  seg, pos = helpers.packed_segments(b, t, packed=packed)
  kw = dict(segment_ids=seg, causal=causal, window_size=window, return_lse=True)
  zz = lambda x: zigzag_reorder(x, z, axis=1)  # noqa: E731
  layout = splash.Layout(splash.TokenOrder(t, z))
  opts = AttentionOptions(
    backend="splash", block_q=128, block_kv=128, causal=causal, window_size=window, fused_bwd=fused
  )

  def fn(q, k, v):
    return flash.flash_attention(
      q,
      k,
      v,
      segment_ids=zz(seg),
      q_positions=zz(pos),
      kv_positions=zz(pos),
      return_lse=True,
      layout=layout,
      options=opts,
    )

  def ref(q, k, v):
    o, l = reference_attention(q, k, v, q_positions=pos, kv_positions=pos, **kw)
    return zz(o), zigzag_reorder(l, z, axis=2)

  (out, lse), vjp = jax.vjp(jax.jit(fn), zz(q), zz(k), zz(v))
  (ro, rl), rvjp = jax.vjp(ref, q, k, v)
  _close(out, ro, 2e-5, "out")
  _close(lse, rl, 2e-5, "lse")
  w = jax.random.normal(jax.random.key(1), out.shape)
  wl = jax.random.normal(jax.random.key(2), lse.shape)
  for name, a, r in zip("qkv", vjp((w, wl)), rvjp((w, wl))):
    _close(a, zz(r), 5e-5, "d" + name)
  grad = jax.grad(lambda q, k, v: fn(q, k, v)[0].sum(), argnums=(0, 1, 2))
  assert (_dq_kernels(grad, q, k, v) == 0) == fused


def test_fused_backward_bounds_its_dq_partials():
  """The fused kernel writes dq partials [kv blocks, *q.shape]: a call whose
  partials outgrow dq_partial_bytes runs as kv pieces (then q pieces) whose
  partials fit, and still equals the reference (values and gradients)."""
  b, t = 2, 512
  q, k, v = _qkv("gqa16", b, t, seed=3)
  row = b * q.shape[2] * q.shape[3] * 4  # f32 bytes of one q row, all heads
  cfg = splash._config(q, k, True, None, None, (128, 128, None, None), None, True)
  assert dq_partials_bytes(cfg, t, t, row) == 4 * t * row  # 4 kv blocks of 128
  small = dict(cfg.__dict__, dq_partial_bytes=t * row)  # one kv block of partials
  assert bwd_tiles(type(cfg)(**small), t, t, row) == (t, 128)
  tiny = dict(cfg.__dict__, dq_partial_bytes=128 * row)  # one block of q too
  assert bwd_tiles(type(cfg)(**tiny), t, t, row) == (128, 128)
  assert bwd_tiles(type(cfg)(**dict(tiny, fused_bwd=False)), t, t, row) == (t, t)
  opts = AttentionOptions(backend="splash", block_q=128, block_kv=128, dq_partial_bytes=128 * row)
  fn = jax.jit(lambda q, k, v: flash.flash_attention(q, k, v, options=opts))
  out, vjp = jax.vjp(fn, q, k, v)
  ro, rvjp = jax.vjp(lambda q, k, v: reference_attention(q, k, v), q, k, v)
  _close(out, ro, 2e-5, "out")
  w = jax.random.normal(jax.random.key(4), out.shape)
  for name, a, r in zip("qkv", vjp(w), rvjp(w)):
    _close(a, r, 5e-5, "d" + name)


def test_explicit_splash_refuses_and_auto_falls_back_with_one_log(caplog):
  q, k, v = _qkv("gqa16", 1, 128)
  pos = np.arange(128)[None]
  with pytest.raises(ValueError, match="backend='splash'.*token layout"):
    flash.flash_attention(q, k, v, backend="splash", q_positions=pos, kv_positions=pos)
  q96, k96, v96 = _qkv("gqa16", 1, 96)
  with pytest.raises(ValueError, match="backend='splash'.*multiples of 128"):
    flash.flash_attention(q96, k96, v96, backend="splash", platform="cpu")
  with pytest.raises(ValueError, match="backend='splash'.*zigzag chunks"):
    layout = splash.Layout(splash.TokenOrder(4096, 8), 0, 0)  # 256-token chunks
    flash.attention_block_forward(
      q,
      *_qkv("gqa16", 1, 128, 384)[1:],
      q_segment_ids=None,
      kv_segment_ids=None,
      q_positions=pos,
      kv_positions=np.arange(384)[None],
      options=AttentionOptions(block_q=128, block_kv=128, backend="splash"),
      layout=layout,
    )
  flash._FALLBACKS_LOGGED.clear()  # pylint: disable=protected-access
  with caplog.at_level(logging.WARNING):
    for _ in range(3):
      got = flash.choose_backend(q, k, v, platform="tpu", positions_given=True)
      assert got == "blockwise"
  assert len([r for r in caplog.records if "not splash" in r.getMessage()]) == 1
  layout = splash.Layout(splash.TokenOrder(128))
  assert flash.choose_backend(q, k, v, platform="tpu", positions_given=True, layout=layout) == (
    "splash"
  )
  assert flash.choose_backend(q, k, v, platform="cpu", layout=layout) != "splash"


@pytest.mark.parametrize("heads", ["mqa16", pytest.param("gqa16", marks=pytest.mark.slow)])
def test_local_plugin_on_splash_matches_reference(heads):
  """Strategy 'none' (lctx.parallel.local): the plug-in declares natural order, so
  splash takes the pipeline's explicit positions; it runs in a shard_map over the
  mesh (rows over fsdp, q heads over tensor; MQA's one kv head replicated there).
  Packed rows with padding and restarting positions, a causal window; values and
  q/k/v gradients against the reference."""
  mesh = jax.make_mesh(
    (2, 2), ("fsdp", "tensor"), axis_types=(AUTO,) * 2, devices=jax.devices()[:4]
  )
  b, t = 2, 256
  q, k, v = _qkv(heads, b, t)
  seg, pos = helpers.packed_segments(b, t)
  kw = dict(segment_ids=seg, window_size=100)
  attn = local_attention_fn(
    AttentionOptions(backend="splash", block_q=128, block_kv=128), mesh=mesh
  )
  out, vjp = jax.vjp(jax.jit(lambda q, k, v: attn(q, k, v, positions=pos, **kw)), q, k, v)
  ro, rvjp = jax.vjp(
    lambda q, k, v: reference_attention(q, k, v, q_positions=pos, kv_positions=pos, **kw), q, k, v
  )
  _close(out, ro, 2e-5, "out")
  assert np.all(np.asarray(out)[0, t - t // 5 :] == 0)  # padding sees nothing
  w = jax.random.normal(jax.random.key(6), out.shape)
  for name, a, r in zip("qkv", vjp(w), rvjp(w)):
    _close(a, r, 5e-5, "d" + name)


def test_local_plugin_without_natural_order_refuses_splash(caplog):
  """natural_order=False (arbitrary positions): an explicit 'splash' raises naming
  the missing layout; 'auto' for TPU passes splash over with one logged reason."""
  q, k, v = _qkv("gqa16", 1, 128)
  pos = np.arange(128)[None]
  seg = np.ones((1, 128), np.int32)
  attn = local_attention_fn(AttentionOptions(backend="splash"), natural_order=False)
  with pytest.raises(ValueError, match="backend='splash'.*token layout"):
    attn(q, k, v, segment_ids=seg, positions=pos)
  flash._FALLBACKS_LOGGED.clear()  # pylint: disable=protected-access
  auto = local_attention_fn(AttentionOptions(platform="tpu"), natural_order=False)
  with caplog.at_level(logging.WARNING):
    for _ in range(2):
      jax.eval_shape(lambda q, k, v: auto(q, k, v, segment_ids=seg, positions=pos), q, k, v)
  assert len([r for r in caplog.records if "not splash" in r.getMessage()]) == 1


# ---------------------------------------------------------------------------
# Strategies on the 8-device CPU mesh
# ---------------------------------------------------------------------------


def _strategy_case(strategy, mesh_name, heads, t, lb, window=None, causal=True, options=None):
  """Values and gradients of a strategy on splash against the reference; returns
  how many separate dq kernels (two-pass backward) its gradient traces."""
  shape, names = MESHES[mesh_name]
  mesh = jax.make_mesh(shape, names, axis_types=(AUTO,) * len(shape))
  b = 2
  q, k, v = _qkv(heads, b, t)
  seg, pos = helpers.packed_segments(b, t)
  kw = dict(segment_ids=seg, causal=causal, window_size=window)
  kernel = (
    dict(kernel_backend="splash", block_q=128, block_kv=128)
    if options is None
    else dict(options=options)
  )

  def fn(q, k, v):
    return context_attention(
      q,
      k,
      v,
      mesh=mesh,
      strategy=strategy,
      positions=pos,
      load_balance=lb,
      **kernel,
      **kw,
    )

  out, vjp = jax.vjp(fn, q, k, v)
  ro, rvjp = jax.vjp(
    lambda q, k, v: reference_attention(q, k, v, q_positions=pos, kv_positions=pos, **kw), q, k, v
  )
  _close(out, ro, 2e-5, "out")
  w = jax.random.normal(jax.random.key(4), out.shape)
  for name, a, r in zip("qkv", vjp(w), rvjp(w)):
    _close(a, r, 5e-5, "d" + name)
  return _dq_kernels(jax.grad(lambda q, k, v: fn(q, k, v).sum(), argnums=(0, 1, 2)), q, k, v)


# One case per strategy: packed rows with padding, a causal window, zigzag order
# where the strategy balances load (chunks of 128 tokens: splash's lane width).
FUSED_STRATEGY_CASES = [
  ("all_gather", "t2c4", "gqa16", 1024, True),
  ("ulysses", "t2c4", "mha16", 512, False),
  ("ring", "d2c4", "gqa16", 1024, True),
  # usp's zigzag is over its ring of 2: 512 tokens are 4 chunks of 128.
  ("usp", "usp2x4", "mha16", 512, True),
]


@pytest.mark.parametrize("strategy,mesh_name,heads,t,lb", FUSED_STRATEGY_CASES)
def test_fused_backward_under_every_strategy(strategy, mesh_name, heads, t, lb):
  """Every strategy on splash with the fused backward (explicitly on, and with a
  dq-partials budget of one 128-row kv block, so each call's backward is cut
  into pieces): values and q/k/v gradients equal the reference, and no separate
  dq kernel is traced anywhere (the block API's per-hop calls included)."""
  row = 2 * 16 * 4 * HEADS[heads][0]  # f32 bytes of one q row over batch and heads
  opts = AttentionOptions(
    backend="splash", block_q=128, block_kv=128, fused_bwd=True, dq_partial_bytes=128 * row
  )
  assert _strategy_case(strategy, mesh_name, heads, t, lb, window=300, options=opts) == 0


def test_ulysses_on_splash_in_pieces(monkeypatch):
  """Ulysses runs splash on the whole sequence per device, whose block maps are the
  first to outgrow SMEM (1M tokens): the piece loops inside shard_map, over tensor
  x context, with packed rows, against the reference (values and gradients)."""
  monkeypatch.setattr(splash, "MAX_BLOCK_MAP_BYTES", MAP_BUDGETS["tiled"])
  _strategy_case("ulysses", "t2c4", "mha16", 512, False)


def test_ring_train_path_on_splash():
  """The train-step plug-in on a batch already in zigzag order, sharded over data:
  ring over 4 devices, each hop cut into 2 x 2 pieces, GQA, packed rows, a window."""
  shape, names = MESHES["d2c4"]
  mesh = jax.make_mesh(shape, names, axis_types=(AUTO,) * len(shape))
  b, t = 2, 1024
  q, k, v = _qkv("gqa16", b, t)
  seg, pos = helpers.packed_segments(b, t)
  kw = dict(segment_ids=seg, positions=pos, window_size=300)
  attn = helpers.strategy_attention_fn(
    mesh, "ring", load_balance=True, sub_chunks=2, backend="splash", block_q=128
  )
  zz = lambda x: zigzag_reorder(x, 4, axis=1)  # noqa: E731
  kwz = {n: zz(x) if n != "window_size" else x for n, x in kw.items()}
  out, vjp = jax.vjp(lambda q, k, v: attn(q, k, v, **kwz), zz(q), zz(k), zz(v))

  def ref(q, k, v):
    return zz(
      reference_attention(
        q, k, v, segment_ids=seg, q_positions=pos, kv_positions=pos, window_size=300
      )
    )

  ro, rvjp = jax.vjp(ref, q, k, v)
  _close(out, ro, 2e-5, "out")
  w = jax.random.normal(jax.random.key(5), out.shape)
  for name, a, r in zip("qkv", vjp(w), rvjp(w)):
    _close(zz(r), a, 5e-5, "d" + name)


SLOW_CASES = [
  # strategy, mesh, heads, global length, load balance, window, causal
  ("ring", "c8", "gqa16", 2048, True, None, True),
  ("ring", "c8", "mqa16", 2048, True, 300, True),
  ("ring", "d2c4", "mla24", 1024, False, None, True),
  ("ring", "c8", "gqa16", 1024, False, 200, False),
  ("usp", "usp2x4", "gqa16", 2048, True, None, True),
  ("usp", "usp4x2", "mha16", 2048, True, 500, True),
  ("all_gather", "c8", "gqa16", 2048, True, None, True),
  ("all_gather", "c8", "mqa16", 2048, True, 300, True),
  ("all_gather", "t2c4", "mqa16", 1024, False, None, True),
  ("ulysses", "c8", "mha16", 1024, False, None, True),
  ("ulysses", "t2c4", "mha16", 1024, False, 200, True),
]


@pytest.mark.slow
@pytest.mark.parametrize("strategy,mesh_name,heads,t,lb,window,causal", SLOW_CASES)
def test_strategy_on_splash_matches_reference(strategy, mesh_name, heads, t, lb, window, causal):
  _strategy_case(strategy, mesh_name, heads, t, lb, window, causal)


# ---------------------------------------------------------------------------
# Compiled for TPU (libtpu compile-only devices)
# ---------------------------------------------------------------------------

TINY = [
  "ModelConfig.vocab_size = 384",
  "ModelConfig.d_model = 128",
  "ModelConfig.num_layers = 1",
  "ModelConfig.num_heads = 4",
  "ModelConfig.num_kv_heads = 2",
  "ModelConfig.head_dim = 128",
  "ModelConfig.mlp_dim = 384",
  "ModelConfig.mlp_chunk_size = None",
  "TrainConfig.seq_len = 4096",
  "TrainConfig.loss_chunk_size = 1024",
]
FLAGSHIPS = {
  "gin/ring_v5p.gin": ("v5p:2x2x1", ["MeshConfig.fsdp = 2", "MeshConfig.context = 2"]),
  "gin/allgather_v5p.gin": ("v5p:2x2x1", ["MeshConfig.fsdp = 2", "MeshConfig.context = 2"]),
  "gin/ulysses_v5p.gin": ("v5p:2x2x1", ["MeshConfig.fsdp = 2", "MeshConfig.context = 2"]),
  "gin/usp_ironwood.gin": (
    "tpu7x:2x2x1",
    ["MeshConfig.context = 4", "MeshConfig.context_ulysses = 2", "TrainConfig.batch_size = 1"],
  ),
}


def _compiled_train_step(path, monkeypatch):
  """HLO of the flagship's train step with a tiny model on a small slice of its
  kind, with every blockwise kernel entry made to fail if attention traces it."""
  topology, mesh_params = FLAGSHIPS[path]
  gin.clear_config()
  gin_utils.parse([path], [*TINY, *mesh_params], [ROOT])
  exp = configs.experiment()
  gin.clear_config()
  assert exp.train.attention_options.backend == "auto", (
    f"{path} pins a kernel; 'auto' must take splash"
  )
  _no_blockwise(monkeypatch)
  mesh = mesh_lib.make_mesh(exp.mesh, devices=tpu_lib.topology_devices(topology))
  return Trainer(exp.model, exp.train, mesh).lower_train_step().compile().as_text()


def _no_blockwise(monkeypatch):
  """Makes every blockwise kernel entry fail if attention traces it."""

  def no_blockwise(*a, **k):
    raise AssertionError("attention traced the blockwise kernel")

  for name in ("blockwise_attention", "blockwise_block_forward", "blockwise_block_backward"):
    monkeypatch.setattr(flash, name, no_blockwise)


@pytest.mark.slow  # the default suite compiles ring_v5p.gin on its own slice (test_main_cli.py)
def test_ring_flagship_compiles_with_splash_for_tpu(monkeypatch):
  hlo = _compiled_train_step("gin/ring_v5p.gin", monkeypatch)
  assert compile_lib.attention_backend_of(hlo) == "splash"
  assert hlo.count('custom_call_target="tpu_custom_call"') >= 2  # fwd, fused dq+dkv


@pytest.mark.slow
@pytest.mark.parametrize(
  "path", ["gin/allgather_v5p.gin", "gin/ulysses_v5p.gin", "gin/usp_ironwood.gin"]
)
def test_flagship_compiles_with_splash_for_tpu(path, monkeypatch):
  hlo = _compiled_train_step(path, monkeypatch)
  assert compile_lib.attention_backend_of(hlo) == "splash"


def test_strategy_none_compiles_with_splash_for_tpu(monkeypatch):
  """Strategy 'none' (no context parallelism) on a v5p slice, rows over fsdp,
  packed batches with positions: 'auto' takes splash (the Mosaic fwd and fused
  dq+dkv kernels in a shard_map), traces no blockwise kernel, and compiles under
  conftest's matmul precision 'highest' with bf16 activations."""
  assert jax.config.jax_default_matmul_precision == "highest"
  _no_blockwise(monkeypatch)
  cfg = models.ModelConfig(
    vocab_size=384,
    d_model=128,
    num_layers=1,
    num_heads=4,
    num_kv_heads=2,
    head_dim=128,
    mlp_dim=384,
    dtype="bfloat16",
  )
  train = TrainConfig(batch_size=4, seq_len=1024, context_parallel_strategy="none")
  devices = tpu_lib.topology_devices("v5p:2x2x1")
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(fsdp=4, context=1), devices=devices)
  trainer = Trainer(cfg, train, mesh)
  assert trainer.plan.strategy == "none"
  hlo = trainer.lower_train_step().compile().as_text()
  assert compile_lib.attention_backend_of(hlo) == "splash"
  assert hlo.count('custom_call_target="tpu_custom_call"') >= 2  # fwd, fused dq+dkv


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_splash_compiles_for_tpu_under_highest_precision(dtype):
  """A user's default_matmul_precision('highest') used to reach Mosaic as fp32
  contract precision on bf16 operands ('Bad lhs type'): bf16 kernels are traced
  at the default precision (nothing lost: f32 accumulation), f32 keep 'highest'."""
  mesh = jax.sharding.Mesh(tpu_lib.topology_devices("v5p:2x2x1")[:1], ("x",))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

  def grads(q, k, v):
    def loss(q, k, v):
      out = flash.flash_attention(q, k, v, backend="splash", platform="tpu", block_q=128)
      return out.astype(jnp.float32).sum()

    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

  def arg(heads):
    return jax.ShapeDtypeStruct((1, 256, heads, 128), jnp.dtype(dtype), sharding=sharding)

  with jax.default_matmul_precision("highest"):
    hlo = jax.jit(grads).lower(arg(4), arg(2), arg(2)).compile().as_text()
  assert compile_lib.attention_backend_of(hlo) == "splash"
  assert hlo.count('custom_call_target="tpu_custom_call"') == 2  # fwd, fused dq+dkv


def _splash_grads_for_tpu(t: int):
  """Compiles the gradient of one splash call on `t` tokens (1,024-token blocks)
  for one v5p device."""
  mesh = jax.sharding.Mesh(tpu_lib.topology_devices("v5p:2x2x1")[:1], ("x",))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  x = jax.ShapeDtypeStruct((1, t, 1, 128), jnp.bfloat16, sharding=sharding)

  def loss(q, k, v):
    out = flash.flash_attention(
      q, k, v, backend="splash", platform="tpu", block_q=1024, block_kv=1024
    )
    return out.astype(jnp.float32).sum()

  return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x).compile()


def _one_call_config(t: int):
  """The static config of `_splash_grads_for_tpu`'s call."""
  x = jax.ShapeDtypeStruct((1, t, 1, 128), jnp.bfloat16)
  return splash._config(x, x, True, None, None, (1024, 1024, None, None), None, False)


def test_tiled_splash_compiles_for_tpu(monkeypatch):
  """Piece calls inside their loops compile for TPU (Mosaic inside while loops):
  4,096 tokens cut by a small budget into 1,024 x 2,048-token pieces, the loops
  the one-call program does not have."""
  one_call = _splash_grads_for_tpu(4096).as_text()
  monkeypatch.setattr(splash, "MAX_BLOCK_MAP_BYTES", 4)
  assert splash._tiles(_one_call_config(4096), 4096, 4096) == (1024, 2048)
  hlo = _splash_grads_for_tpu(4096).as_text()
  assert compile_lib.attention_backend_of(hlo) == "splash"
  assert hlo.count(" while(") > one_call.count(" while(")


@pytest.mark.slow
def test_a_call_beyond_smem_compiles_for_tpu_in_pieces(monkeypatch):
  """655,360 tokens in one call (ulysses' whole sequence per device): 640 x 640
  blocks of maps, 1.17 MiB, which libtpu refuses ('Ran out of memory in memory
  space smem'); cut into pieces the call compiles (about 100 s on 2 cores)."""
  t = 655_360
  cfg = _one_call_config(t)
  assert splash._block_map_bytes(cfg, t, t) > 1 << 20
  assert splash._tiles(cfg, t, t) == (t // 2, t)
  hlo = _splash_grads_for_tpu(t).as_text()
  assert compile_lib.attention_backend_of(hlo) == "splash"
  monkeypatch.setattr(splash, "MAX_BLOCK_MAP_BYTES", 1 << 30)  # one call: refused
  with pytest.raises(Exception, match="smem"):
    _splash_grads_for_tpu(t)

"""Validation rules, zigzag reorder, auto choice and ring block skipping (no compiles)."""

import logging

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lctx.kernels import AttentionOptions
from lctx.parallel import AttentionDims, ContextOptions
from lctx.parallel.auto import choose_strategy, smallest_context_degree
from lctx.parallel.block_ops import count_ring_blocks, maybe_visible
from lctx.parallel.validation import validate_context_parallel
from lctx.parallel.zigzag import zigzag_inverse, zigzag_reorder

OK = dict(num_q_heads=8, num_kv_heads=4, seq_len=64)


def _validate(strategy, mesh, load_balance=False, **kw):
  validate_context_parallel(
    strategy=strategy, mesh_shape=mesh, load_balance=load_balance, **{**OK, **kw}
  )


@pytest.mark.parametrize(
  "strategy,mesh,lb",
  [
    ("all_gather", {"context": 8}, False),
    ("ulysses", {"context": 2, "tensor": 2}, False),
    ("ring", {"context": 8, "data": 1}, True),
    ("usp", {"context": 2, "context_ulysses": 4}, True),
    ("usp", {"context": 4, "context_ulysses": 2}, False),
  ],
)
def test_valid_configurations_pass(strategy, mesh, lb):
  _validate(strategy, mesh, lb)


@pytest.mark.parametrize(
  "strategy,mesh,lb,kw,pattern",
  [
    ("flash", {"context": 8}, False, {}, r"\[unknown-strategy\].*'flash'"),
    ("auto", {"context": 8}, False, {}, r"\[unknown-strategy\].*choose_strategy"),
    ("ring", {"context": 1, "data": 8}, False, {}, r"\[context-degree\].*context = 1"),
    ("ulysses", {"context": 1}, False, {}, r"\[context-degree\].*'ulysses'"),
    ("ring", {"context": 4, "context_ulysses": 2}, False, {}, r"\[single-context-axis\].*got 2"),
    (
      "usp",
      {"context": 8, "context_ulysses": 1},
      False,
      {},
      r"\[usp-factors\].*context = 8, context_ulysses = 1",
    ),
    (
      "usp",
      {"context": 1, "context_ulysses": 8},
      False,
      {},
      r"\[usp-factors\].*context = 1, context_ulysses = 8",
    ),
    ("ulysses", {"context": 8}, False, {"num_kv_heads": 1}, r"\[ulysses-mqa\].*degree 8"),
    (
      "usp",
      {"context": 2, "context_ulysses": 4},
      False,
      {"num_kv_heads": 1},
      r"\[ulysses-mqa\].*degree 4",
    ),
    ("ulysses", {"context": 8}, False, {}, r"\[ulysses-heads\].*\(4 / 1 = 4\).*ulysses degree 8"),
    (
      "ulysses",
      {"context": 4, "tensor": 2},
      False,
      {"num_q_heads": 16, "num_kv_heads": 4},
      r"\[ulysses-heads\].*16 / tensor 2 = 8.*4 / 2 = 2.*degree 4",
    ),
    (
      "usp",
      {"context": 2, "context_ulysses": 4},
      False,
      {"num_q_heads": 6, "num_kv_heads": 6},
      r"\[ulysses-heads\].*\(6 / tensor 1 = 6\).*degree 4",
    ),
    ("ulysses", {"context": 4}, True, {}, r"\[ulysses-load-balance\]"),
    ("ring", {"context": 3}, True, {"seq_len": 60}, r"\[odd-ring-load-balance\].*got 3"),
    (
      "usp",
      {"context": 3, "context_ulysses": 2},
      True,
      {"seq_len": 96},
      r"\[odd-ring-load-balance\].*got 3",
    ),
    ("ring", {"context": 8}, True, {"seq_len": 72}, r"\[seq-divisible\].*\(72\).*2 x 8 = 16"),
    (
      "usp",
      {"context": 2, "context_ulysses": 2},
      True,
      {"seq_len": 42},
      r"\[seq-divisible\].*\(42\).*context\) = 2 x 2 = 4",
    ),
    ("ring", {"context": 8}, False, {"seq_len": 60}, r"\[seq-divisible\].*\(60\).*degree 8"),
    (
      "usp",
      {"context": 2, "context_ulysses": 2},
      False,
      {"seq_len": 30},
      r"\[seq-divisible\].*\(30\).*context 2 x context_ulysses 2",
    ),
    (
      "all_gather",
      {"context": 4, "tensor": 2},
      False,
      {"num_q_heads": 7, "num_kv_heads": 7},
      r"\[tensor-heads\] q heads \(7\).*tensor \(2\)",
    ),
    (
      "ring",
      {"context": 4, "tensor": 2},
      False,
      {"num_q_heads": 6, "num_kv_heads": 3},
      r"\[tensor-heads\] kv heads \(3\).*tensor \(2\)",
    ),
  ],
)
def test_every_rule_names_itself_and_the_numbers(strategy, mesh, lb, kw, pattern):
  with pytest.raises(ValueError, match=pattern):
    _validate(strategy, mesh, lb, **kw)


@pytest.mark.parametrize("xp", [np, jnp])
@pytest.mark.parametrize("ring", [1, 2, 4])
def test_zigzag_places_chunks_and_inverts(xp, ring):
  t = 8 * ring
  x = xp.asarray(np.arange(3 * t).reshape(3, t))
  z = zigzag_reorder(x, ring, axis=1)
  assert type(z) is type(x) or xp is jnp
  chunk = t // (2 * ring)
  per_dev = np.asarray(z).reshape(3, ring, 2 * chunk)
  for r in range(ring):  # device r holds chunks r and 2P-1-r
    expect = np.concatenate(
      [
        np.arange(r * chunk, (r + 1) * chunk),
        np.arange((2 * ring - 1 - r) * chunk, (2 * ring - r) * chunk),
      ]
    )
    np.testing.assert_array_equal(per_dev[0, r], expect)
  np.testing.assert_array_equal(np.asarray(zigzag_inverse(z, ring, axis=1)), np.asarray(x))


def test_zigzag_other_axis_and_bad_length():
  x = np.arange(2 * 16 * 3).reshape(2, 16, 3)
  np.testing.assert_array_equal(zigzag_inverse(zigzag_reorder(x, 4, axis=-2), 4, axis=-2), x)
  with pytest.raises(ValueError, match=r"length 12 .* 2 x ring_size = 8"):
    zigzag_reorder(np.zeros((1, 12)), 4)


def test_zigzag_balances_causal_ring_blocks():
  """Counted with the same skip test the ring uses: ~2x imbalance -> 1.0."""
  t, p = 64, 8
  cfg, ctx = AttentionOptions(causal=True), ContextOptions(sub_chunks=2)
  pos = np.arange(t)[None]
  seg = np.ones((1, t), np.int32)
  plain = count_ring_blocks(seg, pos, ring_size=p, cfg=cfg, ctx=ctx)
  zz = count_ring_blocks(
    zigzag_reorder(seg, p), zigzag_reorder(pos, p), ring_size=p, cfg=cfg, ctx=ctx
  )
  assert plain.max() / plain.mean() > 1.7
  assert zz.max() / zz.mean() <= 1.1
  assert zz.sum() == plain.sum()  # same work, just spread evenly
  full = count_ring_blocks(seg, pos, ring_size=p, cfg=AttentionOptions(causal=False), ctx=ctx)
  assert full.min() == full.max() == 4 * p


def test_maybe_visible_skips_only_fully_masked_blocks():
  cfg = AttentionOptions(causal=True)
  one = np.ones((2, 4), np.int32)
  early, late = np.arange(4)[None].repeat(2, 0), 4 + np.arange(4)[None].repeat(2, 0)
  assert not maybe_visible(one, one, early, late, cfg, xp=np)  # keys after queries
  assert maybe_visible(one, one, late, early, cfg, xp=np)
  assert not maybe_visible(one, 2 * one, late, early, cfg, xp=np)  # other document
  assert not maybe_visible(0 * one, one, late, early, cfg, xp=np)  # padding queries
  win = AttentionOptions(causal=True, window_size=2)
  far = early + 10
  assert not maybe_visible(one, one, far, early, win, xp=np)  # beyond the window
  assert maybe_visible(one, one, far, early, AttentionOptions(causal=False), xp=np)


HEADS = dict(dims=AttentionDims(num_heads=32, num_kv_heads=8, head_dim=128, v_head_dim=128))


def test_auto_prefers_all_gather_when_kv_fits(caplog):
  with caplog.at_level(logging.INFO, logger="lctx.parallel.auto"):
    s, reason = choose_strategy(mesh_shape={"context": 8}, seq_len=8192, **HEADS)
  assert s == "all_gather" and "fits" in reason
  assert "chose all_gather" in caplog.text


def test_auto_moves_to_ulysses_then_ring_as_memory_tightens():
  kw = dict(seq_len=1 << 20, memory_budget_bytes=2 * 2**30, **HEADS)
  s, reason = choose_strategy(mesh_shape={"context": 8}, **kw)
  assert s == "ulysses", reason
  assert "all_gather: estimated" in reason
  # 6 kv heads do not divide by 8: ring.
  gqa6 = AttentionDims(num_heads=24, num_kv_heads=6, head_dim=128, v_head_dim=128)
  s, reason = choose_strategy(mesh_shape={"context": 8}, **{**kw, "dims": gqa6})
  assert s == "ring" and "[ulysses-heads]" in reason
  # MLA (value dim != qk dim) goes to ring.
  mla = AttentionDims(num_heads=32, num_kv_heads=8, head_dim=128, v_head_dim=64)
  s, _ = choose_strategy(mesh_shape={"context": 8}, **{**kw, "dims": mla})
  assert s == "ring"
  # A mesh with a ulysses axis: usp.
  s, _ = choose_strategy(mesh_shape={"context": 4, "context_ulysses": 2}, **kw)
  assert s == "usp"


def test_auto_raises_when_nothing_is_valid():
  with pytest.raises(
    ValueError,
    match=r"\[auto-no-strategy\].*all_gather: \[seq-div.*"
    r"ring: \[single-context-axis\]",
  ):
    choose_strategy(
      mesh_shape={"context": 1, "context_ulysses": 8},
      seq_len=4100,
      dims=AttentionDims(num_heads=8, num_kv_heads=1, head_dim=64, v_head_dim=64),
    )


def test_smallest_context_degree_grows_with_length():
  kw = dict(memory_budget_bytes=2**30, **HEADS)
  short = smallest_context_degree(64, seq_len=1 << 16, **kw)
  long = smallest_context_degree(64, seq_len=1 << 22, **kw)
  assert 2 <= short < long <= 64


def test_zigzag_ring_size_and_default_load_balance():
  from lctx.parallel.validation import default_load_balance, zigzag_ring_size

  assert zigzag_ring_size({"context": 4, "context_ulysses": 2, "data": 2}) == 4
  assert zigzag_ring_size({"data": 8}) == 1
  assert default_load_balance("ring") and default_load_balance("usp")
  assert not default_load_balance("ring", causal=False)
  assert not default_load_balance("ulysses") and not default_load_balance("all_gather")


def test_ring_sub_chunks_bounds_the_kernel_call_length():
  from lctx.parallel.block_ops import ring_sub_chunks

  auto = ContextOptions()
  assert ring_sub_chunks(auto, 4096) == 1
  assert ring_sub_chunks(auto, 8192) == 4
  assert ring_sub_chunks(auto, 16384) == 8  # 128K tokens over 8 devices
  assert ring_sub_chunks(auto, 1 << 17) == 8  # capped at max_sub_chunks
  assert ring_sub_chunks(auto, 3 * 4096) == 8  # 1536-token pieces
  assert ring_sub_chunks(ContextOptions(sub_chunks=2), 16384) == 2
  assert ring_sub_chunks(ContextOptions(sub_chunks=3), 16) == 1  # must divide


def _plan(strategy, *, load_balance=None, budget=None, seq_len=1024):
  from lctx.parallel import make_context_plan  # pylint: disable=g-import-not-at-top

  return make_context_plan(
    helpers.mesh("c8"),
    AttentionDims(num_heads=8, num_kv_heads=8, head_dim=8, v_head_dim=8),
    seq_len=seq_len,
    batch_size=1,
    context=ContextOptions(strategy=strategy, load_balance=load_balance),
    memory_budget_bytes=budget,
  )


def test_rules_are_checked_once_when_the_plan_is_made(monkeypatch):
  from lctx.parallel import auto, context, plan, validation  # pylint: disable=g-import-not-at-top

  calls = []

  def counting(**kw):
    calls.append(kw["strategy"])
    return validation.validate_context_parallel(**kw)

  monkeypatch.setattr(plan, "validate_context_parallel", counting)
  monkeypatch.setattr(auto, "validate_context_parallel", counting)
  monkeypatch.setattr(context, "validate_context_parallel", counting)
  configured = _plan("ring")
  assert calls == ["ring"]
  calls.clear()
  _plan("auto")  # each candidate until one fits; the chosen one not again
  assert calls == ["all_gather"]
  calls.clear()
  q = jnp.zeros((1, 1024, 8, 8), jnp.float32)
  jax.eval_shape(configured.attention_fn, q, q, q)  # the plan's own length
  assert calls == []
  jax.eval_shape(configured.attention_fn, q[:, :512], q[:, :512], q[:, :512])
  jax.eval_shape(configured.attention_fn, q[:, :512], q[:, :512], q[:, :512])
  assert calls == ["ring"]  # another length (the eval grid's): once per shape


def test_auto_plan_holds_the_load_balance_its_choice_was_checked_with():
  # Nothing fits a 1-byte budget: auto takes the smallest estimate, ulysses,
  # which it checks without zigzag (no ring to balance); the plan agrees.
  p = _plan("auto", load_balance=True, budget=1)
  assert (p.strategy, p.load_balance) == ("ulysses", False)
  assert _plan("auto", load_balance=True).load_balance  # all_gather: zigzag as asked
  with pytest.raises(ValueError, match=r"\[ulysses-load-balance\]"):
    _plan("ulysses", load_balance=True)  # configured: the user's contradiction

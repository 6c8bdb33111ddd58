"""Window-aware context parallelism for sliding-window layers: a halo exchange.

A causal query at natural index p with window w sees the keys p - w + 1 .. p. A
device's shard is one natural run of tokens (its chunk), or with zigzag two
(chunks r and 2P-1-r of 2P). When w - 1 tokens fit in one run, the keys any
local query can see lie in that run and in the last w - 1 tokens of the run just
before it in natural order, so the layer needs no other device's keys:

- natural order: run r needs the tail of run r-1, held by device r-1 (one
  ppermute of w - 1 tokens, where the ring sends P - 1 whole chunks and
  all_gather gathers the whole sequence);
- zigzag: chunk r needs the tail of chunk r-1 (device r-1's first half) and
  chunk 2P-1-r the tail of chunk 2P-2-r (device r+1's second half; for
  r = P-1 that is chunk P-1, this device's own first half): two ppermutes.

Each run then attends to [its halo, itself] with the window mask on positions.
This relies on the promise the kernels' token layouts make
(lctx.kernels.token_order): positions count up by one along the natural order
inside every segment and each segment is contiguous in natural order (what the
data pipeline produces). A window longer than a run, a non-causal window or an
unknown token order falls back to the strategy's own attention (which skips the
compute of masked blocks but not their transfer). Gradients are autodiff's:
the halo's dK/dV go back by the transposed ppermute.

Local shapes (inside shard_map): q `[B, T, N, H]`, k `[B, T, K, H]`, v `[B, T, K,
V]`, seg/pos `[B, T]` int32 over a sequence sharded P ways; out `[B, T, N, V]`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lctx.kernels.options import AttentionOptions
from lctx.kernels.token_order import Layout, TokenOrder
from lctx.parallel import block_ops
from lctx.parallel.options import ContextOptions


def halo_fits(cfg: AttentionOptions, local_len: int, zigzag: bool) -> bool:
  """Whether the halo exchange covers this call: a causal window whose w - 1
  keys fit in one natural run of the local shard (its half with zigzag)."""
  if cfg.window_size is None or not cfg.causal:
    return False
  run = local_len // 2 if zigzag else local_len
  return cfg.window_size - 1 <= run


_LANES = 128  # TPU kernels (splash) take lengths in multiples of this


def halo_length(window: int, run: int) -> int:
  """Tokens sent: w - 1, rounded up to a multiple of 128 (at most the run) when
  the run is one, so [halo, run] stays a length the TPU kernels take; the extra
  keys are outside every window and masked."""
  if run % _LANES:
    return window - 1
  return min(run, -(-(window - 1) // _LANES) * _LANES)


def _shift(xs, axis_names, size: int, offset: int):
  """Each array of device i to device i + offset, without wrapping around; a
  device nobody sends to receives zeros (segment id 0: padding, masked)."""
  perm = [(i, i + offset) for i in range(size) if 0 <= i + offset < size]
  return tuple(jax.lax.ppermute(x, axis_names, perm) for x in xs)


def _attend_run(q, kv, halo, q_start, cfg: AttentionOptions, ordered: bool, length: int):
  """One natural run's queries against [halo, run]; q_start: the run's first
  natural index (a kernel that masks on it needs the rows' layout); ordered: the
  batch's token order is known (ContextOptions.token_order)."""
  k, v, seg, pos = (jnp.concatenate([h, x], axis=1) for h, x in zip(halo, kv))
  h = halo[0].shape[1]
  layout = None
  if ordered:  # rows are natural indices q_start - h .. q_start + run
    layout = Layout(TokenOrder(int(length), 0), q_start, q_start - h)
  return block_ops.attend(
    q, k, v, q_seg=kv[2], kv_seg=seg, q_pos=kv[3], kv_pos=pos, cfg=cfg, layout=layout
  )


def halo_attention_local(
  q,
  k,
  v,
  seg,
  pos,
  *,
  cfg: AttentionOptions,
  ctx: ContextOptions,
  axis_names,
  axis_size: int,
  zigzag: bool,
):
  """Sliding-window attention of the local shard with the halo exchange (see
  the module docstring); requires halo_fits(cfg, T, zigzag)."""
  size, t = int(axis_size), q.shape[1]
  h = halo_length(cfg.window_size, t // 2 if zigzag else t)
  ordered = ctx.token_order is not None
  length = t * size
  r = jax.lax.axis_index(axis_names) if size > 1 else 0
  tail = lambda xs: tuple(x[:, x.shape[1] - h :] for x in xs)  # noqa: E731
  if not zigzag:
    kv = (k, v, seg, pos)
    halo = _shift(tail(kv), axis_names, size, 1) if size > 1 else tail(kv)
    if size == 1:  # no run before: an all-padding halo
      halo = tuple(jnp.zeros_like(x) for x in halo)
    return _attend_run(q, kv, halo, r * t, cfg, ordered, length)
  c = t // 2
  first = tuple(x[:, :c] for x in (k, v, seg, pos))  # natural chunk r
  second = tuple(x[:, c:] for x in (k, v, seg, pos))  # natural chunk 2P-1-r
  if size > 1:
    halo_first = _shift(tail(first), axis_names, size, 1)  # tail of chunk r-1
    from_next = _shift(tail(second), axis_names, size, -1)  # tail of chunk 2P-2-r
  else:
    halo_first = tuple(jnp.zeros_like(x) for x in tail(first))
    from_next = halo_first
  last = r == size - 1  # chunk 2P-2-r is this device's own first chunk
  halo_second = tuple(jnp.where(last, own, got) for own, got in zip(tail(first), from_next))
  out_first = _attend_run(q[:, :c], first, halo_first, r * c, cfg, ordered, length)
  out_second = _attend_run(
    q[:, c:], second, halo_second, (2 * size - 1 - r) * c, cfg, ordered, length
  )
  return jnp.concatenate([out_first, out_second], axis=1)


def window_aware(
  plain, *, cfg: AttentionOptions, ctx: ContextOptions, axis_names, axis_size: int, zigzag: bool
):
  """A local attention function (q, k, v, seg, pos) -> out that runs the halo
  exchange when it covers the call and `plain` (the strategy's) otherwise."""

  def local(q, k, v, seg, pos):
    if halo_fits(cfg, q.shape[1], zigzag):
      return halo_attention_local(
        q,
        k,
        v,
        seg,
        pos,
        cfg=cfg,
        ctx=ctx,
        axis_names=axis_names,
        axis_size=axis_size,
        zigzag=zigzag,
      )
    return plain(q, k, v, seg, pos)

  return local


def usp_window_aware(plain, *, cfg: AttentionOptions, ctx: ContextOptions, ring_axis: str, ring_size: int,
                     ulysses_axis: str, ulysses_size: int, zigzag: bool):  # fmt: skip
  """usp for a sliding layer: the ulysses all-to-all (a ring group's chunk, a
  head group), then the halo exchange over the ring instead of the ring's hops;
  `plain` (usp's own) where the halo does not cover the call or with UPipe."""
  from lctx.parallel import ulysses  # pylint: disable=g-import-not-at-top

  def local(q, k, v, seg, pos):
    group_len = q.shape[1] * ulysses_size
    if (ctx.head_chunks or 1) > 1 or not halo_fits(cfg, group_len, zigzag):
      return plain(q, k, v, seg, pos)
    q, k, v = (ulysses._to_heads(x, ulysses_axis) for x in (q, k, v))  # noqa: SLF001
    seg, pos = (ulysses._gather_tokens(x, ulysses_axis) for x in (seg, pos))  # noqa: SLF001
    out = halo_attention_local(
      q,
      k,
      v,
      seg,
      pos,
      cfg=cfg,
      ctx=ctx,
      axis_names=ring_axis,
      axis_size=ring_size,
      zigzag=zigzag,
    )
    return ulysses._to_seq(out, ulysses_axis)  # noqa: SLF001

  return local

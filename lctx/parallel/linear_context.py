"""Linear attention (gated delta rule, short conv) under context parallelism.

`make_linear_fns(mesh, load_balance=...)` gives the two ops on global arrays whose
sequence is sharded over the context axes, in the order the batch is held (zigzag
over ring size `context` when load_balance, natural otherwise).

One scheme serves every strategy (all_gather, ring, ulysses, usp): whatever the
strategy does inside attention, the model's activations are sharded the same way
outside it (batch over (data, fsdp), sequence over (context, context_ulysses)
flattened, heads over tensor), so the linear layers only see that layout; they
never all-to-all to heads. Zigzag on or off is a property of the batch's order,
not of the strategy (ulysses refuses zigzag, so it is off there).

How (each device, inside one shard_map over the whole mesh):
- Its shard is cut into pieces that are contiguous in natural order: the whole
  shard (natural order) or its two halves (zigzag; lctx.parallel.zigzag); which
  natural piece each (device, half) holds is static.
- Delta rule: for each piece, its summary, the affine map of the incoming state
  S -> A S + C (A `[B, N, H, H]`, C `[B, N, H, V]` float32, one scan over the piece
  with v and the state widened by H columns), and its first / last segment ids.
  The summaries are all-gathered over the sequence axes, put in natural piece
  order, and composed by a scan: piece j starts from S_in(j) = A S_in(j-1) + C of
  its predecessor, or from 0 when its first token's segment id differs from the
  predecessor's last (a document boundary on a piece boundary). Each piece then
  runs `delta_rule` from its S_in. The backward pass is JAX's transpose of this
  (the all-gather's is a reduce-scatter).
- Short conv: the last W-1 tokens (and segment ids) of every piece are
  all-gathered the same way (a few KiB); each piece takes its natural
  predecessor's as its halo.
- Memory: the all-gather holds every piece's summary on every device,
  O(devices x B N H (H + V)) float32 per layer; a log-depth ppermute prefix
  (Hillis-Steele) would hold O(1) summaries but take log2(devices) dependent
  rounds. `state_exchange_bytes` counts what each device sends.

Heads: q, k (Q heads) and v, g, beta (N heads, a multiple of Q: value head j
reads q/k head j // (N / Q), repeated inside the kernel one chunk at a time) are
sharded over `tensor` when both Q and N divide by it (a device's value heads
then read exactly its q/k heads), else replicated (every tensor device computes
every head). Conv channels likewise: sharded over tensor when C divides it.

Shapes (docs/contracts.md legend): q, k `[B, T, Q, H]`, v `[B, T, N, V]`, g
`[B, T, N]` or `[B, T, N, H]`, beta `[B, T, N]`, segment_ids `[B, T]`; conv x
`[B, T, C]`, weight `[W, C]`, bias `[C]`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from lctx.errors import ConfigError
from lctx.kernels.delta_rule import delta_rule as delta_rule_kernel
from lctx.kernels.delta_rule import delta_rule_summary
from lctx.kernels.shard_typing import varying_like
from lctx.kernels.short_conv import short_conv as short_conv_kernel
from lctx.parallel.mesh import BATCH_AXES, LOGICAL_RULES, SEQ_AXES, mesh_shape, shard_map_over
from lctx.parallel.validation import zigzag_ring_size
from lctx.parallel.zigzag import zigzag_piece_order

HEAD_AXIS = dict(LOGICAL_RULES)["act_heads"]


@dataclasses.dataclass(frozen=True)
class LinearFns:
  """The linear-attention ops on global, sequence-sharded arrays.

  short_conv(x, weight, bias, *, segment_ids, activation='silu') -> `[B, T, C]`
  delta_rule(q, k, v, g, beta, *, segment_ids) -> o `[B, T, N, V]` (q, k `[B, T, Q, H]`)
  """

  short_conv: Callable
  delta_rule: Callable


def _present(mesh, axes):
  names = tuple(a for a in axes if a in mesh.axis_names)
  return names or None


def piece_table(shape: dict, load_balance: bool) -> np.ndarray:
  """`[ways, pieces]` int: the natural piece index held by each (device along the
  flattened sequence axes, piece of its shard). Natural order: one piece per
  device, piece d on device d; zigzag: the two halves of each shard."""
  ways = math.prod(shape.get(a, 1) for a in SEQ_AXES)
  if not load_balance:
    return np.arange(ways).reshape(ways, 1)
  return zigzag_piece_order(zigzag_ring_size(shape) or 1, ways).reshape(ways, 2)


def _check_layout(mesh, batch: int, length: int, table: np.ndarray, what: str) -> int:
  shape = mesh_shape(mesh)
  rows = math.prod(shape.get(a, 1) for a in BATCH_AXES)
  if batch % rows:
    raise ConfigError(
      f"[batch-divisible] batch ({batch}) must be divisible by data x fsdp = {rows}"
    )
  parts = table.size
  if length % parts:
    raise ConfigError(
      f"[seq-divisible] {what}: sequence length ({length}) must be divisible by "
      f"{parts} pieces ({table.shape[0]} sequence shards x {table.shape[1]} per shard)"
    )
  return length // parts


def _my_pieces(table: np.ndarray, seq_axes):
  """Natural piece index of each local piece (traced: depends on the device)."""
  d = jax.lax.axis_index(seq_axes) if seq_axes else 0
  return [jnp.asarray(table[:, h])[d] for h in range(table.shape[1])]


def _gather_natural(parts, seq_axes, table: np.ndarray):
  """Local float32 `[pieces, ...]` arrays -> every piece's, `[all pieces, ...]` in
  natural piece order, by ONE all-gather: fake CPU devices deadlock when
  independent collectives start in different orders on different devices, and one
  collective is also one latency."""
  n_p = parts[0].shape[0]
  flat = jnp.concatenate([p.reshape(n_p, -1) for p in parts], axis=1)
  if seq_axes:
    flat = jax.lax.all_gather(flat, seq_axes, axis=0, tiled=True)  # position d * pieces + h
  flat = jnp.take(flat, np.argsort(table.reshape(-1)), axis=0)
  out, at = [], 0
  for p in parts:
    size = math.prod(p.shape[1:])
    out.append(flat[:, at : at + size].reshape(flat.shape[0], *p.shape[1:]))
    at += size
  return out


def _ids_float(ids):
  """Segment ids travel inside the float32 gather: exact below 2^24 (ids count
  documents within a row)."""
  return ids.astype(jnp.float32)


# ----------------------------------------------------------------------------
# Delta rule
# ----------------------------------------------------------------------------
def _delta_local(q, k, v, g, beta, seg, *, seq_axes, table, chunk_size):
  n_p = table.shape[1]
  lp = q.shape[1] // n_p
  cut = lambda x, h: x[:, h * lp : (h + 1) * lp]  # noqa: E731
  b, _, _, h_dim = q.shape
  n, v_dim = v.shape[2], v.shape[3]
  # A piece's map final(S0) = A S0 + C, stored as [C | A] (one scan: the kernel's
  # delta_rule_summary).
  summaries = [
    delta_rule_summary(
      cut(k, i), cut(v, i), cut(g, i), cut(beta, i), segment_ids=cut(seg, i), chunk_size=chunk_size
    )
    for i in range(n_p)
  ]
  ends = jnp.stack([jnp.stack([cut(seg, i)[:, 0], cut(seg, i)[:, -1]]) for i in range(n_p)])
  summ, ends = _gather_natural([jnp.stack(summaries), _ids_float(ends)], seq_axes, table)
  first, last = ends[:, 0], ends[:, 1]  # [pieces, B]: each piece's first / last segment id
  last_before = jnp.concatenate([first[:1], last[:-1]], axis=0)  # [pieces, B]

  def compose(s_prev, xs):
    m, first_id, prev_id = xs
    s_in = jnp.where((first_id != prev_id)[:, None, None, None], 0.0, s_prev)
    s_out = jnp.einsum("bnhk,bnkv->bnhv", m[..., v_dim:], s_in) + m[..., :v_dim]
    return s_out, s_in

  zero = varying_like(jnp.zeros((b, n, h_dim, v_dim), jnp.float32), summ)
  _, s_ins = jax.lax.scan(compose, zero, (summ, first, last_before))  # [pieces, B, N, H, V]
  outs = []
  for i, j in enumerate(_my_pieces(table, seq_axes)):
    o, _ = delta_rule_kernel(
      cut(q, i),
      cut(k, i),
      cut(v, i),
      cut(g, i),
      cut(beta, i),
      segment_ids=cut(seg, i),
      initial_state=s_ins[j],
      chunk_size=chunk_size,
    )
    outs.append(o)
  return jnp.concatenate(outs, axis=1)


def _delta_rule(q, k, v, g, beta, *, segment_ids, mesh, table, chunk_size):
  b, t, nq, _ = q.shape
  n = v.shape[2]
  _check_layout(mesh, b, t, table, "delta_rule")
  seg = (
    jnp.ones((b, t), jnp.int32)
    if segment_ids is None
    else jnp.broadcast_to(jnp.asarray(segment_ids, jnp.int32), (b, t))
  )
  batch, seq = _present(mesh, BATCH_AXES), _present(mesh, SEQ_AXES)
  tp = mesh_shape(mesh).get(HEAD_AXIS, 1)
  head = HEAD_AXIS if tp > 1 and n % tp == 0 and nq % tp == 0 else None
  x4 = P(batch, seq, head, None)
  specs = (
    x4,
    x4,
    x4,
    x4 if g.ndim == 4 else P(batch, seq, head),
    P(batch, seq, head),
    P(batch, seq),
  )
  local = functools.partial(_delta_local, seq_axes=seq, table=table, chunk_size=chunk_size)
  return shard_map_over(local, mesh, specs, x4)(q, k, v, g, beta, seg)


# ----------------------------------------------------------------------------
# Short conv
# ----------------------------------------------------------------------------
def _conv_local(x, weight, bias, seg, *, seq_axes, table, activation):
  n_p = table.shape[1]
  lp = x.shape[1] // n_p
  w = weight.shape[0]
  tail = lambda a, i: a[:, (i + 1) * lp - (w - 1) : (i + 1) * lp]  # noqa: E731
  tails_x = jnp.stack([tail(x, i) for i in range(n_p)]).astype(jnp.float32)  # [pieces, B, W-1, C]
  tails_id = jnp.stack([_ids_float(tail(seg, i)) for i in range(n_p)])  # [pieces, B, W-1]
  all_x, all_id = _gather_natural([tails_x, tails_id], seq_axes, table)
  outs = []
  for i, j in enumerate(_my_pieces(table, seq_axes)):
    # The halo is the natural predecessor's tail; natural piece 0 has none (zeros
    # with id 0, which its taps never read unless it starts in padding).
    prev = jnp.maximum(j - 1, 0)
    halo = jnp.where(j > 0, all_x[prev], 0.0).astype(x.dtype)
    halo_ids = jnp.where(j > 0, all_id[prev], 0.0).astype(jnp.int32)
    outs.append(
      short_conv_kernel(
        x[:, i * lp : (i + 1) * lp],
        weight,
        bias,
        segment_ids=seg[:, i * lp : (i + 1) * lp],
        activation=activation,
        halo=halo,
        halo_segment_ids=halo_ids,
      )
    )
  return jnp.concatenate(outs, axis=1)


def _short_conv(x, weight, bias, *, segment_ids, activation, mesh, table):
  b, t, c = x.shape
  lp = _check_layout(mesh, b, t, table, "short_conv")
  w = weight.shape[0]
  if lp < w - 1:
    raise ConfigError(
      f"[conv-halo] short_conv: each device's pieces hold {lp} tokens, fewer than the "
      f"kernel's W-1 = {w - 1} halo tokens; use a longer sequence or fewer context devices"
    )
  seg = (
    jnp.ones((b, t), jnp.int32)
    if segment_ids is None
    else jnp.broadcast_to(jnp.asarray(segment_ids, jnp.int32), (b, t))
  )
  if bias is None:
    bias = jnp.zeros((c,), weight.dtype)
  batch, seq = _present(mesh, BATCH_AXES), _present(mesh, SEQ_AXES)
  tp = mesh_shape(mesh).get(HEAD_AXIS, 1)
  ch = HEAD_AXIS if tp > 1 and c % tp == 0 else None
  specs = (P(batch, seq, ch), P(None, ch), P(ch), P(batch, seq))
  local = functools.partial(_conv_local, seq_axes=seq, table=table, activation=activation)
  return shard_map_over(local, mesh, specs, P(batch, seq, ch))(x, weight, bias, seg)


def make_linear_fns(mesh, *, load_balance: bool, chunk_size: int = 64) -> LinearFns:
  """The linear-attention plug-in for the model: `LinearFns` over `mesh`.

  load_balance: the batch is in zigzag order over ring size `context` (as the
  pipeline makes it for ring / usp); False: natural order. chunk_size: the delta
  rule's chunk (tokens). Bad layouts (batch or length not divisible, pieces
  shorter than the conv halo) raise ConfigError at trace time.
  """
  shape = mesh_shape(mesh)
  if load_balance and zigzag_ring_size(shape) > 1 and zigzag_ring_size(shape) % 2:
    raise ConfigError(
      f"[odd-ring-load-balance] zigzag needs an even ring size (context); got {zigzag_ring_size(shape)}"
    )
  table = piece_table(shape, load_balance)

  def short_conv(x, weight, bias=None, *, segment_ids=None, activation="silu"):
    return _short_conv(
      x, weight, bias, segment_ids=segment_ids, activation=activation, mesh=mesh, table=table
    )

  def delta_rule(q, k, v, g, beta, *, segment_ids=None):
    return _delta_rule(
      q, k, v, g, beta, segment_ids=segment_ids, mesh=mesh, table=table, chunk_size=chunk_size
    )

  return LinearFns(short_conv=short_conv, delta_rule=delta_rule)


# ----------------------------------------------------------------------------
# Sizing
# ----------------------------------------------------------------------------
def state_exchange_bytes(
  *,
  batch: int,
  heads: int,
  key_dim: int,
  value_dim: int,
  ways: int,
  load_balance: bool,
  conv_channels: int = 0,
  conv_width: int = 4,
) -> dict:
  """Bytes each device sends per linear layer in the forward pass (the backward
  sends the same again: an all-gather's transpose is a reduce-scatter of the same
  size). batch / heads / conv_channels: per device (after data, fsdp and tensor
  sharding); ways: sequence shards (context x context_ulysses).

  Returns {summary_bytes (one device's summaries and their first / last ids,
  float32), all_gather_bytes ((ways - 1) x summary_bytes: a ring all-gather's
  traffic per device), halo_bytes (the conv tails' all-gather, float32), total}."""
  pieces = 2 if load_balance else 1
  summary = pieces * batch * (heads * key_dim * (key_dim + value_dim) + 2) * 4
  tails = pieces * batch * (conv_width - 1) * (conv_channels + 1) * 4
  gather, halo = (ways - 1) * summary, (ways - 1) * tails if conv_channels else 0
  return {
    "summary_bytes": summary,
    "all_gather_bytes": gather,
    "halo_bytes": halo,
    "total": gather + halo,
  }


def ring_attention_bytes(
  *,
  batch: int,
  tokens: int,
  kv_heads: int,
  head_dim: int,
  value_dim: int,
  ways: int,
  activation_bytes: int = 2,
) -> int:
  """Bytes each device sends in one forward ring-attention pass over `ways`
  devices at `tokens` per device: its K/V block travels ways - 1 hops."""
  return (ways - 1) * batch * tokens * kv_heads * (head_dim + value_dim) * activation_bytes

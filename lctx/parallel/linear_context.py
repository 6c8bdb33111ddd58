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
  Each piece's incoming state is the prefix of those maps in natural piece
  order, composed in log2(pieces) rounds of ppermutes (Hillis-Steele: round r
  composes a piece's map with the one 2^r pieces before it); a piece whose first
  token's segment id differs from its predecessor's last (a document boundary on
  a piece boundary) takes no state, its A zeroed. Each piece then runs
  `delta_rule` from its incoming state. The backward pass is JAX's transpose of
  this (a ppermute's is the reverse ppermute).
- Short conv: the last W-1 tokens (and segment ids) of every piece are
  all-gathered over the sequence axes (a few KiB); each piece takes its natural
  predecessor's as its halo.
- Memory: the prefix holds O(log2(pieces)) summaries per layer and device,
  B N H (H + V) float32 each, for the backward. (It replaced an all-gather of
  every piece's summary, O(devices): at 64 v5p devices, two pieces each, that
  was f32 [128, 1048578], 512 MiB per gathered copy.) `state_exchange_bytes`
  counts what each device sends.

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
from lctx.kernels import flop_tags
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
  layer(parts, p, x, *, segment_ids, chunk_size) -> `[B, T, D]`: a whole linear layer
    run over sequence chunks (`chunked_layer`)
  """

  short_conv: Callable
  delta_rule: Callable
  layer: Callable | None = None


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
  v_dim = v.shape[3]
  # A piece's map final(S0) = A S0 + C, stored as [C | A] (one scan: the kernel's
  # delta_rule_summary).
  summaries = [
    delta_rule_summary(
      cut(k, i), cut(v, i), cut(g, i), cut(beta, i), segment_ids=cut(seg, i), chunk_size=chunk_size
    )
    for i in range(n_p)
  ]
  first = _ids_float(jnp.stack([cut(seg, i)[:, 0] for i in range(n_p)]))  # [pieces, B]
  last = _ids_float(jnp.stack([cut(seg, i)[:, -1] for i in range(n_p)]))
  s_ins = _incoming_states(jnp.stack(summaries), first, last, seq_axes, table, v_dim)
  outs = []
  for i in range(n_p):
    o, _ = delta_rule_kernel(
      cut(q, i),
      cut(k, i),
      cut(v, i),
      cut(g, i),
      cut(beta, i),
      segment_ids=cut(seg, i),
      initial_state=s_ins[i],
      chunk_size=chunk_size,
    )
    outs.append(o)
  return jnp.concatenate(outs, axis=1)


def _shift_moves(table: np.ndarray, offset: int) -> dict[tuple[int, int], list[tuple[int, int]]]:
  """`{(source slot, destination slot): [(source device, destination device)]}`:
  where each piece's value goes when every piece takes the one `offset` places
  before it in natural order. Each group is a partial permutation of devices, so
  each is one ppermute (as in lctx.parallel.zigzag.zigzag_half_moves)."""
  ways, n_p = table.shape
  where = {int(table[d, h]): (d, h) for d in range(ways) for h in range(n_p)}
  moves: dict[tuple[int, int], list[tuple[int, int]]] = {}
  for j in range(offset, table.size):
    (ds, hs), (dd, hd) = where[j - offset], where[j]
    moves.setdefault((hs, hd), []).append((ds, dd))
  return moves


def _prefix_offsets(pieces: int) -> list[int]:
  """The Hillis-Steele rounds' offsets: 1, 2, 4, ... below `pieces`."""
  offsets = [1]
  while offsets[-1] * 2 < pieces:
    offsets.append(offsets[-1] * 2)
  return offsets if pieces > 1 else []


def _shift(x, offset: int, seq_axes, table: np.ndarray):
  """x `[pieces, ...]` (this device's pieces) -> y with y[h] = x of the piece
  `offset` places before local piece h in natural order (zeros where there is
  none), by one ppermute per `_shift_moves` group. Each is ordered after the
  previous one (fake CPU devices deadlock when independent collectives start in
  different orders on different devices)."""
  out = [jnp.zeros_like(x[0]) for _ in range(table.shape[1])]
  prev = None
  for (hs, hd), pairs in sorted(_shift_moves(table, offset).items()):
    src = x[hs]
    if not seq_axes:  # one device: its own pieces
      out[hd] = out[hd] + src
      continue
    if prev is not None:
      prev, src = jax.lax.optimization_barrier((prev, src))
    prev = jax.lax.ppermute(src, seq_axes, perm=pairs)
    out[hd] = out[hd] + prev
  return jnp.stack(out)


def _incoming_states(summ, first, last, seq_axes, table: np.ndarray, v_dim: int):
  """Each local piece's incoming state `[pieces, B, N, H, V]` from every piece's
  summary `[C | A]` (`[pieces, B, N, H, V + H]`, local) and first / last segment
  ids (`[pieces, B]`), by a log-depth prefix over natural piece order
  (Hillis-Steele): round r composes each piece's map with the one 2^r places
  before it, so a device holds one received summary per round (log2(pieces)
  rounds kept for the backward), not every device's.

  A document boundary on a piece boundary (first id != its predecessor's last)
  zeroes the piece's A, so nothing flows into it. A map whose prefix reaches
  piece 0 keeps only its C (its A would act on piece 0's zero incoming state),
  which is why the zeros a piece with no partner receives are harmless."""
  d = jax.lax.axis_index(seq_axes) if seq_axes else 0
  j = jnp.asarray(table)[d]  # [pieces]: natural index of each local piece
  prev_last = _shift(last, 1, seq_axes, table)
  cont = ((first == prev_last) & (j > 0)[:, None]).astype(jnp.float32)  # [pieces, B]
  c, a = summ[..., :v_dim], summ[..., v_dim:] * cont[:, :, None, None, None]
  for offset in _prefix_offsets(table.size):
    got = _shift(jnp.concatenate([c, a], axis=-1), offset, seq_axes, table)
    c_prev, a_prev = got[..., :v_dim], got[..., v_dim:]
    c = jnp.einsum("pbnhk,pbnkv->pbnhv", a, c_prev) + c
    a = jnp.einsum("pbnhk,pbnkj->pbnhj", a, a_prev)
  return _shift(c, 1, seq_axes, table) * cont[:, :, None, None, None]


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
def _predecessor_tails(x, seg, width: int, seq_axes, table: np.ndarray):
  """Each local piece's halo: its natural predecessor's last `width` tokens of x
  `[B, T, C]` and their segment ids, as `[(halo [B, width, C] in x.dtype, ids
  [B, width] int32)]` per local piece, by one all-gather of every piece's tail.
  Natural piece 0 has none: zeros with id 0, which its taps never read unless it
  starts in padding."""
  n_p = table.shape[1]
  lp = x.shape[1] // n_p
  tail = lambda a, i: a[:, (i + 1) * lp - width : (i + 1) * lp]  # noqa: E731
  tails_x = jnp.stack([tail(x, i) for i in range(n_p)]).astype(jnp.float32)  # [pieces, B, w, C]
  tails_id = jnp.stack([_ids_float(tail(seg, i)) for i in range(n_p)])  # [pieces, B, w]
  all_x, all_id = _gather_natural([tails_x, tails_id], seq_axes, table)
  halos = []
  for j in _my_pieces(table, seq_axes):
    prev = jnp.maximum(j - 1, 0)
    halo = jnp.where(j > 0, all_x[prev], 0.0).astype(x.dtype)
    halos.append((halo, jnp.where(j > 0, all_id[prev], 0.0).astype(jnp.int32)))
  return halos


def _conv_local(x, weight, bias, seg, *, seq_axes, table, activation):
  n_p = table.shape[1]
  lp = x.shape[1] // n_p
  halos = _predecessor_tails(x, seg, weight.shape[0] - 1, seq_axes, table)
  outs = []
  for i, (halo, halo_ids) in enumerate(halos):
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


def _check_conv_halo(lp: int, w: int, what: str) -> None:
  """`[conv-halo]`: a piece of lp tokens must hold the W-1 tokens the next one reads."""
  if lp < w - 1:
    raise ConfigError(
      f"[conv-halo] {what}: each device's pieces hold {lp} tokens, fewer than the "
      f"conv's W-1 = {w - 1} halo tokens; use a longer sequence or fewer context devices"
    )


def _short_conv(x, weight, bias, *, segment_ids, activation, mesh, table):
  b, t, c = x.shape
  lp = _check_layout(mesh, b, t, table, "short_conv")
  _check_conv_halo(lp, weight.shape[0], "short_conv")
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


# ----------------------------------------------------------------------------
# The whole layer over sequence chunks
# ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class LinearParts:
  """A linear layer as three per-token functions of its params `p` (a dict that
  holds `conv_q`, `conv_k`, `conv_v` `[W, C]`), for `chunked_layer`:

    project(p, x `[B, s, D]`) -> (q, k `[B, s, Q, H]`, v `[B, s, N, V]` before the
      conv, g, beta), the raw projections and the gates
    heads(p, q, k, v) -> (q, k, v) after the conv: what the delta rule reads (norms,
      scaling, dtype)
    finish(p, x `[B, s, D]`, o `[B, s, N, V]`) -> out `[B, s, D]`
  """

  project: Callable
  heads: Callable
  finish: Callable


CONV_PARAMS = ("conv_q", "conv_k", "conv_v")  # the conv weights LinearParts' p holds


def _conv_chunk(raw, weight, seg, halo, halo_ids):
  """The conv + SiLU of one chunk's raw projection `[B, s, H, K]` from the W-1 raw
  tokens before it (halo `[B, W-1, H*K]`)."""
  b, s, h, k = raw.shape
  with flop_tags.linear_scope():
    y = short_conv_kernel(
      raw.reshape(b, s, h * k),
      weight,
      None,
      segment_ids=seg,
      activation="silu",
      halo=halo,
      halo_segment_ids=halo_ids,
    )
  return y.reshape(b, s, h, k)


def _roll_tail(halo, new, width: int):
  """The last `width` tokens of halo + new along axis 1."""
  return jnp.concatenate([halo, new], axis=1)[:, -width:]


def _chunk_inputs(parts, p, xc, sc, halos, halo_ids):
  """One chunk's delta-rule inputs: (q, k, v, g, beta) and the chunk's raw tails."""
  raw_q, raw_k, raw_v, g, beta = parts.project(p, xc)
  w1 = halo_ids.shape[1]
  convs, tails = [], []
  for raw, name, halo in zip((raw_q, raw_k, raw_v), CONV_PARAMS, halos):
    convs.append(_conv_chunk(raw, p[name], sc, halo, halo_ids))
    tails.append(_roll_tail(halo, raw.reshape(*raw.shape[:2], -1).astype(halo.dtype), w1))
  q, k, v = parts.heads(p, *convs)
  return (q, k, v, g, beta), tuple(tails), _roll_tail(halo_ids, sc, w1)


def _as_chunks(a, chunk: int):
  """`[B, L, ...]` -> `[L / chunk, B, chunk, ...]` (scan axis first)."""
  return jnp.moveaxis(a.reshape(a.shape[0], a.shape[1] // chunk, chunk, *a.shape[2:]), 1, 0)


def _layer_local(p, x, seg, *, parts, seq_axes, table, chunk, dr_chunk):
  """One device's pieces of a linear layer, chunk by chunk (see `chunked_layer`)."""
  n_p = table.shape[1]
  b, lp = x.shape[0], x.shape[1] // n_p
  w1 = p["conv_q"].shape[0] - 1
  xs = [_as_chunks(x[:, i * lp : (i + 1) * lp], chunk) for i in range(n_p)]
  ss = [_as_chunks(seg[:, i * lp : (i + 1) * lp], chunk) for i in range(n_p)]
  # The raw projections of each piece's halo (its natural predecessor's last W-1
  # tokens of x): the conv of the piece's first chunk reads them.
  if table.size > 1:
    with flop_tags.linear_scope():  # sizing counts the layer's exchange apart
      halos = _predecessor_tails(x, seg, w1, seq_axes, table)
  else:  # one piece: nothing before it (zeros with id 0, as for natural piece 0)
    halos = [(jnp.zeros((b, w1, x.shape[2]), x.dtype), jnp.zeros((b, w1), seg.dtype))]
  starts = []
  for halo_x, halo_ids in halos:
    raw = parts.project(p, halo_x)[:3]
    starts.append((tuple(r.reshape(*r.shape[:2], -1) for r in raw), halo_ids))
  firsts = [ss[i][0][:, 0] for i in range(n_p)]  # [B]: each piece's first id
  n, v_dim, h = _state_dims(parts, p, x[:, :1])

  def carry_like(c):
    return jax.tree.map(lambda a: varying_like(a, x, seg), c)

  s_ins = [None] * n_p
  if table.size > 1:
    # Pass 1: each piece's summary [C | A], composed chunk by chunk.
    def summary_step(carry, inp):
      summ, halos, halo_ids, last = carry
      xc, sc = inp
      (_, k, v, g, beta), tails, ids = _chunk_inputs(parts, p, xc, sc, halos, halo_ids)
      cont = (sc[:, 0] == last).astype(jnp.float32)[:, None, None, None]
      with flop_tags.linear_scope():
        summ = delta_rule_summary(
          k, v, g, beta, segment_ids=sc, chunk_size=dr_chunk, initial_summary=summ * cont
        )
      return (summ, tails, ids, sc[:, -1]), None

    start = jnp.concatenate(
      [
        jnp.zeros((b, n, h, v_dim), jnp.float32),
        jnp.broadcast_to(jnp.eye(h, dtype=jnp.float32), (b, n, h, h)),
      ],
      axis=-1,
    )
    summaries = []
    for i in range(n_p):
      carry = carry_like((start, starts[i][0], starts[i][1], firsts[i]))
      step = jax.checkpoint(summary_step, prevent_cse=False)
      summaries.append(jax.lax.scan(step, carry, (xs[i], ss[i]))[0][0])
    first = _ids_float(jnp.stack(firsts))
    last = _ids_float(jnp.stack([ss[i][-1][:, -1] for i in range(n_p)]))
    with flop_tags.linear_scope():
      s_ins = list(_incoming_states(jnp.stack(summaries), first, last, seq_axes, table, v_dim))

  # Pass 2: the outputs, each chunk from the state the one before it left.
  def out_step(carry, inp):
    state, halos, halo_ids, last = carry
    xc, sc = inp
    (q, k, v, g, beta), tails, ids = _chunk_inputs(parts, p, xc, sc, halos, halo_ids)
    cont = (sc[:, 0] == last).astype(jnp.float32)[:, None, None, None]
    with flop_tags.linear_scope():
      o, state = delta_rule_kernel(
        q, k, v, g, beta, segment_ids=sc, initial_state=state * cont, chunk_size=dr_chunk
      )
    return (state, tails, ids, sc[:, -1]), parts.finish(p, xc, o)

  outs = []
  for i in range(n_p):
    if s_ins[i] is None:
      s_ins[i] = jnp.zeros((b, n, h, v_dim), jnp.float32)
    carry = carry_like((s_ins[i], starts[i][0], starts[i][1], firsts[i]))
    step = jax.checkpoint(out_step, prevent_cse=False)
    out = jax.lax.scan(step, carry, (xs[i], ss[i]))[1]  # [chunks, B, chunk, D]
    outs.append(jnp.moveaxis(out, 0, 1).reshape(b, lp, -1))
  return jnp.concatenate(outs, axis=1)


def _state_dims(parts, p, x1):
  """(N, V, H) of the layer's state, read from its projections' shapes (no FLOPs run)."""
  q, _, v, _, _ = jax.eval_shape(lambda a: parts.project(p, a), x1)
  return v.shape[2], v.shape[3], q.shape[3]


def chunk_tokens(piece: int, chunk_size: int | None) -> int:
  """The tokens per chunk for pieces of `piece` tokens: chunk_size (None or
  larger than the piece: the whole piece). Refuses a chunk that does not divide
  the piece (ConfigError). Any chunk length works with the conv: each chunk reads
  the W-1 raw tokens before it, carried from the chunks before."""
  chunk = piece if not chunk_size or chunk_size >= piece else int(chunk_size)
  if piece % chunk:
    raise ConfigError(
      f"[linear-chunk] linear_chunk_size ({chunk}) must divide each piece's {piece} "
      "tokens (the sequence per device, halved under zigzag)"
    )
  return chunk


def chunked_layer(
  parts, p, x, *, segment_ids=None, chunk_size=None, mesh=None, table=None, dr_chunk=64
):
  """A whole linear layer (`LinearParts`) on x `[B, T, D]`, run over sequence
  chunks of `chunk_size` tokens so that no per-token value other than x, the
  output and their cotangents spans the sequence.

  Each piece (a device's shard, or its two zigzag halves) runs a `lax.scan` over
  its chunks: project, conv (the W-1 raw tokens before the chunk carried), delta
  rule (the state carried), finish. Under context parallelism a first scan
  composes the piece's summary [C | A] chunk by chunk (the same projections, k
  and v only), the state prefix gives each piece its incoming state, and the
  second scan runs from it. Both scan bodies are rematerialised, so the backward
  keeps one carry per chunk (a state `[B, N, H, V]` float32) and recomputes the
  chunk. Values and gradients equal the unchunked layer's. mesh None: one device.

  The params enter replicated: under `tensor` > 1 every tensor device computes
  every head of the layer (the unchunked ops shard heads over tensor).
  """
  b, t, _ = x.shape
  if mesh is None:
    table = np.zeros((1, 1), int)
  else:
    lp = _check_layout(mesh, b, t, table, "linear layer")
    if table.size > 1:
      _check_conv_halo(lp, p["conv_q"].shape[0], "linear layer")
  seg = (
    jnp.ones((b, t), jnp.int32)
    if segment_ids is None
    else jnp.broadcast_to(jnp.asarray(segment_ids, jnp.int32), (b, t))
  )
  chunk = chunk_tokens(t // table.size, chunk_size)
  local = functools.partial(_layer_local, parts=parts, table=table, chunk=chunk, dr_chunk=dr_chunk)
  if mesh is None:
    return local(p, x, seg, seq_axes=None)
  batch, seq = _present(mesh, BATCH_AXES), _present(mesh, SEQ_AXES)
  specs = (jax.tree.map(lambda _: P(), p), P(batch, seq, None), P(batch, seq))
  local = functools.partial(local, seq_axes=seq)
  return shard_map_over(local, mesh, specs, P(batch, seq, None))(p, x, seg)


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

  def layer(parts, p, x, *, segment_ids=None, chunk_size=None):
    return chunked_layer(
      parts,
      p,
      x,
      segment_ids=segment_ids,
      chunk_size=chunk_size,
      mesh=mesh,
      table=table,
      dr_chunk=dr_chunk,
    )

  dr_chunk = chunk_size
  return LinearFns(short_conv=short_conv, delta_rule=delta_rule, layer=layer)


# ----------------------------------------------------------------------------
# Sizing
# ----------------------------------------------------------------------------
def prefix_permutes(table: np.ndarray) -> list[tuple[int, int]]:
  """`[(offset, ppermutes)]`: the shifts the state prefix runs over a piece table
  (`piece_table`), in order: the boundary ids' shift (offset 1), one per
  Hillis-Steele round (offsets 1, 2, 4, ... below the piece count), and the final
  shift of the composed states (offset 1); each shift is one ppermute per
  (source slot, destination slot) pair some piece uses (none on one device)."""
  if table.shape[0] == 1:
    return []
  shifts = [1] + _prefix_offsets(table.size) + [1]
  return [(o, len(_shift_moves(table, o))) for o in shifts]


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
  ring: int | None = None,
) -> dict:
  """Bytes each device sends per linear layer in the forward pass (the backward
  sends the same again: a ppermute's transpose is the reverse ppermute, an
  all-gather's a reduce-scatter of the same size). batch / heads / conv_channels:
  per device (after data, fsdp and tensor sharding); ways: sequence shards
  (context x context_ulysses); ring: the zigzag ring size (`context`; default
  ways).

  Returns {summary_bytes (one piece's summary `[C | A]`, float32), prefix_bytes
  (the state prefix's ppermutes, each counted at its operand's size as the
  compiled program holds it: the boundary ids, log2(pieces) rounds of summaries,
  the composed states), halo_bytes (the conv tails' all-gather, float32: (ways -
  1) x one device's tails), total}."""
  table = piece_table(
    {"context": ring or ways, "context_ulysses": ways // (ring or ways)}, load_balance
  )
  n_p = table.shape[1]
  summary = batch * heads * key_dim * (key_dim + value_dim) * 4
  steps = prefix_permutes(table)
  prefix = 0
  if steps and heads:
    ids, state = batch * 4, batch * heads * key_dim * value_dim * 4
    prefix = steps[0][1] * ids + sum(c for _, c in steps[1:-1]) * summary
    prefix += steps[-1][1] * state
  tails = n_p * batch * (conv_width - 1) * (conv_channels + 1) * 4
  halo = (ways - 1) * tails if conv_channels else 0
  return {
    "summary_bytes": summary,
    "prefix_bytes": prefix,
    "halo_bytes": halo,
    "total": prefix + halo,
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

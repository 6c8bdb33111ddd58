"""The gated delta rule (Gated DeltaNet, Kimi Delta Attention): chunked form and reference.

Per head, with state S `[H, V]` (key dim x value dim) and D_t the decay:
    S_t = (I - beta_t k_t k_t^T) D_t S_{t-1} + beta_t k_t v_t^T,    o_t = S_t^T q_t,
D_t = exp(g_t) (g `[B, T, N]`: GDN, one log decay per head and token) or
diag(exp(g_t)) (g `[B, T, N, H]`: KDA, one per key channel). This is transformers'
`torch_chunk_gated_delta_rule` / `chunk_kimi_delta_attention` math, less their
L2 norm and q scaling (the caller does both). q and k may have fewer heads Q than
v, g and beta (N, a multiple of Q): value head j reads q/k head j // (N / Q)
(transformers' repeat_interleave), repeated here one chunk at a time, so no
`[T, N, H]` copy of q or k is ever formed.

Packing: segment_ids `[B, T]` (0 = padding). The state is reset to zero before
every token whose segment id differs from the previous token's (a reset), so a
token only sees tokens of its own run; outputs at padding are 0. `initial_state`
is the state before token 0 and is applied as given (no reset at token 0).

The chunked form (`delta_rule`): chunks of C tokens; inside a chunk the UT
transform turns the C rank-one updates into one unit-lower-triangular solve,
    (I + L) U = beta V - beta (Gamma K) S0,  L[i, j] = beta_i k_i^T Gamma_i Gamma_j^-1 k_j (j < i),
with Gamma_t the decay from the chunk start to t, and a `lax.scan` carries the state
across chunks. All decay exponents are differences G_i - G_j with j <= i (never
positive), resets enter as masks (tokens i, j interact iff no reset lies in (j, i]),
and the state and gate products are float32 inside a chunk; what crosses chunks
per token (the inputs, the stacked output and their cotangents) keeps the inputs'
dtype (v's for the output). The scan body is rematerialised
(`jax.checkpoint`), and from `TWO_LEVEL_MIN_CHUNKS` chunks on the scan runs in two
levels (groups of about sqrt(T/C) chunks, each group rematerialised: `scan_group`),
so the backward pass keeps about 2 sqrt(T/C) states rather than T/C, for one
more forward of the scan:
work is linear in T, memory linear in T for the inputs and their cotangents.

Shapes (docs/contracts.md legend): B batch, T length, Q q/k heads, N value heads
(N % Q == 0), H key dim, V value dim, C chunk tokens.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from lctx.kernels.shard_typing import varying_like

_HI = jax.lax.Precision.HIGHEST


def _check(q, k, v, g, beta, segment_ids, initial_state):
  b, t, nq, h = q.shape
  if k.shape != q.shape:
    raise ValueError(f"delta_rule: k {k.shape} must have q's shape {q.shape}")
  if v.ndim != 4 or v.shape[:2] != (b, t) or v.shape[2] % nq:
    raise ValueError(
      f"delta_rule: v {v.shape} must be [B, T, N, V] with B, T = {b, t} and N a multiple "
      f"of q's {nq} heads"
    )
  n = v.shape[2]
  if g.shape not in ((b, t, n), (b, t, n, h)):
    raise ValueError(f"delta_rule: g {g.shape} must be [B, T, N] or [B, T, N, H] = {(b, t, n, h)}")
  if beta.shape != (b, t, n):
    raise ValueError(f"delta_rule: beta {beta.shape} must be [B, T, N] = {(b, t, n)}")
  if segment_ids is not None and segment_ids.shape != (b, t):
    raise ValueError(f"delta_rule: segment_ids {segment_ids.shape} must be [B, T] = {(b, t)}")
  if initial_state is not None and initial_state.shape != (b, n, h, v.shape[3]):
    raise ValueError(
      f"delta_rule: initial_state {initial_state.shape} must be [B, N, H, V] = "
      f"{(b, n, h, v.shape[3])}"
    )


def resets(segment_ids, length: int, batch: int):
  """`[B, T]` bool: token t starts a new run (its id differs from token t-1's);
  never at t = 0 (the initial state is applied as given)."""
  if segment_ids is None:
    return jnp.zeros((batch, length), bool)
  s = jnp.asarray(segment_ids)
  return jnp.concatenate([jnp.zeros((batch, 1), bool), s[:, 1:] != s[:, :-1]], axis=1)


def _pad_time(x, pad, value=0):
  if not pad:
    return x
  widths = [(0, 0)] * x.ndim
  widths[1] = (0, pad)
  return jnp.pad(x, widths, constant_values=value)


def _to_chunks(x, c):
  """[B, T, ...] -> [T/C, B, C, ...] (scan axis first)."""
  b, t = x.shape[:2]
  return jnp.moveaxis(x.reshape(b, t // c, c, *x.shape[2:]), 1, 0)


# Blocks up to this size are inverted by matmul squarings; larger ones by halves.
_SOLVE_BLOCK = 16


def _unit_lower_solve(lower, rhs):
  """Solves (I + lower) X = rhs for strictly lower-triangular `lower` `[..., C, C]`
  with matmuls only. XLA's CPU triangular solve runs on the intra-op thread pool,
  which fake devices blocked at a collective can starve; matmuls are also what
  TPUs run fast. Up to `_SOLVE_BLOCK` rows: (I + L)^-1 = (I - L)(I + L^2)(I + L^4)...
  (L is nilpotent, L^C = 0), ceil(log2 C) squarings applied to rhs; above, rhs
  times the inverse built by halves (`_unit_lower_inverse`): squarings of the
  whole C x C matrix would cost C^3 log C a chunk, the halves about C^3."""
  if lower.shape[-1] > _SOLVE_BLOCK:
    return jnp.matmul(_unit_lower_inverse(lower), rhs, precision=_HI)
  x = rhs - jnp.matmul(lower, rhs, precision=_HI)
  power = lower
  c, span = lower.shape[-1], 2
  while span < c:
    power = jnp.matmul(power, power, precision=_HI)  # L^span
    x = x + jnp.matmul(power, x, precision=_HI)
    span *= 2
  return x


def _unit_lower_inverse(lower):
  """(I + lower)^-1 `[..., C, C]` for strictly lower-triangular `lower`, by halves:
      [[I + A, 0], [B, I + D]]^-1 = [[A', 0], [-D' B A', D']],
  A' = (I + A)^-1, D' = (I + D)^-1 (both halves in one call when they have the
  same size); blocks up to `_SOLVE_BLOCK` rows by the squarings.
  lctx.models.config.unit_lower_solve_flops counts its matmuls."""
  c = lower.shape[-1]
  if c <= _SOLVE_BLOCK:  # the squarings on I: (I - L)(I + L^2)...
    x = jnp.eye(c, dtype=lower.dtype) - lower
    power, span = lower, 2
    while span < c:
      power = jnp.matmul(power, power, precision=_HI)
      x = x + jnp.matmul(power, x, precision=_HI)
      span *= 2
    return x
  h = c // 2
  a, d, b = lower[..., :h, :h], lower[..., h:, h:], lower[..., h:, :h]
  if 2 * h == c:
    both = _unit_lower_inverse(jnp.stack([a, d], axis=-3))  # [..., 2, H, H]
    a_inv, d_inv = both[..., 0, :, :], both[..., 1, :, :]
  else:
    a_inv, d_inv = _unit_lower_inverse(a), _unit_lower_inverse(d)
  b_inv = -jnp.matmul(d_inv, jnp.matmul(b, a_inv, precision=_HI), precision=_HI)
  top = jnp.concatenate([a_inv, jnp.zeros(b.shape[:-2] + (h, c - h), lower.dtype)], axis=-1)
  return jnp.concatenate([top, jnp.concatenate([b_inv, d_inv], axis=-1)], axis=-2)


def _cumsum_restarting(g, reset):
  """Cumulative sum of g along axis 1 that restarts at every reset token.

  Decays only ever enter as differences within one run, so a plain cumsum gives
  the same values up to rounding; restarting makes them independent of the
  other documents' decays to the bit (a segmented scan discards, not subtracts,
  what came before), which is the packing guarantee.
  """
  r = reset.reshape(reset.shape + (1,) * (g.ndim - 2))
  r = jnp.broadcast_to(r, g.shape)

  def combine(a, b):
    (sa, ra), (sb, rb) = a, b
    return jnp.where(rb, sb, sa + sb), ra | rb

  return jax.lax.associative_scan(combine, (g, r), axis=1)[0]


def _chunk_step(state, xs, *, per_channel: bool, want_out: bool):
  """One chunk: state `[B, N, H, V]` in, (state out, o `[B, C, N, V]` or None).

  xs: q, k `[B, C, Q, H]`, v `[B, C, N, V]`, g `[B, C, N]` or `[B, C, N, H]`,
  beta `[B, C, N]`, reset `[B, C]` bool. o comes out in v's dtype.
  """
  q, k, v, g, beta, reset = xs
  f32, out_dtype = jnp.float32, v.dtype
  q, k, v, g, beta = (x.astype(f32) for x in (q, k, v, g, beta))
  if q.shape[2] != v.shape[2]:  # value head j reads q/k head j // G
    q, k = (jnp.repeat(x, v.shape[2] // q.shape[2], axis=2) for x in (q, k))
  c = q.shape[1]
  # run[b, i]: resets seen in the chunk up to token i; i and j interact iff equal.
  run = jnp.cumsum(reset.astype(jnp.int32), axis=1)  # [B, C]
  same = run[:, :, None] == run[:, None, :]  # [B, C, C]
  idx = jnp.arange(c)
  strict = (idx[:, None] > idx[None, :]) & same  # j < i, same run
  incl = (idx[:, None] >= idx[None, :]) & same
  first = (run == 0)[:, :, None, None]  # [B, C, 1, 1]: the incoming state reaches i
  to_end = (run == run[:, -1:])[:, :, None, None]  # token j reaches the chunk end
  keep = (run[:, -1] == 0)[:, None, None, None]  # the incoming state reaches the end

  gcum = _cumsum_restarting(g, reset)  # [B, C, N] or [B, C, N, H]
  glast = gcum[:, -1:]
  # Decay from token j to the chunk end, for the last run's tokens only: across a
  # restart the difference has no meaning and could overflow exp.
  ends = (run == run[:, -1:]).reshape(run.shape + (1,) * (gcum.ndim - 2))
  tail = jnp.where(ends, glast - gcum, 0.0)
  if per_channel:
    gam, gam_end = jnp.exp(gcum), jnp.exp(tail)  # [B, C, N, H]
    diff = gcum[:, :, None] - gcum[:, None, :]  # [B, C(i), C(j), N, H]

    def pair(mask, a, b_):  # sum_h a_i b_j exp(G_i - G_j) over masked pairs
      m = mask[..., None, None]
      dec = jnp.where(m, jnp.exp(jnp.where(m, diff, 0.0)), 0.0)
      return jnp.einsum("bind,bjnd,bijnd->bnij", a, b_, dec, precision=_HI)

    s_end = jnp.exp(glast[:, 0])[..., None]  # [B, N, H, 1]
  else:
    gam, gam_end = jnp.exp(gcum)[..., None], jnp.exp(tail)[..., None]  # [B, C, N, 1]
    diff = gcum[:, :, None] - gcum[:, None, :]  # [B, C, C, N]

    def pair(mask, a, b_):
      m = mask[..., None]
      dec = jnp.where(m, jnp.exp(jnp.where(m, diff, 0.0)), 0.0)
      return jnp.einsum("bind,bjnd->bnij", a, b_, precision=_HI) * jnp.moveaxis(dec, 3, 1)

    s_end = jnp.exp(glast[:, 0])[..., None, None]  # [B, N, 1, 1]

  bet = beta[..., None]  # [B, C, N, 1]
  lower = pair(strict, bet * k, k)  # [B, N, C, C], strictly lower
  rhs_v = jnp.moveaxis(bet * v, 2, 1)  # [B, N, C, V]
  rhs_k = jnp.moveaxis(jnp.where(first, bet * k * gam, 0.0), 2, 1)  # [B, N, C, H]
  solved = _unit_lower_solve(lower, jnp.concatenate([rhs_v, rhs_k], axis=-1))
  w_v, w_k = solved[..., : v.shape[-1]], solved[..., v.shape[-1] :]
  if state.shape[-1] > w_v.shape[-1]:  # a wider state: its extra columns read v = 0
    w_v = jnp.pad(w_v, [(0, 0)] * 3 + [(0, state.shape[-1] - w_v.shape[-1])])
  u = w_v - jnp.einsum("bnch,bnhv->bncv", w_k, state, precision=_HI)  # new values [B, N, C, V]

  k_end = jnp.where(to_end, k * gam_end, 0.0)  # [B, C, N, H]
  new_state = jnp.where(keep, s_end * state, 0.0) + jnp.einsum(
    "bcnh,bncv->bnhv", k_end, u, precision=_HI
  )
  if not want_out:
    return new_state, None
  q_in = jnp.where(first, q * gam, 0.0)
  o = jnp.einsum("bcnh,bnhv->bcnv", q_in, state, precision=_HI)
  o = o + jnp.einsum("bnij,bnjv->binv", pair(incl, q, k), u, precision=_HI)
  return new_state, o.astype(out_dtype)


def _scan(q, k, v, g, beta, segment_ids, initial_state, chunk_size, want_out):
  b, t, _, h = q.shape
  n = v.shape[2]
  c = int(chunk_size)
  if c < 1:
    raise ValueError(f"delta_rule: chunk_size must be >= 1; got {chunk_size}")
  reset = resets(segment_ids, t, b)
  pad = (-t) % c
  # Padded tail tokens: k = v = beta = g = 0, no reset: they leave the state as it is.
  q, k, v, g, beta, reset = (_pad_time(x, pad) for x in (q, k, v, g, beta, reset))
  xs = tuple(_to_chunks(x, c) for x in (q, k, v, g, beta, reset))
  if initial_state is None:
    state = varying_like(jnp.zeros((b, n, h, v.shape[3]), jnp.float32), q, k, v, g, beta)
  else:
    state = varying_like(initial_state.astype(jnp.float32), q, k, v, g, beta)
  step = jax.checkpoint(
    functools.partial(_chunk_step, per_channel=g.ndim == 4, want_out=want_out),
    prevent_cse=False,
  )
  chunks = xs[0].shape[0]
  group = scan_group(chunks) if chunks >= TWO_LEVEL_MIN_CHUNKS else 1
  if group > 1:
    # Two levels: the backward keeps one state per group of chunks and, while it
    # runs one group, that group's per-chunk states (its forward run again).
    xs = tuple(x.reshape(chunks // group, group, *x.shape[1:]) for x in xs)
    inner = jax.checkpoint(lambda s, xg: jax.lax.scan(step, s, xg), prevent_cse=False)
    final, o = jax.lax.scan(inner, state, xs)
    if o is not None:
      o = o.reshape(chunks, *o.shape[2:])
  else:
    final, o = jax.lax.scan(step, state, xs)
  if o is not None:
    o = jnp.moveaxis(o, 0, 1).reshape(b, t + pad, n, v.shape[3])[:, :t]
  return o, final


# Fewer chunks scan in one level: two would keep at most 2 states fewer (4 chunks:
# 2 groups + 2 chunks; 6: 3 + 2) for one more forward of the scan.
TWO_LEVEL_MIN_CHUNKS = 8


def scan_group(chunks: int) -> int:
  """Chunks per group of the two-level scan: the largest divisor of `chunks` no
  larger than sqrt(chunks), so the backward keeps about 2 sqrt(chunks) states
  instead of one per chunk; 1 (one level) when there is none above 1."""
  best = 1
  for d in range(2, math.isqrt(chunks) + 1):
    if chunks % d == 0:
      best = d
  return best


def delta_rule(q, k, v, g, beta, *, segment_ids=None, initial_state=None, chunk_size=64):
  """The chunked gated delta rule.

  Args:
    q, k: `[B, T, Q, H]` (already L2-normalised; q already scaled: no scaling here);
      Q divides N (value head j reads q/k head j // (N / Q)).
    v: `[B, T, N, V]`.
    g: `[B, T, N]` (GDN) or `[B, T, N, H]` (KDA): log decays, <= 0.
    beta: `[B, T, N]`.
    segment_ids: `[B, T]` int32, 0 = padding; None: one segment.
    initial_state: `[B, N, H, V]` float32 or None (zeros): the state before token 0.
    chunk_size: tokens per chunk C (any T: padded internally to a multiple).
  Returns:
    o `[B, T, N, V]` in v.dtype (0 at padding), final_state `[B, N, H, V]` float32.
  """
  _check(q, k, v, g, beta, segment_ids, initial_state)
  o, final = _scan(q, k, v, g, beta, segment_ids, initial_state, chunk_size, True)
  if segment_ids is not None:
    o = jnp.where((jnp.asarray(segment_ids) != 0)[:, :, None, None], o, jnp.zeros((), o.dtype))
  return o, final


def delta_rule_final_state(
  q, k, v, g, beta, *, segment_ids=None, initial_state=None, chunk_size=64
):
  """`delta_rule`'s final state alone (the outputs are never formed): `[B, N, H, V]`."""
  _check(q, k, v, g, beta, segment_ids, initial_state)
  return _scan(q, k, v, g, beta, segment_ids, initial_state, chunk_size, False)[1]


def delta_rule_transition(k, g, beta, *, segment_ids=None, chunk_size=64):
  """The matrix A `[B, N, H, H]` float32 with final_state(S0) = A @ S0 + final_state(0).

  A is 0 when a reset lies inside the row. Computed chunk by chunk, as the final
  state of the same recurrence run with v = 0 from S0 = I (no `[T, H, H]` buffer).
  k `[B, T, Q, H]`; N (beta's heads) a multiple of Q.
  """
  b, t, _, h = k.shape
  n = beta.shape[2]
  eye = jnp.broadcast_to(jnp.eye(h, dtype=jnp.float32), (b, n, h, h))
  zeros = jnp.zeros((b, t, n, h), k.dtype)
  return delta_rule_final_state(
    k, k, zeros, g, beta, segment_ids=segment_ids, initial_state=eye, chunk_size=chunk_size
  )


def delta_rule_summary(k, v, g, beta, *, segment_ids=None, chunk_size=64, initial_summary=None):
  """The affine map of a row's incoming state, S0 -> A @ S0 + C, as `[B, N, H, V + H]`
  float32 [C | A]: C = `delta_rule_final_state` from 0, A = `delta_rule_transition`.

  One scan from [0 | I] whose extra H state columns read v = 0: both share the
  in-chunk decays, k k^T and solve, and no widened `[T, N, V + H]` v is formed.
  k `[B, T, Q, H]`, v `[B, T, N, V]`, g, beta as in `delta_rule`.

  initial_summary `[B, N, H, V + H]` (an earlier row's [C0 | A0]; None: [0 | I]):
  the scan starts from it, so the result is this row's map composed after it,
  S0 -> A (A0 S0 + C0) + C (the recurrence is linear in the state; applied as
  given, no reset at token 0).
  """
  _check(k, k, v, g, beta, segment_ids, None)
  b, t, _, h = k.shape
  n, v_dim = v.shape[2], v.shape[3]
  if initial_summary is None:
    start = jnp.concatenate(
      [
        jnp.zeros((b, n, h, v_dim), jnp.float32),
        jnp.broadcast_to(jnp.eye(h, dtype=jnp.float32), (b, n, h, h)),
      ],
      axis=-1,
    )
  elif initial_summary.shape != (b, n, h, v_dim + h):
    raise ValueError(
      f"delta_rule_summary: initial_summary {initial_summary.shape} must be "
      f"[B, N, H, V + H] = {(b, n, h, v_dim + h)}"
    )
  else:
    start = initial_summary
  return _scan(k, k, v, g, beta, segment_ids, start, chunk_size, False)[1]


def delta_rule_reference(q, k, v, g, beta, *, segment_ids=None, initial_state=None, chunk_size=64):
  """Token-by-token recurrence (the plain reference), same signature as `delta_rule`
  (chunk_size is ignored). Computes in the inputs' promoted float dtype (float64
  under `jax.enable_x64` with float64 inputs); o in v.dtype, final state likewise."""
  del chunk_size
  _check(q, k, v, g, beta, segment_ids, initial_state)
  b, t, nq, h = q.shape
  n = v.shape[2]
  if n != nq:  # value head j reads q/k head j // G
    q, k = (jnp.repeat(x, n // nq, axis=2) for x in (q, k))
  dt = jnp.result_type(q, k, v, g, beta, jnp.float32)
  reset = resets(segment_ids, t, b)
  state = (
    jnp.zeros((b, n, h, v.shape[3]), dt) if initial_state is None else initial_state.astype(dt)
  )

  def step(s, xs):
    q_t, k_t, v_t, g_t, b_t, r_t = xs
    dec = jnp.exp(g_t)[..., None] if g_t.ndim == 3 else jnp.exp(g_t)[..., None, None]
    s = jnp.where(r_t[:, None, None, None], 0.0, s) * dec  # D_t S_{t-1}, reset to 0
    read = jnp.einsum("bnhv,bnh->bnv", s, k_t)
    s = s + jnp.einsum("bnh,bnv->bnhv", k_t, b_t[..., None] * (v_t - read))
    return s, jnp.einsum("bnhv,bnh->bnv", s, q_t)

  xs = tuple(jnp.moveaxis(x.astype(dt) if x.dtype != bool else x, 1, 0) for x in (q, k, v, g, beta))
  final, o = jax.lax.scan(step, state, (*xs, jnp.moveaxis(reset, 1, 0)))
  o = jnp.moveaxis(o, 0, 1)
  if segment_ids is not None:
    o = jnp.where((jnp.asarray(segment_ids) != 0)[:, :, None, None], o, 0.0)
  return o.astype(v.dtype), final

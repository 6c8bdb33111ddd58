"""`flash_attention` and the ring block API: the one place a kernel backend is chosen.

Backends (`BACKENDS`):
- "blockwise": the pure-JAX block-sparse kernel (blockwise.py); any mask, lse.
- "cpu": the fused C++ kernel on the XLA CPU backend (cpu_fused.py, built by
  cpu_build.py): the same masks and lse as blockwise, float32, head dims that are
  multiples of 16.
- "splash": TPU Pallas splash attention (splash.py and its splash_*.py): lse, segment ids, windows,
  GQA/MQA; explicit positions through a token `layout` (the strategies pass
  one); through the Pallas interpreter on CPU.
- "cudnn", "xla": `jax.nn.dot_product_attention` (jax_nn.py).
- "reference": the dense plain-jnp reference (reference.py).
- "auto": by the platform the call compiles for, where the call qualifies:
  splash on 'tpu', cudnn on 'gpu', cpu on 'cpu' (the kernel also built here),
  else blockwise; passing over splash on 'tpu' logs its reason once.

The settings travel as one `AttentionOptions` (options.py), which validates
them: every backend and the block API take it (`options=`) and nothing else;
`flash_attention`, the public edge, also takes its fields as keywords.

`platform` is the platform of the devices the computation runs on ('tpu',
'gpu', 'cpu'). Callers that know their mesh pass it (a TPU compile started from
a CPU host must pick TPU kernels); None means `jax.default_backend()`.

An explicitly requested fast backend that cannot take the call raises a
ValueError naming the rule, never falls back silently. Everything imports on CPU:
Pallas/TPU modules are imported only when splash runs.

The ring block API (`attention_block_forward` / `attention_block_backward`: one
visiting K/V block, normalised out + lse, and the FA2 backward against the global
out/lse) goes through the same choice (splash, cpu and blockwise have block forms);
backends without one ("reference", "xla", "cudnn") run their blocks on blockwise.
"""

from __future__ import annotations

import dataclasses
import logging

import jax

from lctx.kernels import cpu_fused, flop_tags, jax_nn, splash
from lctx.kernels.blockwise import (
  blockwise_attention,
  blockwise_block_backward,
  blockwise_block_forward,
)
from lctx.kernels.masking import check_shapes
from lctx.kernels.options import BACKENDS, PLATFORMS, AttentionOptions, options_from  # noqa: F401
from lctx.kernels.reference import reference_attention
from lctx.kernels.remat_tags import tag_output

_FALLBACKS_LOGGED: set[tuple[str, str]] = set()


def _log_fallback(kernel: str, why: str) -> None:
  """'auto' passed over a kernel: say why, once per distinct reason (not per call)."""
  if (kernel, why) not in _FALLBACKS_LOGGED:
    _FALLBACKS_LOGGED.add((kernel, why))
    logging.getLogger(__name__).warning("attention 'auto': not %s (%s); blockwise", kernel, why)


def _platform(platform: str | None) -> str:
  """The platform a call compiles for (None: the default backend)."""
  return jax.default_backend() if platform is None else platform


def choose_backend(
  q,
  k,
  v,
  *,
  backend: str = "auto",
  platform: str | None = None,
  segment_ids=None,
  positions_given: bool = False,
  window_size=None,
  return_lse: bool = False,
  layout=None,
) -> str:
  """The backend a call runs on: `backend` itself unless it is "auto"."""
  AttentionOptions(backend=backend, platform=platform)  # validates both
  if backend != "auto":
    return backend
  p = _platform(platform)
  if p == "tpu":
    why = splash.unsupported(q, k, v, positions_given=positions_given, layout=layout)
    if not why:
      return "splash"
    _log_fallback("splash", why)
  if p == "gpu" and not jax_nn.cudnn_unsupported(
    q, k, v, segment_ids, positions_given, window_size, return_lse
  ):
    return "cudnn"
  if p == "cpu" and cpu_fused.auto_applies(q, k, v, p):
    return "cpu"
  return "blockwise"


@flop_tags.in_attention_scope
def flash_attention(
  q,
  k,
  v,
  *,
  segment_ids=None,
  q_positions=None,
  kv_positions=None,
  causal=True,
  window_size=None,
  softmax_scale=None,
  return_lse=False,
  block_q=512,
  block_kv=512,
  backend="auto",
  positions_in_order=False,
  block_q_bwd=None,
  block_kv_bwd=None,
  platform=None,
  layout=None,
  options: AttentionOptions | None = None,
):
  """Attention without the score matrix, skipping fully masked blocks.

  Args/returns as `lctx.kernels.reference_attention`: q `[B, T, N, H]`, k
  `[B, S, K, H]`, v `[B, S, K, V]`; segment_ids `[B, T]` or `(q_ids, kv_ids)`,
  0 = padding; causality and window on positions (default arange). Returns out
  `[B, T, N, V]` (and lse `[B, N, T]` f32 if return_lse). Differentiable in
  q, k, v (and through lse on the blockwise, cpu and splash backends).
  options: the settings as one `AttentionOptions` (options.py); or the keywords
    causal, window_size, softmax_scale, block_q, block_kv, block_q_bwd,
    block_kv_bwd, backend and platform, which mean the same fields (not both).
  positions_in_order: the caller promises that positions count up by one along
    the array inside every segment, starting equal for q and kv (plain or packed
    rows, not zigzag-reordered, not a visiting ring block). Then the array-order
    masks of splash/cudnn are exact and those backends may be used although
    positions were passed. Ignored by blockwise/reference/xla.
  layout: `lctx.kernels.token_order.Layout` (splash only): which natural token
    indices the q and kv rows hold, so splash can take explicit positions (see
    token_order.py for what it promises about them). The strategies pass it.
  """
  opts = options_from(
    options,
    causal=causal,
    window_size=window_size,
    softmax_scale=softmax_scale,
    block_q=block_q,
    block_kv=block_kv,
    backend=backend,
    block_q_bwd=block_q_bwd,
    block_kv_bwd=block_kv_bwd,
    platform=platform,
  )
  check_shapes(q, k, v)
  inputs = dict(segment_ids=segment_ids, q_positions=q_positions, kv_positions=kv_positions)
  positions_given = not positions_in_order and (q_positions is not None or kv_positions is not None)
  kernel = choose_backend(
    q,
    k,
    v,
    backend=opts.backend,
    platform=opts.platform,
    segment_ids=segment_ids,
    positions_given=positions_given,
    window_size=opts.window_size,
    return_lse=return_lse,
    layout=layout,
  )
  if kernel == "blockwise":
    return blockwise_attention(q, k, v, return_lse=return_lse, options=opts, **inputs)
  if kernel == "cpu":
    return cpu_fused.attend(q, k, v, return_lse=return_lse, options=opts, **inputs)
  # Backends without a custom VJP of their own: the output tagged here (remat_tags.py).
  if kernel == "reference":
    mask = dict(causal=opts.causal, window_size=opts.window_size, softmax_scale=opts.softmax_scale)
    return tag_output(reference_attention(q, k, v, return_lse=return_lse, **mask, **inputs))
  if kernel == "xla":
    if return_lse:
      raise ValueError("backend='xla' cannot return lse; use 'blockwise' or 'reference'")
    return tag_output(jax_nn.xla_attention(q, k, v, options=opts, **inputs))
  if kernel == "splash":  # raises ValueError naming why if the call cannot take it
    return splash.splash_attention(
      q,
      k,
      v,
      segment_ids=segment_ids,
      return_lse=return_lse,
      layout=layout,
      positions_given=positions_given,
      interpret=_platform(opts.platform) != "tpu",
      options=opts,
    )
  why = jax_nn.cudnn_unsupported(
    q, k, v, segment_ids, positions_given, opts.window_size, return_lse
  )
  if why:
    raise ValueError(f"backend='cudnn': {why}")
  return tag_output(jax_nn.cudnn_attention(q, k, v, options=opts))


def _block_backend(q, k, v, backend: str, platform: str | None, layout, positions_given) -> str:
  """The kernel of one ring block step: splash or the fused CPU kernel where
  flash_attention would take them, else blockwise (backend and platform are
  validated AttentionOptions fields)."""
  if backend == "splash":
    return "splash"  # the splash block functions raise if they cannot take the call
  p = _platform(platform)
  if backend == "cpu" or (backend == "auto" and cpu_fused.auto_applies(q, k, v, p)):
    return "cpu"
  if backend == "auto" and p == "tpu":
    why = splash.unsupported(q, k, v, positions_given=positions_given, layout=layout)
    if not why:
      return "splash"
    _log_fallback("splash", why)
  return "blockwise"


def _block_options(options: AttentionOptions) -> AttentionOptions:
  """The options of one block-API call: its backward uses the forward's blocks."""
  if not isinstance(options, AttentionOptions):
    raise TypeError(f"options must be an AttentionOptions; got {type(options).__name__}")
  return dataclasses.replace(options, block_q_bwd=None, block_kv_bwd=None)


@flop_tags.in_attention_scope
def attention_block_forward(
  q,
  k,
  v,
  *,
  q_segment_ids,
  kv_segment_ids,
  q_positions,
  kv_positions,
  options: AttentionOptions,
  layout=None,
):
  """Attention of q against one (e.g. visiting ring) K/V block, for merging.

  q `[B, T, N, H]`, k `[B, S, K, H]`, v `[B, S, K, V]`; segment ids may both be None.
  Returns out `[B, T, N, V]` float32, normalised within this block, and lse
  `[B, N, T]` float32 (MASKED_LSE where a row sees no key of this block; its out
  is 0). Merge two partials with lse = logaddexp(lse_a, lse_b),
  out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse). Not differentiable
  by itself: use attention_block_backward in the caller's custom_vjp.
  options (mask, blocks, backend, platform) and layout: as flash_attention's.
  """
  opts = _block_options(options)
  segments = dict(q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids)
  positions_given = q_positions is not None or kv_positions is not None
  kernel = _block_backend(q, k, v, opts.backend, opts.platform, layout, positions_given)
  if kernel == "splash":
    return splash.splash_block_forward(
      q,
      k,
      v,
      **segments,
      options=opts,
      layout=layout,
      positions_given=positions_given,
      interpret=_platform(opts.platform) != "tpu",
    )
  fn = cpu_fused.cpu_block_forward if kernel == "cpu" else blockwise_block_forward
  return fn(q, k, v, **segments, q_positions=q_positions, kv_positions=kv_positions, options=opts)


@flop_tags.in_attention_scope
def attention_block_backward(
  q,
  k,
  v,
  out,
  lse,
  dout,
  *,
  q_segment_ids,
  kv_segment_ids,
  q_positions,
  kv_positions,
  options: AttentionOptions,
  layout=None,
):
  """FA2 backward of one K/V block against the GLOBAL (merged) out and lse.

  out `[B, T, N, V]` and lse `[B, N, T]` are the final merged results over all
  K/V blocks, dout `[B, T, N, V]` its cotangent. Returns (dq `[B, T, N, H]`,
  dk `[B, S, K, H]`, dv `[B, S, K, V]`), float32, this block's contributions
  (sum dq over blocks; dk/dv belong to this block).
  """
  opts = _block_options(options)
  segments = dict(q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids)
  positions_given = q_positions is not None or kv_positions is not None
  kernel = _block_backend(q, k, v, opts.backend, opts.platform, layout, positions_given)
  if kernel == "splash":
    return splash.splash_block_backward(
      q,
      k,
      v,
      out,
      lse,
      dout,
      **segments,
      options=opts,
      layout=layout,
      positions_given=positions_given,
      interpret=_platform(opts.platform) != "tpu",
    )
  fn = cpu_fused.cpu_block_backward if kernel == "cpu" else blockwise_block_backward
  return fn(
    q,
    k,
    v,
    out,
    lse,
    dout,
    **segments,
    q_positions=q_positions,
    kv_positions=kv_positions,
    options=opts,
  )

"""`AttentionOptions`: the one object that carries attention settings to every kernel.

Gin binds it as `TrainConfig.attention_options = @AttentionOptions()`; the
context plan adds the mesh's platform; the strategies (lctx/parallel) hand it to
the block API (`attention_block_forward` / `_backward`) and to
`flash_attention`, which hands it to the backend it picks. Every kernel takes
this object only; `flash_attention` (the public edge) also takes its fields as
keywords (`options_from`). Frozen and made of
plain scalars, so it is hashable: a static jit / custom_vjp argument and a key
of the strategies' compile cache.

Its validation is here and nowhere else: an invalid value raises a ValueError
naming the field when the object is made.
"""

from __future__ import annotations

import dataclasses

BACKENDS = ("auto", "blockwise", "cpu", "reference", "splash", "cudnn", "xla")
PLATFORMS = ("cpu", "gpu", "tpu")
_BLOCKS = ("block_q", "block_kv", "block_q_bwd", "block_kv_bwd")


@dataclasses.dataclass(frozen=True)
class AttentionOptions:
  """Static attention settings.

  Mask (the model sets these per call; see `with_mask`):
    causal: keys at positions <= the query's only.
    window_size: None, or w >= 1: keys within w positions of the query.
    softmax_scale: None: head_dim ** -0.5.
  Kernel (lctx.kernels.flash_attention):
    backend: one of BACKENDS ('auto': by platform and call, flash.choose_backend).
    block_q, block_kv: kernel blocks (blockwise, cpu, splash).
    block_q_bwd, block_kv_bwd: the backward pass's blocks (None: the forward's);
      the block API's backward uses block_q / block_kv.
    platform: 'cpu' | 'gpu' | 'tpu' the call compiles for (None: the default
      backend); decides what 'auto' picks.
    fused_bwd: splash's backward as the library's one fused dq+dkv kernel (QK^T
      and P computed once per block pair: 5 matmuls) instead of its dkv and dq
      kernels (7). The fused kernel writes dq partials [kv blocks, *q.shape]
      in q's dtype and sums them after, so each fused call is cut into
      (q piece, kv piece) calls whose partials stay within dq_partial_bytes
      (splash_tiling.bwd_tiles). Valid for every mask, layout and strategy
      splash takes; False keeps the two-pass form (no partials). The
      blockwise and CPU kernels are single-pass already and ignore it.
    dq_partial_bytes: the most bytes of dq partials one fused splash backward
      call may write (summed over the batch and heads of the call).
  The context strategies' settings (strategy, load balance, head stages, ring
  pieces, token order) are lctx.parallel.ContextOptions, beside this object.
  """

  causal: bool = True
  window_size: int | None = None
  softmax_scale: float | None = None
  backend: str = "auto"
  block_q: int = 512
  block_kv: int = 512
  block_q_bwd: int | None = None
  block_kv_bwd: int | None = None
  platform: str | None = None
  fused_bwd: bool = True
  dq_partial_bytes: int = 1 << 30

  def __post_init__(self):
    if self.backend not in BACKENDS:
      raise ValueError(f"backend must be one of {BACKENDS}; got {self.backend!r}")
    if self.platform is not None and self.platform not in PLATFORMS:
      raise ValueError(f"platform must be one of {PLATFORMS} or None; got {self.platform!r}")
    for name in _BLOCKS:
      value = getattr(self, name)
      optional = name.endswith("_bwd")
      if (value is None and optional) or (
        isinstance(value, int) and not isinstance(value, bool) and value >= 1
      ):
        continue
      kind = "None or a positive int" if optional else "a positive int"
      raise ValueError(f"{name} must be {kind} (block sizes must be >= 1); got {value!r}")
    if not isinstance(self.dq_partial_bytes, int) or self.dq_partial_bytes < 1:
      raise ValueError(f"dq_partial_bytes must be a positive int; got {self.dq_partial_bytes!r}")
    if self.window_size is not None and int(self.window_size) < 1:
      raise ValueError(f"window_size must be None or >= 1; got {self.window_size}")
    # Normalised so equal settings hash equal (np.int64 windows, 0/1 causal).
    object.__setattr__(self, "causal", bool(self.causal))
    object.__setattr__(self, "fused_bwd", bool(self.fused_bwd))
    if self.window_size is not None:
      object.__setattr__(self, "window_size", int(self.window_size))

  def scale(self, head_dim: int) -> float:
    """The softmax scale for q/k heads of `head_dim`."""
    return head_dim**-0.5 if self.softmax_scale is None else float(self.softmax_scale)

  def with_mask(self, causal, window_size, softmax_scale) -> AttentionOptions:
    """These options with the mask of one call (the model's attention plug-in
    passes causal, window_size and softmax_scale per call)."""
    return dataclasses.replace(
      self, causal=causal, window_size=window_size, softmax_scale=softmax_scale
    )


_DEFAULTS = AttentionOptions()


def options_from(options: AttentionOptions | None, **fields) -> AttentionOptions:
  """`options`, or the options the keyword `fields` spell out (for entry points
  that take both); passing options and a non-default field is an error."""
  if options is None:
    return AttentionOptions(**fields)
  if not isinstance(options, AttentionOptions):
    raise TypeError(f"options must be an AttentionOptions; got {type(options).__name__}")
  given = sorted(k for k, v in fields.items() if v != getattr(_DEFAULTS, k))
  if given:
    raise ValueError(f"pass these settings in options, not also as keywords: {given}")
  return options

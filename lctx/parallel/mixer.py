"""The sequence-mixer plug-in: the one object the model asks how each layer mixes tokens.

A decoder layer mixes tokens along the sequence in one of a few ways (Hugging
Face's `layer_types` names them): `full_attention`, `sliding_attention` (a
window) or `linear_attention` (a recurrent state). How that runs, on one device
or split over the mesh's context axes, is decided here in `lctx.parallel` from
the run's `ContextPlan` (`ContextPlan.mixer`); the model only calls what the
`SequenceMixer` hands it and names no mesh axis.

    mixer = plan.mixer                        # or as_mixer(reference_attention_fn)
    attend = mixer.attention_for("full_attention")
    out = attend(q, k, v, segment_ids=..., positions=..., causal=True,
                 window_size=None, softmax_scale=None)   # docs/contracts.md
    mixer.head_stages                         # UPipe's per-stage heads, or None

`lctx.models.Transformer(config, mixer)` also takes a bare attention function
(such as `lctx.models.reference_attention_fn`); `as_mixer` makes it the mixer
of every attention layer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from lctx.errors import ConfigError

# Hugging Face's names for what a layer does along the sequence (ModelConfig.layer_types).
LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention")

AttentionFn = Callable[..., Any]
# head_stages(num_q_heads, num_kv_heads) -> (q_heads [S, N/S], kv_heads [S, M]):
# the global head indices each UPipe stage projects (lctx.parallel.upipe.head_stages).
HeadStagesFn = Callable[[int, int], tuple[Any, Any]]


@dataclasses.dataclass(frozen=True)
class SequenceMixer:
  """How each kind of layer mixes tokens, for one run.

  Attributes:
    attention: the attention call of full-attention layers (the signature in
      docs/contracts.md, "Attention plug-in").
    sliding_attention: the call of sliding-window layers; None: `attention`
      with the layer's window (every strategy handles windows; a window-aware
      call may skip the work and transfers outside the window).
    head_stages: ulysses / usp with per-stage projections (UPipe): the heads
      each stage projects; the attention layer then projects q/k/v and its
      output one stage at a time and calls `attention` per stage. None: whole.
    linear: the linear-attention layers' ops with their state exchange
      (an object with `short_conv` and `delta_rule`, docs/contracts.md); None:
      the single-device kernels (no context parallelism).
  """

  attention: AttentionFn
  sliding_attention: AttentionFn | None = None
  head_stages: HeadStagesFn | None = None
  linear: Any = None

  def attention_for(self, layer_type: str) -> AttentionFn:
    """The attention call of a `full_attention` or `sliding_attention` layer."""
    if layer_type == "full_attention":
      return self.attention
    if layer_type == "sliding_attention":
      return self.sliding_attention or self.attention
    raise ConfigError(
      f"[layer-type] {layer_type!r} has no attention call; attention layer types are "
      "'full_attention' and 'sliding_attention'"
    )


def as_mixer(mixer: SequenceMixer | AttentionFn) -> SequenceMixer:
  """A SequenceMixer as it is; a bare attention function as the mixer of every
  attention layer (single-device linear layers)."""
  if isinstance(mixer, SequenceMixer):
    return mixer
  if not callable(mixer):
    raise TypeError(
      f"the model's mixer must be a SequenceMixer or an attention function; got {mixer!r}"
    )
  return SequenceMixer(attention=mixer)

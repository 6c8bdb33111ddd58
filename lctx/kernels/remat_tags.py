"""The names under which attention kernels expose their custom-VJP residuals.

A remat policy (lctx/models/transformer.py `checkpoint_policies`) keeps, offloads
or recomputes values by `jax.ad_checkpoint.checkpoint_name`. The model tags the
attention output it sees ('attention_out'), but a kernel's backward needs its own
residuals: the output and the logsumexp. Untagged, a rematerialised layer
re-runs the whole attention forward in the backward to get them, even when the
policy keeps the model's output. So each kernel's forward rule (splash,
blockwise, the CPU kernel, the ring's) returns its output and lse through
`tag_residuals`, and uses those same values as its residuals: a policy that keeps
both tags keeps what the backward needs, and the forward is not re-run.

The output carries the model's tag 'attention_out'. Plug-ins whose calls all go
through these kernels (lctx.parallel's) say so with the attribute
`TAGS_ATTRIBUTE`; the model then does not tag the output again (two saved
copies otherwise): the model's output is the kernel's, or a re-layout of it (a
transpose, a sharding constraint, ulysses' all-to-all) recomputed from it.
Backends without a custom VJP of their own (reference, xla, cudnn) have their
output tagged by `flash_attention`.
"""

from __future__ import annotations

from jax.ad_checkpoint import checkpoint_name

OUT_TAG = "attention_out"  # [B, T, N, V] (splash: head-major [B, N, T, V])
LSE_TAG = "attention_lse"  # [B, N, T] float32
# A plug-in attribute: True when its output is tagged inside (see the module doc).
TAGS_ATTRIBUTE = "tags_attention_residuals"


def tag_residuals(out, lse):
  """(out, lse) named for the remat policies (see the module doc)."""
  return checkpoint_name(out, OUT_TAG), checkpoint_name(lse, LSE_TAG)


def tag_output(out):
  """The output of a backend without its own custom VJP, tagged (out or (out, lse))."""
  if isinstance(out, tuple):
    return tag_residuals(*out)
  return checkpoint_name(out, OUT_TAG)

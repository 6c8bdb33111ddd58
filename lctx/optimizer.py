"""The optimizer and learning-rate schedule a TrainConfig describes."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import optax

if TYPE_CHECKING:
  from lctx.train_config import TrainConfig


def make_optimizer(cfg: TrainConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """AdamW with linear warm-up, cosine decay and global-norm clipping."""
  schedule = optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=cfg.learning_rate,
    warmup_steps=max(cfg.warmup_steps, 1),
    decay_steps=max(cfg.steps, cfg.warmup_steps + 1),
    end_value=cfg.learning_rate * cfg.end_lr_ratio,
  )

  def decay_mask(params):
    # Norm scales and biases are not decayed; stacked (scanned) norm scales
    # are 2-D, so decide by name rather than by rank.
    def keep(path, _):
      names = [str(getattr(p, "key", p)) for p in path]
      return not any(n in ("scale", "bias") for n in names)

    return jax.tree_util.tree_map_with_path(keep, params)

  parts = []
  if cfg.grad_clip > 0:
    parts.append(optax.clip_by_global_norm(cfg.grad_clip))
  parts.append(
    optax.adamw(
      schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=decay_mask
    )
  )
  return optax.chain(*parts), schedule

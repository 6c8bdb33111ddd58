"""ModelConfig.layer_types: Hugging Face's per-layer names, one mechanism with attention_pattern."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lctx.models import ModelConfig, Transformer

SMALL = dict(vocab_size=32, d_model=16, num_heads=2, num_kv_heads=2, head_dim=8, mlp_dim=32)


def test_layer_types_are_attention_pattern():
  """Sliding/full layer types build the model attention_pattern builds: same
  block, same params, same logits."""
  types = ModelConfig(
    num_layers=4, layer_types=("sliding_attention", "full_attention") * 2, sliding_window=3, **SMALL
  )
  pattern = ModelConfig(num_layers=4, attention_pattern=(3, None), **SMALL)
  assert types.attention_pattern == (3, None) and types.num_repeats == 2
  assert types.block_layer_types == ("sliding_attention", "full_attention")
  assert [types.layer_type_of(i) for i in range(4)] == list(types.layer_types)
  ids = jax.random.randint(jax.random.key(1), (1, 12), 0, 32)
  pos = jnp.arange(12)[None]
  seg = jnp.ones_like(ids)
  params = Transformer(pattern).init(jax.random.key(0), ids, pos, seg)
  np.testing.assert_array_equal(
    Transformer(types).apply(params, ids, pos, seg),
    Transformer(pattern).apply(params, ids, pos, seg),
  )
  # The window matters: the same params with global layers give other logits.
  glob = ModelConfig(num_layers=4, attention_pattern=(None, None), **SMALL)
  assert not np.allclose(
    Transformer(glob).apply(params, ids, pos, seg), Transformer(types).apply(params, ids, pos, seg)
  )


def test_layer_types_period():
  """The scanned block is the shortest period that divides the layers (or all of them)."""
  c = ModelConfig(
    num_layers=6,
    layer_types=("sliding_attention",) * 2 + ("full_attention",) * 4,
    sliding_window=2,
    **SMALL,
  )
  assert c.attention_pattern == (2, 2, None, None, None, None) and c.num_repeats == 1
  c = ModelConfig(
    num_layers=8,
    layer_types=("sliding_attention",) * 3
    + ("full_attention",) * 1
    + ("sliding_attention",) * 3
    + ("full_attention",),
    sliding_window=5,
    **SMALL,
  )
  assert c.attention_pattern == (5, 5, 5, None) and c.num_repeats == 2


@pytest.mark.parametrize(
  "kwargs,match",
  [
    (dict(num_layers=4, layer_types=("full_attention",) * 3), "one per layer"),
    (dict(num_layers=2, layer_types=("sliding_attention",) * 2), "set sliding_window"),
    (dict(num_layers=2, layer_types=("global",) * 2), "layer_types entries must be in"),
    (
      dict(num_layers=2, layer_types=("full_attention",) * 2, attention_pattern=(4,)),
      "not both",
    ),
  ],
)
def test_layer_types_refused(kwargs, match):
  with pytest.raises(ValueError, match=match):
    ModelConfig(**kwargs, **SMALL)


def test_a_checkpoint_takes_sliding_layers_but_not_linear_ones():
  """Sliding vs full layers share parameters (context extension may add windows
  to a Llama checkpoint); a linear layer has other parameters, so it is refused."""
  from lctx.models.hf_config import check_shape_fields

  llama = ModelConfig(num_layers=4, **SMALL)
  windows = ModelConfig(
    num_layers=4, layer_types=("sliding_attention", "full_attention") * 2, sliding_window=3, **SMALL
  )
  check_shape_fields(llama, windows, "ckpt")
  hybrid = ModelConfig(
    num_layers=4,
    layer_types=("linear_attention", "full_attention") * 2,
    linear_num_key_heads=2,
    linear_num_value_heads=2,
    **SMALL,
  )
  with pytest.raises(ValueError, match="layer_types"):
    check_shape_fields(llama, hybrid, "ckpt")

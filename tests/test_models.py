"""lctx.models against the plain reference forward, packing, patterns, scan, remat."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from lctx.models import (
    ModelConfig,
    Transformer,
    reference_attention_fn,
    stack_unscanned_params,
    tiny,
    unembed_matrix,
)
from lctx.models.reference import reference_forward

B, T = 2, 12

MLA = dict(attention="mla", num_heads=4, kv_lora_rank=16, qk_nope_head_dim=8,
           qk_rope_head_dim=4, v_head_dim=12)


def _batch(seed=0, vocab=256):
    rng = np.random.default_rng(seed)
    inputs = rng.integers(0, vocab, (B, T)).astype(np.int32)
    # Row 0: two packed documents then padding; row 1: one doc, permuted positions
    # with gaps (what zigzag reordering produces), so order != position.
    seg = np.array([[1] * 5 + [2] * 5 + [0] * 2, [1] * T], np.int32)
    pos0 = np.r_[np.arange(5), np.arange(5), [0, 0]]
    pos1 = rng.permutation(np.arange(0, 2 * T, 2))
    pos = np.stack([pos0, pos1]).astype(np.int32)
    return jnp.asarray(inputs), jnp.asarray(pos), jnp.asarray(seg)


def _init(config, seed=0):
    inputs, pos, seg = _batch()
    model = Transformer(config)
    return model, model.init(jax.random.key(seed), inputs, pos, seg)


@pytest.mark.parametrize("name,overrides", [
    ("mha", dict(num_kv_heads=4)),
    ("gqa", dict(num_kv_heads=2)),
    ("mqa", dict(num_kv_heads=1)),
    ("mla", MLA),
    ("mla_qlora", dict(MLA, q_lora_rank=8)),
    ("tied", dict(tie_embeddings=True)),
])
def test_matches_reference_forward(name, overrides):
    config = tiny(**overrides)
    model, params = _init(config)
    inputs, pos, seg = _batch()
    logits = model.apply(params, inputs, pos, seg)
    assert logits.shape == (B, T, config.vocab_size) and logits.dtype == jnp.float32
    want = reference_forward(params, config, inputs, pos, seg)
    np.testing.assert_allclose(logits, want, rtol=2e-4, atol=2e-4)
    hidden = model.apply(params, inputs, pos, seg, return_hidden=True)
    assert hidden.shape == (B, T, config.d_model)
    np.testing.assert_allclose(hidden @ unembed_matrix(params, config), logits, rtol=1e-5,
                               atol=1e-5)

"""lctx.models.rope: schedules against transformers, exact angles at any int32 position,
and a model whose logits do not move when every position shifts."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lctx.models import ModelConfig, Transformer, rope
from lctx.models.reference import reference_forward

LLAMA31 = {
  "rope_type": "llama3",
  "factor": 8.0,
  "low_freq_factor": 1.0,
  "high_freq_factor": 4.0,
  "original_max_position_embeddings": 8192,
}
SCHEDULES = {
  "default": None,
  "linear": {"rope_type": "linear", "factor": 4.0},
  "llama3": LLAMA31,
  "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
  "yarn_betas": {
    "rope_type": "yarn",
    "factor": 16.0,
    "original_max_position_embeddings": 2048,
    "beta_fast": 16,
    "beta_slow": 2,
    "truncate": False,
  },
  "yarn_mscale": {
    "rope_type": "yarn",
    "factor": 40.0,
    "original_max_position_embeddings": 4096,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
  },
}


def _transformers_rope(head_dim, theta, scaling):
  """(inv_freq, attention_factor) as transformers computes them for a Llama config."""
  transformers = pytest.importorskip("transformers")
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

  params = {"rope_type": "default", "rope_theta": theta, **(scaling or {})}
  cfg = transformers.LlamaConfig(
    hidden_size=head_dim * 4,
    num_attention_heads=4,
    head_dim=head_dim,
    max_position_embeddings=131072,
    rope_parameters=params,
  )
  kind = params["rope_type"]
  if kind == "default":
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    inv, factor = LlamaRotaryEmbedding.compute_default_rope_parameters(cfg)
  else:
    inv, factor = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu")
  return inv.double().numpy(), float(factor)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("head_dim,theta", [(128, 500000.0), (64, 10000.0)])
def test_schedules_equal_transformers(name, head_dim, theta):
  scaling = SCHEDULES[name]
  want_inv, want_factor = _transformers_rope(head_dim, theta, scaling)
  got = rope.inv_frequencies(head_dim, theta, scaling)
  # transformers computes in float32: agree to its rounding, everywhere.
  np.testing.assert_allclose(got, want_inv, rtol=2e-6, atol=0)
  assert rope.attention_factor(scaling) == pytest.approx(want_factor, rel=1e-7)


def test_llama31_schedule_differs_from_default_where_it_should():
  default = rope.inv_frequencies(128, 500000.0)
  scaled = rope.inv_frequencies(128, 500000.0, LLAMA31)
  wavelen = 2 * math.pi / default
  assert np.array_equal(scaled[wavelen < 8192 / 4], default[wavelen < 8192 / 4])
  np.testing.assert_allclose(scaled[wavelen > 8192], default[wavelen > 8192] / 8)
  # 35 of Llama-3.1-8B's 64 pairs are rescaled (high ones kept, the ramp between).
  assert int(np.sum(scaled != default)) == 35


def _exact_angles(positions, inv_freq):
  """(position x inv_freq) mod 2 pi in 80-bit long double: ~1e-10 rad at 2^31."""
  p = np.asarray(positions, np.longdouble)[..., None]
  two_pi = np.longdouble(2) * np.arccos(np.longdouble(-1))
  return np.mod(p * inv_freq.astype(np.longdouble), two_pi), two_pi


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_angles_exact_at_every_int32_position(name):
  scaling = SCHEDULES[name]
  rng = np.random.default_rng(0)
  positions = np.concatenate(
    [
      np.arange(64),
      2 ** np.arange(31) - 1,
      2 ** np.arange(1, 31),
      rng.integers(0, 2**31 - 1, 512),
      [2**31 - 1, 2**31 - 2, 2**24 + 1, 2**26 + 3],
    ]
  ).astype(np.int64)
  inv = rope.inv_frequencies(128, 500000.0, scaling)
  got = np.asarray(jax.jit(lambda p: rope.rope_angles(p, 128, 500000.0, scaling))(positions))
  want, two_pi = _exact_angles(positions, inv)
  err = np.abs(got.astype(np.longdouble) - want)
  err = np.minimum(err, two_pi - err).astype(np.float64)  # distance on the circle
  assert err.max() < 1.5e-6, (err.max(), positions[np.argmax(err.max(-1))])
  assert got.min() >= 0 and got.max() < 2 * math.pi + 1e-6


def test_float32_products_were_not_exact():
  """The recipe the exact angles replace: float32(position) x inv_freq is radians off
  at 2^26 (so the test above is one that float32 products fail)."""
  p = np.array([2**26 + 3], np.int64)
  inv = rope.inv_frequencies(128, 500000.0)
  naive = np.float32(p[:, None]) * inv.astype(np.float32)
  want, two_pi = _exact_angles(p, inv)
  err = np.abs(np.mod(naive.astype(np.longdouble), two_pi) - want)
  assert np.minimum(err, two_pi - err).max() > 0.5


def _sharp_model(**overrides):
  kw = dict(
    vocab_size=128,
    d_model=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    mlp_dim=128,
    rope_theta=500000.0,
  )
  cfg = ModelConfig(**{**kw, **overrides})
  b, t = 2, 24
  rng = np.random.default_rng(0)
  inputs = jnp.asarray(rng.integers(0, 128, (b, t)), jnp.int32)
  pos = jnp.tile(jnp.arange(t, dtype=jnp.int32), (b, 1))
  seg = jnp.ones((b, t), jnp.int32)
  model = Transformer(cfg)
  params = model.init(jax.random.key(1), inputs, pos, seg)
  # Scaled weights make attention sharp, so a wrong angle shows in the logits.
  params = jax.tree.map(lambda w: w * 4.0 if w.ndim == 3 else w, params)
  return cfg, model, params, inputs, pos, seg


@pytest.mark.parametrize(
  "scaling", [None, LLAMA31, SCHEDULES["yarn"]], ids=["default", "llama3", "yarn"]
)
def test_logits_unchanged_when_every_position_shifts_by_2_pow_26(scaling):
  cfg, model, params, inputs, pos, seg = _sharp_model(rope_scaling=scaling or ())
  fwd = jax.jit(model.apply)
  base = np.asarray(fwd(params, inputs, pos, seg))
  scale = np.abs(base).max()
  for shift in (2**17, 2**24 + 1, 2**26, 2**31 - 64):
    moved = np.asarray(fwd(params, inputs, pos + shift, seg))
    assert np.abs(moved - base).max() / scale <= 1e-4, shift


@pytest.mark.parametrize(
  "overrides",
  [
    dict(rope_scaling=LLAMA31),
    dict(rope_scaling=SCHEDULES["yarn"]),
    dict(qkv_bias=True),
    dict(qk_norm=True, head_dim=24),
    dict(qkv_bias=True, qk_norm=True, rope_scaling={"rope_type": "linear", "factor": 2.0}),
  ],
  ids=["llama3", "yarn", "bias", "qk_norm", "all"],
)
def test_model_options_match_the_reference(overrides):
  cfg, model, params, inputs, pos, seg = _sharp_model(**overrides)
  # Non-trivial biases and norm scales, so a dropped weight shows.
  leaves, tree = jax.tree.flatten_with_path(params)
  rng = np.random.default_rng(3)
  new = []
  for path, leaf in leaves:
    name = jax.tree_util.keystr(path)
    if any(k in name for k in ("'bq'", "'bk'", "'bv'", "q_norm", "k_norm")):
      leaf = leaf + jnp.asarray(rng.normal(0, 0.5, leaf.shape), leaf.dtype)
    new.append(leaf)
  params = jax.tree.unflatten(tree, new)
  names = {jax.tree_util.keystr(p) for p, _ in leaves}
  if cfg.qkv_bias:
    assert any("'bq'" in n for n in names)
  if cfg.qk_norm:
    assert any("q_norm" in n for n in names) and any("k_norm" in n for n in names)
  got = np.asarray(jax.jit(model.apply)(params, inputs, pos, seg))
  want = np.asarray(reference_forward(params, cfg, inputs, pos, seg))
  np.testing.assert_allclose(got, want, atol=2e-4 * np.abs(want).max(), rtol=0)
  assert sum(x.size for x in jax.tree.leaves(params)) == cfg.num_params()


def test_bad_rope_scaling_is_refused_by_name():
  with pytest.raises(ValueError, match="rope_type 'dynamic' is not supported"):
    ModelConfig(rope_scaling={"rope_type": "dynamic", "factor": 2.0})
  with pytest.raises(ValueError, match="needs \\['low_freq_factor'"):
    ModelConfig(rope_scaling={"rope_type": "llama3", "factor": 8.0})
  with pytest.raises(ValueError, match="unknown keys \\['beta_fast'\\]"):
    ModelConfig(rope_scaling={"rope_type": "linear", "factor": 2.0, "beta_fast": 3})

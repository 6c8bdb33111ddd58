"""lctx.models against the plain reference forward, packing, patterns, scan, remat."""

import dataclasses
import functools

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
  unembed_matrix,
)
from lctx.models.reference import reference_forward

B, T = 2, 12


def tiny(**overrides) -> ModelConfig:
  """The hand-countable model of these tests: 2 layers, D 64, 4 q / 2 kv heads of 16,
  F 128, E 256 (smaller than gin/models/tiny.gin on purpose)."""
  kw = dict(
    vocab_size=256, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128
  )
  return ModelConfig(**{**kw, **overrides})


MLA = dict(
  attention="mla",
  num_heads=4,
  kv_lora_rank=16,
  qk_nope_head_dim=8,
  qk_rope_head_dim=4,
  v_head_dim=12,
)


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
  return model, jax.jit(model.init)(jax.random.key(seed), inputs, pos, seg)


@pytest.mark.parametrize(
  "name,overrides",
  [
    pytest.param("mha", dict(num_kv_heads=4), marks=pytest.mark.slow),
    ("gqa", dict(num_kv_heads=2)),
    ("mqa", dict(num_kv_heads=1)),
    pytest.param("mla", MLA, marks=pytest.mark.slow),
    ("mla_qlora", dict(MLA, q_lora_rank=8)),
    pytest.param("tied", dict(tie_embeddings=True), marks=pytest.mark.slow),
  ],
)
def test_matches_reference_forward(name, overrides):
  config = tiny(**overrides)
  model, params = _init(config)
  inputs, pos, seg = _batch()
  logits = jax.jit(model.apply)(params, inputs, pos, seg)
  assert logits.shape == (B, T, config.vocab_size) and logits.dtype == jnp.float32
  want = reference_forward(params, config, inputs, pos, seg)
  np.testing.assert_allclose(logits, want, rtol=2e-4, atol=2e-4)
  hidden = model.apply(params, inputs, pos, seg, return_hidden=True)
  assert hidden.shape == (B, T, config.d_model)
  init_hidden = jax.eval_shape(
    functools.partial(model.init, return_hidden=True), jax.random.key(0), inputs, pos, seg
  )
  assert jax.tree.structure(init_hidden) == jax.tree.structure(params)
  np.testing.assert_allclose(hidden @ unembed_matrix(params, config), logits, rtol=1e-5, atol=1e-5)
  pre, final_norm = model.apply(params, inputs, pos, seg, return_hidden="pre_norm")
  np.testing.assert_allclose(final_norm(pre), hidden, rtol=1e-6, atol=1e-6)
  with pytest.raises(ValueError, match="return_hidden"):
    model.apply(params, inputs, pos, seg, return_hidden="logits")


def test_reference_attention_fn_matches_kernels_reference():
  from lctx.kernels import reference_attention

  rng = np.random.default_rng(1)
  _, pos, seg = _batch()
  q = jnp.asarray(rng.normal(size=(B, T, 4, 8)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(B, T, 2, 8)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(B, T, 2, 6)), jnp.float32)
  for window in (None, 3):
    got = reference_attention_fn(q, k, v, segment_ids=seg, positions=pos, window_size=window)
    want = reference_attention(
      q, k, v, segment_ids=seg, q_positions=pos, kv_positions=pos, window_size=window
    )
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  assert np.all(np.asarray(got)[0, 10:] == 0)  # padding rows see no key


@pytest.mark.parametrize("overrides", [dict(), pytest.param(MLA, marks=pytest.mark.slow)])
def test_packed_documents_do_not_interact(overrides):
  config = tiny(**overrides)
  model, params = _init(config)
  inputs, pos, seg = _batch()
  apply = jax.jit(model.apply)
  base = apply(params, inputs, pos, seg)
  changed = inputs.at[0, 5:10].set((inputs[0, 5:10] + 7) % config.vocab_size)  # doc 2 only
  out = apply(params, changed, pos, seg)
  np.testing.assert_array_equal(out[0, :5], base[0, :5])  # doc 1 untouched
  np.testing.assert_array_equal(out[1], base[1])
  assert not np.allclose(out[0, 5:10], base[0, 5:10])  # the test can fail
  # Doc 1's logits do not depend on where doc 2's tokens sit in the row either.
  changed_doc1 = inputs.at[0, 0].set((inputs[0, 0] + 1) % config.vocab_size)
  out1 = apply(params, changed_doc1, pos, seg)
  np.testing.assert_array_equal(out1[0, 5:10], base[0, 5:10])


def test_sliding_window_pattern_matches_reference():
  config = tiny(num_layers=4, attention_pattern=(3, None))
  model, params = _init(config)
  inputs, pos, seg = _batch()
  assert params["params"]["layers"]["layer_0"]["mlp"]["wo"].value.shape[0] == 2  # 2 repeats
  logits = jax.jit(model.apply)(params, inputs, pos, seg)
  np.testing.assert_allclose(
    logits, reference_forward(params, config, inputs, pos, seg), rtol=2e-4, atol=2e-4
  )
  global_cfg = dataclasses.replace(config, attention_pattern=(None, None))
  glob = jax.jit(Transformer(global_cfg).apply)(params, inputs, pos, seg)
  assert not np.allclose(glob, logits, atol=1e-3)  # the window really masks something


@pytest.mark.parametrize(
  "overrides",
  [
    dict(attention_pattern=(3, None), num_layers=4),
    pytest.param(MLA, marks=pytest.mark.slow),
  ],
)
def test_scan_and_unrolled_layers_identical(overrides):
  config = tiny(**overrides)
  unrolled_cfg = dataclasses.replace(config, scan_layers=False)
  inputs, pos, seg = _batch()
  unrolled = Transformer(unrolled_cfg)
  params_u = jax.jit(unrolled.init)(jax.random.key(3), inputs, pos, seg)
  assert "layers_1" in params_u["params"] and "layers" not in params_u["params"]
  params_s = {"params": stack_unscanned_params(params_u["params"], config)}
  out_u = jax.jit(unrolled.apply)(params_u, inputs, pos, seg)
  out_s = jax.jit(Transformer(config).apply)(params_s, inputs, pos, seg)
  np.testing.assert_allclose(out_s, out_u, rtol=1e-6, atol=1e-6)


def _loss_and_grads(config, params):
  inputs, pos, seg = _batch()
  model = Transformer(config)

  def loss(p):
    logits = model.apply(p, inputs, pos, seg)
    return jnp.mean(jax.nn.log_softmax(logits)[..., 0] * (seg > 0))

  return jax.jit(jax.value_and_grad(loss))(params)


def test_remat_policies_same_values_and_grads():
  config = tiny(num_layers=2)
  _, params = _init(config)
  want_loss, want_grads = _loss_and_grads(config, params)
  cases = [
    (policy, True) for policy in ("full", "dots", "dots_no_batch", "offload_layer_inputs")
  ] + [("full", False)]
  for policy, scan in cases:
    cfg = dataclasses.replace(config, remat_policy=policy, scan_layers=scan)
    p = params if scan else {"params": _unstack(params["params"], cfg)}
    got_loss, got_grads = _loss_and_grads(cfg, p)
    if not scan:
      got_grads = {"params": stack_unscanned_params(got_grads["params"], cfg)}
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6, err_msg=policy)
    jax.tree.map(
      lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7, err_msg=policy),
      nn.unbox(got_grads),
      nn.unbox(want_grads),
    )


def _unstack(params, config):
  params = dict(nn.unbox(params))
  stacked = params.pop("layers")
  for r in range(config.num_repeats):
    params[f"layers_{r}"] = jax.tree.map(lambda x: x[r], stacked)
  return params


_HYBRID_TINY = dict(
  num_layers=4,
  layer_types=("linear_attention",) * 3 + ("full_attention",),
  linear_num_key_heads=2,
  linear_num_value_heads=4,
  linear_key_head_dim=8,
  linear_value_head_dim=8,
)


@pytest.mark.parametrize(
  "overrides",
  [
    {},
    # Gemma's post-MLP norm (applied inside the chunks) and a hybrid's linear
    # layers under the chunked MLP.
    dict(post_sublayer_norms=True, norm_plus_one=True),
    _HYBRID_TINY,
  ],
  ids=["llama", "post_norms", "hybrid"],
)
def test_chunked_mlp_matches_unchunked(overrides):
  config = tiny(**overrides)
  _, params = _init(config)
  inputs, pos, seg = _batch()
  want_loss, want_grads = _loss_and_grads(config, params)
  got_loss, got_grads = _loss_and_grads(dataclasses.replace(config, mlp_chunk_size=5), params)
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
  # Each gradient within 1e-5 of its largest entry: float32 sums in other orders
  # (the hybrid's differ by up to 2.6e-6 of it; an entry near 0 can differ by
  # more than 1e-5 of itself).
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.abs(b).max()),
    nn.unbox(got_grads),
    nn.unbox(want_grads),
  )


@pytest.mark.parametrize("overrides", [dict(), pytest.param(MLA, marks=pytest.mark.slow)])
def test_bf16_compute_with_f32_params(overrides):
  config = tiny(dtype="bfloat16", **overrides)
  model, params = _init(config)
  leaves = jax.tree.leaves(nn.unbox(params))
  assert all(x.dtype == jnp.float32 for x in leaves)
  inputs, pos, seg = _batch()
  logits = jax.jit(model.apply)(params, inputs, pos, seg)
  hidden = model.apply(params, inputs, pos, seg, return_hidden=True)
  assert logits.dtype == jnp.float32 and hidden.dtype == jnp.bfloat16
  want = reference_forward(params, config, inputs, pos, seg)
  err = np.abs(np.asarray(logits) - np.asarray(want)).max()
  assert np.isfinite(np.asarray(logits)).all() and err < 0.1 * np.abs(np.asarray(want)).max()
  _, grads = _loss_and_grads(config, params)
  assert all(
    np.isfinite(g).all() and g.dtype == jnp.float32 for g in jax.tree.leaves(nn.unbox(grads))
  )


@pytest.mark.parametrize(
  "overrides,message",
  [
    (dict(num_layers=5, attention_pattern=(8, None)), r"num_layers \(5\).*multiple.*\(2\)"),
    (dict(num_heads=4, num_kv_heads=3), r"num_heads \(4\).*num_kv_heads \(3\)"),
    (dict(head_dim=7), "head_dim must be even"),
    (dict(attention="flash"), "attention must be one of"),
    (dict(remat_policy="some"), "remat_policy must be one of"),
    (dict(attention_pattern=(0,)), "attention_pattern entries"),
    (dict(attention_pattern=[None]), "non-empty tuple"),
    (dict(MLA, qk_rope_head_dim=3), "qk_rope_head_dim must be even"),
    (dict(dtype="bf16"), "dtype must be one of"),
    (dict(mlp_chunk_size=0), "mlp_chunk_size"),
  ],
)
def test_invalid_configs_raise_clear_errors(overrides, message):
  with pytest.raises(ValueError, match=message):
    tiny(**overrides)


ALLOWED_PARAM_AXES = {
  "vocab",
  "embed",
  "mlp",
  "heads",
  "kv_heads",
  "head_dim",
  "q_lora",
  "kv_lora",
  "layers",
}


@pytest.mark.parametrize("overrides", [dict(), dict(MLA, q_lora_rank=8)])
def test_params_carry_logical_names_and_shard_on_a_mesh(overrides):
  config = tiny(**overrides)
  model, params = _init(config)
  boxes = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
  assert all(isinstance(b, nn.LogicallyPartitioned) for b in boxes)
  for box in boxes:
    assert set(box.names) <= ALLOWED_PARAM_AXES and len(box.names) == box.value.ndim
  layer_boxes = jax.tree.leaves(
    params["params"]["layers"], is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned)
  )
  assert all(b.names[0] == "layers" for b in layer_boxes)
  # Under a mesh with rules, the constraints are legal and values unchanged.
  mesh = jax.make_mesh((2, 4), ("fsdp", "context"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  rules = (
    ("act_batch", "fsdp"),
    ("act_seq", "context"),
    ("embed", "fsdp"),
    ("act_heads", None),
    ("act_embed", None),
  )
  inputs, pos, seg = _batch()
  want = jax.jit(model.apply)(params, inputs, pos, seg)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    got = jax.jit(model.apply)(params, inputs, pos, seg)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_flops_and_params_hand_count():
  c = tiny()  # D 64, 2 layers, N 4, K 2, H 16, F 128, E 256
  seq = 8
  qkv, out, mlp = 2 * 64 * (4 + 2 * 2) * 16, 2 * 64 * 4 * 16, 2 * 64 * 128 * 3
  attn = 4 * (seq / 2) * 4 * 16  # causal: half the keys
  forward = 2 * (qkv + out + mlp + attn) + 2 * 64 * 256
  assert c.flops_per_token(seq, training=False) == forward
  assert c.flops_per_token(seq) == 3 * forward
  assert c.flops_per_token(seq, causal=False, training=False) == forward + 2 * attn
  # Window 2 of 8 causal keys: mean of min(p, 2) over p in [0, 8) = 2 - 4/16.
  w = tiny(attention_pattern=(2, None))
  assert w.flops_per_token(seq, training=False) == forward - 4 * (4 - 1.75) * 4 * 16
  m = tiny(**dict(MLA, q_lora_rank=8))  # D 64, N 4, Q 8, C 16, nope 8, R 4, V 12
  mla_proj = 64 * 8 + 8 * 4 * 12 + 64 * (16 + 4) + 16 * 4 * (8 + 12) + 4 * 12 * 64
  mla_attn = 2 * (seq / 2) * 4 * (12 + 12)
  assert m.flops_per_token(seq, training=False) == (
    2 * (2 * mla_proj + mla_attn + mlp) + 2 * 64 * 256
  )
  _, params = _init(m)
  n_params = sum(x.size for x in jax.tree.leaves(nn.unbox(params)))
  assert m.num_params() == n_params
  assert m.num_params(include_embedding=False) == n_params - 256 * 64
  _, params = _init(tiny(tie_embeddings=True))
  assert tiny(tie_embeddings=True).num_params() == sum(
    x.size for x in jax.tree.leaves(nn.unbox(params))
  )


def test_flops_match_compiled_cost_analysis():
  # Matmul-dominated shape; the plain attention computes every (query, key) pair,
  # so it is compared with the non-causal count. Unrolled layers: XLA's cost
  # analysis counts a while-loop (scan) body once, not once per iteration.
  c = tiny(
    d_model=128,
    mlp_dim=512,
    vocab_size=512,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    scan_layers=False,
  )
  model, params = _init(c)
  inputs, pos, seg = _batch()
  cost = jax.jit(model.apply).lower(params, inputs, pos, seg).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  want = c.flops_per_token(T, causal=False, training=False) * B * T
  assert 0.9 < cost["flops"] / want < 1.25, (cost["flops"], want)


@pytest.mark.parametrize("scan", [True, False])
def test_offload_policy_moves_layer_inputs_to_host(scan):
  # Tracing only: the backward's saved layer inputs live in host memory
  # (jaxpr type f32<host>), one [B, T, D] per layer, stacked over the scan.
  config = tiny(
    num_layers=4,
    attention_pattern=(None, None),
    remat_policy="offload_layer_inputs",
    scan_layers=scan,
  )
  model = Transformer(config)
  inputs, pos, seg = _batch()
  params = jax.eval_shape(model.init, jax.random.key(0), inputs, pos, seg)
  jaxpr = str(jax.make_jaxpr(jax.grad(lambda p: model.apply(p, inputs, pos, seg).sum()))(params))
  want = "f32<host>[2,2,12,64]" if scan else "f32<host>[2,12,64]"
  assert want in jaxpr
  no_offload = dataclasses.replace(config, remat_policy="full")
  jaxpr = str(
    jax.make_jaxpr(jax.grad(lambda p: Transformer(no_offload).apply(p, inputs, pos, seg).sum()))(
      params
    )
  )
  assert "<host>" not in jaxpr


def test_llama3_8b_gin_shapes_without_memory():
  from lctx import configs

  config = configs.model_config("llama3_8b", dtype="bfloat16")
  inputs = jax.ShapeDtypeStruct((1, 16), jnp.int32)
  model = Transformer(config)
  shapes = jax.eval_shape(model.init, jax.random.key(0), inputs, inputs, inputs)
  n_params = sum(x.size for x in jax.tree.leaves(nn.unbox(shapes)))
  assert n_params == config.num_params()
  assert round(n_params / 1e9, 2) == 8.03  # Llama-3.1-8B's published count
  wq = shapes["params"]["layers"]["layer_0"]["attention"]["wq"]
  assert wq.value.shape == (32, 4096, 32, 128)
  assert wq.names == ("layers", "embed", "heads", "head_dim")


def test_rms_norm_values_and_grads_match_autodiff_formula():
  from lctx.models.layers import rms_norm

  def plain(x, scale):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-5) * scale

  kx, ks, kg = jax.random.split(jax.random.key(3), 3)
  x = jax.random.normal(kx, (2, 3, 5, 16)) * 3.0
  scale = 1.0 + jax.random.normal(ks, (16,))
  g = jax.random.normal(kg, x.shape)
  got, got_vjp = jax.vjp(lambda a, b: rms_norm(a, b, 1e-5), x, scale)
  want, want_vjp = jax.vjp(plain, x, scale)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  for a, b in zip(got_vjp(g), want_vjp(g)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)

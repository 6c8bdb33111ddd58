"""The linear-attention layers (lctx.models.linear_attention) against transformers'
own layers on the same random weights (values and input gradients within 2e-4),
and the packing property: a packed row gives each document the outputs and
gradients it gets alone."""

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lctx.models import ModelConfig, reference_attention_fn
from lctx.models.linear_attention import GatedDeltaNet, KimiDeltaAttention

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

D, T = 32, 80  # two delta-rule chunks, the second partial
GDN = ModelConfig(**helpers.TINY_LINEAR["gdn"])
KDA = ModelConfig(**helpers.TINY_LINEAR["kda"])
assert GDN.d_model == KDA.d_model == D


def _hf_layer(kind):
  torch.manual_seed(0)
  lin = dict(
    hidden_size=D,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=12,
    linear_conv_kernel_dim=4,
    num_hidden_layers=1,
    layer_types=["linear_attention"],
    rms_norm_eps=1e-6,
  )
  if kind == "qwen3_5":
    from transformers.models.qwen3_5 import modeling_qwen3_5 as mod

    layer = mod.Qwen3_5GatedDeltaNet(transformers.Qwen3_5TextConfig(**lin), 0)
  elif kind == "qwen3_next":
    from transformers.models.qwen3_next import modeling_qwen3_next as mod

    layer = mod.Qwen3NextGatedDeltaNet(transformers.Qwen3NextConfig(**lin), 0)
  else:
    from transformers.models.kimi_linear import modeling_kimi_linear as mod

    cfg = transformers.KimiLinearConfig(
      hidden_size=D,
      num_hidden_layers=1,
      rms_norm_eps=1e-5,
      linear_attn_config=dict(head_dim=8, num_heads=4, short_conv_kernel_size=4),
      layer_types=["linear_attention"],
      mlp_layer_types=["dense"],
      pad_token_id=0,
      bos_token_id=None,
      eos_token_id=None,
    )
    layer = mod.KimiLinearDeltaAttention(cfg, 0)
  with torch.no_grad():
    for _, p in layer.named_parameters():
      p.copy_(0.3 * torch.randn_like(p))
    sd = {k: v.double().numpy() for k, v in layer.state_dict().items()}
  return layer.float().eval(), sd


def _lctx_params(kind, sd):
  """lctx's params from the HF layer's (runtime) state dict, written out by hand."""
  t = lambda name: sd[name].T  # noqa: E731  [out, in] -> [in, out]
  conv = sd["conv1d.weight"][:, 0, :].T  # [W, C]: channels [q | k | v]
  if kind == "kimi":
    n, k = 4, 8
    p = dict(
      wq=t("q_proj.weight").reshape(D, n, k),
      wk=t("k_proj.weight").reshape(D, n, k),
      wv=t("v_proj.weight").reshape(D, n, k),
      conv_q=conv[:, : n * k],
      conv_k=conv[:, n * k : 2 * n * k],
      conv_v=conv[:, 2 * n * k :],
      wb=t("b_proj.weight"),
      wf_a=t("forget_gate.f_a_proj.weight"),
      wf_b=t("forget_gate.f_b_proj.weight").reshape(k, n, k),
      dt_bias=sd["forget_gate.dt_bias"].reshape(n, k),
      A_log=sd["forget_gate.A_log"].reshape(n),
      wg_a=t("g_a_proj.weight"),
      wg_b=t("g_b_proj.weight").reshape(k, n, k),
      norm_scale=sd["o_norm.weight"],
      wo=t("o_proj.weight").reshape(n, k, D),
    )
  else:
    q, m, k, v = 2, 4, 8, 12
    if kind == "qwen3_5":
      qkv = t("in_proj_qkv.weight")
      wq, wk, wv = qkv[:, : q * k], qkv[:, q * k : 2 * q * k], qkv[:, 2 * q * k :]
      wz, wb, wa = t("in_proj_z.weight"), t("in_proj_b.weight"), t("in_proj_a.weight")
    else:  # per q/k head: [q | k | v (G heads) | z (G heads)], and [b (G) | a (G)]
      g = m // q
      qkvz = t("in_proj_qkvz.weight").reshape(D, q, 2 * k + 2 * g * v)
      wq, wk = qkvz[..., :k], qkvz[..., k : 2 * k]
      wv, wz = qkvz[..., 2 * k : 2 * k + g * v], qkvz[..., 2 * k + g * v :]
      ba = t("in_proj_ba.weight").reshape(D, q, 2 * g)
      wb, wa = ba[..., :g].reshape(D, m), ba[..., g:].reshape(D, m)
    p = dict(
      wq=wq.reshape(D, q, k),
      wk=wk.reshape(D, q, k),
      wv=wv.reshape(D, m, v),
      wz=wz.reshape(D, m, v),
      wb=wb,
      wa=wa,
      conv_q=conv[:, : q * k],
      conv_k=conv[:, q * k : 2 * q * k],
      conv_v=conv[:, 2 * q * k :],
      dt_bias=sd["dt_bias"],
      A_log=sd["A_log"],
      norm_scale=sd["norm.weight"],
      wo=t("out_proj.weight").reshape(m, v, D),
    )
  return jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), p)


def _module(kind):
  return (
    KimiDeltaAttention(KDA, reference_attention_fn)
    if kind == "kimi"
    else GatedDeltaNet(GDN, reference_attention_fn)
  )


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next", "kimi"])
def test_layer_matches_transformers(kind):
  layer, sd = _hf_layer(kind)
  params = _lctx_params(kind, sd)
  module = _module(kind)
  rng = np.random.default_rng(1)
  x = rng.standard_normal((2, T, D)).astype(np.float32)
  cot = rng.standard_normal((2, T, D)).astype(np.float32)
  ones = jnp.ones((2, T), jnp.int32)
  # The tree lctx would create has the same names and shapes.
  init = jax.eval_shape(lambda: module.init(jax.random.key(0), x, ones, ones)["params"])
  shapes = jax.tree.map(lambda a: a.shape, __import__("flax").linen.unbox(init))
  assert shapes == jax.tree.map(lambda a: a.shape, params)

  @jax.jit
  def f(x):
    return module.apply({"params": params}, x, ones, ones)

  got, vjp = jax.vjp(f, jnp.asarray(x))
  (got_dx,) = vjp(jnp.asarray(cot))
  xt = torch.from_numpy(x).requires_grad_(True)
  want = layer(xt)
  (want * torch.from_numpy(cot)).sum().backward()
  want, want_dx = want.detach().numpy(), xt.grad.numpy()
  for a, b in ((got, want), (got_dx, want_dx)):
    err = np.abs(np.asarray(a) - b).max() / np.abs(b).max()
    assert err < 2e-4, f"{kind}: max |diff| / max = {err:.2e}"


@pytest.mark.parametrize("kind", ["qwen3_5", "kimi"])
def test_packed_documents_equal_documents_alone(kind):
  """Three documents and padding in one row: each document's outputs, and the
  parameter gradients of the whole row, are those of the documents run alone."""
  module = _module(kind)
  rng = np.random.default_rng(2)
  bounds = [(0, 23), (23, 70), (70, 90)]  # the second straddles the 64-token chunk edge
  t = 96  # 6 tokens of padding
  x = rng.standard_normal((1, t, D)).astype(np.float32)
  cot = rng.standard_normal((1, t, D)).astype(np.float32)
  seg = np.zeros((1, t), np.int32)
  for i, (a, b) in enumerate(bounds):
    seg[0, a:b] = i + 1
  params = module.init(jax.random.key(0), x, seg, seg)["params"]

  @jax.jit
  def out_and_grads(p, x, seg, cot):
    def loss(p):
      out = module.apply({"params": p}, x, seg, seg)
      return jnp.sum(out * cot), out

    return jax.grad(loss, has_aux=True)(p)[::-1]

  def close(u, v):  # relative to the largest entry (float32 sums in other orders)
    err = np.abs(np.asarray(u) - np.asarray(v)).max() / max(np.abs(np.asarray(v)).max(), 1e-30)
    assert err < 1e-4, f"max |diff| / max = {err:.2e}"

  # One shape for both calls (one compile): the packed row beside two rows of
  # padding, and each document alone at the start of a row of padding.
  zeros = np.zeros_like(seg)
  pad_rows = lambda a: np.concatenate([a, np.zeros((2,) + a.shape[1:], a.dtype)])  # noqa: E731
  packed, packed_grads = out_and_grads(params, pad_rows(x), np.concatenate([seg, zeros, zeros]),
                                       pad_rows(cot))  # fmt: skip
  xs, cots, segs = (
    np.zeros((3, t, D), np.float32),
    np.zeros((3, t, D), np.float32),
    zeros.repeat(3, 0),
  )
  for i, (a, b) in enumerate(bounds):
    xs[i, : b - a], cots[i, : b - a], segs[i, : b - a] = x[0, a:b], cot[0, a:b], 1
  alone, alone_grads = out_and_grads(params, xs, segs, cots)
  for i, (a, b) in enumerate(bounds):
    close(packed[0, a:b], alone[i, : b - a])
  np.testing.assert_array_equal(np.asarray(packed[:, 90:]), 0.0)  # padding
  jax.tree.map(close, packed_grads, alone_grads)


@pytest.mark.parametrize(
  "overrides, message",
  [
    (
      dict(linear_num_key_heads=3, linear_num_value_heads=4),
      r"linear_num_value_heads \(4\).*\(3\)",
    ),
    (dict(linear_attention="kda", linear_num_value_heads=8, linear_num_key_heads=4), "kda"),
    (dict(linear_attention="mamba"), "linear_attention must be one of"),
    (dict(partial_rotary_factor=0.2, head_dim=8), "must be even and >= 2"),
    (dict(attention="mla", attention_output_gate=True), "attention_output_gate applies"),
  ],
)
def test_invalid_hybrid_configs_raise_clear_errors(overrides, message):
  with pytest.raises(ValueError, match=message):
    ModelConfig(**overrides)

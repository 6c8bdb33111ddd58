"""Hybrid Hugging Face families in and out, against transformers (PyTorch, CPU):
Qwen3.5 (dense), Qwen3-Next with dense MLPs, Kimi Linear with dense MLPs.

Tiny random models are built and saved by transformers, with every norm weight,
A_log and dt_bias randomised; lctx's float32 logits must match within 2e-4 of
the largest logit over two delta-rule chunks (T = 80). Exports reload in
transformers with no missing or unexpected keys. MoE layers are refused by
name; dense configs that still carry num_experts keys are not.
"""

import json
import os

import jax
import numpy as np
import pytest

from lctx.models import Transformer, hf, reference_attention_fn

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

T = 80  # two chunks of the delta rule (64), the second partial
L = 4  # three linear layers, then one full-attention layer
BASE = dict(
  vocab_size=97,
  hidden_size=32,
  intermediate_size=48,
  num_hidden_layers=L,
  num_attention_heads=4,
  initializer_range=0.2,
  max_position_embeddings=256,
)
QWEN_LINEAR = dict(
  num_key_value_heads=2,
  head_dim=16,  # partial rotary 0.25: 4 rotated dims
  linear_num_key_heads=2,
  linear_num_value_heads=4,
  linear_key_head_dim=8,
  linear_value_head_dim=12,
  linear_conv_kernel_dim=4,
)
FAMILIES = {
  "qwen3_5": ("Qwen3_5Text", "Qwen3_5ForCausalLM", QWEN_LINEAR),
  "qwen3_next": ("Qwen3Next", "Qwen3NextForCausalLM", dict(QWEN_LINEAR, mlp_only_layers=list(range(L)))),
  "kimi_linear": (
    "KimiLinear",
    "KimiLinearForCausalLM",
    dict(
      num_key_value_heads=4,
      kv_lora_rank=8,
      qk_nope_head_dim=8,
      qk_rope_head_dim=4,
      v_head_dim=8,
      linear_attn_config=dict(
        head_dim=8, num_heads=4, short_conv_kernel_size=4, kda_layers=[1, 2, 3],
        full_attn_layers=[4],
      ),
      mlp_layer_types=["dense"] * L,
      pad_token_id=0,
      bos_token_id=None,
      eos_token_id=None,
    ),
  ),
}  # fmt: skip


def build(tmp_path, case, name="hf", **overrides):
  """A random transformers model of `case` saved (sharded) under tmp_path/name."""
  family, arch, kw = FAMILIES[case]
  cfg = getattr(transformers, f"{family}Config")(**{**BASE, **kw, **overrides})
  torch.manual_seed(0)
  model = getattr(transformers, arch)(cfg).float()
  with torch.no_grad():
    for pname, p in model.named_parameters():
      if "norm" in pname:
        p.copy_(1.0 + 0.3 * torch.randn_like(p))
      elif pname.endswith(("A_log", "dt_bias")):
        p.copy_(p + 0.3 * torch.randn_like(p))
  model.eval()
  path = str(tmp_path / name)
  model.save_pretrained(path, max_shard_size="40KB")
  return path, model


def _inputs(seed=0):
  rng = np.random.default_rng(seed)
  ids = rng.integers(1, BASE["vocab_size"], (2, T)).astype(np.int32)
  positions = np.broadcast_to(np.arange(T, dtype=np.int32) + 3, (2, T)).copy()
  return ids, positions


def _hf_logits(model, ids, positions):
  with torch.no_grad():
    out = model(torch.from_numpy(ids).long(), position_ids=torch.from_numpy(positions).long())
  return out.logits.float().numpy()


def _lctx_logits(config, params, ids, positions):
  apply = jax.jit(Transformer(config, reference_attention_fn).apply)
  return np.asarray(apply({"params": params}, ids, positions, np.ones_like(ids)))


def _assert_close(got, want, tol=2e-4):
  err = np.abs(got - want).max() / np.abs(want).max()
  assert err < tol, f"max |diff| / max |logit| = {err:.2e}"


@pytest.mark.parametrize("case", sorted(FAMILIES))
def test_logits_match_transformers_and_export_reloads(tmp_path, case):
  path, model = build(tmp_path, case)
  config, params = hf.load_pretrained(path)
  assert config.layer_types == ("linear_attention",) * 3 + ("full_attention",)
  ids, positions = _inputs()
  want = _hf_logits(model, ids, positions)
  _assert_close(_lctx_logits(config, params, ids, positions), want)

  arch = FAMILIES[case][1]
  out = str(tmp_path / "export")
  hf.save_pretrained(
    out, config, params, dtype="float32", max_shard_bytes=30_000, architecture=arch
  )
  reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
    out, output_loading_info=True, attn_implementation="eager"
  )
  assert not info["missing_keys"] and not info["unexpected_keys"], info
  assert type(reloaded) is type(model)
  _assert_close(_hf_logits(reloaded, ids, positions), want, 1e-6)
  config2, params2 = hf.load_pretrained(out)
  assert config2 == config
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-6), params2, params)


def test_config_mapping(tmp_path):
  path, _ = build(tmp_path, "qwen3_5")
  c = hf.load_config(path)
  assert (c.head_dim, c.partial_rotary_factor, c.qk_norm, c.attention_output_gate) == (
    16,
    0.25,
    True,
    True,
  )
  assert (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_value_head_dim) == (2, 4, 12)
  c = hf.load_config(build(tmp_path, "kimi_linear", "k")[0])
  assert (c.attention, c.mla_rope, c.linear_attention, c.q_lora_rank) == ("mla", False, "kda", 0)


def _edit_config(path, **changes):
  file = os.path.join(path, "config.json")
  with open(file) as f:
    cfg = json.load(f)
  cfg.update(changes)
  with open(file, "w") as f:
    json.dump(cfg, f)


@pytest.mark.parametrize(
  "case, changes, message",
  [
    ("qwen3_next", dict(mlp_only_layers=[0, 1, 2]), r"mixture-of-experts layers \[3\]"),
    ("qwen3_next", dict(mlp_only_layers=[], decoder_sparse_step=2), r"layers \[1, 3\]"),
    ("kimi_linear", dict(mlp_layer_types=["dense", "sparse", "dense", "dense"]), r"layers \[1\]"),
    ("kimi_linear", dict(mlp_layer_types=None, first_k_dense_replace=2), r"layers \[2, 3\]"),
    ("qwen3_5", dict(architectures=["Qwen3_5MoeForCausalLM"]), "Qwen3_5MoeForCausalLM .* mixture"),
    ("qwen3_5", dict(hidden_act="gelu"), "hidden_act='gelu'"),
  ],
)
def test_refuses_moe_layers_by_name(tmp_path, case, changes, message):
  path, _ = build(tmp_path, case)
  _edit_config(path, **changes)
  with pytest.raises(ValueError, match=message):
    hf.load_pretrained(path)


def test_dense_configs_with_expert_keys_load(tmp_path):
  """Dense Qwen3-Next and Kimi configs carry num_experts / moe_intermediate_size."""
  for case in ("qwen3_next", "kimi_linear"):
    path, _ = build(tmp_path, case, name=case)
    with open(os.path.join(path, "config.json")) as f:
      cfg = json.load(f)
    assert cfg.get("num_experts") and cfg.get("moe_intermediate_size"), sorted(cfg)
    assert hf.load_config(path).layer_types[-1] == "full_attention"


def test_qwen3_5_9b_gin_is_transformers_default_shape():
  """gin/models/qwen3_5_9b.gin has the params of Qwen3_5TextConfig()'s model
  (counted by transformers on the meta device), and what load_config makes of
  that config.json."""
  import dataclasses

  import flax.linen as nn
  import jax.numpy as jnp

  from lctx import configs

  config = configs.model_config("qwen3_5_9b")
  hf_cfg = transformers.Qwen3_5TextConfig()
  with torch.device("meta"):
    want = sum(p.numel() for p in transformers.Qwen3_5ForCausalLM(hf_cfg).parameters())
  inputs = jax.ShapeDtypeStruct((1, 16), jnp.int32)
  shapes = jax.eval_shape(Transformer(config).init, jax.random.key(0), inputs, inputs, inputs)
  assert sum(x.size for x in jax.tree.leaves(nn.unbox(shapes))) == config.num_params() == want
  from_hf = hf.config_from_hf({**hf_cfg.to_dict(), "architectures": ["Qwen3_5ForCausalLM"]})
  keep = dict(dtype=config.dtype, param_dtype=config.param_dtype, remat_policy=config.remat_policy)
  assert dataclasses.replace(from_hf, **keep) == config

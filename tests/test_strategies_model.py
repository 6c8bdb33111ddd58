"""A whole-model loss and gradient step under each context-parallel strategy
equals the single-device model with plain reference attention."""

import jax
import numpy as np
import pytest

from lctx import models
from lctx.kernels import AttentionOptions, chunked_cross_entropy
from lctx.parallel import halo
from lctx.parallel import mesh as mesh_lib
from lctx.trainer import TrainConfig, Trainer

MODEL = models.ModelConfig(
  vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64
)
MLA = models.ModelConfig(
  vocab_size=64,
  d_model=32,
  num_layers=2,
  num_heads=4,
  attention="mla",
  kv_lora_rank=16,
  qk_nope_head_dim=8,
  qk_rope_head_dim=4,
  v_head_dim=8,
  mlp_dim=64,
)
# Gemma 3's layer pattern: two sliding layers (window 6: within every device's
# chunk on these meshes, so they run window-aware) per global one, with its norms,
# GELU-tanh MLP, embedding scale, query_pre_attn_scalar and RoPE per layer type.
GEMMA = models.ModelConfig(
  vocab_size=64,
  d_model=32,
  num_layers=3,
  num_heads=4,
  num_kv_heads=2,
  head_dim=8,
  mlp_dim=64,
  qk_norm=True,
  layer_types=("sliding_attention", "sliding_attention", "full_attention"),
  sliding_window=6,
  norm_plus_one=True,
  mlp_activation="gelu_tanh",
  embed_scale=True,
  post_sublayer_norms=True,
  query_pre_attn_scalar=12.0,
  rope_theta=1e6,
  rope_scaling={"rope_type": "linear", "factor": 8.0},
  sliding_rope_theta=1e4,
)
B, T = 4, 64


def _batch(seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(3, MODEL.vocab_size, (B, T + 1), dtype=np.int32)
  # Two documents per row, the second ending in padding.
  seg = np.ones((B, T), np.int32)
  seg[:, T // 3 :] = 2
  seg[:, -5:] = 0
  pos = np.zeros((B, T), np.int32)
  for s in (1, 2):
    idx = np.where(seg[0] == s)[0]
    pos[:, idx] = np.arange(len(idx))
  return {
    "inputs": tokens[:, :-1],
    "targets": tokens[:, 1:],
    "segment_ids": seg,
    "positions": pos,
    "loss_mask": (seg > 0).astype(np.float32),
  }


def _reference(model_cfg, params, batch):
  model = models.Transformer(model_cfg, models.reference_attention_fn)

  def loss(p):
    hidden = model.apply(
      {"params": p}, batch["inputs"], batch["positions"], batch["segment_ids"], return_hidden=True
    )
    s, _, w = chunked_cross_entropy(
      hidden,
      models.unembed_matrix(p, model_cfg),
      batch["targets"],
      batch["loss_mask"],
      chunk_size=None,
    )
    return s / w

  return jax.value_and_grad(loss)(params)


SLOW = pytest.mark.slow
# One case per strategy in the default run; the other meshes under -m slow.
CASES = [
  ("all_gather", MODEL, dict(context=8)),
  pytest.param("all_gather", MODEL, dict(data=2, context=4), marks=SLOW),
  ("ulysses", MODEL, dict(context=2, data=2, fsdp=2)),
  ("ring", MODEL, dict(data=2, context=4)),
  pytest.param("ring", MODEL, dict(tensor=2, context=4), marks=SLOW),
  pytest.param("ring", MLA, dict(data=2, context=4), marks=SLOW),
  ("usp", MODEL, dict(context=2, context_ulysses=2, data=2)),
  ("ring", GEMMA, dict(data=2, context=4)),
  pytest.param("all_gather", GEMMA, dict(context=8), marks=SLOW),
  pytest.param("ulysses", GEMMA, dict(context=2, data=2, fsdp=2), marks=SLOW),
  pytest.param("usp", GEMMA, dict(context=2, context_ulysses=2, data=2), marks=SLOW),
]


def _case_id(case):
  strategy, cfg, mesh = case.values if hasattr(case, "values") else case
  kind = "gemma3" if cfg.layer_types else cfg.attention
  return f"{strategy}-{kind}-" + "x".join(f"{k}{v}" for k, v in mesh.items())


@pytest.mark.parametrize("strategy,model_cfg,mesh_kw", CASES, ids=[_case_id(c) for c in CASES])
def test_model_step_matches_single_device(strategy, model_cfg, mesh_kw, monkeypatch):
  halo_calls = []  # the sliding layers' window-aware calls (lctx/parallel/halo.py)
  real_halo = halo.halo_attention_local
  monkeypatch.setattr(
    halo, "halo_attention_local", lambda *a, **kw: halo_calls.append(1) or real_halo(*a, **kw)
  )
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(**{"context": 1, **mesh_kw}))
  trainer = Trainer(
    model_cfg,
    TrainConfig(
      batch_size=B,
      seq_len=T,
      context_parallel_strategy=strategy,
      attention_options=AttentionOptions(block_q=8, block_kv=8),
    ),
    mesh,
  )
  state = trainer.init_state(0)
  params = jax.device_get(state["params"])
  batch = _batch()
  want_loss, want_grads = _reference(model_cfg, params, batch)

  dev = trainer.device_batch(trainer.plan.to_device_order(batch))
  with trainer._context():  # pylint: disable=protected-access
    (got_loss, _), got_grads = jax.jit(jax.value_and_grad(trainer.loss_fn, has_aux=True))(
      state["params"], dev
    )
  np.testing.assert_allclose(got_loss, want_loss, rtol=2e-5)
  windowed = model_cfg.layer_types and strategy in ("ring", "all_gather", "usp")
  assert bool(halo_calls) == bool(windowed), (strategy, len(halo_calls))
  jax.tree.map(
    lambda g, w: np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-4, atol=2e-5),
    got_grads,
    want_grads,
  )

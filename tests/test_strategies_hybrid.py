"""A tiny Qwen3.5-pattern hybrid (3 Gated DeltaNet layers : 1 gated full-attention
layer, scan_layers on) gives, packed and under every context-parallel strategy on
the 8-device mesh, the loss and gradients of the single-device model."""

import dataclasses

import jax
import numpy as np
import pytest

from lctx import models
from lctx.kernels import AttentionOptions, chunked_cross_entropy
from lctx.parallel import ContextOptions
from lctx.parallel import mesh as mesh_lib
from lctx.trainer import TrainConfig, Trainer

HYBRID = models.ModelConfig(
  vocab_size=64,
  d_model=32,
  num_layers=4,
  layer_types=("linear_attention",) * 3 + ("full_attention",),
  num_heads=4,
  num_kv_heads=2,
  head_dim=8,
  qk_norm=True,
  attention_output_gate=True,
  partial_rotary_factor=0.5,
  linear_num_key_heads=2,
  linear_num_value_heads=4,
  linear_key_head_dim=8,
  linear_value_head_dim=8,
  mlp_dim=64,
  scan_layers=True,
)
KDA = dataclasses.replace(
  HYBRID,
  attention="mla",
  kv_lora_rank=16,
  qk_nope_head_dim=8,
  qk_rope_head_dim=4,
  v_head_dim=8,
  mla_rope=False,
  qk_norm=False,
  attention_output_gate=False,
  partial_rotary_factor=1.0,
  linear_attention="kda",
  linear_num_key_heads=4,
)
CHUNKED = dataclasses.replace(HYBRID, linear_chunk_size=4)
B, T = 4, 64


def _batch(seed=0):
  """Three documents per row (the second spans several devices' shards under
  every mesh here), the last ending in padding."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(3, HYBRID.vocab_size, (B, T + 1), dtype=np.int32)
  seg = np.ones((B, T), np.int32)
  seg[:, 5:41] = 2
  seg[:, 41:] = 3
  seg[:, -6:] = 0
  pos = np.zeros((B, T), np.int32)
  for s in (1, 2, 3):
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
  model = models.Transformer(model_cfg, models.reference_attention_fn)  # single-device kernels

  def loss(p):
    hidden = model.apply(
      {"params": p}, batch["inputs"], batch["positions"], batch["segment_ids"], return_hidden=True
    )
    s, _, w = chunked_cross_entropy(
      hidden, models.unembed_matrix(p, model_cfg), batch["targets"], batch["loss_mask"],
      chunk_size=None,
    )  # fmt: skip
    return s / w

  return jax.jit(jax.value_and_grad(loss))(params)


SLOW = pytest.mark.slow
CASES = [
  ("all_gather", HYBRID, dict(context=8), None),
  ("ulysses", HYBRID, dict(context=2, data=2, fsdp=2), None),
  ("ring", HYBRID, dict(data=2, context=4), True),
  # usp with the linear layers over sequence chunks (pieces of 8 tokens, 2 chunks each)
  ("usp", CHUNKED, dict(context=2, context_ulysses=2, data=2), None),
  pytest.param("usp", HYBRID, dict(context=2, context_ulysses=2, data=2), None, marks=SLOW),
  pytest.param("ring", HYBRID, dict(data=2, context=4), False, marks=SLOW),
  pytest.param("ring", HYBRID, dict(tensor=2, context=4), None, marks=SLOW),
  pytest.param("ring", KDA, dict(data=2, context=4), None, marks=SLOW),
]


def _case_id(case):
  strategy, cfg, mesh, zigzag = case.values if hasattr(case, "values") else case
  kind = cfg.linear_attention + (f"-chunk{cfg.linear_chunk_size}" if cfg.linear_chunk_size else "")
  lb = "" if zigzag is None else ("-zigzag" if zigzag else "-natural")
  return f"{strategy}-{kind}{lb}-" + "x".join(f"{k}{v}" for k, v in mesh.items())


@pytest.mark.parametrize(
  "strategy,model_cfg,mesh_kw,zigzag", CASES, ids=[_case_id(c) for c in CASES]
)
def test_hybrid_step_matches_single_device(strategy, model_cfg, mesh_kw, zigzag):
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(**{"context": 1, **mesh_kw}))
  kw = {} if zigzag is None else dict(context_options=ContextOptions(load_balance=zigzag))
  trainer = Trainer(
    model_cfg,
    TrainConfig(
      batch_size=B,
      seq_len=T,
      context_parallel_strategy=strategy,
      attention_options=AttentionOptions(block_q=8, block_kv=8),
      **kw,
    ),
    mesh,
  )
  assert trainer.plan.mixer.linear is not None  # the context-parallel linear ops
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
  jax.tree.map(
    lambda g, w: np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-4, atol=2e-5),
    got_grads,
    want_grads,
  )

"""Data pipeline -> context-parallel model: packed documents stay independent."""

import numpy as np

from lctx import models
from lctx.data import DataConfig, make_iterator
from lctx.kernels import AttentionOptions
from lctx.parallel import mesh as mesh_lib
from lctx.trainer import TrainConfig, Trainer


def test_changing_one_packed_document_leaves_the_others_unchanged():
  seq = 256
  it = make_iterator(
    DataConfig(sources=("text", "copy"), copy_max_key_len=16),
    split="validation",
    batch_size=2,
    seq_len=seq,
    seed=3,
    process_index=0,
    process_count=1,
  )
  for _ in range(20):  # the first batch whose row 0 packs several documents
    batch = next(it)
    seg = batch["segment_ids"][0]
    docs = [s for s in np.unique(seg) if s > 0]
    if len(docs) >= 2:
      break
  assert len(docs) >= 2, "need a row that packs at least two documents"
  target = docs[len(docs) // 2]

  model = models.ModelConfig(
    vocab_size=384, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64
  )
  trainer = Trainer(
    model,
    TrainConfig(
      batch_size=2,
      seq_len=seq,
      context_parallel_strategy="ring",
      attention_options=AttentionOptions(block_q=32, block_kv=32),
    ),
    mesh_lib.make_mesh(mesh_lib.MeshConfig(data=2, context=4)),
  )
  assert trainer.load_balance  # the zigzag path is exercised too
  logits_fn = trainer.logits_fn(trainer.init_state(0))

  before = logits_fn(batch)
  changed = {k: v.copy() for k, v in batch.items()}
  inside = changed["segment_ids"][0] == target
  rng = np.random.default_rng(0)
  changed["inputs"][0, inside] = rng.integers(3, 259, inside.sum())
  after = logits_fn(changed)

  others = (seg > 0) & ~inside
  np.testing.assert_allclose(after[0, others], before[0, others], atol=1e-5)
  np.testing.assert_allclose(after[1], before[1], atol=1e-5)
  assert np.abs(after[0, inside] - before[0, inside]).max() > 1e-3
  # The forward compiled once for this shape, across calls and logits_fn objects.
  apply = trainer._logits_apply  # pylint: disable=protected-access
  trainer.logits_fn(trainer.init_state(1))(batch)
  assert trainer._logits_apply is apply and apply._cache_size() == 1  # pylint: disable=protected-access

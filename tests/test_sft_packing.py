"""Packed conversations under every context-parallel strategy (8 fake devices):
each conversation's loss and gradients equal the conversation alone on one
device (and for a hybrid of linear and full attention under ring);
changing one conversation changes no other's logits; devices holding only
masked tokens add zero, not NaN; masked prompt targets add no gradient."""

import jax
import numpy as np
import pytest

from lctx import models
from lctx.kernels import AttentionOptions
from lctx.parallel import ContextOptions
from lctx.parallel import mesh as mesh_lib
from lctx.trainer import TrainConfig, Trainer

MODEL = models.ModelConfig(
  vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64
)
B, T = 4, 64
# (strategy, mesh, zigzag load balance): the 8-device meshes.
STRATEGIES = [
  ("all_gather", dict(context=8), True),
  ("ulysses", dict(context=2, data=2, fsdp=2), False),  # 2 kv heads: ulysses degree 2
  ("ring", dict(context=8), True),
  ("usp", dict(context=2, context_ulysses=2, data=2), True),
]


def _conversations(seed=0):
  """Packed rows of conversations: [(row, start, length)], and the batch. Each
  conversation is a prompt (loss 0) then an answer (loss 1), twice (two turns);
  positions restart per conversation; rows end in padding."""
  rng = np.random.default_rng(seed)
  lengths = [[20, 17, 14], [31, 9, 19], [40, 24], [12, 12, 12, 12]]
  batch = {k: np.zeros((B, T), np.int32) for k in ("inputs", "targets", "segment_ids", "positions")}
  batch["loss_mask"] = np.zeros((B, T), np.float32)
  convs = []
  for r, row in enumerate(lengths):
    start = 0
    for s, n in enumerate(row, start=1):
      ids = rng.integers(3, MODEL.vocab_size, n + 1, dtype=np.int32)
      mask = np.zeros(n + 1, np.float32)  # over ids; 1 on answer tokens
      a, b = n // 4, n // 2
      mask[a + 2 : b] = 1
      mask[b + 3 :] = 1
      sl = slice(start, start + n)
      batch["inputs"][r, sl], batch["targets"][r, sl] = ids[:-1], ids[1:]
      batch["segment_ids"][r, sl] = s
      batch["positions"][r, sl] = np.arange(n)
      batch["loss_mask"][r, sl] = mask[1:]
      convs.append((r, start, n))
      start += n
  return convs, batch


def _trainer(strategy, mesh_kw, zigzag, devices=None, model=MODEL):
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(**{"context": 1, **mesh_kw}), devices=devices)
  cfg = TrainConfig(
    batch_size=B,
    seq_len=T,
    context_parallel_strategy=strategy,
    context_options=ContextOptions(load_balance=zigzag),
    attention_options=AttentionOptions(block_q=8, block_kv=8),
  )
  return Trainer(model, cfg, mesh)


def _loss_and_grads(trainer):
  """(natural-order batch, params) -> (loss, aux, grads), one compile per trainer."""
  step = jax.jit(jax.value_and_grad(trainer.loss_fn, has_aux=True))

  def run(batch, params):
    dev = trainer.device_batch(trainer.plan.to_device_order(batch))
    with trainer._context():  # pylint: disable=protected-access
      (loss, aux), grads = step(params, dev)
    return float(loss), jax.device_get(aux), jax.device_get(grads)

  return run


def _only(batch, row, start, n):
  """The batch with the loss on one conversation only."""
  out = dict(batch)
  keep = np.zeros_like(batch["loss_mask"])
  keep[row, start : start + n] = 1
  out["loss_mask"] = batch["loss_mask"] * keep
  return out


def _alone(batch, row, start, n):
  """One conversation alone at the start of row 0, the rest padding."""
  out = {k: np.zeros_like(v) for k, v in batch.items()}
  for k, v in batch.items():
    out[k][0, :n] = v[row, start : start + n]
  return out


def _reference(model):
  """The one-device trainer (plain attention) and its parameters."""
  trainer = _trainer("all_gather", dict(context=1), False, devices=jax.devices()[:1], model=model)
  assert trainer.mesh.devices.size == 1
  state = trainer.init_state(0)
  return _loss_and_grads(trainer), jax.device_get(state["params"])


@pytest.fixture(scope="module")
def reference():
  return _reference(MODEL)


def _close(got, want, rtol=2e-4, atol=2e-6):
  jax.tree.map(
    lambda g, w: np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=atol),
    got,
    want,
  )


@pytest.mark.parametrize("strategy,mesh_kw,zigzag", STRATEGIES, ids=[s[0] for s in STRATEGIES])
def test_each_packed_conversation_equals_it_alone(reference, strategy, mesh_kw, zigzag):
  _check_packed_conversations(reference, _trainer(strategy, mesh_kw, zigzag), zigzag)


@pytest.mark.slow  # minutes of compiles (the hybrid, one device and eight) on 2 cores
def test_hybrid_packed_conversations_equal_them_alone():
  """The same under ring (zigzag) for the hybrid of tests/test_strategies_hybrid.py
  (3 Gated DeltaNet layers : 1 gated full attention): the linear layers' state
  and short convolutions restart at each conversation, across shards too."""
  from test_strategies_hybrid import HYBRID  # pylint: disable=g-import-not-at-top

  trainer = _trainer("ring", dict(data=2, context=4), True, model=HYBRID)
  assert trainer.plan.mixer.linear is not None
  # The chunked delta rule's sums differ in the last bits between layouts: the
  # gradient tolerance of tests/test_strategies_hybrid.py (a leak from another
  # conversation moves gradients by their own size).
  _check_packed_conversations(_reference(HYBRID), trainer, True, grad_atol=2e-5)


def _check_packed_conversations(reference, trainer, zigzag, grad_atol=2e-6):
  ref_run, params = reference
  assert trainer.mesh.devices.size == 8 and trainer.load_balance == zigzag
  run = _loss_and_grads(trainer)
  convs, batch = _conversations()
  for conv in convs:
    got_loss, got_aux, got_grads = run(_only(batch, *conv), params)
    want_loss, want_aux, want_grads = ref_run(_alone(batch, *conv), params)
    assert float(got_aux["tokens"]) == float(want_aux["tokens"]) > 0
    np.testing.assert_allclose(got_loss, want_loss, rtol=2e-5)
    _close(got_grads, want_grads, atol=grad_atol)
  # The packed batch's loss is the token-weighted mean of the conversations'.
  loss, aux, _ = run(batch, params)
  parts = [ref_run(_alone(batch, *c), params) for c in convs]
  weights = np.array([float(p[1]["tokens"]) for p in parts])
  np.testing.assert_allclose(
    loss, np.dot([p[0] for p in parts], weights) / weights.sum(), rtol=2e-5
  )
  assert float(aux["tokens"]) == weights.sum() == batch["loss_mask"].sum()

  # Isolation (TRL's probe): new tokens in one conversation leave every other
  # conversation's logits as they were.
  state = {"params": params}
  logits = trainer.logits_fn(state)
  before = logits(batch)
  changed = dict(batch)
  row, start, n = convs[1]
  changed["inputs"] = batch["inputs"].copy()
  changed["inputs"][row, start : start + n] = (batch["inputs"][row, start : start + n] + 7) % 61 + 3
  after = logits(changed)
  for r, s, m in convs:
    same = (r, s, m) != convs[1]
    diff = np.abs(after[r, s : s + m] - before[r, s : s + m]).max()
    assert (diff == 0) if same else (diff > 1e-3), (r, s, m, diff)


def test_devices_with_only_masked_tokens(reference):
  """Under ring on context=8 the supervised tokens sit on one device's shard:
  the loss is finite and equals one device's; a fully masked batch gives 0."""
  ref_run, params = reference
  run = _loss_and_grads(_trainer("ring", dict(context=8), False))
  _, batch = _conversations(1)
  mask = np.zeros_like(batch["loss_mask"])
  mask[0, 2:6] = 1  # inside the first of 8 shards of row 0 (no zigzag)
  batch["loss_mask"] = mask
  got_loss, got_aux, got_grads = run(batch, params)
  want_loss, _, want_grads = ref_run(batch, params)
  assert np.isfinite(got_loss) and float(got_aux["tokens"]) == 4
  np.testing.assert_allclose(got_loss, want_loss, rtol=2e-5)
  _close(got_grads, want_grads)
  batch["loss_mask"] = np.zeros_like(mask)
  loss, aux, grads = run(batch, params)
  assert loss == 0.0 and float(aux["tokens"]) == 0
  assert all(np.all(np.asarray(g) == 0) for g in jax.tree.leaves(grads))


def test_masked_prompt_targets_add_no_gradient(reference):
  """Other targets under the prompt's zero mask give the same loss and
  gradients to the bit: a masked-out prompt contributes nothing."""
  ref_run, params = reference
  run = _loss_and_grads(_trainer("ring", dict(context=8), True))
  _, batch = _conversations(2)
  loss, _, grads = run(batch, params)
  other = dict(batch)
  masked = (batch["loss_mask"] == 0) & (batch["segment_ids"] > 0)
  other["targets"] = np.where(masked, (batch["targets"] + 11) % 61 + 3, batch["targets"])
  assert (other["targets"] != batch["targets"]).sum() == masked.sum() > 20
  loss2, _, grads2 = run(other, params)
  assert loss == loss2
  jax.tree.map(
    lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), grads, grads2
  )
  # And the same targets counted (mask 1) do change them.
  counted = dict(other, loss_mask=(batch["segment_ids"] > 0).astype(np.float32))
  assert run(counted, params)[0] != loss

"""The train loop end to end: metrics, checkpoints, exact resume, error paths."""

import json
import os

import gin
import jax
import numpy as np
import pytest

from lctx import checkpoint as ckpt_lib
from lctx import configs, gin_utils, models  # noqa: F401  (configs registers the gin names)
from lctx import train as train_lib
from lctx.data import DataConfig
from lctx.kernels import AttentionOptions
from lctx.parallel import ContextOptions
from lctx.parallel import mesh as mesh_lib
from lctx.trainer import TrainConfig, Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = models.ModelConfig(
  vocab_size=384, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64
)


def _experiment(**train_overrides):
  train = dict(
    batch_size=4,
    seq_len=64,
    steps=6,
    log_every=1,
    checkpoint_every=3,
    async_checkpoint=False,
    warmup_steps=2,
    context_parallel_strategy="ring",
    attention_options=AttentionOptions(block_q=16, block_kv=16),
    eval_batches=1,
  )
  train.update(train_overrides)
  return train_lib.Experiment(
    model=TINY,
    data=DataConfig(sources=("copy",), copy_max_key_len=16),
    train=TrainConfig(**train),
    mesh=mesh_lib.MeshConfig(data=2, context=4),
  )


def _metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def test_train_writes_metrics_and_checkpoints_and_resumes_exactly(tmp_path):
  full, part = str(tmp_path / "full"), str(tmp_path / "part")
  train_lib.run("train", full, _experiment())
  # Same run, stopped after step 3 (its last checkpoint), then resumed.
  train_lib.run("train", part, _experiment(steps=3))
  train_lib.run("train", part, _experiment())

  records = _metrics(full)
  assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
  for key in (
    "loss",
    "tokens_per_sec",
    "mfu",
    "grad_norm",
    "learning_rate",
    "tflops_per_device",
    "memory/temp_bytes",
  ):
    assert key in records[0], key
  assert all(r["tokens_per_sec"] > 0 and r["mfu"] > 0 for r in records)
  resumed = {r["step"]: r["loss"] for r in _metrics(part)}
  np.testing.assert_allclose(
    [resumed[s] for s in (4, 5, 6)], [r["loss"] for r in records[3:]], rtol=1e-5
  )
  steps = sorted(int(d) for d in os.listdir(os.path.join(full, "checkpoints")) if d.isdigit())
  assert steps == [3, 6]


def test_resume_with_a_different_model_names_the_mismatch(tmp_path):
  workdir = str(tmp_path)
  train_lib.run("train", workdir, _experiment(steps=1, checkpoint_every=1))
  other = _experiment(steps=2)
  other = train_lib.Experiment(
    model=models.ModelConfig(**{**TINY.__dict__, "mlp_dim": 96}),
    data=other.data,
    train=other.train,
    mesh=other.mesh,
  )
  with pytest.raises(
    ckpt_lib.CheckpointMismatchError, match=r"model\.mlp_dim: checkpoint has 64, config has 96"
  ):
    train_lib.run("train", workdir, other)
  # Nothing already written is lost.
  assert os.path.isdir(os.path.join(workdir, "checkpoints", "1"))


def test_eval_mode_without_checkpoint_is_a_clear_error(tmp_path):
  with pytest.raises(FileNotFoundError, match="--mode=eval needs a checkpoint"):
    train_lib.run("eval", str(tmp_path), _experiment())


def test_loss_falls_on_the_copy_task(tmp_path):
  exp = _experiment(steps=30, checkpoint_every=0, learning_rate=1e-2, log_every=5)
  train_lib.run("train", str(tmp_path), exp)
  losses = [r["loss"] for r in _metrics(str(tmp_path))]
  assert losses[-1] < 0.7 * losses[0], losses


def test_batch_not_divisible_by_data_axes_is_an_error():
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(data=2, fsdp=2, context=2))
  with pytest.raises(
    ValueError,
    match=r"batch_size=6 is not divisible by the "
    r"batch sharding data x fsdp = 4",
  ):
    Trainer(
      TINY, TrainConfig(batch_size=6, seq_len=64, context_parallel_strategy="all_gather"), mesh
    )


@pytest.mark.parametrize(
  "field, value, message",
  [
    ("cpu_vector_width", 300, "cpu_vector_width must be None, 128, 256 or 512"),
    ("max_skipped_steps", 0, "max_skipped_steps must be a positive int"),
    ("profile_steps", (5, 2), "profile_steps must be None or \\(start, stop\\)"),
    ("context_parallel_strategy", "zigzag", "context_parallel_strategy must be one of"),
  ],
)
def test_bad_cpu_and_block_settings_are_errors(field, value, message):
  # TrainConfig rejects them itself, before any Trainer is built.
  with pytest.raises(ValueError, match=message):
    TrainConfig(
      **{"batch_size": 4, "seq_len": 64, "context_parallel_strategy": "all_gather", field: value}
    )


def test_cpu_vector_width_reaches_the_compiled_steps():
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(data=4, context=2))
  base = dict(batch_size=4, seq_len=64, context_parallel_strategy="all_gather")
  assert Trainer(TINY, TrainConfig(**base), mesh).compiler_options == {
    "xla_cpu_prefer_vector_width": 512
  }
  assert Trainer(TINY, TrainConfig(cpu_vector_width=None, **base), mesh).compiler_options == {}


def test_unknown_gin_binding_is_an_error():
  gin.clear_config()
  with pytest.raises(ValueError, match="No configurable matching 'NotAThing'"):
    gin_utils.parse([], ["NotAThing.x = 1"], [ROOT])
  gin.clear_config()
  with pytest.raises(ValueError, match="no_such_field"):
    gin_utils.parse([], ["TrainConfig.no_such_field = 1"], [ROOT])
  gin.clear_config()


def test_local_devices_macro_is_read_before_jax():
  n = gin_utils.local_devices_macro(["gin/local_cpu.gin"], [ROOT])
  assert n == 8
  assert gin_utils.local_devices_macro(["gin/local_cpu.gin"], [ROOT], ["LOCAL_DEVICES = 4"]) == 4


def test_in_loop_retrieval_evals_class_cells_of_a_windowed_model(tmp_path):
  from lctx.evals import EvalConfig  # pylint: disable=g-import-not-at-top

  exp = _experiment(steps=2, checkpoint_every=0, retrieval_eval_every=2)
  exp = train_lib.Experiment(
    model=models.ModelConfig(**{**TINY.__dict__, "attention_pattern": (16,)}),
    data=exp.data,
    train=exp.train,
    mesh=exp.mesh,
    evals=EvalConfig(
      tasks=("passkey",),
      lengths=(128,),
      depths=(0.0, 1.0),
      samples_per_cell=1,
      batch_size=4,
      length_multiple=8,
      window=0,
    ),
  )
  train_lib.run("train", str(tmp_path), exp)
  with open(tmp_path / "evals" / "retrieval.json") as f:
    records = json.load(f)
  # Two layers of window 16 reach 2 x 15 tokens back; the depth-0 needle ends
  # ~60 tokens before the answer, so no path reaches it.
  assert {r["receptive_field"] for r in records} == {30}
  main = {
    r["depth"]: r["reach_class"] for r in records if not r["needle_removed"] and not r["held_out"]
  }
  assert main[0.0] == "beyond"
  assert any("eval/passkey/acc_beyond" in r for r in _metrics(str(tmp_path)))


def test_head_chunks_reach_the_train_step():
  # ContextOptions.head_chunks -> ContextPlan -> UPipe stages; same loss and
  # gradients as all heads at once (4 q / 2 kv heads over a ulysses degree of 2).
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(data=4, context=2))
  rng = np.random.default_rng(0)
  tokens = rng.integers(3, 259, (4, 65), dtype=np.int32)
  batch = {
    "inputs": tokens[:, :-1],
    "targets": tokens[:, 1:],
    "segment_ids": np.ones((4, 64), np.int32),
    "positions": np.tile(np.arange(64, dtype=np.int32), (4, 1)),
    "loss_mask": np.ones((4, 64), np.float32),
  }
  results = []
  for chunks in (None, 2):
    cfg = TrainConfig(
      batch_size=4,
      seq_len=64,
      context_parallel_strategy="ulysses",
      context_options=ContextOptions(head_chunks=chunks),
    )
    trainer = Trainer(TINY, cfg, mesh)
    assert trainer.plan.head_chunks == chunks
    state = trainer.init_state(0)
    with trainer._context():  # pylint: disable=protected-access
      (loss, _), grads = jax.jit(jax.value_and_grad(trainer.loss_fn, has_aux=True))(
        state["params"], trainer.device_batch(batch)
      )
    results.append((float(loss), jax.device_get(grads)))
  assert abs(results[0][0] - results[1][0]) < 1e-5
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), *[r[1] for r in results]
  )
  with pytest.raises(ValueError, match="head_chunks.*strategy 'none'"):
    Trainer(
      TINY,
      TrainConfig(batch_size=8, seq_len=64, context_options=ContextOptions(head_chunks=2)),
      mesh_lib.make_mesh(mesh_lib.MeshConfig(data=8, context=1)),
    )
  with pytest.raises(ValueError, match="head_chunks"):
    Trainer(
      TINY,
      TrainConfig(
        batch_size=4,
        seq_len=64,
        context_parallel_strategy="ring",
        context_options=ContextOptions(head_chunks=2),
      ),
      mesh,
    )


def test_loss_runs_on_each_devices_own_tokens():
  """The chunked loss in a shard_map over batch and sequence axes: the same loss
  and gradients as plain SPMD over the global tokens, and no chunk's logits are
  all-reduced (plain SPMD ran every chunk on all devices with d_model split)."""
  import re  # pylint: disable=g-import-not-at-top

  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  from lctx.kernels import chunked_cross_entropy  # pylint: disable=g-import-not-at-top

  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(data=2, context=4))
  cfg = TrainConfig(
    batch_size=4, seq_len=256, context_parallel_strategy="ring", loss_chunk_size=16, z_loss=1e-3
  )
  rng = np.random.default_rng(0)
  batch = {
    "inputs": rng.integers(0, 384, (4, 256)).astype(np.int32),
    "targets": rng.integers(0, 384, (4, 256)).astype(np.int32),
    "segment_ids": np.ones((4, 256), np.int32),
    "positions": np.tile(np.arange(256, dtype=np.int32), (4, 1)),
    "loss_mask": (rng.random((4, 256)) > 0.3).astype(np.float32),
  }
  trainer = Trainer(TINY, cfg, mesh)
  state = trainer.init_state(0)
  step = jax.jit(jax.value_and_grad(trainer.loss_fn, has_aux=True))
  with trainer._context():  # pylint: disable=protected-access
    dev_batch = trainer.device_batch(batch)
    (loss, aux), grads = step(state["params"], dev_batch)
    hlo = step.lower(state["params"], dev_batch).compile().as_text()
    # The reference: plain SPMD, the final norm applied to the whole sequence first.
    trainer._cross_entropy = lambda h, norm, u, t, w: chunked_cross_entropy(  # pylint: disable=protected-access
      norm(h), u, t, w, chunk_size=16, z_loss=1e-3
    )
    (want, want_aux), want_grads = jax.jit(jax.value_and_grad(trainer.loss_fn, has_aux=True))(
      state["params"], dev_batch
    )
  np.testing.assert_allclose(loss, want, rtol=1e-6)
  assert float(aux["tokens"]) == float(want_aux["tokens"]) == batch["loss_mask"].sum()
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), grads, want_grads
  )
  # [chunk, vocab] f32 logits never cross devices ([d_model, vocab] = [32, 384] does).
  assert not re.search(r"f32\[16,384\]\S* all-reduce", hlo), "a chunk's logits are all-reduced"
  del jnp

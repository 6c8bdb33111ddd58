"""Training stages: TrainConfig.init_params_from with an lctx checkpoint, and what
resuming the same workdir accepts (any change but the parameter tree)."""

import dataclasses
import json
import logging
import os
import shutil

import jax
import numpy as np
import pytest

from lctx import checkpoint as ckpt_lib
from lctx import init_from, models
from lctx import train as train_lib
from lctx.data import DataConfig
from lctx.kernels import AttentionOptions
from lctx.models import config as config_lib
from lctx.parallel import mesh as mesh_lib
from lctx.trainer import TrainConfig, Trainer

TINY = models.ModelConfig(
  vocab_size=288, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64
)
STAGE1_TRAIN = dict(
  batch_size=8,
  seq_len=64,
  steps=2,
  log_every=1,
  checkpoint_every=0,
  async_checkpoint=False,
  warmup_steps=1,
  learning_rate=3e-3,
  context_parallel_strategy="none",
  attention_options=AttentionOptions(backend="reference"),
  eval_batches=1,
)
STAGE1_MESH = mesh_lib.MeshConfig(data=4, fsdp=2, context=1)


def _experiment(model=TINY, mesh=None, **train) -> train_lib.Experiment:
  return train_lib.Experiment(
    model=model,
    data=DataConfig(sources=("copy",), copy_max_key_len=16),
    train=TrainConfig(**{**STAGE1_TRAIN, **train}),
    mesh=mesh or STAGE1_MESH,
  )


def _metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def _messages(caplog):
  return [r.getMessage() for r in caplog.records]


@pytest.fixture(scope="module", autouse=True)
def compilation_cache(tmp_path_factory):
  """A persistent compilation cache: a resumed run reuses its first run's compile."""
  from jax._src import compilation_cache as cache  # pylint: disable=g-import-not-at-top

  before = jax.config.jax_compilation_cache_dir
  jax.config.update("jax_compilation_cache_dir", str(tmp_path_factory.mktemp("jax_cache")))
  cache.reset_cache()
  yield
  jax.config.update("jax_compilation_cache_dir", before)
  cache.reset_cache()


@pytest.fixture(scope="module")
def stage1(tmp_path_factory):
  """A finished 2-step run at 64 tokens: the checkpoint later stages start from."""
  workdir = str(tmp_path_factory.mktemp("stage1"))
  train_lib.run("train", workdir, _experiment())
  return workdir


def _checkpoint_params(workdir, exp):
  trainer = Trainer(exp.model, exp.train, mesh_lib.make_mesh(exp.mesh))
  checkpointer = ckpt_lib.Checkpointer(workdir, save_every=0, keep=3, async_save=False)
  try:
    step, state, _ = checkpointer.restore_latest(
      trainer.abstract_state, ckpt_lib.experiment_meta(exp)
    )
  finally:
    checkpointer.close()
  return step, jax.device_get(state["params"])


def _assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ----------------------------------------------------------------------------
# A stage that starts from another run's checkpoint
# ----------------------------------------------------------------------------
def test_a_stage_starts_from_a_checkpoint_with_new_length_rope_lr_and_mesh(
  stage1, tmp_path, caplog
):
  step, saved = _checkpoint_params(stage1, _experiment())
  assert step == 2
  # Stage 2: twice the length, another RoPE theta and schedule (position
  # interpolation by 2), remat and MLP chunks, another
  # mesh (fsdp x tensor), its own learning rate and warm-up, another seed.
  model = dataclasses.replace(
    TINY,
    rope_theta=40000.0,
    rope_scaling={"rope_type": "linear", "factor": 2.0},
    remat_policy="full",
    mlp_chunk_size=32,
  )
  mesh = mesh_lib.MeshConfig(data=2, fsdp=2, tensor=2, context=1)
  exp = _experiment(
    model,
    mesh,
    seq_len=128,
    steps=2,
    learning_rate=1e-3,
    warmup_steps=1,
    grad_clip=0.0,
    seed=7,
    init_params_from=stage1,
  )

  # Before the first step: the checkpoint's params, laid out for this run's mesh.
  trainer = Trainer(exp.model, exp.train, mesh_lib.make_mesh(exp.mesh))
  source = init_from.find_source(stage1)
  assert (source.kind, source.step) == ("lctx", 2)
  params = init_from.load_params(source, exp.model, trainer.abstract_state["params"])
  for leaf, sharding in zip(
    jax.tree.leaves(params), jax.tree.leaves(trainer.state_sharding["params"])
  ):
    assert leaf.sharding == sharding
  _assert_trees_equal(jax.device_get(params), saved)
  state = trainer.state_from_params(params, exp.train.seed)
  assert int(state["step"]) == 0
  fresh = trainer.init_state(exp.train.seed)
  _assert_trees_equal(jax.device_get(state["opt_state"]), jax.device_get(fresh["opt_state"]))

  workdir = str(tmp_path / "stage2")
  with caplog.at_level(logging.INFO):
    train_lib.run("train", workdir, exp)
  assert any(
    m.startswith("Started at step 0 from the parameters of the lctx checkpoint") and stage1 in m
    for m in _messages(caplog)
  ), _messages(caplog)
  records = _metrics(workdir)
  assert [r["step"] for r in records] == [1, 2]  # the step counter restarted at 0
  assert all(np.isfinite(r["loss"]) for r in records)
  # Its own schedule: 0 at step 0 (warm-up from 0), the new peak after 1 step.
  assert [r["learning_rate"] for r in records] == [0.0, pytest.approx(1e-3)]

  # Run again with more steps: the workdir has checkpoints now, so it resumes
  # (and says init_params_from is not used).
  caplog.clear()
  with caplog.at_level(logging.INFO):
    more = dataclasses.replace(exp, train=dataclasses.replace(exp.train, steps=3))
    train_lib.run("train", workdir, more)
  messages = _messages(caplog)
  assert "Resumed from step 2 in " + os.path.join(workdir, "checkpoints") + "." in messages
  assert any("init_params_from" in m and "is not used" in m for m in messages), messages
  assert [r["step"] for r in _metrics(workdir)] == [1, 2, 3]


def test_init_params_from_refuses_another_parameter_shape_naming_the_field(stage1):
  source = init_from.find_source(os.path.join(stage1, "checkpoints", "2"))
  assert (source.kind, source.step) == ("lctx", 2)
  abstract = None  # the check comes before any tensor is read
  with pytest.raises(ValueError, match=r"model\.mlp_dim: checkpoint has 64, config has 96"):
    init_from.load_params(source, dataclasses.replace(TINY, mlp_dim=96), abstract)
  with pytest.raises(ValueError, match=r"model\.scan_layers: checkpoint has True"):
    init_from.load_params(source, dataclasses.replace(TINY, scan_layers=False), abstract)


def test_init_params_from_a_path_that_holds_no_parameters_is_an_error(tmp_path):
  with pytest.raises(
    ValueError, match=r"is neither a Hugging Face directory \(config.json.*nor an lctx checkpoint"
  ):
    init_from.find_source(str(tmp_path))
  with pytest.raises(ValueError, match="init_params_from must be None or a path"):
    TrainConfig(init_params_from="")


# ----------------------------------------------------------------------------
# Resuming the same workdir
# ----------------------------------------------------------------------------
@pytest.mark.parametrize(
  "field, value",
  [("num_kv_heads", 4), ("param_dtype", "bfloat16"), ("attention_pattern", (None, 32))],
)
def test_resume_refuses_a_parameter_change_naming_the_field(stage1, field, value):
  exp = _experiment(dataclasses.replace(TINY, **{field: value}), steps=3)
  name = "attention_pattern \\(its length\\)" if field == "attention_pattern" else field
  with pytest.raises(ckpt_lib.CheckpointMismatchError, match=rf"model\.{name}: checkpoint has"):
    train_lib.run("train", stage1, exp)


def test_resume_accepts_rope_remat_and_chunking_changes_with_a_warning(stage1, tmp_path, caplog):
  workdir = str(tmp_path / "resumed")
  shutil.copytree(stage1, workdir)
  model = dataclasses.replace(
    TINY,
    rope_theta=20000.0,
    rope_scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64},
    remat_policy="minimal",
    mlp_chunk_size=16,
    attention_pattern=(48,),
  )
  with caplog.at_level(logging.WARNING):
    train_lib.run("train", workdir, _experiment(model, steps=3, seq_len=128))
  messages = _messages(caplog)
  for line in (
    "model.rope_theta: checkpoint has 10000.0, config has 20000.0",
    f"model.rope_scaling: checkpoint has [], config has {model.rope_scaling!r}",
    "model.remat_policy: checkpoint has 'none', config has 'minimal'",
    "model.mlp_chunk_size: checkpoint has None, config has 16",
    "model.attention_pattern: checkpoint has [None], config has (48,)",
  ):
    assert f"Resuming with a changed model setting (same parameters): {line}" in messages, messages
  assert [r["step"] for r in _metrics(workdir)] == [1, 2, 3]


# ----------------------------------------------------------------------------
# Which fields fix the parameter tree (checked against the model itself)
# ----------------------------------------------------------------------------
def _tree(cfg):
  model = models.Transformer(cfg, models.reference_attention_fn)
  x = np.zeros((1, 8), np.int32)
  shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), x, x, x + 1)["params"])
  return jax.tree.map(lambda a: (a.shape, a.dtype), shapes)


MLA = dataclasses.replace(TINY, attention="mla", q_lora_rank=16)
HYBRID = dataclasses.replace(
  TINY,
  layer_types=("linear_attention", "full_attention"),
  linear_num_key_heads=2,
  linear_num_value_heads=2,
)
# A change of every field: the layout fields must change the tree, the others not.
CHANGES = {
  "vocab_size": (TINY, 320),
  "d_model": (TINY, 48),
  "num_layers": (TINY, 4),
  "num_heads": (TINY, 8),
  "num_kv_heads": (TINY, 4),
  "head_dim": (TINY, 16),
  "mlp_dim": (TINY, 96),
  "attention": (TINY, "mla"),
  "q_lora_rank": (MLA, 8),
  "kv_lora_rank": (MLA, 16),
  "qk_nope_head_dim": (MLA, 8),
  "qk_rope_head_dim": (MLA, 4),
  "v_head_dim": (MLA, 8),
  "tie_embeddings": (TINY, True),
  "qkv_bias": (TINY, True),
  "qk_norm": (TINY, True),
  "param_dtype": (TINY, "bfloat16"),
  "scan_layers": (TINY, False),
  "attention_pattern": (TINY, (None, 4)),
  "layer_types": (TINY, ("linear_attention", "full_attention")),
  "linear_attention": (HYBRID, "kda"),
  "linear_num_key_heads": (HYBRID, 1),
  "linear_num_value_heads": (HYBRID, 4),
  "linear_key_head_dim": (HYBRID, 8),
  "linear_value_head_dim": (HYBRID, 8),
  "linear_conv_kernel_dim": (HYBRID, 3),
  "attention_output_gate": (TINY, True),
  "post_sublayer_norms": (TINY, True),
}
FREE = {
  "rope_theta": 5e5,
  "rope_scaling": {"rope_type": "linear", "factor": 4.0},
  "norm_eps": 1e-6,
  "dtype": "bfloat16",
  "remat_policy": "custom",
  "remat_custom": (("layer_input", "offload"),),
  "remat_group_size": 2,
  "remat_group_inner_inputs": "offload",
  "layer_input_pieces": 2,
  "mlp_chunk_size": 4,
  "linear_chunk_size": 4,
  "sliding_window": 4,
  "partial_rotary_factor": 0.5,
  "mla_rope": False,
  "norm_plus_one": True,
  "mlp_activation": "gelu_tanh",
  "embed_scale": True,
  "query_pre_attn_scalar": 16.0,
  "sliding_rope_theta": 1e4,
  "sliding_rope_scaling": (("rope_type", "linear"), ("factor", 2.0)),
  "final_logit_softcap": 30.0,
}


def test_the_layout_fields_are_exactly_those_that_change_the_parameter_tree():
  fields = {f.name for f in dataclasses.fields(models.ModelConfig)}
  layout = set(config_lib.param_layout({})) - {"attention_pattern (its length)"}
  assert layout | {"attention_pattern"} == set(CHANGES)
  assert fields == set(CHANGES) | set(FREE) | {"attention_pattern"}, (
    "classify the new ModelConfig field: SHAPE_FIELDS (and CHANGES here) if it changes "
    "the parameters, else FREE"
  )
  for name, (base, value) in CHANGES.items():
    assert _tree(base) != _tree(dataclasses.replace(base, **{name: value})), name
  # Every free field at once (a valid combination), and a window change.
  free = dataclasses.replace(TINY, **FREE)
  assert _tree(free) == _tree(TINY)
  assert _tree(dataclasses.replace(TINY, attention_pattern=(4,))) == _tree(TINY)

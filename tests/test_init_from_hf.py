"""TrainConfig.init_params_from with a Hugging Face directory: the model config
from config.json under gin, the sharded load on an fsdp x tensor mesh and across
two processes (both equal to the single-host lctx.models.hf.load_pretrained), and
--mode=eval of the imported parameters."""

import json
import os
import subprocess
import sys

import gin
import helpers
import jax
import numpy as np
import pytest

from lctx import configs, gin_utils, init_from  # noqa: F401  (configs registers the gin names)
from lctx import train as train_lib
from lctx.data import DataConfig
from lctx.kernels import AttentionOptions
from lctx.models import hf
from lctx.parallel import mesh as mesh_lib
from lctx.trainer import TrainConfig, Trainer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FSDP_TENSOR = mesh_lib.MeshConfig(fsdp=4, tensor=2, context=1)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  """A random Llama saved by transformers in two safetensors shards (with an index)."""
  path = str(tmp_path_factory.mktemp("llama"))
  helpers.save_tiny_llama(path, random_norms=True, max_shard_size="60KB")
  assert os.path.exists(os.path.join(path, hf.INDEX_FILE))
  return path


def _gin_experiment(params):
  gin.clear_config()
  try:
    gin_utils.parse(["gin/runs/base.gin"], params, search_paths=[ROOT])
    return configs.experiment()
  finally:
    gin.clear_config()


def _train(**overrides):
  train = dict(
    batch_size=4,
    seq_len=64,
    steps=1,
    warmup_steps=1,
    checkpoint_every=0,
    async_checkpoint=False,
    eval_batches=1,
    context_parallel_strategy="none",
    attention_options=AttentionOptions(backend="reference"),
  )
  return TrainConfig(**{**train, **overrides})


def _flat(tree):
  return {
    jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(tree)
  }


def _assert_equal_to_single_host_load(params, path):
  _, want = hf.load_pretrained(path)
  got, want = _flat(params), _flat(want)
  assert sorted(got) == sorted(want)
  for name in want:
    np.testing.assert_array_equal(got[name], want[name], err_msg=name)


# ----------------------------------------------------------------------------
# The model config: shapes from config.json, the rest from gin
# ----------------------------------------------------------------------------
def test_gin_sets_the_non_shape_fields_and_config_json_the_shapes(hf_dir):
  exp = _gin_experiment(
    [
      f"TrainConfig.init_params_from = '{hf_dir}'",
      "ModelConfig.rope_theta = 40000.0",
      "ModelConfig.remat_policy = 'full'",
      "ModelConfig.mlp_chunk_size = 16",
      "ModelConfig.num_layers = 2",  # agrees with config.json: accepted
    ]
  )
  m = exp.model
  assert (m.vocab_size, m.d_model, m.num_layers, m.num_heads, m.num_kv_heads) == (
    288,
    32,
    2,
    4,
    2,
  )
  assert (m.head_dim, m.mlp_dim, m.norm_eps, m.tie_embeddings) == (8, 64, 1e-5, False)
  assert (m.rope_theta, m.remat_policy, m.mlp_chunk_size) == (40000.0, "full", 16)


def test_a_gin_shape_field_that_disagrees_with_config_json_is_an_error(hf_dir):
  with pytest.raises(ValueError, match=r"ModelConfig\.d_model = 64 disagrees with .*config\.json"):
    _gin_experiment([f"TrainConfig.init_params_from = '{hf_dir}'", "ModelConfig.d_model = 64"])
  # The same check guards a config built in Python, before any tensor is read.
  exp = _gin_experiment([f"TrainConfig.init_params_from = '{hf_dir}'"])
  wrong = exp.model.__class__(**{**exp.model.__dict__, "mlp_dim": 96})
  with pytest.raises(ValueError, match=r"model\.mlp_dim: .*config\.json gives 64, config has 96"):
    init_from.load_params(init_from.find_source(hf_dir), wrong, None)


def test_the_model_config_reads_no_tensor(hf_dir, tmp_path):
  """What --mode=compile needs (the config) comes from config.json alone."""
  bare = tmp_path / "bare"
  bare.mkdir()
  with open(os.path.join(hf_dir, "config.json")) as f:
    (bare / "config.json").write_text(f.read())
  (bare / "model.safetensors").write_bytes(b"")  # no weights at all
  exp = _gin_experiment([f"TrainConfig.init_params_from = '{bare}'"])
  assert exp.model.d_model == 32


# ----------------------------------------------------------------------------
# The parameters
# ----------------------------------------------------------------------------
def test_the_sharded_load_on_an_fsdp_tensor_mesh_equals_the_single_host_load(hf_dir):
  exp = _gin_experiment([f"TrainConfig.init_params_from = '{hf_dir}'"])
  trainer = Trainer(exp.model, _train(), mesh_lib.make_mesh(FSDP_TENSOR))
  source = init_from.find_source(hf_dir)
  assert source.kind == "hf"
  params = init_from.load_params(source, exp.model, trainer.abstract_state["params"])
  leaves, shardings = jax.tree.leaves(params), jax.tree.leaves(trainer.state_sharding["params"])
  assert all(a.sharding == s for a, s in zip(leaves, shardings))
  # Really split: the embedding [E, D] is cut over tensor (E) and fsdp (D).
  embedding = params["embedding"]
  assert embedding.addressable_shards[0].data.shape == (288 // 2, 32 // 4)
  _assert_equal_to_single_host_load(params, hf_dir)


def test_eval_on_a_fresh_workdir_scores_the_imported_parameters(hf_dir, tmp_path):
  model = init_from.hf_model_config(hf_dir, {})
  exp = train_lib.Experiment(
    model=model,
    data=DataConfig(sources=("copy",), copy_max_key_len=16),
    train=_train(init_params_from=hf_dir),
    mesh=FSDP_TENSOR,
  )
  workdir = str(tmp_path / "eval")
  train_lib.run("eval", workdir, exp)
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    (record,) = [json.loads(line) for line in f]
  assert record["step"] == 0
  # The same held-out batches through the single-host load.
  trainer = Trainer(model, exp.train, mesh_lib.make_mesh(exp.mesh))
  _, params = hf.load_pretrained(hf_dir)
  state = trainer.state_from_params(
    jax.device_put(params, trainer.state_sharding["params"]), exp.train.seed
  )
  want = train_lib.evaluate_loss(exp, trainer, state)
  np.testing.assert_allclose(record["eval/loss"], want["eval/loss"], rtol=1e-6)


def test_two_processes_load_exactly_what_one_host_does(hf_dir, tmp_path):
  """Two processes of 4 devices start a run from the HF directory. Its first step
  runs at learning rate 0 (the warm-up starts at 0), so the step-1 checkpoint
  holds the loaded parameters unchanged: they must equal the single-host load."""
  workdir = str(tmp_path / "two")
  gin_file = tmp_path / "two.gin"
  gin_file.write_text(
    "\n".join(
      [
        "include 'gin/runs/base.gin'",
        "LOCAL_DEVICES = 8",
        "MeshConfig.fsdp = 4",
        "MeshConfig.tensor = 2",
        "MeshConfig.context = 1",
        "DataConfig.sources = ('copy',)",
        "DataConfig.copy_max_key_len = 16",
        "TrainConfig.batch_size = 4",
        "TrainConfig.seq_len = 64",
        "TrainConfig.steps = 1",
        "TrainConfig.warmup_steps = 1",
        "TrainConfig.log_every = 1",
        "TrainConfig.checkpoint_every = 0",
        "TrainConfig.async_checkpoint = False",
        "TrainConfig.context_parallel_strategy = 'none'",
        "TrainConfig.attention_options = @AttentionOptions()",
        "AttentionOptions.backend = 'reference'",
        f"TrainConfig.init_params_from = '{hf_dir}'",
      ]
    )
  )
  env = dict(os.environ, PYTHON=sys.executable)
  env.pop("XLA_FLAGS", None)  # each process sets its own device count
  proc = subprocess.run(
    ["bash", os.path.join(ROOT, "scripts/launch_local.sh"), "2", str(gin_file), workdir],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=400,
  )
  logs = []
  for i in range(2):
    with open(os.path.join(workdir, "logs", f"process_{i}.log")) as f:
      logs.append(f.read())
  assert proc.returncode == 0, (proc.stderr, logs[0][-3000:], logs[1][-3000:])
  for log in logs:
    assert "Started at step 0 from the parameters of the Hugging Face checkpoint" in log
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    (record,) = [json.loads(line) for line in f]
  assert record["learning_rate"] == 0.0 and np.isfinite(record["loss"])

  # Read the step-1 checkpoint back on this (single) process.
  exp = _gin_experiment([f"TrainConfig.init_params_from = '{hf_dir}'"])
  trainer = Trainer(exp.model, _train(), mesh_lib.make_mesh(FSDP_TENSOR))
  source = init_from.find_source(workdir)
  assert (source.kind, source.step) == ("lctx", 1)
  params = init_from.load_params(source, exp.model, trainer.abstract_state["params"])
  _assert_equal_to_single_host_load(params, hf_dir)

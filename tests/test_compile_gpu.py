"""Compile-only H100 devices (lctx.sizing.gpu): needs the CUDA plugin, not a GPU.

Skipped where jax-cuda12-plugin is not installed (the default environment);
see `lctx.sizing.gpu.install_hint()`.
"""

import json
import os

import numpy as np
import pytest

pytest.importorskip("jax_plugins.xla_cuda12", reason="needs jax-cuda12-plugin (no GPU needed)")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from lctx.sizing import gpu as compile_gpu  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def h100x8():
  return compile_gpu.gpu_topology_devices("h100", 8)


def test_devices(h100x8):
  assert len(h100x8) == 8
  assert {d.device_kind for d in h100x8} == {"NVIDIA H100 80GB HBM3"}
  assert {d.platform for d in h100x8} == {"gpu"}


def test_sharded_matmul_compiles(h100x8):
  mesh = Mesh(np.array(h100x8).reshape(2, 4), ("data", "model"))

  def f(x, w):
    return jnp.tanh(x @ w).sum()

  x = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P("data", None)))
  w = jax.ShapeDtypeStruct(
    (512, 1024), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "model"))
  )
  compiled = jax.jit(f).lower(x, w).compile()
  m = compiled.memory_analysis()
  assert m.temp_size_in_bytes > 0
  # Per device: x is [128, 512] and w is [512, 256], bf16.
  assert m.argument_size_in_bytes == (128 * 512 + 512 * 256) * 2
  assert "all-reduce" in compiled.as_text()


def test_topology_shape():
  assert compile_gpu.topology_shape("h100", 8) == "1x1x8"
  assert compile_gpu.topology_shape("h100", 4) == "1x1x4"
  assert compile_gpu.topology_shape("h200", 16) == "1x2x8"
  with pytest.raises(ValueError):
    compile_gpu.topology_shape("h100", 12)


def test_unknown_kind():
  with pytest.raises(ValueError):
    compile_gpu.gpu_topology_devices("v5p", 8)


# --mode=compile for a GPU node: the train step of a tiny Llama on 8 compile-only H100s.
_TINY = [
  "ModelConfig.vocab_size = 512",
  "ModelConfig.d_model = 256",
  "ModelConfig.num_layers = 4",
  "ModelConfig.num_heads = 32",
  "ModelConfig.num_kv_heads = 8",
  "ModelConfig.head_dim = 64",
  "ModelConfig.mlp_dim = 512",
  "ModelConfig.mlp_chunk_size = 4096",
  "ModelConfig.layer_input_pieces = 1",
  "TrainConfig.loss_chunk_size = 1024",
  "TrainConfig.offload_params = False",
  "TrainConfig.offload_optimizer_state = False",
]


def _experiment(params):
  import gin  # pylint: disable=g-import-not-at-top

  from lctx import configs, gin_utils  # pylint: disable=g-import-not-at-top

  gin.clear_config()
  gin_utils.parse(["gin/long_h100.gin"], list(params), [ROOT])
  exp = configs.experiment()
  gin.clear_config()
  return exp


def test_compile_mode_on_a_gpu_node(tmp_path, capsys):
  from lctx.sizing import compile as compile_lib  # pylint: disable=g-import-not-at-top

  exp = _experiment([*_TINY, "TrainConfig.seq_len = 16384"])
  record = compile_lib.run_compile(exp, str(tmp_path), topology="h100x8")
  saved = json.loads((tmp_path / "compile.json").read_text())
  assert saved["fits"] is True and saved["devices"] == 8 and saved["devices_per_chip"] == 1
  assert saved["device_kind"] == "NVIDIA H100 80GB HBM3" and saved["strategy"] == "ulysses"
  assert saved["hbm_bytes_per_device"] == compile_gpu.GPU_SPECS["h100"].device_memory_size
  d = saved["per_device"]
  assert d["temp_bytes"] > 0 and d["host_bytes"] > 0  # offloaded layer inputs
  assert (
    d["total_bytes"] == d["argument_bytes"] + d["output_bytes"] - d["alias_bytes"] + d["temp_bytes"]
  )
  assert any("compile-only GPU devices" in n for n in saved["notes"])
  assert record["attention_backend"] == "blockwise"  # packed segments: no cuDNN path
  assert "fits:" in capsys.readouterr().out


def test_stage_projections_shrink_the_layer_working_set():
  """UPipe with per-stage projections (ContextOptions.stage_projections)
  against the stages slicing the layer's whole q/k/v: the compiled temporaries
  fall (no whole-layer q, attention output or their gradients)."""
  from lctx.parallel import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
  from lctx.trainer import Trainer  # pylint: disable=g-import-not-at-top

  devices = compile_gpu.gpu_topology_devices("h100", 8)
  temps = {}
  for staged in (False, True):
    exp = _experiment(
      [
        *_TINY,
        "TrainConfig.seq_len = 262144",
        f"ContextOptions.stage_projections = {staged}",
      ]
    )
    trainer = Trainer(exp.model, exp.train, mesh_lib.make_mesh(exp.mesh, devices=devices))
    compiled = trainer.lower_train_step().compile()
    temps[staged] = compiled.memory_analysis().temp_size_in_bytes
  assert temps[True] < 0.9 * temps[False], temps

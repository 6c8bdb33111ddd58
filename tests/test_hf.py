"""Hugging Face checkpoints in and out, against transformers itself (PyTorch, CPU).

Tiny random models of each family are built and saved by transformers; lctx loads
them and its float32 logits must match transformers' within 2e-4 of the largest
logit. Norm weights and biases are randomised (they initialise to 1 and 0), so a
dropped or misplaced weight shows. Exports are reloaded by transformers.
"""

import json
import os

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from lctx.models import Transformer, hf, reference_attention_fn
from lctx.parallel import mesh as mesh_lib

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

T = 24  # sequence length of the logit checks
TINY = dict(
  vocab_size=97,
  hidden_size=32,
  intermediate_size=48,
  num_hidden_layers=3,
  num_attention_heads=4,
  num_key_value_heads=2,
  initializer_range=0.2,  # peaky attention, so RoPE and masks matter
  max_position_embeddings=256,
)


GEMMA3_TINY = dict(
  num_hidden_layers=6,
  head_dim=8,
  layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
  sliding_window=5,
  query_pre_attn_scalar=12,
  rope_parameters={
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
  },
)


def _build(tmp_path, family: str, name: str = "hf", **overrides):
  """A random transformers model of `family` saved (sharded) under tmp_path/name."""
  config_cls = getattr(transformers, f"{family}Config")
  cfg = config_cls(**{**TINY, **overrides})
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float()
  with torch.no_grad():
    for pname, p in model.named_parameters():
      if "norm" in pname:
        p.copy_(1.0 + 0.3 * torch.randn_like(p))
      elif pname.endswith("bias"):
        p.copy_(0.3 * torch.randn_like(p))
  model.eval()
  path = str(tmp_path / name)
  model.save_pretrained(path, max_shard_size="40KB")
  return path, model


def _inputs(seed=0):
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, TINY["vocab_size"], (2, T)).astype(np.int32)
  positions = np.broadcast_to(np.arange(T, dtype=np.int32) + 5, (2, T)).copy()
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


FAMILIES = {
  "llama_plain": ("Llama", {}),
  "llama_llama3": (
    "Llama",
    dict(
      rope_theta=500000.0,
      rope_scaling=dict(
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=64,
      ),
    ),
  ),
  "llama_yarn": (
    "Llama",
    dict(
      rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32),
      max_position_embeddings=128,
    ),
  ),
  "llama_linear": ("Llama", dict(rope_scaling=dict(rope_type="linear", factor=3.0))),
  "llama_tied": ("Llama", dict(tie_word_embeddings=True, num_key_value_heads=1)),
  "mistral_window": ("Mistral", dict(sliding_window=5)),
  "qwen2_bias_tied": ("Qwen2", dict(tie_word_embeddings=True)),
  "qwen3_qk_norm": ("Qwen3", dict(head_dim=12)),
  # Gemma 3: two sliding layers per global one (scanned twice), a window shorter
  # than T, RoPE per layer type (linear scaling on the global layers only), a
  # query_pre_attn_scalar other than head_dim, and a final logit cap.
  "gemma3_pattern": ("Gemma3Text", dict(GEMMA3_TINY, final_logit_softcapping=3.0)),
  "gemma3_untied": ("Gemma3Text", dict(GEMMA3_TINY, tie_word_embeddings=False)),
}


@pytest.mark.parametrize("case", sorted(FAMILIES))
def test_logits_match_transformers(tmp_path, case):
  family, overrides = FAMILIES[case]
  path, model = _build(tmp_path, family, **overrides)
  assert os.path.exists(os.path.join(path, hf.INDEX_FILE))  # sharded
  config, params = hf.load_pretrained(path)
  ids, positions = _inputs()
  _assert_close(_lctx_logits(config, params, ids, positions), _hf_logits(model, ids, positions))


def test_config_mapping(tmp_path):
  path, _ = _build(tmp_path, "Qwen3", head_dim=12)
  c = hf.load_config(path)
  assert (c.d_model, c.num_heads, c.num_kv_heads, c.head_dim, c.qk_norm) == (32, 4, 2, 12, True)
  path, _ = _build(tmp_path, "Mistral", "m", sliding_window=5)
  assert hf.load_config(path).attention_pattern == (5,)


@pytest.mark.parametrize("case", ["llama_llama3", "mistral_window", "qwen2_bias_tied",
                                  "qwen3_qk_norm", "gemma3_pattern", "gemma3_untied"])  # fmt: skip
def test_export_reloads_in_transformers(tmp_path, case):
  family, overrides = FAMILIES[case]
  path, model = _build(tmp_path, family, **overrides)
  config, params = hf.load_pretrained(path)
  out = str(tmp_path / "export")
  files = hf.save_pretrained(out, config, params, dtype="float32", max_shard_bytes=30_000)
  assert len(files) > 2 and os.path.exists(os.path.join(out, hf.INDEX_FILE))
  reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
    out, output_loading_info=True, attn_implementation="eager"
  )
  assert not info["missing_keys"] and not info["unexpected_keys"], info
  assert type(reloaded) is type(model)
  ids, positions = _inputs(1)
  _assert_close(_hf_logits(reloaded, ids, positions), _hf_logits(model, ids, positions), 1e-6)
  # And lctx reads its own export back to the same tree.
  config2, params2 = hf.load_pretrained(out)
  assert config2 == config
  jax.tree.map(np.testing.assert_array_equal, params2, params)


def test_export_bfloat16_single_file(tmp_path):
  path, model = _build(tmp_path, "Llama", **FAMILIES["llama_llama3"][1])
  config, params = hf.load_pretrained(path)
  out = str(tmp_path / "bf16")
  hf.save_pretrained(out, config, params)  # bfloat16, one file
  assert os.path.exists(os.path.join(out, hf.SINGLE_FILE))
  assert json.load(open(os.path.join(out, "config.json")))["torch_dtype"] == "bfloat16"
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
  assert next(reloaded.parameters()).dtype == torch.bfloat16
  ids, positions = _inputs(2)
  _assert_close(
    _hf_logits(reloaded.float(), ids, positions), _hf_logits(model, ids, positions), 3e-2
  )


# ----------------------------------------------------------------------------
# Refusals: each names what is wrong, before any tensor is read.
# ----------------------------------------------------------------------------
def _single_file_model(tmp_path):
  path, _ = _build(tmp_path, "Llama")
  tensors = {}
  for f in os.listdir(path):
    if f.endswith(".safetensors"):
      tensors.update(load_file(os.path.join(path, f)))
      os.remove(os.path.join(path, f))
  os.remove(os.path.join(path, hf.INDEX_FILE))
  return path, tensors


def _edit_config(path, **changes):
  file = os.path.join(path, "config.json")
  cfg = json.load(open(file))
  cfg.update(changes)
  json.dump(cfg, open(file, "w"))


def test_refuses_wrong_shape_missing_tensor_and_dtype(tmp_path):
  path, tensors = _single_file_model(tmp_path)
  file = os.path.join(path, hf.SINGLE_FILE)
  name = "model.layers.1.mlp.up_proj.weight"
  save_file({**tensors, name: tensors[name][:-1]}, file)
  with pytest.raises(ValueError, match=rf"{name} in model.safetensors has shape \[47, 32\]"):
    hf.open_pretrained(path)
  save_file({k: v for k, v in tensors.items() if k != name}, file)
  with pytest.raises(ValueError, match=rf"missing tensor\(s\) {name}"):
    hf.load_pretrained(path)
  save_file({**tensors, name: tensors[name].astype(np.int32)}, file)
  with pytest.raises(ValueError, match=rf"{name} .* dtype I32"):
    hf.load_pretrained(path)


def test_refuses_truncated_file(tmp_path):
  path, _ = _build(tmp_path, "Llama")
  shard = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))[1]
  with open(os.path.join(path, shard), "r+b") as f:
    f.truncate(os.path.getsize(os.path.join(path, shard)) - 100)
  with pytest.raises(ValueError, match=rf"{shard}: unreadable safetensors file"):
    hf.load_pretrained(path)


@pytest.mark.parametrize(
  "changes, message",
  [
    (dict(architectures=["MixtralForCausalLM"]), "MixtralForCausalLM .* mixture-of-experts"),
    (dict(architectures=["Gemma2ForCausalLM"]), "Gemma2ForCausalLM .* softcapping"),
    (dict(architectures=["GPT2LMHeadModel"]), "'GPT2LMHeadModel' is not supported"),
    (dict(rope_parameters=dict(rope_type="dynamic", factor=2.0)), "rope_type 'dynamic'"),
    (dict(rope_parameters=None, rope_scaling=dict(type="longrope")), "rope_type 'longrope'"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(attention_bias=True), "attention_bias=True"),
    (dict(num_local_experts=8), "num_local_experts=8"),
  ],
)
def test_refuses_unsupported_configs(tmp_path, changes, message):
  path, _ = _build(tmp_path, "Llama")
  _edit_config(path, **changes)
  with pytest.raises(ValueError, match=message):
    hf.load_pretrained(path)


def test_gemma3_config_mapping(tmp_path):
  path, _ = _build(tmp_path, "Gemma3Text", **GEMMA3_TINY)
  c = hf.load_config(path)
  assert c.attention_pattern == (5, 5, None) and c.num_repeats == 2
  assert (c.rope_theta, c.rope_scaling_dict) == (1e6, {"factor": 8.0, "rope_type": "linear"})
  assert (c.sliding_rope_theta, c.sliding_rope_scaling) == (1e4, ())
  assert (c.query_pre_attn_scalar, c.mlp_activation, c.tie_embeddings) == (12.0, "gelu_tanh", True)
  assert c.norm_plus_one and c.embed_scale and c.post_sublayer_norms and c.qk_norm


def test_gemma3_published_config_equals_the_gin_model_file():
  """google/gemma-3-4b-pt's config.json (its text_config keys; the rest are
  transformers' defaults) maps to gin/models/gemma3_4b.gin."""
  from lctx import configs

  published = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "model_type": "gemma3",
    "text_config": {
      "hidden_size": 2560,
      "intermediate_size": 10240,
      "model_type": "gemma3_text",
      "num_hidden_layers": 34,
      "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
      "sliding_window": 1024,
    },
  }
  gin_config = configs.model_config("gemma3_4b", dtype="float32", remat_policy="none")
  assert hf.config_from_hf(published) == gin_config


@pytest.mark.parametrize(
  "changes, message",
  [
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping=50.0"),
    (dict(use_bidirectional_attention=True), "bidirectional attention"),
    (dict(hidden_activation="gelu"), "hidden_activation='gelu'"),
  ],
)
def test_gemma3_refusals(tmp_path, changes, message):
  path, _ = _build(tmp_path, "Gemma3Text", **GEMMA3_TINY)
  _edit_config(path, **changes)
  with pytest.raises(ValueError, match=message):
    hf.load_config(path)


def test_gemma3_multimodal_checkpoint_reads_its_language_model(tmp_path):
  text = transformers.Gemma3TextConfig(**{**TINY, **GEMMA3_TINY})
  vision = transformers.SiglipVisionConfig(
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    image_size=28,
    patch_size=14,
  )
  cfg = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
  torch.manual_seed(0)
  model = transformers.Gemma3ForConditionalGeneration(cfg).float()
  with torch.no_grad():
    for pname, p in model.named_parameters():
      if "norm" in pname:
        p.copy_(1.0 + 0.3 * torch.randn_like(p))
  model.eval()
  path = str(tmp_path / "mm")
  model.save_pretrained(path)
  config, params = hf.load_pretrained(path)  # the vision tower's tensors stay unread
  assert config.post_sublayer_norms and config.attention_pattern == (5, 5, None)
  ids, positions = _inputs()
  _assert_close(_lctx_logits(config, params, ids, positions), _hf_logits(model, ids, positions))


def test_config_must_match_checkpoint_shapes(tmp_path):
  path, _ = _build(tmp_path, "Llama")
  config = hf.load_config(path)
  import dataclasses

  wrong = dataclasses.replace(config, mlp_dim=64)
  with pytest.raises(ValueError, match="mlp_dim: checkpoint has 48, config has 64"):
    hf.open_pretrained(path, wrong)


# ----------------------------------------------------------------------------
# Sharded loading: each device's slice read on its own equals the whole load.
# ----------------------------------------------------------------------------
def test_sharded_load_equals_single_host_load(tmp_path, monkeypatch):
  import dataclasses

  import flax.linen as nn

  path, _ = _build(tmp_path, "Qwen3", head_dim=12, vocab_size=96)
  config, params = hf.load_pretrained(path)
  config = dataclasses.replace(config, param_dtype="bfloat16")  # reads convert
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(fsdp=4, tensor=2, context=1))
  ids = jax.ShapeDtypeStruct((1, 2), np.int32)
  boxed = jax.eval_shape(lambda i: Transformer(config).init(jax.random.key(0), i, i, i), ids)
  with nn.logical_axis_rules(mesh_lib.LOGICAL_RULES):
    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh)["params"]
  reads = []
  read = hf.PretrainedReader.read_hf
  monkeypatch.setattr(
    hf.PretrainedReader, "read_hf", lambda self, n, i: reads.append(n) or read(self, n, i)
  )
  loaded = hf.load_pretrained_sharded(path, config, shardings)
  # wq [R, D, N, H] is split 4 ways over D and 2 over N: 8 distinct slices, each
  # read from the file on its own (one read per device and layer).
  wq = loaded["layers"]["layer_0"]["attention"]["wq"]
  assert len({str(s.index) for s in wq.addressable_shards}) == 8
  assert reads.count("model.layers.0.self_attn.q_proj.weight") == 8
  for kp, arr in jax.tree_util.tree_leaves_with_path(loaded):
    want, sharding = params, shardings
    for k in kp:
      want, sharding = want[k.key], sharding[k.key]
    assert arr.dtype == np.dtype("bfloat16") and arr.sharding == sharding, kp
    np.testing.assert_array_equal(np.asarray(arr), want.astype(arr.dtype), err_msg=str(kp))


def test_lazy_reader_reads_only_slices(tmp_path):
  path, _ = _build(tmp_path, "Llama")
  reader = hf.open_pretrained(path)
  _, params = hf.load_pretrained(path)
  t = reader.tensor("layers/layer_0/attention/wo")  # [R, N, H, D]
  assert t.shape == (3, 4, 8, 32)
  np.testing.assert_array_equal(
    t[1:3, 1:3, 2:5, 7:20], params["layers"]["layer_0"]["attention"]["wo"][1:3, 1:3, 2:5, 7:20]
  )
  calls = []
  read = reader.read_hf
  reader.read_hf = lambda name, index: calls.append((name, index)) or read(name, index)
  t[2, 1:2]
  assert calls == [("model.layers.2.self_attn.o_proj.weight", (slice(0, 32), slice(8, 16)))]


# ----------------------------------------------------------------------------
# --mode=export_hf: a workdir's checkpoint, as transformers reads it.
# ----------------------------------------------------------------------------
def test_export_mode_writes_a_checkpoint_transformers_runs(tmp_path):
  from lctx import checkpoint as ckpt_lib
  from lctx import train as train_lib
  from lctx.data import DataConfig
  from lctx.models import ModelConfig
  from lctx.trainer import TrainConfig, Trainer

  model = ModelConfig(
    vocab_size=96,
    d_model=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    mlp_dim=64,
    attention_pattern=(6,),  # fmt: skip
  )
  exp = train_lib.Experiment(
    model=model,
    data=DataConfig(sources=("copy",), copy_max_key_len=16),
    train=TrainConfig(batch_size=4, seq_len=32, async_checkpoint=False),
    mesh=mesh_lib.MeshConfig(fsdp=4, tensor=2, context=1),
  )
  workdir = str(tmp_path / "w")
  trainer = Trainer(model, exp.train, mesh_lib.make_mesh(exp.mesh))
  checkpointer = ckpt_lib.Checkpointer(workdir, save_every=1, keep=3, async_save=False)

  def random_state(seed):  # the trainer's state tree and shardings (init_state compiles)
    rng = np.random.default_rng(seed)
    fill = lambda a: rng.normal(size=a.shape).astype(a.dtype)  # noqa: E731
    return jax.tree.map(lambda a: jax.device_put(fill(a), a.sharding), trainer.abstract_state)

  states = {s: random_state(s) for s in (3, 7)}
  for step, state in states.items():
    checkpointer.save(step, state, {}, ckpt_lib.experiment_meta(exp), wait=True)
  checkpointer.close()
  from lctx import export  # pylint: disable=g-import-not-at-top

  with pytest.raises(ValueError, match=r"--export_step=5: .* has steps \[3, 7\]"):
    export.run_export_hf(exp, workdir, export_dir=str(tmp_path / "x"), step=5)
  ids, positions = _inputs(3)
  ids = ids % model.vocab_size
  for step, kwargs in ((7, {}), (3, {"step": 3})):
    out = str(tmp_path / f"export{step}")
    record = export.run_export_hf(exp, workdir, export_dir=out, dtype="float32", **kwargs)
    assert record["step"] == step
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
      out, output_loading_info=True, attn_implementation="eager"
    )
    assert type(reloaded).__name__ == "MistralForCausalLM" and not info["missing_keys"]
    params = jax.device_get(states[step]["params"])
    _assert_close(_hf_logits(reloaded, ids, positions), _lctx_logits(model, params, ids, positions))


# ----------------------------------------------------------------------------
# Two processes (4 devices each, one 8-device mesh): each reads only its slices,
# and an export gathers across processes; the result equals the files read.
# ----------------------------------------------------------------------------
_WORKER = """
import sys
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
port, pid, src, dst = sys.argv[1:]
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=int(pid))
import flax.linen as nn
import numpy as np
from lctx.models import Transformer, hf
from lctx.parallel import mesh as mesh_lib

config = hf.load_config(src)
mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(fsdp=4, tensor=2, context=1))
ids = jax.ShapeDtypeStruct((1, 2), np.int32)
boxed = jax.eval_shape(lambda i: Transformer(config).init(jax.random.key(0), i, i, i), ids)
with nn.logical_axis_rules(mesh_lib.LOGICAL_RULES):
  shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh)["params"]
reads = []
read = hf.PretrainedReader.read_hf
hf.PretrainedReader.read_hf = lambda self, n, i: reads.append(n) or read(self, n, i)
params = hf.load_pretrained_sharded(src, config, shardings)
wq = params["layers"]["layer_0"]["attention"]["wq"]
assert not wq.is_fully_addressable and len(wq.addressable_shards) == 4
# This process read the layer-0 q_proj slices of its own 4 devices only.
assert reads.count("model.layers.0.self_attn.q_proj.weight") == 4, reads
hf.save_pretrained(dst, config, params, dtype="float32", max_shard_bytes=30_000)
print("worker", pid, "done")
"""


def test_two_processes_load_and_export_what_one_process_reads(tmp_path):
  import socket
  import subprocess
  import sys

  path, _ = _build(tmp_path, "Qwen2", tie_word_embeddings=True, vocab_size=96)
  out = str(tmp_path / "export2")
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=root)
  env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
  procs = [
    subprocess.Popen(
      [sys.executable, "-c", _WORKER, str(port), str(i), path, out],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(2)
  ]
  logs = [p.communicate(timeout=300)[0] for p in procs]
  for p, log in zip(procs, logs):
    assert p.returncode == 0, log[-3000:]
  _, want = hf.load_pretrained(path)
  _, got = hf.load_pretrained(out)
  jax.tree.map(np.testing.assert_array_equal, got, want)

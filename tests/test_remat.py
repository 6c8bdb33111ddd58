"""Remat and offload policies: named tags, presets, 'custom' and layer groups.

Every policy must give the loss and gradients of no remat (CPU, tiny model), and
change what the compiled step keeps where it says (the real TPU compiler on
compile-only 'v5p:2x2x1' devices: host bytes appear with offload, device temp
falls, a group of k layers offloads 1/k of the inputs).
"""

import dataclasses

import pytest

# Read when libtpu loads (the first topology call), so before any test runs.
from lctx.kernels import AttentionOptions
from lctx.sizing import devices as devices_lib  # noqa: E402  (no jax import)

devices_lib.compile_only_env()

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from lctx import models  # noqa: E402
from lctx.models.config import REMAT_POLICIES, REMAT_TAGS  # noqa: E402
from lctx.models.transformer import Transformer  # noqa: E402

CPU = models.ModelConfig(
  vocab_size=64, d_model=32, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64
)
CUSTOM = (("layer_input", "offload"), ("query_proj", "device"), ("mlp_hidden", "offload"))
B, T = 2, 16


def _batch():
  inputs = jax.random.randint(jax.random.key(1), (B, T), 0, CPU.vocab_size)
  pos = jnp.concatenate([jnp.arange(10), jnp.arange(T - 10)])  # two packed documents
  seg = jnp.concatenate([jnp.ones(10, jnp.int32), jnp.full(T - 10, 2, jnp.int32)])
  return inputs, jnp.broadcast_to(pos, (B, T)), jnp.broadcast_to(seg, (B, T))


def _loss_and_grads(config, params):
  inputs, pos, seg = _batch()
  model = Transformer(config)

  def loss(p):
    logits = model.apply(p, inputs, pos, seg)
    return jnp.mean(jax.nn.log_softmax(logits)[..., 0])

  return jax.jit(jax.value_and_grad(loss))(params)


@pytest.fixture(scope="module")
def reference():
  inputs, pos, seg = _batch()
  params = Transformer(CPU).init(jax.random.key(0), inputs, pos, seg)
  return params, _loss_and_grads(CPU, params)


def _check_same(config, reference, rtol=1e-5, atol=1e-6):
  params, (want_loss, want_grads) = reference
  got_loss, got_grads = _loss_and_grads(config, params)
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=rtol, atol=atol),
    nn.unbox(got_grads),
    nn.unbox(want_grads),
  )


def _cfg(policy, group=1):
  custom = CUSTOM if policy == "custom" else ()
  return dataclasses.replace(CPU, remat_policy=policy, remat_custom=custom, remat_group_size=group)


# The default run: one plain, one offloading preset and 'custom'; the rest is slow.
FAST = ("full", "offload_layer_inputs", "custom")


@pytest.mark.parametrize(
  "policy,group",
  [(p, 1) for p in FAST]
  + [("custom", 4)]
  + [pytest.param(p, 1, marks=pytest.mark.slow) for p in REMAT_POLICIES if p not in FAST]
  + [
    pytest.param(p, k, marks=pytest.mark.slow)
    for p in ("full", "dots", "save_dots", "offload_layer_inputs", "qkv_proj_offloaded")
    for k in (2, 4)
  ],
)
def test_policy_matches_no_remat(policy, group, reference):
  if policy == "none":
    pytest.skip("the reference itself")
  _check_same(_cfg(policy, group), reference)


@pytest.mark.parametrize("group", [1, 2])
def test_layer_input_in_pieces_matches_no_remat(group, reference):
  """layer_input_pieces splits the saved (offloaded) input along d_model."""
  _check_same(
    dataclasses.replace(_cfg("offload_layer_inputs", group), layer_input_pieces=4), reference
  )


def test_group_inner_inputs_offloaded_match_no_remat(reference):
  """remat_group_inner_inputs='offload': the group's layers send their inputs to
  host as the group is recomputed; values and gradients are unchanged."""
  cfg = dataclasses.replace(_cfg("offload_layer_inputs", 2), remat_group_inner_inputs="offload")
  _check_same(cfg, reference)


HYBRID = dataclasses.replace(
  CPU,
  num_layers=8,
  linear_num_key_heads=2,
  linear_num_value_heads=4,
  linear_key_head_dim=8,
  linear_value_head_dim=8,
)


@pytest.mark.parametrize(
  "pattern",
  [
    ("linear_attention",) * 3 + ("full_attention",),  # Qwen3.5's 3:1
    ("full_attention", "linear_attention", "linear_attention", "full_attention"),
  ],
)
def test_hybrid_group_inner_inputs_offloaded_match_no_remat(pattern):
  """remat_group_inner_inputs='offload' in a block of several layers (each run of
  same-kind layers scanned over its stacked params): values and gradients of no
  remat, and the parameter tree is unchanged."""
  plain = dataclasses.replace(HYBRID, layer_types=pattern * 2)
  inputs, pos, seg = _batch()
  params = Transformer(plain).init(jax.random.key(0), inputs, pos, seg)
  late = dataclasses.replace(
    plain,
    remat_policy="offload_layer_inputs",
    remat_group_size=4,
    remat_group_inner_inputs="offload",
    layer_input_pieces=2,
  )
  assert jax.tree.structure(Transformer(late).init(jax.random.key(0), inputs, pos, seg)) == (
    jax.tree.structure(params)
  )
  # Looser than the default: the Gated DeltaNet's float32 chunk math is fused
  # differently when recomputed (the existing 'offload' differs from no remat by
  # the same ~6e-5 here); a misplaced input or parameter is off by O(1e-2).
  _check_same(late, (params, _loss_and_grads(plain, params)), rtol=1e-4, atol=1e-4)


def test_group_keeps_the_scanned_param_layout(reference):
  params, _ = reference
  inputs, pos, seg = _batch()
  grouped = Transformer(_cfg("full", 2)).init(jax.random.key(0), inputs, pos, seg)
  assert jax.tree.structure(grouped) == jax.tree.structure(params)
  is_box = lambda x: isinstance(x, nn.meta.AxisMetadata)  # noqa: E731
  for a, b in zip(
    jax.tree.leaves(grouped, is_leaf=is_box), jax.tree.leaves(params, is_leaf=is_box)
  ):
    assert a.value.shape == b.value.shape and a.names == b.names, (a.names, b.names)


def test_presets_and_custom_choices():
  assert _cfg("full").remat_choices == dict.fromkeys(REMAT_TAGS, "remat")
  assert _cfg("offload_layer_inputs").remat_choices["layer_input"] == "offload"
  custom = _cfg("custom").remat_choices
  assert custom["query_proj"] == "device" and custom["mlp_hidden"] == "offload"
  assert custom["key_proj"] == "remat"
  assert _cfg("dots").remat_choices is None
  # Gin may give lists; the config stays hashable.
  cfg = dataclasses.replace(CPU, remat_policy="custom", remat_custom=[["layer_input", "device"]])
  assert cfg.remat_custom == (("layer_input", "device"),) and hash(cfg)


@pytest.mark.parametrize(
  "overrides,message",
  [
    (dict(remat_policy="some"), "remat_policy must be one of"),
    (dict(remat_policy="custom", remat_custom=(("query", "device"),)), "unknown tag 'query'"),
    (
      dict(remat_policy="custom", remat_custom=(("query_proj", "host"),)),
      "choice 'host' for 'query_proj'",
    ),
    (
      dict(remat_policy="custom", remat_custom=(("query_proj", "device"),) * 2),
      "more than once",
    ),
    (dict(remat_policy="custom", remat_custom=("query_proj",)), r"\(tag, choice\) pairs"),
    (dict(remat_policy="full", remat_custom=(("query_proj", "device"),)), "remat_policy='custom'"),
    (dict(remat_policy="full", remat_group_size=3), r"remat_group_size \(3\).*divide num_layers"),
    (dict(remat_policy="none", remat_group_size=2), "needs a remat policy"),
    (dict(remat_policy="full", remat_group_size=2, scan_layers=False), "scan_layers=True"),
    (dict(remat_policy="full", remat_group_size=0), "remat_group_size must be"),
    (
      dict(remat_policy="dots", remat_group_size=2, remat_group_inner_inputs="offload"),
      "needs a per-tag remat policy",
    ),
    (dict(remat_policy="full", remat_group_inner_inputs="host"), "must be 'device' or 'offload'"),
    (dict(layer_input_pieces=3), r"layer_input_pieces must be a positive divisor of d_model"),
  ],
)
def test_invalid_remat_configs_raise_clear_errors(overrides, message):
  with pytest.raises(ValueError, match=message):
    dataclasses.replace(CPU, **overrides)


# ----------------------------------------------------------------------------
# What the TPU compiler keeps where (compile-only devices, no TPU needed)
# ----------------------------------------------------------------------------
# bf16 activations; 16 layers; 4 rows of 1024 tokens on 4 devices (fsdp).
TPU = models.ModelConfig(
  vocab_size=256,
  d_model=512,
  num_layers=16,
  num_heads=4,
  num_kv_heads=2,
  head_dim=64,
  mlp_dim=256,
  dtype="bfloat16",
)
TOKENS_PER_DEVICE = 1024


def _tpu_memory(
  policy, group=1, custom=(), config=TPU, seq_len=TOKENS_PER_DEVICE, compile_step=True
):
  from lctx.parallel import mesh as mesh_lib
  from lctx.sizing import tpu as tpu_lib
  from lctx.trainer import TrainConfig, Trainer

  try:
    devices = tpu_lib.topology_devices("v5p:2x2x1")
  except RuntimeError as err:  # libtpu missing
    pytest.skip(str(err))
  cfg = dataclasses.replace(
    config, remat_policy=policy, remat_custom=custom, remat_group_size=group
  )
  train = TrainConfig(batch_size=4, seq_len=seq_len, context_parallel_strategy="none")
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(fsdp=4, context=1), devices=devices)
  trainer = Trainer(cfg, train, mesh)
  return trainer.lower_train_step().compile().memory_analysis() if compile_step else trainer


def test_tpu_offload_moves_layer_inputs_to_host():
  # 4,096 tokens per device: at 1,024 the inputs (1 MiB per layer) are smaller than
  # what scheduling moves about, and since the loss reduce-scatters the
  # unembedding's gradient (lctx/loss.py) 'full' compiles to fewer temporaries
  # there than 'offload_layer_inputs' (30.9 against 35.0 MB; 190.9 against 100.6
  # at 4,096).
  d, layers, tok = TPU.d_model, TPU.num_layers, 4 * TOKENS_PER_DEVICE
  inputs_bytes = layers * tok * d * 2  # bf16 layer inputs of every layer, per device
  full = _tpu_memory("full", seq_len=tok)
  offload = _tpu_memory("offload_layer_inputs", seq_len=tok)
  assert full.host_temp_size_in_bytes == 0
  assert offload.host_temp_size_in_bytes == inputs_bytes
  assert offload.temp_size_in_bytes < full.temp_size_in_bytes


@pytest.mark.slow
def test_tpu_offload_groups_divide_and_custom_tags_add_to_the_host():
  """Three more TPU compiles beside the test above, out of the default suite for time:
  groups of 4 keep a quarter of the inputs, a custom policy offloads a second
  tag, and inputs split in two pieces keep the same bytes."""
  d, layers, tok = TPU.d_model, TPU.num_layers, TOKENS_PER_DEVICE
  inputs_bytes = layers * tok * d * 2
  grouped = _tpu_memory("offload_layer_inputs", group=4)
  custom = _tpu_memory("custom", custom=(("layer_input", "offload"), ("mlp_hidden", "offload")))
  assert grouped.host_temp_size_in_bytes == inputs_bytes // 4
  assert custom.host_temp_size_in_bytes == inputs_bytes + layers * tok * TPU.mlp_dim * 2
  pieces = _tpu_memory(
    "offload_layer_inputs", config=dataclasses.replace(TPU, layer_input_pieces=2)
  )
  assert pieces.host_temp_size_in_bytes == inputs_bytes


@pytest.mark.slow
def test_tpu_group_inner_inputs_go_to_host():
  """Groups of 4 with remat_group_inner_inputs='offload': the host holds the groups'
  inputs plus the inner inputs of the group being recomputed, and the device
  temp falls (the inner inputs no longer wait on the device)."""
  # Long enough that the inputs dominate the layer's working set.
  big = dataclasses.replace(TPU, num_layers=8, mlp_dim=512)
  d, layers, tok = big.d_model, big.num_layers, 16384
  one_input = tok * d * 2
  kept = _tpu_memory("offload_layer_inputs", group=4, config=big, seq_len=tok)
  sent = _tpu_memory(
    "offload_layer_inputs",
    group=4,
    config=dataclasses.replace(big, remat_group_inner_inputs="offload"),
    seq_len=tok,
  )
  assert kept.host_temp_size_in_bytes == layers // 4 * one_input
  # What the host holds more is libtpu's choice: 10 inputs here (libtpu
  # 0.0.42.1: device temp 897.5 -> 748.6 MB at 2026-12-07); the compile-only H100 of
  # gin/long_h100.gin holds one group's (2 inputs) more.
  extra = sent.host_temp_size_in_bytes - kept.host_temp_size_in_bytes
  assert extra >= 4 * one_input, extra / one_input
  assert sent.temp_size_in_bytes < kept.temp_size_in_bytes - 2 * one_input


def test_tpu_offloaded_input_over_libtpu_limit_is_refused():
  """An offloaded layer input of >= 2**31 elements per device makes libtpu abort
  the process; the trainer refuses it first and names the setting that fixes it."""
  tokens = 2**31 // TPU.d_model  # 4 rows of this many tokens: one row per device
  with pytest.raises(ValueError, match=r"Set ModelConfig.layer_input_pieces = 2\."):
    _tpu_memory("offload_layer_inputs", seq_len=tokens, compile_step=False)
  ok = dataclasses.replace(TPU, layer_input_pieces=2)
  _tpu_memory("offload_layer_inputs", config=ok, seq_len=tokens, compile_step=False)
  _tpu_memory("full", seq_len=tokens, compile_step=False)  # nothing offloaded: no limit


@pytest.mark.slow
def test_tpu_qkv_offload_and_group_device_temp():
  # q, k, v after RoPE: (N + 2K) x H bf16 values per token and layer. With the
  # splash kernel XLA lays them out head dim minor, padded to 128 lanes (64 -> 128).
  tok, layers = TOKENS_PER_DEVICE, TPU.num_layers
  qkv = _tpu_memory("qkv_proj_offloaded")
  per_token = (TPU.num_heads + 2 * TPU.num_kv_heads) * max(TPU.head_dim, 128) * 2
  assert qkv.host_temp_size_in_bytes == layers * tok * per_token
  none, saved = _tpu_memory("none"), _tpu_memory("save_qkv_proj")
  full = _tpu_memory("full")
  assert full.temp_size_in_bytes < saved.temp_size_in_bytes < none.temp_size_in_bytes
  # Where layer inputs dominate (32 layers, 4096 tokens per device), remat over
  # groups of 4 layers keeps a quarter of them and the device temp falls by more
  # than a quarter of all inputs (the group's recompute holds some back; with
  # splash: 297.8 -> 256.9 MB, inputs 134.2 MB).
  big = dataclasses.replace(TPU, num_layers=32, mlp_dim=512)
  one = _tpu_memory("full", config=big, seq_len=4096)
  four = _tpu_memory("full", group=4, config=big, seq_len=4096)
  inputs_bytes = 32 * 4096 * big.d_model * 2
  assert four.temp_size_in_bytes < one.temp_size_in_bytes - inputs_bytes // 4


# ----------------------------------------------------------------------------
# Optimizer-state and parameter host offload (TrainConfig.offload_*)
# ----------------------------------------------------------------------------
def test_tpu_state_offload_moves_arguments_to_host():
  small = dataclasses.replace(TPU, num_layers=2, d_model=128, remat_policy="full")
  from lctx.parallel import mesh as mesh_lib
  from lctx.sizing import tpu as tpu_lib
  from lctx.trainer import TrainConfig, Trainer

  try:
    devices = tpu_lib.topology_devices("v5p:2x2x1")
  except RuntimeError as err:  # libtpu missing
    pytest.skip(str(err))
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(fsdp=4, context=1), devices=devices)

  def memory(**offload):
    train = TrainConfig(batch_size=4, seq_len=512, context_parallel_strategy="none", **offload)
    return Trainer(small, train, mesh).lower_train_step().compile().memory_analysis()

  plain = memory()
  both = memory(offload_optimizer_state=True, offload_params=True)
  assert plain.host_argument_size_in_bytes == 0
  # Parameters and both Adam moments live in host memory; only the batch (5 x 512
  # int32/f32 per device, 10 KiB), step and rng stay on the device.
  moved = plain.argument_size_in_bytes - both.argument_size_in_bytes
  assert both.host_argument_size_in_bytes == moved > 0
  assert both.argument_size_in_bytes < 16 * 1024 < moved
  assert both.host_output_size_in_bytes == both.host_argument_size_in_bytes


def test_state_offload_step_runs_on_cpu_and_matches():
  from lctx.parallel import mesh as mesh_lib
  from lctx.trainer import TrainConfig, Trainer

  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(fsdp=2, context=4))
  rng = np.random.default_rng(0)
  batch = {
    "inputs": rng.integers(0, CPU.vocab_size, (2, 64)).astype(np.int32),
    "targets": rng.integers(0, CPU.vocab_size, (2, 64)).astype(np.int32),
    "segment_ids": np.ones((2, 64), np.int32),
    "positions": np.tile(np.arange(64, dtype=np.int32), (2, 1)),
    "loss_mask": np.ones((2, 64), np.float32),
  }
  losses = []
  for offload in (False, True):
    train = TrainConfig(
      batch_size=2,
      seq_len=64,
      context_parallel_strategy="ring",
      attention_options=AttentionOptions(block_q=16, block_kv=16),
      offload_optimizer_state=offload,
      offload_params=offload,
    )
    trainer = Trainer(CPU, train, mesh)
    state = trainer.init_state(0)
    device_batch = trainer.device_batch(batch)
    for _ in range(2):
      state, metrics = trainer.train_step(state, device_batch)
    losses.append(float(metrics["loss"]))
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves((state["params"], state["opt_state"]))}
    assert kinds == ({"pinned_host"} if offload else {"device"}), kinds
  np.testing.assert_allclose(losses[1], losses[0], rtol=1e-6)


# The trainer's step compiled for TPU: attention FLOPs by the kernels' own tags.
@pytest.mark.parametrize(
  "strategy,kept",
  [
    ("ring", "save_attention_out"),
    pytest.param("ring", "attention_out_offloaded", marks=pytest.mark.slow),
    pytest.param("ulysses", "save_attention_out", marks=pytest.mark.slow),
    pytest.param("all_gather", "save_attention_out", marks=pytest.mark.slow),
  ],
)
def test_kept_attention_outputs_are_not_recomputed(strategy, kept):
  """The presets that keep the attention output keep the kernel's residuals with
  it (output and lse, tagged in the kernels' custom VJPs and the ring's): the
  compiled step's attention FLOPs equal no remat's (forward once, then the
  backward), while 'full' runs the attention forward once more. Splash on a
  v5p slice, context 4 (a compile of about a minute each on 2 busy cores)."""
  import jax

  from lctx.parallel import mesh as mesh_lib
  from lctx.sizing import compile as compile_lib
  from lctx.sizing import hlo_flops
  from lctx.sizing import tpu as tpu_lib
  from lctx.trainer import TrainConfig, Trainer

  try:
    devices = tpu_lib.topology_devices("v5p:2x2x1")
  except RuntimeError as err:  # libtpu missing
    pytest.skip(str(err))
  small = dataclasses.replace(
    TPU, num_layers=2, d_model=256, num_heads=4, num_kv_heads=4, head_dim=128
  )
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(fsdp=1, context=4), devices=devices)
  train = TrainConfig(batch_size=1, seq_len=4096, context_parallel_strategy=strategy)
  flops = {}
  for policy in ("none", "full", kept):
    trainer = Trainer(dataclasses.replace(small, remat_policy=policy), train, mesh)
    with jax.default_matmul_precision("default"):  # what Mosaic takes for bf16
      hlo = trainer.lower_train_step().compile().as_text()
    assert compile_lib.attention_backend_of(hlo) == "splash"
    flops[policy] = hlo_flops.matmul_flops(hlo)["attention_flops"]
  fwd = flops["full"] - flops["none"]  # the attention forward 'full' runs again
  assert fwd > 0.2 * flops["none"], flops
  assert flops[kept] == pytest.approx(flops["none"], rel=1e-9), flops


@pytest.mark.slow
def test_upipe_stages_replay_attention_unless_kept():
  """UPipe's head stages (ContextOptions.head_chunks) are checkpoints of their
  own: with remat 'none' the compiled step runs the attention forward once more
  than plain ulysses, 'full' once more again, and 'save_attention_out' (the kept
  output and lse) neither; the same with stage_projections and the output gate.
  Ulysses on a v5p slice, context 4, splash."""
  import jax

  from lctx.parallel import mesh as mesh_lib
  from lctx.parallel.options import ContextOptions
  from lctx.sizing import hlo_flops
  from lctx.sizing import tpu as tpu_lib
  from lctx.trainer import TrainConfig, Trainer

  try:
    devices = tpu_lib.topology_devices("v5p:2x2x1")
  except RuntimeError as err:  # libtpu missing
    pytest.skip(str(err))
  small = dataclasses.replace(
    TPU, num_layers=2, d_model=256, num_heads=8, num_kv_heads=4, head_dim=128
  )
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(fsdp=1, context=4), devices=devices)
  flops = {}
  cases = (
    (None, "none", False),
    (2, "none", False),
    (2, "full", False),
    (2, "save_attention_out", False),
    # Stages that project their own q/k/v (and output gate): the same rule.
    (2, "full", True),
    (2, "save_attention_out", True),
  )
  for chunks, policy, staged in cases:
    train = TrainConfig(
      batch_size=1,
      seq_len=4096,
      context_parallel_strategy="ulysses",
      context_options=ContextOptions(head_chunks=chunks, stage_projections=staged),
    )
    model = dataclasses.replace(small, remat_policy=policy, attention_output_gate=staged)
    trainer = Trainer(model, train, mesh)
    with jax.default_matmul_precision("default"):
      hlo = trainer.lower_train_step().compile().as_text()
    flops[chunks, policy, staged] = hlo_flops.matmul_flops(hlo)["attention_flops"]
  plain = flops[None, "none", False]
  fwd = flops[2, "none", False] - plain  # the forward each stage's checkpoint replays
  assert fwd > 0.2 * plain, flops
  assert flops[2, "full", False] - flops[2, "none", False] == pytest.approx(fwd, rel=1e-9), flops
  assert flops[2, "save_attention_out", False] == pytest.approx(plain, rel=1e-9), flops
  assert flops[2, "full", True] == pytest.approx(flops[2, "full", False], rel=1e-9), flops
  assert flops[2, "save_attention_out", True] == pytest.approx(plain, rel=1e-9), flops

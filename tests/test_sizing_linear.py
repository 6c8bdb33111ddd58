"""Sizing knows linear-attention layers: the chunked delta rule's FLOPs (HLO count
and model formula, by hand), a compile-only tiny hybrid's model FLOPs, linear
FLOPs and state-exchange bytes, and the planner's memory and step figures for it."""

import jax
import jax.numpy as jnp
import pytest

from lctx import data as data_lib
from lctx import hardware, models
from lctx import train as train_lib
from lctx.kernels.delta_rule import delta_rule
from lctx.kernels.options import AttentionOptions
from lctx.models.config import delta_rule_flops_per_token, linear_mixer_flops
from lctx.parallel.linear_context import state_exchange_bytes
from lctx.parallel.mesh import MeshConfig
from lctx.sizing import hlo_flops, linear_layers, planner
from lctx.sizing import memory_model as mm
from lctx.trainer import TrainConfig

# A tiny Qwen3.5-pattern hybrid: 3 GDN layers : 1 gated full-attention layer.
HYBRID = dict(
  vocab_size=1024,
  d_model=256,
  num_layers=4,
  layer_types=("linear_attention",) * 3 + ("full_attention",),
  num_heads=4,
  num_kv_heads=2,
  head_dim=64,
  qk_norm=True,
  attention_output_gate=True,
  partial_rotary_factor=0.25,
  linear_num_key_heads=2,
  linear_num_value_heads=4,
  linear_key_head_dim=64,
  linear_value_head_dim=64,
  mlp_dim=512,
  scan_layers=True,
  dtype="bfloat16",
  param_dtype="float32",
)
SEQ, CONTEXT = 2048, 4


def _hand_count_per_token(seq):
  """Forward FLOPs per token of HYBRID, by hand (chunks of 64)."""
  d, f, e = 256, 512, 1024
  # Full attention: q, k, v, o and the output gate; the MLP; causal attention
  # over seq / 2 keys on average, 4 heads of (H + V) = 128.
  attn_params = d * 4 * 64 + 2 * d * 2 * 64 + 4 * 64 * d + d * 4 * 64
  attention_layer = 2 * attn_params + 2 * 3 * d * f + 2 * (seq / 2) * 4 * 128
  # GDN: q, k (2 heads of 64), v, z (4 of 64), out, b, a, dt_bias, A_log, norm, convs.
  gdn_params = d * (2 * 128 + 2 * 256) + 256 * d + 2 * d * 4 + 2 * 4 + 64 + 4 * (2 * 128 + 256)
  # Delta rule per chunk (C = 64) and head, K = V = 64: k k^T; the solve: the
  # inverse by halves (four 16-row blocks by 3 rounds of a squaring and a product,
  # the two 32-row merges' and the 64-row merge's two off-diagonal products) and
  # its product with [beta V | beta Gamma K]; 3 state products, q k^T and its
  # product with u.
  c, k, v = 64, 64, 64
  inverse = 4 * 3 * (2 + 2) * 16**3 + 2 * 2 * 2 * 16**3 + 2 * 2 * 32**3
  chunk = (
    2 * c * c * k + inverse + 2 * c * c * (v + k) + 6 * c * k * v + 2 * c * c * k + 2 * c * c * v
  )
  linear_layer = 2 * gdn_params + 2 * 3 * d * f + 4 * chunk / c
  return attention_layer + 3 * linear_layer + 2 * d * e


def _exp(seq=SEQ, **model):
  return train_lib.Experiment(
    model=models.ModelConfig(**{**HYBRID, **model}),
    data=data_lib.DataConfig(),
    train=TrainConfig(
      batch_size=1,
      seq_len=seq,
      context_parallel_strategy="ring",
      loss_chunk_size=512,
      attention_options=AttentionOptions(block_q=512, block_kv=512),
    ),
    mesh=MeshConfig(context=CONTEXT),
  )


@pytest.mark.parametrize("c", [16, 64], ids=["squarings", "halves"])
@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
def test_delta_rule_hlo_flops_are_the_hand_count(per_channel, c):
  """The chunk loops at their trip counts (9 chunks: 3 groups of 3) give the formula's
  matmuls, with the in-chunk solve by squarings (16-token chunks) and by halves
  (64); KDA's per-channel decay makes XLA compute its two in-chunk pair
  products (2 C^2 K each) as multiply-reduce, not as dots."""
  b, t, n, h, v = 2, c * 9, 3, 8, 6
  s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
  g = s(b, t, n, h) if per_channel else s(b, t, n)
  fn = jax.jit(lambda *a: delta_rule(*a, chunk_size=c)[0])
  text = fn.lower(s(b, t, n, h), s(b, t, n, h), s(b, t, n, v), g, s(b, t, n)).compile().as_text()
  count = hlo_flops.matmul_flops(text)
  assert count["unknown_trip_count_loops"] == 0
  assert sorted(count["loops"].values()) == [3, 3]  # the two levels
  want = delta_rule_flops_per_token(n, h, v, c) * b * t
  if per_channel:
    want -= 2 * (2 * c * c * h) * n * b * t / c
  assert count["dot_flops"] == want


def test_summary_hlo_flops_are_the_hand_count():
  """The context-parallel summary scan (delta_rule_summary, GDN) runs the matmuls
  summary_flops_per_token counts."""
  import types  # pylint: disable=g-import-not-at-top

  from lctx.kernels.delta_rule import delta_rule_summary  # pylint: disable=g-import-not-at-top

  b, t, n, h, v, c = 2, 64 * 9, 3, 8, 6, 64
  s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
  fn = jax.jit(lambda *a: delta_rule_summary(*a, chunk_size=c))
  text = fn.lower(s(b, t, n, h), s(b, t, n, v), s(b, t, n), s(b, t, n)).compile().as_text()
  count = hlo_flops.matmul_flops(text)
  model = types.SimpleNamespace(
    linear_num_value_heads=n, linear_key_head_dim=h, linear_value_head_dim=v
  )
  assert count["dot_flops"] == linear_layers.summary_flops_per_token(model, c) * b * t


def test_model_flops_of_a_hybrid_are_the_hand_count():
  exp = _exp()
  assert exp.model.flops_per_token(SEQ, training=False) == _hand_count_per_token(SEQ)
  assert exp.model.flops_per_token(SEQ) == 3 * _hand_count_per_token(SEQ)
  assert linear_mixer_flops(exp.model) == 4 * delta_rule_flops_per_token(1, 64, 64)


@pytest.fixture(scope="module")
def compiled():
  """compile_step's record of HYBRID under ring (zigzag) on v5p:2x2x1, remat 'none'."""
  from lctx.sizing import compile as compile_lib  # pylint: disable=g-import-not-at-top

  exp = _exp(remat_policy="none")
  with jax.default_matmul_precision("default"):  # Mosaic (splash) takes default only
    record = compile_lib.compile_step(exp, topology="v5p:2x2x1")
  return exp, record


def test_compiled_hybrid_counts_its_linear_layers(compiled):
  exp, r = compiled
  assert r["fits"] and r["unknown_trip_count_loops"] == 0
  tokens_per_device = SEQ / CONTEXT
  assert r["model_flops_per_device"] == 3 * _hand_count_per_token(SEQ) * tokens_per_device
  assert r["linear_layers"] == 3
  assert r["model_linear_flops_per_device"] == 3 * 3 * linear_mixer_flops(exp.model) * (
    tokens_per_device
  )
  # What the program runs per model FLOP of the linear layers' sequence work: the
  # forward, the backward (2x), the kernel's one remat level (+1: 4 chunks a
  # zigzag piece, below TWO_LEVEL_MIN_CHUNKS), and under context parallelism the
  # summary pass with the same factors: between 4/3 (the main rule alone) and
  # 4/3 (1 + summary / main).
  ratio = r["linear_flops_per_device"] / r["model_linear_flops_per_device"]
  summary = linear_layers.summary_flops_per_token(exp.model) / linear_mixer_flops(exp.model)
  assert 4 / 3 <= ratio <= 4 / 3 * (1 + summary), (ratio, summary)
  # The state prefix's ppermutes (two zigzag pieces of 4 heads x 64 x (64 + 64)
  # f32 a round, their ids and incoming states), forward and their transposes in
  # the backward, and the three conv halos' forward all-gather, exactly as
  # state_exchange_bytes counts them.
  prefix = state_exchange_bytes(
    batch=1, heads=4, key_dim=64, value_dim=64, ways=CONTEXT, load_balance=True
  )["prefix_bytes"]
  halos = 0
  for channels in (128, 128, 256):
    halos += state_exchange_bytes(
      batch=1,
      heads=0,
      key_dim=0,
      value_dim=0,
      ways=CONTEXT,
      load_balance=True,
      conv_channels=channels,
    )["halo_bytes"]
  kinds = r["linear_collective_bytes_by_kind"]
  # No summary is gathered: the all-gathers are the halos, to the byte.
  assert kinds["all-gather"] == 3 * halos, (kinds, halos)
  # The ppermutes: the forward's, and below as much again for the backward's
  # transposes. Not to the byte: the compiler sends the cotangents that come
  # from bf16 values in bf16, and the layers share one boundary-id shift (the
  # same segment ids). Measured 6,094,860 B against the 3 x 2 x 1,114,124 bound.
  assert 3 * prefix < kinds["collective-permute"] <= 3 * 2 * prefix, (kinds, prefix)
  per_layer = prefix + halos
  # The planner's count of the same exchange: forward once, backward twice.
  setup = planner.make_setup(exp, strategy="ring", mesh={"context": CONTEXT}, remat_policy="none")
  assert linear_layers.exchange_bytes(exp.model, setup, 1) == 3 * 3 * per_layer


@pytest.fixture(scope="module")
def compiled_chunked():
  """The same hybrid with its linear layers over sequence chunks of 64 tokens
  (linear_chunk_size: 4 chunks a zigzag piece)."""
  from lctx.sizing import compile as compile_lib  # pylint: disable=g-import-not-at-top

  exp = _exp(remat_policy="none", linear_chunk_size=64)
  with jax.default_matmul_precision("default"):
    record = compile_lib.compile_step(exp, topology="v5p:2x2x1")
  return exp, record


def test_compiled_chunked_hybrid_counts_its_linear_layers(compiled, compiled_chunked):
  """Over sequence chunks: the same model, the same state prefix, one halo of x's
  W-1 tokens (D channels) in place of the three conv halos, and more linear work
  (each chunk body's forward again in the backward; the summary pass)."""
  exp, r = compiled_chunked
  _, whole = compiled
  assert r["fits"] and r["unknown_trip_count_loops"] == 0
  assert r["model_flops_per_device"] == whole["model_flops_per_device"]
  assert r["linear_flops_per_device"] > whole["linear_flops_per_device"]
  prefix = state_exchange_bytes(
    batch=1, heads=4, key_dim=64, value_dim=64, ways=CONTEXT, load_balance=True
  )["prefix_bytes"]
  halo = state_exchange_bytes(
    batch=1, heads=0, key_dim=0, value_dim=0, ways=CONTEXT, load_balance=True, conv_channels=256
  )["halo_bytes"]
  kinds = r["linear_collective_bytes_by_kind"]
  assert kinds["all-gather"] == 3 * halo, (kinds, halo)
  assert 3 * prefix < kinds["collective-permute"] <= 3 * 2 * prefix, (kinds, prefix)


@pytest.mark.xfail(
  strict=True,
  reason="measured: the planner reads 46.5 MiB for this tiny hybrid, the compiler "
  "151.6 MiB (remat 'full': 25.8 vs 148.0 MiB; with the summaries all-gathered, "
  "before the state prefix, 49.2 vs 160.9); the planner is not fitted to hybrids yet",
)
def test_planner_memory_of_a_hybrid_against_the_compiler(compiled):
  exp, r = compiled
  setup = planner.make_setup(exp, strategy="ring", mesh={"context": CONTEXT}, remat_policy="none")
  dims = planner.model_dims(exp.model)
  assert dims.linear_layers == 3 and dims.attention_layers == 1
  est = planner.evaluate(dims, setup, hardware.parse_target("v5p:2x2x1"))
  assert est["breakdown"]["linear_buffers"] > 0
  compiled_bytes = r["per_device"]["total_bytes"]
  err = est["per_device_total_bytes"] / compiled_bytes - 1
  assert abs(err) <= 0.25, (est["per_device_total_bytes"], compiled_bytes, err)


def test_planner_prices_linear_layers_apart_from_attention():
  """At long context the hybrid's step is about its attention layers' share; its
  saved tensors are the linear layers' (no lse) and its state exchange is counted."""
  seq = 1 << 22
  hybrid, full = _exp(seq), _exp(seq, layer_types=("full_attention",) * 4)
  target = hardware.parse_target("v5p:4x4x4")
  mesh = {"context": 64}
  got = {}
  for name, exp in (("hybrid", hybrid), ("full", full)):
    setup = planner.make_setup(exp, strategy="ring", mesh=mesh, remat_policy="full")
    got[name] = planner.evaluate(planner.model_dims(exp.model), setup, target, model=exp.model)
  flops = lambda n: got[n]["step_time"]["flops_per_device"]["total"]  # noqa: E731
  assert 0.2 < flops("hybrid") / flops("full") < 0.3  # 1 attention layer of 4
  assert got["hybrid"]["step_time"]["flops_per_device"]["linear_extra"] > 0
  assert got["hybrid"]["breakdown"]["linear_buffers"] > 0
  assert got["full"]["breakdown"]["linear_buffers"] == 0
  sizes = lambda name: linear_layers.tensor_bytes_per_token(name, hybrid.model, 1, 2)  # noqa: E731
  assert sizes("attention_lse") == 0 and sizes("query_proj") == 2 * 64 * 2  # Q heads
  dims = planner.model_dims(hybrid.model)
  setup = planner.make_setup(hybrid, strategy="ring", mesh=mesh, remat_policy="full")
  bd = mm.estimate(dims, setup)
  # One layer's backward at a time: the attention layer's buffers (its fused
  # splash backward's dq partials in place of the MLP chunk's, where larger)
  # or the linear layer's.
  assert bd.layer_phase == (
    bd.gathered_weights
    + bd.layer_backward
    + max(
      bd.attention_buffers + max(bd.mlp_backward, bd.dq_partials),
      bd.linear_buffers + bd.mlp_backward,
    )
  )


def test_planner_prices_sequence_chunks():
  """linear_chunk_size: the linear layer's backward holds one chunk's working set
  plus x-sized values instead of its delta-rule inputs over the whole sequence; its
  inner tensors are never saved; its chunk bodies' forward runs again."""
  seq, mesh = 1 << 22, {"context": 64}
  whole, chunked = _exp(seq), _exp(seq, linear_chunk_size=2048)
  target = hardware.parse_target("v5p:4x4x4")
  got = {}
  for name, exp in (("whole", whole), ("chunked", chunked)):
    setup = planner.make_setup(exp, strategy="ring", mesh=mesh, remat_policy="full")
    got[name] = planner.evaluate(planner.model_dims(exp.model), setup, target, model=exp.model)
  m = chunked.model
  tokens = seq // 64
  d, a = m.d_model, 2
  per_token = (
    (
      2 * m.linear_num_key_heads * m.linear_key_head_dim
      + m.linear_num_value_heads * m.linear_value_head_dim
    )
    * 2
    * a
  )
  per_token += 2 * m.linear_num_value_heads * 2 * 4  # fmt: skip
  buf = lambda n: got[n]["breakdown"]["linear_buffers"]  # noqa: E731
  # Whole: the delta-rule inputs and cotangents of every local token; chunked: of
  # 2,048 tokens, plus three x-sized values (two passes' cotangents, the outputs).
  assert buf("whole") >= tokens * per_token
  x_sized = 3 * tokens * d * a
  assert x_sized <= buf("chunked") < buf("whole")
  # Beyond those, the chunked layer holds one chunk's per-token values where the
  # whole one holds every token's (their other terms, states and the prefix, are
  # no larger chunked: about 2 sqrt(32) + 32 carries against 2 x 2 sqrt(512)).
  assert buf("chunked") - x_sized < buf("whole") - (tokens - 2048) * per_token
  sizes = lambda name: linear_layers.tensor_bytes_per_token(name, m, 1, a)  # noqa: E731
  assert sizes("query_proj") == sizes("attention_out") == 0 and sizes("out_proj") == d * a
  extra = lambda n: got[n]["step_time"]["flops_per_device"]["linear_extra"]  # noqa: E731
  assert extra("chunked") > extra("whole")

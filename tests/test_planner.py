"""`--mode=plan`: the analytic memory model, its search, plan.json, and the compiler's check.

The compiler cases compile tiny Llama-shaped models on small compile-only TPU
slices (libtpu from the test extras) and hold the planner to within 15% of the
compiled total (argument + output - alias + temp). The full-size comparison is
scripts/bench_memory.py.
"""

import dataclasses
import importlib
import json
import os
import subprocess
import sys

import pytest

from lctx.kernels import AttentionOptions
from lctx.parallel import AttentionDims, ContextOptions
from lctx.sizing import devices as devices_lib  # noqa: E402  (no jax import)

devices_lib.compile_only_env()

from lctx import configs, models  # noqa: E402
from lctx import data as data_lib  # noqa: E402
from lctx import train as train_lib  # noqa: E402
from lctx.parallel import auto  # noqa: E402
from lctx.parallel.mesh import MeshConfig  # noqa: E402
from lctx.sizing import memory_model as mm  # noqa: E402
from lctx.sizing import planner  # noqa: E402
from lctx.sizing import tpu as tpu_lib  # noqa: E402
from lctx.trainer import TrainConfig  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 2**30

# Llama-3.1-8B as gin/models/llama3_8b.gin binds it, with the flagships' MLP chunk.
LLAMA_8B = dataclasses.asdict(configs.model_config("llama3_8b", mlp_chunk_size=32768))


def _exp(model: dict, *, seq_len: int, batch_size: int = 1, mesh=None, attention=None, **train):
  strategy = train.pop("strategy", "ring")
  options = AttentionOptions(**{"block_q": 2048, "block_kv": 2048, **(attention or {})})
  train = dict(
    dict(loss_chunk_size=8192, attention_options=options),
    batch_size=batch_size,
    seq_len=seq_len,
    context_parallel_strategy=strategy,
    **train,
  )
  return train_lib.Experiment(
    model=models.ModelConfig(**model),
    data=data_lib.DataConfig(),
    train=TrainConfig(**train),
    mesh=mesh or MeshConfig(context=-1),
  )


# ----------------------------------------------------------------------------
# The memory model
# ----------------------------------------------------------------------------
def test_breakdown_total_is_the_sum_of_its_device_parts():
  exp = _exp(LLAMA_8B, seq_len=1 << 22)
  dims = planner.model_dims(exp.model)
  setup = planner.make_setup(exp, strategy="ring", mesh={"context": 64}, remat_policy="full")
  bd = mm.estimate(dims, setup)
  d = bd.as_dict()
  assert d["total"] == bd.total > 0
  assert dims.num_params == exp.model.num_params()
  # f32 params + 2 f32 moments, sharded 64 ways.
  assert bd.parameters == pytest.approx(exp.model.num_params() * 4 / 64, rel=1e-6)
  assert bd.optimizer_state == 2 * bd.parameters


def test_remat_policies_order_device_bytes_and_offload_moves_them_to_host():
  exp = _exp(LLAMA_8B, seq_len=1 << 22)
  dims = planner.model_dims(exp.model)
  totals = {}
  for policy in mm.REMAT_POLICIES:
    setup = planner.make_setup(exp, strategy="ring", mesh={"context": 64}, remat_policy=policy)
    totals[policy] = mm.estimate(dims, setup)
  assert totals["none"].total > totals["dots"].total > totals["full"].total
  assert totals["full"].total > totals["offload_layer_inputs"].total
  assert totals["full"].host == 0
  # Offloading the layer inputs: 32 layers x bf16 D per local token on the host.
  tokens = (1 << 22) // 64
  assert totals["offload_layer_inputs"].host == 32 * tokens * 4096 * 2


def test_model_presets_offload_and_groups_follow_the_model_config():
  """Per-tag presets (ModelConfig.remat_choices), state offload and remat groups."""
  tokens = (1 << 22) // 64
  base = _exp(LLAMA_8B, seq_len=1 << 22)
  dims = planner.model_dims(base.model)

  def est(exp, policy):
    return mm.estimate(
      dims, planner.make_setup(exp, strategy="ring", mesh={"context": 64}, remat_policy=policy)
    )

  full = est(base, "full")
  both = est(base, "offload_layer_inputs_and_attention_out")
  # Layer input (D), attention output (N x V) and its f32 lse (N) of 32 layers
  # go to the host.
  assert both.host == 32 * tokens * ((4096 + 32 * 128) * 2 + 32 * 4)
  assert both.saved_activations == 0 < full.saved_activations
  assert est(base, "save_qkv_proj").saved_activations > full.saved_activations
  # AdamW state and master weights on the host: off the device, onto the host.
  offl = _exp(LLAMA_8B, seq_len=1 << 22, offload_optimizer_state=True, offload_params=True)
  moved = est(offl, "full")
  assert moved.optimizer_state == moved.parameters == 0
  assert moved.host == full.parameters + full.optimizer_state
  # Groups of 4 layers save one input in 4.
  grouped = _exp({**LLAMA_8B, "remat_group_size": 4}, seq_len=1 << 22)
  assert est(grouped, "full").saved_activations == full.saved_activations // 4


def test_remat_groups_trade_saved_inputs_for_the_groups_carries():
  """Groups of k layers save 1/k of the layer inputs; the group's backward
  holds its k carries. Hand counts: with one copy of each extra carry and no
  extra MLP chunks (coefficients set so), the group adds (k - 1) bf16 layer
  inputs of the local tokens."""
  exp = _exp(LLAMA_8B, seq_len=1 << 22)
  dims = planner.model_dims(exp.model)
  tokens = (1 << 22) // 64
  layer_input = tokens * 4096 * 2  # bf16 [tokens, D]
  mlp_chunk = 32768 * 14336 * 2  # LLAMA_8B's mlp_chunk_size rows of bf16 F
  base = planner.make_setup(exp, strategy="ring", mesh={"context": 64}, remat_policy="full")
  one = mm.estimate(dims, base)
  for k in (2, 4):
    grouped = mm.estimate(dims, dataclasses.replace(base, remat_group_size=k))
    assert grouped.saved_activations == one.saved_activations // k
    for carries, chunks in ((1.0, 0.0), (0.0, 1.0), (2.0, 3.0)):
      co = {"group_input_copies": carries, "group_mlp_copies": chunks}
      extra = (
        mm.estimate(dims, dataclasses.replace(base, remat_group_size=k), co).layer_backward
        - mm.estimate(dims, base, co).layer_backward
      )
      want = (k - 1) * (carries * layer_input + chunks * mlp_chunk)
      assert abs(extra - want) <= 2, (k, co, extra, want)


def test_tensors_kept_inside_a_remat_group_count_one_groups_layers():
  """A group's inner policy keeps its tensors only while that group's backward
  runs (the group replays its forward from its one input): one group's layers
  of them at a time, not every layer's. Hand count for long_v5p's in-group
  route: the layer inputs offloaded one per group, each layer's attention
  output (N x V bf16) and lse (N f32) kept on the device by the inner policy."""
  tokens = (1 << 22) // 64
  custom = (("layer_input", "offload"), ("attention_out", "device"), ("attention_lse", "device"))
  kept = tokens * (32 * 128 * 2 + 32 * 4)  # one layer's attention output and lse
  for k in (1, 2, 4):
    model = {**LLAMA_8B, "remat_policy": "custom", "remat_custom": custom, "remat_group_size": k}
    exp = _exp(model, seq_len=1 << 22)
    setup = planner.make_setup(exp, strategy="ring", mesh={"context": 64}, remat_policy="custom")
    bd = mm.estimate(planner.model_dims(exp.model), setup)
    layers_held = 32 if k == 1 else k
    assert bd.saved_activations == layers_held * kept, k
    assert bd.host == 32 // k * tokens * 4096 * 2, k


def test_loss_is_chunked_over_each_devices_tokens():
  """TrainConfig.loss_chunk_size is tokens per chunk per device (the trainer's
  shard_map over batch and sequence axes): the logits term grows with the chunk
  up to the local tokens, and every device holds the whole unembedding."""
  exp = _exp(LLAMA_8B, seq_len=1 << 20)
  dims = planner.model_dims(exp.model)
  setup = planner.make_setup(exp, strategy="ring", mesh={"context": 64}, remat_policy="full")
  tokens = (1 << 20) // 64
  assert mm.per_device_loss(setup)

  def loss(chunk, s=setup):
    return mm.estimate(dims, dataclasses.replace(s, loss_chunk_size=chunk)).loss

  # Hand counts with one byte per logit and per table element: a chunk of
  # logits (rows x vocab), the whole [D, vocab] table, and the bf16 cotangent
  # of the local hidden states (the final norm runs in the chunks).
  unit = {"loss_bytes_per_logit": 1.0, "loss_table_bytes_per_elem": 1.0}

  def unit_loss(chunk):
    return mm.estimate(dims, dataclasses.replace(setup, loss_chunk_size=chunk), unit).loss

  v, d = 128256, 4096
  assert unit_loss(1) == pytest.approx(v + d * v + tokens * d * 2, rel=1e-9)
  assert unit_loss(4096) - unit_loss(1) == pytest.approx(4095 * v, rel=1e-9)
  assert loss(tokens) == loss(None) == loss(4 * tokens)  # one chunk: the local tokens
  # With the tensor axis in use the plain SPMD path chunks the global tokens.
  tp = dataclasses.replace(setup, mesh={"context": 16, "tensor": 4})
  assert not mm.per_device_loss(tp)
  local = (1 << 20) // 16
  assert loss(2 * local, tp) > loss(None, tp)  # a chunk of global tokens: one device's share


def test_head_chunks_shrink_ulysses_attention_buffers_only():
  exp = _exp(LLAMA_8B, seq_len=1 << 22)
  dims = planner.model_dims(exp.model)
  for strategy, mesh in (
    ("ulysses", {"context": 8}),
    ("usp", {"context": 8, "context_ulysses": 8}),
  ):
    setup = planner.make_setup(exp, strategy=strategy, mesh=mesh, remat_policy="full")
    whole = mm.attention_buffer_bytes(dims, setup)
    staged = mm.attention_buffer_bytes(dims, dataclasses.replace(setup, head_chunks=2))
    assert staged < whole, strategy
  assert mm.head_chunk_fractions(dims, dataclasses.replace(setup, head_chunks=None)) == (1.0, 1.0)
  # ulysses 8 over 32 q / 8 kv heads: 4 q heads (one kv head) per device; 4
  # stages of one q head share that kv head.
  uly = planner.make_setup(exp, strategy="ulysses", mesh={"context": 8}, remat_policy="full")
  assert mm.head_chunk_fractions(dims, dataclasses.replace(uly, head_chunks=4)) == (0.25, 1.0)
  # ring: head_chunks reach the setup only with stage_projections (planner
  # _head_chunks); its stages have no all-to-all: 4 stages of 8 q heads and their
  # 2 kv heads.
  ring = planner.make_setup(exp, strategy="ring", mesh={"context": 64}, remat_policy="full")
  assert ring.head_chunks is None
  assert mm.head_chunk_fractions(dims, dataclasses.replace(ring, head_chunks=4)) == (0.25, 0.25)
  staged = dataclasses.replace(
    exp, train=dataclasses.replace(
      exp.train, context_options=ContextOptions(head_chunks=4, stage_projections=True)
    )
  )  # fmt: skip
  setup = planner.make_setup(staged, strategy="ring", mesh={"context": 64}, remat_policy="full")
  assert setup.head_chunks == 4


def test_all_gather_grows_with_the_whole_sequence_ring_with_the_shard():
  exp = _exp(LLAMA_8B, seq_len=1 << 22)
  dims = planner.model_dims(exp.model)

  def attn(strategy, seq_len, mesh):
    setup = dataclasses.replace(
      planner.make_setup(exp, strategy=strategy, mesh=mesh, remat_policy="full"), seq_len=seq_len
    )
    return mm.attention_buffer_bytes(dims, setup)

  ag = attn("all_gather", 1 << 22, {"context": 64}), attn("all_gather", 1 << 22, {"context": 32})
  ring = attn("ring", 1 << 22, {"context": 64}), attn("ring", 1 << 22, {"context": 32})
  assert ag[1] < 1.3 * ag[0]  # halving the degree barely matters: K/V are whole
  assert ring[1] > 1.5 * ring[0]  # ring buffers follow the local shard


def test_the_kernel_follows_attention_backend_and_the_platform():
  """'auto' is splash on TPU, blockwise elsewhere (as lctx/kernels/flash.py picks)."""
  exp = _exp(LLAMA_8B, seq_len=1 << 20, batch_size=8, attention=dict(backend="auto"))
  assert planner.plan(exp, hardware="v5p-64")["configured"]["setup"]["attention_kernel"] == (
    "splash"
  )
  assert planner.plan(exp, hardware="h100x8")["configured"]["setup"]["attention_kernel"] == (
    "blockwise"
  )
  pinned = _exp(LLAMA_8B, seq_len=1 << 20, batch_size=8, attention=dict(backend="blockwise"))
  rec = planner.plan(pinned, hardware="v5p-64")
  assert rec["configured"]["setup"]["attention_kernel"] == "blockwise"
  assert rec["smallest"]["setup"]["attention_kernel"] == "blockwise"
  assert mm.resolve_kernel("splash", "gpu") == "splash"
  assert mm.resolve_kernel("cudnn", "gpu") == "blockwise"


def test_splash_keeps_no_score_tiles_in_hbm():
  """Blockwise's f32 [bq, bk] tiles grow with the blocks; splash's stay in VMEM
  (either backward form; the fused form's dq partials are Breakdown.dq_partials)."""
  exp = _exp(LLAMA_8B, seq_len=1 << 22)
  dims = planner.model_dims(exp.model)
  for strategy in ("all_gather", "ulysses", "ring", "usp"):
    mesh = {"context": 8, "context_ulysses": 8} if strategy == "usp" else {"context": 64}
    setup = planner.make_setup(exp, strategy=strategy, mesh=mesh, remat_policy="full")
    small, big = (dataclasses.replace(setup, block_q=b, block_kv=b) for b in (512, 4096))
    for kernel, fused in (("blockwise", True), ("splash", False), ("splash", True)):
      a, b = (
        mm.attention_buffer_bytes(dims, dataclasses.replace(x, kernel=kernel, fused_bwd=fused))
        for x in (small, big)
      )
      if kernel == "blockwise":
        assert b > a, strategy
      else:
        assert b == a > 0, (strategy, kernel, fused)
  with pytest.raises(ValueError, match="unknown attention kernel 'flash'"):
    mm.estimate(dims, dataclasses.replace(setup, kernel="flash"))


def test_fused_splash_backward_dq_partials_follow_the_kernels_calls():
  """Breakdown.dq_partials: one fused splash backward call's dq partials,
  [kv / block_kv_bwd, q tokens, heads, H] in bf16 with H lane-padded (hand
  counts), cut like the kernel cuts its calls (splash_tiling.bwd_tiles: at most
  dq_partial_bytes; ring / usp kv in zigzag runs); none for the two-pass form
  or blockwise."""
  exp = _exp(LLAMA_8B, seq_len=1 << 16, attention=dict(backend="splash", block_kv=1024))
  dims = planner.model_dims(exp.model)

  def dq(strategy, mesh, **kw):
    setup = planner.make_setup(exp, strategy=strategy, mesh=mesh, remat_policy="full")
    return mm.estimate(dims, dataclasses.replace(setup, **kw)).dq_partials

  # all_gather over 64: 1,024 local q tokens against the whole 65,536, 32 heads of 128.
  assert dq("all_gather", {"context": 64}) == 64 * 1024 * 32 * 128 * 2  # 512 MiB
  assert dq("all_gather", {"context": 64}, block_kv_bwd=512) == 128 * 1024 * 32 * 128 * 2
  # Over dq_partial_bytes the kernel cuts kv pieces (whole kv blocks), then q pieces.
  assert dq("all_gather", {"context": 64}, dq_partial_bytes=128 << 20) == 128 << 20
  assert dq("all_gather", {"context": 64}, dq_partial_bytes=4 << 20) <= 4 << 20
  # ulysses over 8: the whole sequence on 4 heads: 64 x 65,536 x 4 x 128 x 2 = 4 GiB,
  # cut to at most the default 1 GiB.
  assert 0 < dq("ulysses", {"context": 8}) <= 1 << 30
  # ring over 64: per hop, 1,024 x 1,024 tokens.
  assert dq("ring", {"context": 64}) == 1 * 1024 * 32 * 128 * 2
  assert dq("ring", {"context": 64}, fused_bwd=False) == 0
  assert dq("ring", {"context": 64}, kernel="blockwise") == 0
  # Head dim 64 takes the room of 128: tests' held-out all_gather case on v5p:2x2x1
  # (8,192 local q tokens, 32,768 kv in blocks of 512, 16 heads): 2 GiB.
  medium = _exp(
    {**MEDIUM, "remat_policy": "full"},
    seq_len=32768,
    strategy="all_gather",
    mesh=MeshConfig(context=4),
    attention_options=AttentionOptions(block_q=512, block_kv=512, backend="splash"),
  )
  setup = planner.make_setup(
    medium, strategy="all_gather", mesh={"context": 4}, remat_policy="full"
  )
  bd = mm.estimate(planner.model_dims(medium.model), setup)
  assert bd.dq_partials == 64 * 8192 * 16 * 128 * 2
  two_pass = mm.estimate(
    planner.model_dims(medium.model), dataclasses.replace(setup, fused_bwd=False)
  )
  # Live while the attention call's backward runs, in place of the MLP chunk's buffers.
  assert bd.total - two_pass.total == bd.dq_partials - bd.mlp_backward > 0


def test_unknown_policy_and_strategy_are_clear_errors():
  exp = _exp(LLAMA_8B, seq_len=1 << 20)
  dims = planner.model_dims(exp.model)
  with pytest.raises(ValueError, match="'sometimes'"):
    mm.estimate(
      dims, planner.make_setup(exp, strategy="ring", mesh={"context": 8}, remat_policy="sometimes")
    )
  setup = mm.Setup(strategy="ring", mesh={"context": 8}, batch_size=1, seq_len=1 << 20)
  with pytest.raises(ValueError, match="unknown remat policy 'sometimes'"):
    mm.estimate(dims, dataclasses.replace(setup, remat_policy="sometimes"))
  setup = planner.make_setup(exp, strategy="spiral", mesh={"context": 8}, remat_policy="full")
  with pytest.raises(ValueError, match="unknown strategy 'spiral'"):
    mm.estimate(dims, setup)


def test_auto_sizes_attention_with_the_memory_model_and_the_resolved_kernel():
  heads = AttentionDims(num_heads=32, num_kv_heads=8, head_dim=128, v_head_dim=128)
  kw = dict(mesh_shape={"context": 8}, dims=heads, seq_len=1 << 20)
  dims = mm.ModelDims(0, 0, 0, 32, 8, 128, 128, 0, 0, 0)
  for s in ("all_gather", "ulysses", "ring"):
    for kernel in mm.KERNELS:
      setup = mm.Setup(
        strategy=s, mesh={"context": 8}, batch_size=1, seq_len=1 << 20, kernel=kernel
      )
      got = auto.estimate_attention_bytes(s, kernel=kernel, **kw)
      assert got == int(mm.attention_buffer_bytes(dims, setup)), (s, kernel)
    # The default is blockwise (what runs off TPU); splash sizes differ.
    assert (
      auto.estimate_attention_bytes(s, **kw)
      == auto.estimate_attention_bytes(s, kernel="blockwise", **kw)
      != auto.estimate_attention_bytes(s, kernel="splash", **kw)
    )
  # choose_strategy sizes candidates with the kernel it is given: at a budget
  # between the two kernels' all_gather figures, the choice follows the kernel.
  ag = {k: auto.estimate_attention_bytes("all_gather", kernel=k, **kw) for k in mm.KERNELS}
  lo, hi = sorted(ag.values())
  picks = {
    k: auto.choose_strategy(memory_budget_bytes=(lo + hi) // 2, kernel=k, **kw)[0]
    for k in mm.KERNELS
  }
  assert sorted(picks.values()) != ["all_gather", "all_gather"], picks
  assert picks[min(ag, key=ag.get)] == "all_gather"
  with pytest.raises(ValueError, match=r"\[unknown-kernel\].*'flash'"):
    auto.choose_strategy(kernel="flash", **kw)


def _script(name: str):
  """A module of scripts/ (fit_memory_model, bench_memory)."""
  sys.path.insert(0, os.path.join(ROOT, "scripts"))
  try:
    return importlib.import_module(name)
  finally:
    sys.path.pop(0)


def _fit_script():
  return _script("fit_memory_model")


@pytest.mark.parametrize("row", range(5))
def test_planner_is_within_15_percent_of_the_full_size_compiles(row):
  """The flagship gin files and the v5p length record (Llama-3.1-8B), against
  their measured `--mode=compile` totals (fit_memory_model.FULL_SIZE: fitted;
  FULL_SIZE_CHECK, gin/long_v5p.gin with remat groups: not fitted)."""
  fit = _fit_script()
  rows = fit.FULL_SIZE + fit.FULL_SIZE_CHECK
  assert len(rows) == 5
  point = fit.gin_point(*rows[row])
  est = mm.estimate(point.dims, point.setup).total
  err = (est - point.compiled) / point.compiled
  assert abs(err) <= 0.15, (
    f"{point.name}: planner {est / GiB:.2f} vs {point.compiled / GiB:.2f} GiB"
  )


def test_record_adds_a_compile_json_and_refuses_one_that_does_not_fit(tmp_path, monkeypatch):
  fit = _fit_script()
  data = tmp_path / "full.json"
  data.write_text(open(fit.FULL_SIZE_FILE).read())
  before = json.loads(data.read_text())
  monkeypatch.setattr(fit, "FULL_SIZE_FILE", str(data))
  # The figures it rewrites (the gin header line, README's table): copies.
  figures = tmp_path / "tree"
  for rel in ("gin/ring_v5p.gin", "README.md"):
    (figures / rel).parent.mkdir(parents=True, exist_ok=True)
    (figures / rel).write_text(open(os.path.join(ROOT, rel)).read())
  monkeypatch.setattr(fit, "FIGURES_ROOT", str(figures))
  rec = {
    "topology": "v5p:2x2x1",
    "devices": 4,
    "strategy": "ring",
    "tokens_per_step": 65536,
    "attention_backend": "splash",
    "per_device": {"total_bytes": 3 * GiB + GiB // 4, "host_bytes": 0},
    "hbm_bytes_per_device": int(95.74 * GiB),
    "total_flops_per_device": 1.5e15,
    "recompute_ratio": 1.75,
    "step_seconds_estimate": 12.5,
    "fits": True,
    "step": "train",
    "date": "2026-12-03",
    "jax_version": "0.10.2",
    "libtpu_version": "0.0.42.1",
  }
  (tmp_path / "c").mkdir()
  (tmp_path / "c" / "compile.json").write_text(json.dumps(rec))
  out = fit.record_full_size(str(figures / "gin/ring_v5p.gin"), str(tmp_path / "c"))
  assert out == {
    "topology": "v5p:2x2x1",
    "kernel": "splash",
    "total_gib": 3.25,
    "allocated_gib": None,  # judged by memory_analysis (no fits_figure)
    "fitted": True,
    "libtpu_version": "0.0.42.1",
    "devices": 4,
    "strategy": "ring",
    "tokens_per_step": 65536,
    "hbm_gib": 95.74,
    "host_gib": 0.0,
    "total_flops": 1.5e15,
    "recompute_ratio": 1.75,
    "step_seconds_estimate": 12.5,
    "date": "2026-12-03",
    "jax_version": "0.10.2",
  }
  saved = json.loads(data.read_text())
  assert saved["gin/ring_v5p.gin"] == out
  assert len(saved) == len(fit.full_size_records()) == len(before)  # replaced, not added
  header = (figures / "gin/ring_v5p.gin").read_text()
  assert [line for line in header.split("\n") if line.startswith("# Figures")] == [
    "# Figures (--mode=compile --compile_topology=v5p:2x2x1, 2026-12-03, jax 0.10.2, libtpu "
    "0.0.42.1; scripts/write_gin_figures.py; history: docs/benchmarks.md): 3.25 GiB per device "
    "of 95.74; splash; 1.50e15 FLOPs per device per step, 1.75x the model's; step ~12 s (an "
    "estimate at 50% of bf16 peak)."
  ]
  assert (
    "| `gin/ring_v5p.gin` | `v5p:2x2x1` (4 devices) | 65,536 | ring | splash | 3.25 GiB"
    in (figures / "README.md").read_text()
  )
  # A TPU record judged by its allocation (the compiler's check) carries it.
  judged = dict(rec, fits_figure="allocation", allocated_hbm_bytes_per_device=5 * GiB // 2)
  (tmp_path / "c" / "compile.json").write_text(json.dumps(judged))
  assert fit.record_full_size(str(figures / "gin/ring_v5p.gin"), str(tmp_path / "c")) == dict(
    out, allocated_gib=2.5
  )
  header = (figures / "gin/ring_v5p.gin").read_text()
  assert "2.50 GiB of HBM allocated per device of 95.74 (memory_analysis 3.25)" in header
  (tmp_path / "c" / "compile.json").write_text(json.dumps(rec))
  fit.record_full_size(str(figures / "gin/ring_v5p.gin"), str(tmp_path / "c"))
  (tmp_path / "c" / "compile.json").write_text(json.dumps(dict(rec, fits=False)))
  with pytest.raises(ValueError, match="not a train-step compile that fits"):
    fit.record_full_size(str(figures / "gin/ring_v5p.gin"), str(tmp_path / "c"))
  assert json.loads(data.read_text())["gin/ring_v5p.gin"] == out  # nothing lost


# scripts/bench_memory.py's matrix (Llama-3.1-8B, remat 'full', splash; the cell
# meshes of its docstring), all 24 cells: the compiler's total per device in GiB
# (memory_analysis, or for a compile that ran out of HBM the total its error
# names), docs/benchmarks.md, libtpu 0.0.42.1. Not fitted: the
# planner's coefficients predate them.
MATRIX_CHECK = [
  ("all_gather", "v5p:4x4x4", "1M", 25.1),
  ("ulysses", "v5p:4x4x4", "1M", 58.25),
  ("ulysses", "v5p:4x4x4", "4M", 167.69),
  ("all_gather", "v5p:4x4x4", "16M", 236.75),
  ("ulysses", "v5p:4x4x4", "16M", 846.84),
  ("ulysses", "tpu7x:4x4x4", "1M", 53.56),
  ("ulysses", "tpu7x:4x4x4", "4M", 167.91),
  ("all_gather", "tpu7x:4x4x4", "16M", 185.54),
  ("ulysses", "tpu7x:4x4x4", "16M", 851.27),
  ("ring", "v5p:4x4x4", "1M", 16.9),
  ("usp", "v5p:4x4x4", "1M", 16.9),
  ("all_gather", "v5p:4x4x4", "4M", 76.6),
  ("ring", "v5p:4x4x4", "4M", 32.6),
  ("usp", "v5p:4x4x4", "4M", 34.1),
  ("ring", "v5p:4x4x4", "16M", 110.0),
  ("usp", "v5p:4x4x4", "16M", 114.0),
  ("all_gather", "tpu7x:4x4x4", "1M", 18.4),
  ("ring", "tpu7x:4x4x4", "1M", 17.3),
  ("usp", "tpu7x:4x4x4", "1M", 17.3),
  ("all_gather", "tpu7x:4x4x4", "4M", 57.9),
  ("ring", "tpu7x:4x4x4", "4M", 24.7),
  ("usp", "tpu7x:4x4x4", "4M", 24.7),
  ("ring", "tpu7x:4x4x4", "16M", 51.3),
  ("usp", "tpu7x:4x4x4", "16M", 53.3),
]
SHORT_SHARD_LOSS = pytest.mark.xfail(
  strict=True,
  reason="measured: at 8,192 tokens per device (1M on 128 devices) the step's "
  "peak is the loss phase, whose vocabulary-wide buffers (f32 [8192, 128256] logits, f32 "
  "[128256, 4096] tables) do not shrink with the device count: compiled 17.3 GiB, the planner "
  "reads 10.8 (-37.6%); its loss coefficients were fitted where the loss was never the peak",
)
ALL_GATHER_4M = pytest.mark.xfail(
  strict=True,
  reason="measured: all_gather 4M on v5p compiles to 76.6 GiB, the planner reads 64.3 (-16.0%)",
)
ULYSSES_16M = pytest.mark.xfail(
  strict=True,
  reason="measured: ulysses at 16M (16 million tokens per device in splash's "
  "piece loops, 8 or 16 rows) needs 846.8 / 851.3 GiB by the compiler's out-of-memory "
  "report; the planner reads 699.7 / 698.7 (-17.4% / -17.9%)",
)
MATRIX_MISSES = {
  ("ulysses", "v5p:4x4x4", "16M"): ULYSSES_16M,
  ("ulysses", "tpu7x:4x4x4", "16M"): ULYSSES_16M,
  ("ring", "tpu7x:4x4x4", "1M"): SHORT_SHARD_LOSS,
  ("usp", "tpu7x:4x4x4", "1M"): SHORT_SHARD_LOSS,
  ("all_gather", "v5p:4x4x4", "4M"): ALL_GATHER_4M,
}


@pytest.mark.parametrize(
  "strategy,topology,length,compiled_gib",
  [
    pytest.param(*row, marks=MATRIX_MISSES.get(row[:3], ()), id="-".join(row[:3]))
    for row in MATRIX_CHECK
  ],
)
def test_planner_is_within_15_percent_of_the_bench_memory_matrix(
  strategy, topology, length, compiled_gib
):
  """The planner's figure for a bench_memory cell, as the script computes it,
  against the cell's compiled total: 19 of the 24 within 15%."""
  bench = _script("bench_memory")
  exp = bench.experiment(bench.cell_params(strategy, topology, bench.LENGTHS[length]))
  # The cells were compiled before splash's fused backward: the two-pass programs.
  no_fused = dataclasses.replace(exp.train.attention_options, fused_bwd=False)
  exp = dataclasses.replace(exp, train=dataclasses.replace(exp.train, attention_options=no_fused))
  est = bench.planner_row(exp, topology)["planner_total_bytes"] / GiB
  err = (est - compiled_gib) / compiled_gib
  assert abs(err) <= 0.15, f"planner {est:.2f} vs compiled {compiled_gib:.2f} GiB ({err:+.1%})"


# ----------------------------------------------------------------------------
# The search and plan.json
# ----------------------------------------------------------------------------
def _rank(rec):
  s = rec["setup"]
  return (s["context_degree"], planner.REMAT_ORDER.index(s["remat_policy"]))


def test_smallest_setup_fits_and_longer_sequences_need_more():
  # Batch 8 leaves the search free to trade fsdp for context on 64 devices.
  short = planner.plan(_exp(LLAMA_8B, seq_len=1 << 16, batch_size=8), hardware="v5p-64")
  long = planner.plan(_exp(LLAMA_8B, seq_len=1 << 21, batch_size=8), hardware="v5p-64")
  for rec in (short, long):
    sm = rec["smallest"]
    assert sm is not None and sm["fits"]
    assert sm["per_device_total_bytes"] <= rec["target"]["hbm_bytes_per_device"]
    assert sm["per_device_total_bytes"] == sm["breakdown"]["total"]
  assert _rank(long["smallest"]) > _rank(short["smallest"])
  # Nothing smaller in the search order fits: one step down does not.
  s = short["smallest"]["setup"]
  assert s["context_degree"] >= 8


def test_plan_json_keys_and_the_compile_command(tmp_path, capsys):
  exp = _exp(
    LLAMA_8B, seq_len=1 << 22, strategy="usp", mesh=MeshConfig(context=8, context_ulysses=8)
  )
  rec = planner.run_plan(exp, str(tmp_path), hardware="v5p-64", gin_files=["gin/x.gin"])
  with open(tmp_path / "plan.json") as f:
    saved = json.load(f)
  assert saved == json.loads(json.dumps(rec))
  for key in ("configured", "smallest"):
    assert {"setup", "per_device_total_bytes"} <= set(saved[key])
  assert "fits" in saved["configured"]
  assert saved["configured"]["setup"]["strategy"] == "usp"
  assert saved["configured"]["setup"]["mesh"]["context_ulysses"] == 8
  assert "planner estimate" in saved["label"]
  out = capsys.readouterr().out
  assert "planner estimate" in out and "--mode=compile --gin_file=gin/x.gin" in out
  assert "--compile_topology=v5p:4x4x4" in out
  assert any("MeshConfig.context=" in p for p in saved["smallest"]["gin_params"])


def test_configured_mesh_that_does_not_resolve_is_reported_not_raised(tmp_path):
  # 8 x 8 is 64 devices; tpu7x-64 has 128.
  exp = _exp(
    LLAMA_8B, seq_len=1 << 22, strategy="usp", mesh=MeshConfig(context=8, context_ulysses=8)
  )
  rec = planner.plan(exp, hardware="tpu7x-64")
  assert rec["configured"]["fits"] is False
  assert "128 devices" in rec["configured"]["error"]
  assert rec["smallest"]["fits"]


@pytest.mark.parametrize("bad", ["v9z-64", "h100", "tpu7x:4x4x4x"])
def test_unknown_hardware_is_a_clear_error(bad, tmp_path):
  exp = _exp(LLAMA_8B, seq_len=1 << 20)
  with pytest.raises(ValueError, match="hardware|accelerator|topology"):
    planner.run_plan(exp, str(tmp_path), hardware=bad)


def test_missing_hardware_names_the_flag(tmp_path):
  with pytest.raises(ValueError, match="--plan_hardware"):
    planner.run_plan(_exp(LLAMA_8B, seq_len=1 << 20), str(tmp_path), hardware=None)


def test_gpu_targets_plan_without_a_compile_command():
  rec = planner.plan(_exp(LLAMA_8B, seq_len=1 << 20, batch_size=8), hardware="h100x8")
  assert rec["target"]["devices"] == 8
  assert rec["smallest"] is None or rec["smallest"]["compile_topology"] is None


def test_main_mode_plan_writes_plan_json(tmp_path):
  cmd = [
    sys.executable,
    os.path.join(ROOT, "main.py"),
    "--mode=plan",
    "--gin_file=gin/ring_v5p.gin",
    "--plan_hardware=v5p-64",
    f"--workdir={tmp_path}",
  ]
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode in (0, 1), proc.stderr[-2000:]
  # Without --plan_hardware, or with one that names no hardware: one `error:`
  # line and exit status 2, no traceback.
  for flag in ([], ["--plan_hardware=v9z-64"]):
    bad = [a for a in cmd if not a.startswith("--plan_hardware")] + flag
    bad_proc = subprocess.run(bad, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert bad_proc.returncode == 2, bad_proc.stderr[-2000:]
    assert "error: --" in bad_proc.stderr and "Traceback" not in bad_proc.stderr, flag
  with open(tmp_path / "plan.json") as f:
    rec = json.load(f)
  assert rec["configured"]["setup"]["strategy"] == "ring"
  assert (proc.returncode == 0) == rec["configured"]["fits"]
  assert "Ask the compiler" in proc.stdout


# ----------------------------------------------------------------------------
# The compiler's check: small Llama-shaped models on small TPU slices
# ----------------------------------------------------------------------------
SMALL = dict(
  vocab_size=4096,
  d_model=256,
  num_layers=2,
  num_heads=8,
  num_kv_heads=4,
  head_dim=32,
  mlp_dim=768,
  dtype="bfloat16",
  param_dtype="float32",
)
COMPILE_CASES = [
  # topology, strategy, mesh, remat policy, loss chunk (batch: data x fsdp rows)
  ("v5p:2x2x1", "ring", dict(fsdp=2, context=2), "full", 1024),
  # Chunked loss on tpu7x:2x2x1: libtpu 0.0.42.1 rejected the global-token
  # chunking's mask reshape ("Reshape should have supported layout"); the
  # per-device loss (Trainer._cross_entropy) compiles.
  ("tpu7x:2x2x1", "usp", dict(context=4, context_ulysses=2), "full", 1024),
  ("v5p:2x2x1", "all_gather", dict(context=4), "offload_layer_inputs", 1024),
]


def _compile(exp, topology):
  """compile_step's record, at the matmul precision Mosaic (splash) accepts."""
  import jax  # pylint: disable=g-import-not-at-top

  from lctx.sizing import compile as compile_lib  # pylint: disable=g-import-not-at-top

  # Mosaic (splash) takes bf16 matmuls at default precision only; conftest sets 'highest'.
  with jax.default_matmul_precision("default"):
    record = compile_lib.compile_step(exp, topology=topology)
  return record


BLOCKWISE_OFFLOAD = pytest.mark.xfail(
  strict=True,
  reason="measured (refit with remat groups): planner 104.5 vs compiled 89.6 MiB "
  "(+16.6%): blockwise all_gather with offloaded layer inputs compiles below remat 'full' "
  "(96.6 MiB); the offload term is fitted to ring / usp, where it costs device memory",
)


def _with_kernels(cases):
  """Both kernels per case; blockwise under `slow`: its compiles are most of this
  test's time, and the TPU flagships run splash ('auto'). The held-out set below
  checks blockwise too."""
  out = []
  for case in cases:
    for kernel in ("blockwise", "splash"):
      marks = [pytest.mark.slow] if kernel == "blockwise" else []
      if "offload" in case[3] and kernel == "blockwise":
        marks.append(BLOCKWISE_OFFLOAD)
      out.append(pytest.param(*case, kernel, marks=marks, id=f"{case[0]}-{case[1]}-{kernel}"))
  return out


@pytest.mark.parametrize(
  "topology,strategy,mesh,remat,loss_chunk,kernel", _with_kernels(COMPILE_CASES)
)
def test_planner_is_within_15_percent_of_the_compiler(
  topology, strategy, mesh, remat, loss_chunk, kernel
):
  from lctx import hardware  # pylint: disable=g-import-not-at-top

  exp = _exp(
    {**SMALL, "remat_policy": remat},
    seq_len=16384,
    batch_size=mesh.get("fsdp", 1),
    strategy=strategy,
    mesh=MeshConfig(**mesh),
    loss_chunk_size=loss_chunk,
    # 'auto' is what the flagship files run: splash on these TPU devices.
    attention=dict(block_q=512, block_kv=512, backend="auto" if kernel == "splash" else kernel),
  )
  record = _compile(exp, topology)
  assert record["fits"], record
  assert record["attention_backend"] == kernel
  compiled = record["per_device"]["total_bytes"]
  setup = planner.make_setup(exp, strategy=strategy, mesh=mesh, remat_policy=remat)
  assert setup.kernel == kernel
  est = planner.evaluate(planner.model_dims(exp.model), setup, hardware.parse_target(topology))
  err = (est["per_device_total_bytes"] - compiled) / compiled
  assert abs(err) <= 0.15, (
    f"planner {est['per_device_total_bytes'] / 2**20:.1f} MiB vs compiled "
    f"{compiled / 2**20:.1f} MiB ({100 * err:+.1f}%)"
  )
  host = record["per_device"]["host_bytes"]
  assert abs(est["host_bytes_per_device"] - host) <= 0.15 * max(host, 1)


def test_plan_then_compile_hands_the_winner_to_the_compiler(tmp_path):
  tiny = dict(SMALL, d_model=128, num_heads=4, num_kv_heads=2, mlp_dim=384, vocab_size=512)
  exp = _exp(
    {**tiny, "remat_policy": "full"},
    seq_len=4096,
    loss_chunk_size=1024,
    attention_options=AttentionOptions(block_q=512, block_kv=512, backend="blockwise"),
  )
  rec = planner.run_plan(exp, str(tmp_path), hardware="v5p:2x2x1", plan_then_compile=True)
  compiled = rec["compiled"]
  assert compiled["topology"] == "v5p:2x2x1" and compiled["fits"]
  assert compiled["strategy"] == rec["smallest"]["setup"]["strategy"]
  assert compiled["mesh"]["context"] == rec["smallest"]["setup"]["mesh"]["context"]
  assert isinstance(compiled["planner_error_pct"], float)
  with open(tmp_path / "plan.json") as f:
    assert json.load(f)["compiled"]["per_device"]["total_bytes"] > 0


# The held-out check: configurations the coefficients were
# not fitted to (scripts/fit_memory_model.py fits d_model 256-1024 at 16K-32K;
# these are d_model 1024 at 32K-64K, vocab 32K / 4K, other meshes and remat
# choices), every strategy on both small slices,
# several remat choices, both kernels. Compiles of up to a minute or more
# each: `python -m pytest -m slow tests/test_planner.py -k held_out`.
MEDIUM = dict(
  vocab_size=32000,
  d_model=1024,
  num_layers=2,
  num_heads=16,
  num_kv_heads=8,
  head_dim=64,
  mlp_dim=2816,
  dtype="bfloat16",
  param_dtype="float32",
)
HELD_OUT = [
  # topology, strategy, mesh, length, remat policy (/gK: remat_group_size K), vocab, loss chunk
  ("v5p:2x2x1", "ring", dict(context=4), 32768, "full", 32000, 1024),
  ("v5p:2x2x1", "all_gather", dict(context=4), 32768, "full", 32000, 1024),
  ("v5p:2x2x1", "usp", dict(context=2, context_ulysses=2), 65536, "dots", 32000, 1024),
  ("v5p:2x2x1", "ulysses", dict(context=4), 65536, "none", 32000, 1024),
  ("tpu7x:2x2x1", "usp", dict(context=4, context_ulysses=2), 65536, "full", 4096, None),
  ("tpu7x:2x2x1", "ulysses", dict(context=8), 32768, "full", 4096, None),
  ("tpu7x:2x2x1", "ring", dict(context=8), 65536, "offload_layer_inputs", 4096, None),
  ("tpu7x:2x2x1", "all_gather", dict(context=8), 65536, "full", 4096, None),
  # A remat group of 2 layers (the whole model here) with its input offloaded,
  # as gin/long_v5p.gin runs: the group terms were fitted to d_model 512.
  (
    "v5p:2x2x1",
    "usp",
    dict(context=2, context_ulysses=2),
    65536,
    "offload_layer_inputs/g2",
    32000,
    1024,
  ),
]


# Held-out cases the planner misses by more than 15%, as measured with
# libtpu 0.0.42.1 (coefficients of scripts/fit_memory_model.py's refit with
# remat groups and head dim 128):
# (topology, strategy, length, remat, kernel) -> planner vs compiled per device.
# Blockwise: measured before splash's fused backward (whose compiles it does not
# change). Splash: compiled again with the fused backward, the planner counting
# its dq partials (Breakdown.dq_partials; docs/benchmarks.md has the table).
# 8-way all_gather on TPU7x holds more of the whole-sequence K/V than the 4-way
# fit cases show, and splash with offloaded layer inputs keeps more ring buffers
# live than the offload term counts; the two fused-era misses (ulysses with
# remat 'none', usp on TPU7x) are not isolated.
HELD_OUT_MISSES = {
  ("v5p:2x2x1", "ulysses", 65536, "none", "splash"): (
    "fused backward: planner 5131.2 vs compiled 6949.4 MiB (-26.2%; 3299.7, -52.5%, "
    "before the dq partials were counted)"
  ),
  ("tpu7x:2x2x1", "usp", 65536, "full", "splash"): (
    "fused backward: planner 800.3 vs compiled 953.3 MiB (-16.0%)"
  ),
  ("tpu7x:2x2x1", "ring", 65536, "offload_layer_inputs", "splash"): (
    "fused backward: planner 901.7 vs compiled 1128.3 MiB (-20.1%; two-pass: 917.7 vs 1109.7)"
  ),
  ("tpu7x:2x2x1", "all_gather", 65536, "full", "blockwise"): (
    "planner 643.2 vs compiled 831.5 MiB (-22.7%)"
  ),
  ("tpu7x:2x2x1", "all_gather", 65536, "full", "splash"): (
    "fused backward: planner 2956.0 vs compiled 3806.4 MiB (-22.3%; two-pass: 1032.3 vs 1414.2)"
  ),
}


def _held_out_params():
  out = []
  for case in HELD_OUT:
    topology, strategy, _, seq_len, remat = case[:5]
    for kernel in ("blockwise", "splash"):
      miss = HELD_OUT_MISSES.get((topology, strategy, seq_len, remat, kernel))
      marks = pytest.mark.xfail(strict=True, reason=f"measured: {miss}") if miss else ()
      out.append(
        pytest.param(
          *case, kernel, marks=marks, id=f"{topology}-{strategy}-{seq_len}-{remat}-{kernel}"
        )
      )
  return out


@pytest.mark.slow
@pytest.mark.parametrize(
  "topology,strategy,mesh,seq_len,remat,vocab,loss_chunk,kernel", _held_out_params()
)
def test_planner_held_out_within_15_percent(
  topology, strategy, mesh, seq_len, remat, vocab, loss_chunk, kernel
):
  from lctx import hardware  # pylint: disable=g-import-not-at-top

  remat, _, group = remat.partition("/g")
  exp = _exp(
    {**MEDIUM, "vocab_size": vocab, "remat_policy": remat, "remat_group_size": int(group or 1)},
    seq_len=seq_len,
    strategy=strategy,
    mesh=MeshConfig(**mesh),
    loss_chunk_size=loss_chunk,
    attention_options=AttentionOptions(block_q=512, block_kv=512, backend=kernel),
  )
  record = _compile(exp, topology)
  assert record["attention_backend"] == kernel
  compiled = record["per_device"]["total_bytes"]
  setup = planner.make_setup(exp, strategy=strategy, mesh=mesh, remat_policy=remat)
  est = planner.evaluate(planner.model_dims(exp.model), setup, hardware.parse_target(topology))
  err = (est["per_device_total_bytes"] - compiled) / compiled
  line = (
    f"planner {est['per_device_total_bytes'] / 2**20:.1f} MiB vs compiled "
    f"{compiled / 2**20:.1f} MiB ({100 * err:+.1f}%)"
  )
  print(f"held-out {kernel} {topology} {strategy} {mesh} {seq_len} {remat}: {line}")
  assert abs(err) <= 0.15, line


# ----------------------------------------------------------------------------
# The fastest setup that fits (lctx/sizing/step_estimate.py)
# ----------------------------------------------------------------------------
def test_fastest_differs_from_smallest_when_attention_dominates():
  """4M tokens of Llama-3.1-8B on v5p-64: attention is ~99% of the FLOPs. The
  smallest setup takes the first policy of the least-recompute order that fits
  (save_qkv_proj: it keeps the projections and recomputes attention); the
  fastest keeps the attention output instead, so the step does not run its
  dominant part twice, and fits too."""
  rec = planner.plan(_exp(LLAMA_8B, seq_len=1 << 22), hardware="v5p-64")
  sm, fa = rec["smallest"], rec["fastest"]
  assert fa["fits"] and fa["setup"] != sm["setup"]
  assert fa["step_seconds_estimate"] < sm["step_seconds_estimate"]
  assert sm["setup"]["remat_policy"] == "save_qkv_proj"
  assert fa["setup"]["remat_policy"] == "save_attention_out"
  sm_flops, fa_flops = sm["step_time"]["flops_per_device"], fa["step_time"]["flops_per_device"]
  assert sm_flops["model"] == fa_flops["model"]  # the same tokens per device
  assert fa_flops["recompute"] < 0.05 * sm_flops["recompute"]
  assert sm["step_time_bound_by"] == fa["step_time_bound_by"] == "flops_seconds"


@pytest.mark.parametrize(
  "seq_len,batch_size,hardware",
  [(1 << 20, 8, "v5p-64"), (1 << 22, 1, "v5p-64"), (1 << 18, 8, "v5p-8"), (1 << 20, 1, "h100x8")],
)
def test_fastest_fits_and_no_fitting_candidate_is_faster(seq_len, batch_size, hardware):
  exp = _exp(LLAMA_8B, seq_len=seq_len, batch_size=batch_size)
  rec = planner.plan(exp, hardware=hardware)
  fa = rec["fastest"]
  assert fa is not None and fa["fits"]
  assert fa["per_device_total_bytes"] <= rec["target"]["hbm_bytes_per_device"]
  target = planner.hw.parse_target(hardware)
  dims = planner.model_dims(exp.model)
  times = [
    r["step_seconds_estimate"]
    for c in planner.candidates(exp, target)
    if not planner.check_valid(dims, c)
    for r in [planner.evaluate(dims, c, target, exp.model)]
    if r["fits"]
  ]
  assert len(times) == rec["candidates_fitting"] and min(times) == fa["step_seconds_estimate"]
  assert rec["smallest"]["step_seconds_estimate"] >= fa["step_seconds_estimate"]


def test_plan_json_has_fastest(tmp_path):
  rec = planner.run_plan(_exp(LLAMA_8B, seq_len=1 << 22), str(tmp_path), hardware="v5p-64")
  with open(tmp_path / "plan.json") as f:
    saved = json.load(f)
  for key in ("setup", "per_device_total_bytes", "step_seconds_estimate"):
    assert saved["fastest"][key] == rec["fastest"][key]
  assert saved["fastest"]["compile_topology"] == "v5p:4x4x4"
  assert any("remat_policy='save_attention_out'" in p for p in saved["fastest"]["gin_params"])


def test_step_flops_follow_the_trainer_formula_and_the_remat_policy():
  """No remat: the formula plus the kernel's backward beyond 2 x forward; 'full'
  recomputes the whole layer forward: the formula's forward less the unembedding."""
  from lctx.sizing import step_estimate  # pylint: disable=g-import-not-at-top

  exp = _exp(LLAMA_8B, seq_len=1 << 20)
  dims, m = planner.model_dims(exp.model), exp.model
  tokens = (1 << 20) / 64
  fwd = m.flops_per_token(1 << 20, training=False)
  for policy, recompute in (("none", 0.0), ("full", fwd - 2 * m.d_model * m.vocab_size)):
    setup = planner.make_setup(exp, strategy="ring", mesh={"context": 64}, remat_policy=policy)
    got = step_estimate.flops_per_device(m, dims, setup, 64)
    assert got["model"] == pytest.approx(m.flops_per_token(1 << 20) * tokens)
    assert got["recompute"] == pytest.approx(recompute * tokens, rel=1e-6)
    # splash's fused backward (6H + 4V = 10H: 2.5 units) against the formula's
    # 2 x 4H; its two-pass form (dkv + dq, 8H + 6V = 14H: 3.5 units).
    attn = fwd - m.flops_per_token(1, training=False)
    assert got["attention_extra"] == pytest.approx(attn * (10 / 4 - 2) * tokens)
    two_pass = dataclasses.replace(setup, fused_bwd=False)
    got = step_estimate.flops_per_device(m, dims, two_pass, 64)
    assert got["attention_extra"] == pytest.approx(attn * (14 / 4 - 2) * tokens)


def test_attention_recompute_follows_the_kept_residuals():
  """By hand, per token: forward 1 unit of attention, backward 2.5 (fused); full
  remat runs the forward again (1 more) unless the policy keeps the attention
  output and lse (save_attention_out, attention_out_offloaded, the offload
  walk's first steps); the JAX dot policies keep no kernel residual."""
  from lctx.sizing import step_estimate  # pylint: disable=g-import-not-at-top

  exp = _exp(LLAMA_8B, seq_len=1 << 20)
  dims, m = planner.model_dims(exp.model), exp.model
  attn = m.flops_per_token(1 << 20, training=False) - m.flops_per_token(1, training=False)
  tokens = (1 << 20) / 64

  def recompute(policy):
    setup = planner.make_setup(exp, strategy="ring", mesh={"context": 64}, remat_policy=policy)
    return step_estimate.flops_per_device(m, dims, setup, 64)["recompute"] / tokens

  dense_full = recompute("full") - attn
  assert dense_full > 0
  for policy in ("save_attention_out", "attention_out_offloaded"):
    assert recompute(policy) == pytest.approx(dense_full), policy
  for policy in ("dots", "minimal"):
    assert recompute(policy) >= attn, policy
  assert recompute("save_dots") < attn  # keeps the residuals and the MLP hidden
  # A remat group of 2 replays the whole forward once more (gin/long_*.gin: the
  # forward three times under 'full', twice with the residuals kept).
  grouped = _exp({**LLAMA_8B, "remat_group_size": 2}, seq_len=1 << 20)
  whole = m.flops_per_token(1 << 20, training=False) - 2 * m.d_model * m.vocab_size
  for policy in ("full", "save_attention_out"):
    setup = planner.make_setup(grouped, strategy="ring", mesh={"context": 64}, remat_policy=policy)
    got = step_estimate.flops_per_device(m, dims, setup, 64)["recompute"] / tokens
    assert got == pytest.approx(recompute(policy) + whole, rel=1e-6), policy


def test_upipe_stages_replay_the_attention_forward_unless_the_residuals_are_kept():
  """UPipe's head stages (ContextOptions.head_chunks > 1) are checkpoints: their
  backward runs the attention forward once more, under 'none' and 'full', but
  not when the layer's policy keeps the attention output and lse (compiled:
  tests/test_remat.py::test_upipe_stages_replay_attention_unless_kept)."""
  from lctx.sizing import step_estimate  # pylint: disable=g-import-not-at-top

  exp = _exp(LLAMA_8B, seq_len=1 << 20)
  dims, m = planner.model_dims(exp.model), exp.model
  attn = m.flops_per_token(1 << 20, training=False) - m.flops_per_token(1, training=False)
  tokens = (1 << 20) / 64

  def recompute(policy, chunks):
    setup = planner.make_setup(exp, strategy="ulysses", mesh={"context": 64}, remat_policy=policy)
    setup = dataclasses.replace(setup, head_chunks=chunks)
    return step_estimate.flops_per_device(m, dims, setup, 64)["recompute"] / tokens

  for policy in ("none", "full", "offload_layer_inputs"):
    assert recompute(policy, 4) - recompute(policy, None) == pytest.approx(attn), policy
  assert recompute("save_attention_out", 4) == pytest.approx(recompute("save_attention_out", None))


def test_fastest_walks_the_offload_order():
  """The search tries the seed's offload order after the remat presets: the
  attention output offloaded, then the optimizer state, the layer inputs, the
  parameters, and remat last; each step is a candidate with its state offload
  and its gin bindings."""
  from lctx import hardware  # pylint: disable=g-import-not-at-top

  exp = _exp(LLAMA_8B, seq_len=1 << 20)
  target = hardware.parse_target("v5p-64")
  walked = [
    (s.remat_policy, s.offload_optimizer_state, s.offload_params)
    for s in planner.candidates(exp, target)
    if s.context_degree == 64 and s.strategy == "ring"
  ]
  order = [w for w in walked if w in planner.OFFLOAD_ORDER]
  assert order[-len(planner.OFFLOAD_ORDER) :] == list(planner.OFFLOAD_ORDER)
  setup = planner.make_setup(
    exp,
    strategy="ring",
    mesh={"context": 64},
    remat_policy="attention_out_offloaded",
    offload_optimizer_state=True,
  )
  assert "TrainConfig.offload_optimizer_state=True" in planner.gin_overrides(setup)
  rec = planner.setup_record(setup)
  assert planner.apply_setup(exp, rec).train.offload_optimizer_state


# ----------------------------------------------------------------------------
# One strategy decision: the planner predicts what the run's ContextPlan takes
# ----------------------------------------------------------------------------
TINY_GQA = dict(
  vocab_size=512, d_model=128, num_layers=2, num_heads=8, num_kv_heads=4, head_dim=32, mlp_dim=256
)
TINY_MLA = dict(TINY_GQA, attention="mla", num_kv_heads=8, kv_lora_rank=32, v_head_dim=32)
TINY_MQA = dict(TINY_GQA, num_kv_heads=1)


@pytest.mark.parametrize(
  "model,topology,mesh,gib,expected",
  [
    # Everything fits: all_gather, the cheapest.
    (TINY_GQA, "v5p:2x2x1", dict(context=4), 4.0, "all_gather"),
    # Nothing fits a tiny budget: the smallest sharded strategy.
    (TINY_GQA, "v5p:2x2x1", dict(context=4), 1e-4, None),
    # MLA heads never go to ulysses / usp, whatever the budget.
    (TINY_MLA, "v5p:2x2x1", dict(context=4), 1e-4, "ring"),
    (TINY_MLA, "tpu7x:2x2x1", dict(context=2, context_ulysses=4), 1e-4, None),
    # MQA: no all-to-all over one kv head.
    (TINY_MQA, "tpu7x:2x2x1", dict(context=8), 1e-4, None),
    # ring x ulysses mesh on TPU7x (8 devices).
    (TINY_GQA, "tpu7x:2x2x1", dict(context=2, context_ulysses=4), 1e-4, None),
    # No context axes: no context parallelism.
    (TINY_GQA, "v5p:2x2x1", dict(fsdp=4, context=1), 4.0, "none"),
  ],
)
def test_planner_predicts_the_strategy_the_run_takes(model, topology, mesh, gib, expected):
  """`--mode=plan`'s configured strategy for 'auto' is the run's ContextPlan's
  (one decision, lctx/parallel/auto.py decide_strategy), on compile-only TPU
  devices so both resolve the kernel for the TPU platform."""
  from lctx import hardware  # pylint: disable=g-import-not-at-top
  from lctx.parallel import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
  from lctx.trainer import Trainer  # pylint: disable=g-import-not-at-top

  exp = _exp(
    dict(model, dtype="bfloat16"),
    seq_len=8192,
    batch_size=mesh.get("fsdp", 1),
    mesh=MeshConfig(**mesh),
    strategy="auto",
    device_memory_gib=gib,
    attention_options=AttentionOptions(block_q=512, block_kv=512),
  )
  run_mesh = mesh_lib.make_mesh(exp.mesh, devices=tpu_lib.topology_devices(topology))
  ran = Trainer(exp.model, exp.train, run_mesh).plan.strategy
  setup, why = planner.configured_setup(
    exp, planner.model_dims(exp.model), hardware.parse_target(topology)
  )
  assert setup is not None, why
  assert setup.strategy == ran
  if expected is not None:
    assert ran == expected
  if model is TINY_MLA or model is TINY_MQA:
    assert ran not in ("ulysses", "usp")


# ----------------------------------------------------------------------------
# The planner's step time against the compiler's, on the planner's own picks
# ----------------------------------------------------------------------------
def _step_exp(remat="full", seq_len=16384):
  return _exp(
    {**SMALL, "remat_policy": remat},
    seq_len=seq_len,
    loss_chunk_size=1024,
    attention_options=AttentionOptions(block_q=512, block_kv=512, backend="auto"),
  )


def _step_error(exp, rec) -> float:
  """(planner - compiled) / compiled step-time estimate of one plan record's setup."""
  compiled = _compile(planner.apply_setup(exp, rec["setup"]), "v5p:2x2x1")
  assert compiled["fits"], compiled
  assert compiled["attention_backend"] == rec["setup"]["attention_kernel"] == "splash"
  return rec["step_seconds_estimate"] / compiled["step_seconds_estimate"] - 1


def test_planner_step_time_is_within_15_percent_of_the_compiler_on_its_picks():
  """`fastest` (and `smallest`, when it differs) on a v5p:2x2x1 slice, a small
  Llama-shaped model at 16K tokens: the planner's step-time estimate against
  `--mode=compile`'s for the same setup (both hardware.step_time; the compiler's
  FLOPs read from the program, the fused splash backward's included)."""
  exp = _step_exp()
  plan = planner.plan(exp, hardware="v5p:2x2x1")
  picks = {"fastest": plan["fastest"]}
  if plan["smallest"]["setup"] != plan["fastest"]["setup"]:
    picks["smallest"] = plan["smallest"]
  for name, rec in picks.items():
    err = _step_error(exp, rec)
    assert abs(err) <= 0.15, f"{name} {rec['setup']}: planner off by {err:+.1%}"


@pytest.mark.slow
@pytest.mark.parametrize("remat", ["full", "save_attention_out", "attention_out_offloaded"])
def test_planner_step_time_follows_the_remat_presets(remat):
  """The fastest pick's mesh and strategy run with each preset the walk reaches:
  the planner's step time (recompute counted by kept residuals) within 15% of
  the compiler's."""
  from lctx import hardware  # pylint: disable=g-import-not-at-top

  exp = _step_exp()
  setup = planner.plan(exp, hardware="v5p:2x2x1")["fastest"]["setup"]
  chosen = planner.make_setup(
    exp, strategy=setup["strategy"], mesh=setup["mesh"], remat_policy=remat
  )
  rec = planner.evaluate(
    planner.model_dims(exp.model), chosen, hardware.parse_target("v5p:2x2x1"), exp.model
  )
  err = _step_error(exp, rec)
  assert abs(err) <= 0.15, f"{remat}: planner off by {err:+.1%}"

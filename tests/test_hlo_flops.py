"""Matmul FLOPs from optimised HLO (lctx/sizing/hlo_flops.py), against programs whose count is known.

Small programs are compiled by the real TPU compiler on libtpu's compile-only
devices ('v5p:2x2x1'), so the HLO read is what the TPU compiler emits (dots
rewritten as convolutions, loops without `known_trip_count`); each compiles in
well under a second.
"""

import math
import os
import sys

import numpy as np
import pytest

# Read when libtpu loads (the first topology call), so before any test runs.
from lctx.sizing import devices as devices_lib  # noqa: E402  (no jax import)

devices_lib.compile_only_env()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import SingleDeviceSharding  # noqa: E402

from lctx.sizing import compile as compile_lib  # noqa: E402
from lctx.sizing import hlo_flops  # noqa: E402
from lctx.sizing import tpu as tpu_lib  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_compile import SMALL_SLICE, TINY, _experiment  # noqa: E402

M, K, N = 64, 128, 256
DOT = 2 * M * K * N  # one [M, K] @ [K, N]
SQ = 2 * M * K * K  # one [M, K] @ [K, K]


@pytest.fixture(autouse=True)
def _tpu_matmul_precision():
  """The TPU default matmul precision (conftest's 'highest' is for CPU numerics)."""
  with jax.default_matmul_precision("default"):
    yield


@pytest.fixture(scope="module")
def device():
  return tpu_lib.topology_devices("v5p:2x2x1")[0]


def _count(device, f, *shapes):
  sharding = SingleDeviceSharding(device)
  args = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=sharding) for s in shapes]
  compiled = jax.jit(f).lower(*args).compile()
  return hlo_flops.matmul_flops(compiled.as_text())


def _scan_tanh(ws, x):
  def body(c, w):
    return jnp.tanh(c @ w), None

  return lax.scan(body, x, ws)[0]


def test_single_dot(device):
  out = _count(device, lambda x, w: x @ w, (M, K), (K, N))
  assert out["dot_flops"] == DOT == out["dot_flops_min"]
  assert out["custom_calls"] == 0 and out["unknown_trip_count_loops"] == 0


def test_batched_einsum(device):
  """A batched contraction (the compiler may give the batch a spatial dimension)."""
  out = _count(device, lambda a, b: jnp.einsum("bmk,bkn->bmn", a, b), (3, M, K), (3, K, N))
  assert out["dot_flops"] == 3 * DOT


def test_scan_counts_its_body_trip_count_times(device):
  out = _count(device, _scan_tanh, (7, K, K), (M, K))
  assert out["dot_flops"] == 7 * SQ
  assert list(out["loops"].values()) == [7] and out["unknown_trip_count_loops"] == 0


def test_nested_scans_multiply(device):
  def f(ws, x):
    def outer(c, w_row):
      return _scan_tanh(w_row, c), None

    return lax.scan(outer, x, ws)[0]

  out = _count(device, f, (3, 5, K, K), (M, K))
  assert out["dot_flops"] == 15 * SQ
  assert sorted(out["loops"].values()) == [3, 5]


def test_fori_loop_with_offset_bounds(device):
  """An induction variable that starts at 2 and stops before 9: 7 trips."""

  def f(w, x):
    return lax.fori_loop(2, 9, lambda i, c: jnp.tanh(c @ w) + i, x)

  assert _count(device, f, (K, K), (M, K))["dot_flops"] == 7 * SQ


def test_grad_of_scan_counts_forward_and_backward(device):
  """Forward c @ w, backward dc = g @ w.T and dw = c.T @ g: 3 matmuls per step."""

  def loss(ws, x):
    return jnp.sum(_scan_tanh(ws, x))

  out = _count(device, jax.grad(loss, argnums=(0, 1)), (7, K, K), (M, K))
  assert out["dot_flops"] == 3 * 7 * SQ
  assert out["unknown_trip_count_loops"] == 0


def test_checkpointed_scan_body_shows_the_recompute(device):
  """jax.checkpoint on the body recomputes c @ w in the backward: 4 matmuls per step."""

  def loss(ws, x, remat):
    def body(c, w):
      return jnp.tanh(c @ w), None

    body = jax.checkpoint(body) if remat else body
    return jnp.sum(lax.scan(body, x, ws)[0])

  shapes = (7, K, K), (M, K)
  plain = _count(device, jax.grad(lambda w, x: loss(w, x, False), argnums=(0, 1)), *shapes)
  remat = _count(device, jax.grad(lambda w, x: loss(w, x, True), argnums=(0, 1)), *shapes)
  assert plain["dot_flops"] == 3 * 7 * SQ
  assert remat["dot_flops"] == 4 * 7 * SQ


def test_cost_analysis_counts_a_loop_body_once(device):
  """Why this module exists: cost_analysis() flops do not grow with the trip count."""
  sharding = SingleDeviceSharding(device)

  def flops(steps):
    args = [
      jax.ShapeDtypeStruct(s, jnp.float32, sharding=sharding) for s in [(steps, K, K), (M, K)]
    ]
    compiled = jax.jit(_scan_tanh).lower(*args).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return cost["flops"], hlo_flops.matmul_flops(compiled.as_text())["dot_flops"]

  (cost_3, ours_3), (cost_9, ours_9) = flops(3), flops(9)
  # Both near one body's matmul (plus elementwise work), not 3 or 9 of them.
  assert SQ <= cost_3 < 2 * SQ and SQ <= cost_9 < 2 * SQ
  assert ours_9 == 3 * ours_3 == 9 * SQ


# A hand-written module: a dot with inline operand shapes, a head projection as
# a convolution with a padded spatial dimension (as the TPU compiler writes
# them), a loop with a known trip count holding a Mosaic call and a conditional
# (one branch with a dot, one without), a loop bounded by a parameter, and a
# `call` of a computation that ends as SparseCore ones do.
HLO = """HloModule snippet, entry_computation_layout={(f32[8,16]{1,0})->f32[8,4]{1,0}}

%branch_dot (p: f32[8,16]) -> f32[8,4] {
  %p = f32[8,16]{1,0} parameter(0)
  %w = f32[16,4]{1,0} constant({...})
  ROOT %d = f32[8,4]{1,0} dot(f32[8,16]{1,0} %p, f32[16,4]{1,0} %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%branch_none (q: f32[8,16]) -> f32[8,4] {
  %q = f32[8,16]{1,0} parameter(0)
  ROOT %s = f32[8,4]{1,0} slice(%q), slice={[0:8], [0:4]}
}

%body (t: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %t = (s32[], f32[8,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[8,16]{1,0} get-tuple-element(%t), index=1
  %k = f32[8,16]{1,0} custom-call(%x), custom_call_target="tpu_custom_call", frontend_attributes={kernel_metadata={
"xprof_metadata":"{}"
}}
  %pred = pred[] constant(true)
  %c = f32[8,4]{1,0} conditional(%pred, %k, %k), branch_computations={%branch_dot, %branch_none}
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %r = (s32[], f32[8,16]{1,0}) tuple(%next, %k)
}

%cond (u: (s32[], f32[8,16])) -> pred[] {
  %u = (s32[], f32[8,16]{1,0}) parameter(0)
  %j = s32[] get-tuple-element(%u), index=0
  %lim = s32[] constant(1000)
  ROOT %lt = pred[] compare(%j, %lim), direction=LT
}

%body2 (t2: (s32[], f32[8,16], s32[])) -> (s32[], f32[8,16], s32[]) {
  %t2 = (s32[], f32[8,16]{1,0}, s32[]) parameter(0)
  %i2 = s32[] get-tuple-element(%t2), index=0
  %x2 = f32[8,16]{1,0} get-tuple-element(%t2), index=1
  %n2 = s32[] get-tuple-element(%t2), index=2
  %w2 = f32[16,16]{1,0} constant({...})
  %y2 = f32[8,16]{1,0} dot(%x2, %w2), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %one2 = s32[] constant(1)
  %next2 = s32[] add(%i2, %one2)
  ROOT %r2 = (s32[], f32[8,16]{1,0}, s32[]) tuple(%next2, %y2, %n2)
}

%cond2 (u2: (s32[], f32[8,16], s32[])) -> pred[] {
  %u2 = (s32[], f32[8,16]{1,0}, s32[]) parameter(0)
  %j2 = s32[] get-tuple-element(%u2), index=0
  %m2 = s32[] get-tuple-element(%u2), index=2
  ROOT %lt2 = pred[] compare(%j2, %m2), direction=LT
}

%proj (a: bf16[8,16,1], b: bf16[16,4,2]) -> bf16[8,4,2] {
  %a = bf16[8,16,1]{0,2,1} parameter(0)
  %b = bf16[16,4,2]{2,1,0} parameter(1)
  ROOT %conv = bf16[8,4,2]{0,2,1} convolution(%a, %b), window={size=4 pad=3_3 rhs_reversal=1}, dim_labels=bf0_i0o->b0f
}

%sc (s: f32[8,16]) -> f32[8,8] {
  %s = f32[8,16]{1,0} parameter(0)
  %ws = f32[16,8]{1,0} constant({...})
  ROOT %ds = f32[8,8]{1,0} dot(%s, %ws), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}, execution_thread="sparsecore"

ENTRY %main (x: f32[8,16], n: s32[]) -> f32[8,4] {
  %x = f32[8,16]{1,0} parameter(0)
  %n = s32[] parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8,16]{1,0}) tuple(%zero, %x)
  %loop = (s32[], f32[8,16]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  %init2 = (s32[], f32[8,16]{1,0}, s32[]) tuple(%zero, %x, %n)
  %loop2 = (s32[], f32[8,16]{1,0}, s32[]) while(%init2), condition=%cond2, body=%body2
  %a = bf16[8,16,1]{0,2,1} constant({...})
  %b = bf16[16,4,2]{2,1,0} constant({...})
  %p = bf16[8,4,2]{0,2,1} fusion(%a, %b), kind=kOutput, calls=%proj
  %called = f32[8,8]{1,0} call(%x), to_apply=%sc
  %y = f32[8,16]{1,0} get-tuple-element(%loop), index=1
  ROOT %out = f32[8,4]{1,0} slice(%y), slice={[0:8], [0:4]}
}
"""


def test_hand_written_module():
  out = hlo_flops.matmul_flops(HLO)
  branch_dot, body2_dot, proj = 2 * 8 * 4 * 16, 2 * 8 * 16 * 16, 2 * 8 * 16 * (4 * 2)
  called = 2 * 8 * 8 * 16
  # known_trip_count (5) wins over the constant bound (1000) in the condition;
  # the parameter-bounded loop counts once and is reported.
  assert out["loops"] == {"main/loop": 5, "main/loop2": None}
  assert out["unknown_trip_count_loops"] == 1
  assert out["dot_flops"] == 5 * branch_dot + body2_dot + proj + called
  assert out["dot_flops_min"] == body2_dot + proj + called
  assert out["custom_calls"] == 5 and out["custom_calls_by_kernel"] == {"k": 5}
  assert out["conditionals"] == 1


def test_bad_input_is_one_clear_error():
  with pytest.raises(ValueError, match="no ENTRY computation"):
    hlo_flops.matmul_flops("not an HLO module")


def test_tiny_train_step_does_at_least_six_flops_per_parameter_and_token(tmp_path):
  """`--mode=compile` of gin/long_v5p.gin (tiny model, v5p:2x2x1) records matmul FLOPs.

  A train step multiplies each matmul weight with each token at least 3 times
  (forward, input gradient, weight gradient): >= 6 x params x tokens / devices
  per device (attention's own matmuls run in splash, which HLO cannot see, and
  the embedding is a gather). This file nests remat: the layer group of 2 is
  recomputed and each layer inside it is checkpointed again, so the forward
  runs at most 3 times: <= 10 x params x tokens / devices.
  """
  path = "gin/long_v5p.gin"
  topology, mesh_params = SMALL_SLICE[path]
  exp = _experiment(path, [*TINY, *mesh_params])
  with jax.default_matmul_precision("default"):
    record = compile_lib.compile_step(exp, topology=topology)
  from lctx.parallel import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
  from lctx.trainer import Trainer  # pylint: disable=g-import-not-at-top

  mesh = mesh_lib.make_mesh(exp.mesh, devices=tpu_lib.topology_devices(topology))
  params = Trainer(exp.model, exp.train, mesh).abstract_state["params"]
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  weights = sum(
    math.prod(leaf.shape)
    for path_, leaf in flat
    if not any(getattr(k, "key", None) in ("embedding", "scale") for k in path_)
  )
  per_device = weights * record["tokens_per_step"] / record["devices"]
  ratio = record["matmul_flops_per_device"] / per_device
  assert 6 <= ratio <= 10, ratio
  assert record["unknown_trip_count_loops"] == 0
  # splash's calls carry their block-map FLOPs (lctx/kernels/flop_tags.py): none is
  # left uncounted, and attention adds to the matmuls.
  assert record["kernel_custom_calls"] == 0 and record["attention_flops_per_device"] > 0
  # cost_analysis() counts loop bodies once: below the real figure.
  assert record["flops_per_device"] < record["matmul_flops_per_device"]
  assert "matmul FLOPs per device" in compile_lib.summary(record)
  # The step's FLOPs, bytes and time (compile.json keys).
  total = record["dense_flops_per_device"] + record["attention_flops_per_device"]
  assert record["total_flops_per_device"] == total
  model = exp.model.flops_per_token(exp.train.seq_len) * record["tokens_per_step"] / 4
  assert record["model_flops_per_device"] == pytest.approx(model)
  # splash's backward (fused: 2.5 x its forward, not the formula's 2 x), the
  # nested remat's recomputed forwards and whole diagonal blocks all cost more.
  assert 1.5 < record["recompute_ratio"] == total / model < 3
  assert record["collective_bytes_per_device"] > 0
  assert record["collective_bytes_by_kind"]["all-to-all"] > 0  # usp's ulysses part
  assert record["collective_bytes_by_kind"]["collective-permute"] > 0  # its ring part
  assert set(record["collective_bytes_by_axis"]) <= {
    "context",
    "context_ulysses",
    "context+context_ulysses",
  }
  assert record["dcn_bytes_per_device"] == 0  # one slice
  # offload_layer_inputs: the bf16 layer inputs go out once and come back once.
  host = record["host_transfer_bytes_per_device"]
  groups = exp.model.num_layers // exp.model.remat_group_size
  per_device_tokens = record["tokens_per_step"] // record["devices"]
  assert host["to_host"] == host["to_device"] == groups * per_device_tokens * 128 * 2
  bounds = record["step_time_bounds"]
  assert record["step_seconds_lower_bound"] == max(bounds.values())
  assert bounds["flops_seconds"] == pytest.approx(total / 459e12)
  assert record["step_seconds_estimate"] == pytest.approx(
    record["step_seconds_lower_bound"] / record["step_time_efficiency"]
  )
  assert record["tokens_per_second_estimate"] == pytest.approx(
    record["tokens_per_step"] / record["step_seconds_estimate"]
  )
  assert "step time ESTIMATE" in compile_lib.summary(record)


# ----------------------------------------------------------------------------
# Attention FLOPs, counted from each kernel's own block map (lctx/kernels/flop_tags.py)
# ----------------------------------------------------------------------------
B, T, NQ, NKV, HD, BLOCK = 1, 1024, 4, 2, 128, 256
PAIRS = BLOCK * BLOCK  # (query, key) pairs of one computed block
# Live 256 x 256 blocks of a 1024-token call (4 x 4 blocks), by hand:
CAUSAL_BLOCKS = 4 + 3 + 2 + 1  # the lower triangle with its diagonal
# window 300: q block i reaches kv block j <= i while 256 (i - j) - 255 < 300,
# i.e. j >= i - 2: rows see 1, 2, 3, 3 blocks.
WINDOW, WINDOW_BLOCKS = 300, 1 + 2 + 3 + 3
# Two documents of 512 tokens: each keeps its own causal triangle of 2 blocks (3 live).
PACKED_SEGMENTS = np.repeat(np.array([[1, 2]], np.int32), 512, axis=1)
PACKED_BLOCKS = 3 + 3
FWD = 2 * HD + 2 * HD  # QK^T + PV per pair and q head
FA2_BWD = 6 * HD + 4 * HD  # S, dP, dV, dQ, dK
SPLASH_BWD = FA2_BWD  # splash's fused dq+dkv kernel (the default): one pass
SPLASH_TWO_PASS_BWD = (4 * HD + 4 * HD) + (4 * HD + 2 * HD)  # dkv pass + dq pass


def _attention_count(
  device,
  backend,
  dtype,
  *,
  window=None,
  segments=None,
  traced_segments=False,
  layers=1,
  remat=False,
  fused_bwd=True,
):
  """hlo_flops' count of one compiled forward + backward of flash_attention on
  `device`; `layers` > 1 runs it in a scan of that many steps (jax.checkpoint on
  the step with remat: its forward runs again in the backward; remat may be a
  jax.checkpoint policy)."""
  from lctx import kernels  # pylint: disable=g-import-not-at-top
  from lctx.kernels.options import AttentionOptions  # pylint: disable=g-import-not-at-top

  opts = AttentionOptions(
    backend=backend,
    block_q=BLOCK,
    block_kv=BLOCK,
    window_size=window,
    platform=device.platform,
    fused_bwd=fused_bwd,
  )

  def loss(q, k, v, *traced):
    seg = traced[0] if traced else segments

    def step(c, _):
      out = kernels.flash_attention(c, k, v, segment_ids=seg, options=opts)
      return out.astype(c.dtype), None

    if remat:
      step = jax.checkpoint(step, policy=None if remat is True else remat)
    return jnp.sum(lax.scan(step, q, None, length=layers)[0].astype(jnp.float32))

  sharding = SingleDeviceSharding(device)
  shapes = [(B, T, NQ, HD), (B, T, NKV, HD), (B, T, NKV, HD)]
  args = [jax.ShapeDtypeStruct(x, dtype, sharding=sharding) for x in shapes]
  if traced_segments:
    args.append(jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=sharding))
  compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
  return hlo_flops.matmul_flops(compiled.as_text())


def _expected(blocks, bwd, calls=1):
  return calls * B * NQ * blocks * PAIRS * (FWD + bwd)


CASES = {
  "causal": (dict(), CAUSAL_BLOCKS),
  "window": (dict(window=WINDOW), WINDOW_BLOCKS),
}


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "two_pass"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_splash_attention_flops(device, case, fused):
  """splash (Mosaic calls on the TPU compiler): the forward and the fused dq+dkv
  backward (forward 1 unit, backward 2.5), or the two-pass dkv and dq backward
  (2 + 1.5 units), by hand."""
  kw, blocks = CASES[case]
  out = _attention_count(device, "splash", jnp.bfloat16, fused_bwd=fused, **kw)
  bwd = SPLASH_BWD if fused else SPLASH_TWO_PASS_BWD
  assert out["attention_kernel_flops"] == _expected(blocks, bwd)
  assert out["kernel_calls_counted"] == (2 if fused else 3) and out["custom_calls"] == 0
  assert bwd / FWD == (2.5 if fused else 3.5)


def test_splash_packed_rows_cost_the_causal_map(device):
  """Segment ids reach splash inside visited blocks only: its block map (so its
  work) is the causal one, whether the ids are traced or known."""
  traced = _attention_count(device, "splash", jnp.bfloat16, traced_segments=True)
  known = _attention_count(device, "splash", jnp.bfloat16, segments=PACKED_SEGMENTS)
  assert (
    traced["attention_flops"] == known["attention_flops"] == _expected(CAUSAL_BLOCKS, SPLASH_BWD)
  )


def test_splash_in_a_rematerialised_scan(device):
  """Kernel FLOPs multiply by the loop's trip count, and a checkpointed step's
  forward runs twice."""
  out = _attention_count(device, "splash", jnp.bfloat16, layers=3, remat=True)
  assert out["attention_flops"] == 3 * B * NQ * CAUSAL_BLOCKS * PAIRS * (2 * FWD + SPLASH_BWD)


KEEP_ATTENTION = jax.checkpoint_policies.save_only_these_names("attention_out", "attention_lse")


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "two_pass"])
def test_splash_kept_residuals_skip_the_forward_recompute(device, fused):
  """A checkpointed step whose policy keeps the kernel's tagged residuals (output
  and lse, lctx/kernels/remat_tags.py) runs the attention forward once: the
  backward does not re-run it (full remat: forward 2 units; kept: 1)."""
  out = _attention_count(
    device, "splash", jnp.bfloat16, layers=3, remat=KEEP_ATTENTION, fused_bwd=fused
  )
  bwd = SPLASH_BWD if fused else SPLASH_TWO_PASS_BWD
  assert out["attention_flops"] == 3 * B * NQ * CAUSAL_BLOCKS * PAIRS * (FWD + bwd)
  assert out["kernel_calls_counted"] == 3 * (2 if fused else 3)


@pytest.fixture(scope="module")
def cpu():
  return jax.devices("cpu")[0]


def _cpu_kernel_or_skip():
  from lctx.kernels import cpu_fused  # pylint: disable=g-import-not-at-top

  if not cpu_fused.available():
    pytest.skip(f"fused CPU kernel unavailable: {cpu_fused.unavailable_reason()}")


@pytest.mark.parametrize("backend", ["blockwise", "cpu"])
@pytest.mark.parametrize(
  "case",
  [
    ("causal", dict(), CAUSAL_BLOCKS),
    ("window", dict(window=WINDOW), WINDOW_BLOCKS),
    # Segment ids known at trace time: cross-document blocks are skipped.
    ("packed", dict(segments=PACKED_SEGMENTS), PACKED_BLOCKS),
    # A traced batch's segments are unknown: one document (the upper bound).
    ("packed_traced", dict(traced_segments=True), CAUSAL_BLOCKS),
  ],
  ids=lambda c: c if isinstance(c, str) else c[0],
)
def test_blockwise_and_cpu_attention_flops(cpu, backend, case):
  """blockwise: its live-block loops run the tagged mean trip count (matmuls in
  HLO); cpu: one tagged FFI call forward, one backward."""
  if backend == "cpu":
    _cpu_kernel_or_skip()
  _, kw, blocks = case
  out = _attention_count(cpu, backend, jnp.float32, **kw)
  assert out["attention_flops"] == _expected(blocks, FA2_BWD)
  # Rematerialised in a scan of 2: the forward again in the backward unless the
  # policy keeps the kernel's tagged output and lse.
  for remat, fwd_runs in ((True, 2), (KEEP_ATTENTION, 1)):
    got = _attention_count(cpu, backend, jnp.float32, layers=2, remat=remat, **kw)
    assert got["attention_flops"] == 2 * B * NQ * blocks * PAIRS * (fwd_runs * FWD + FA2_BWD)
  if backend == "blockwise":
    assert out["estimated_trip_count_loops"] == 2 and out["unknown_trip_count_loops"] == 0
    assert out["attention_dot_flops"] == out["attention_flops"]
  else:
    assert out["kernel_calls_counted"] == 2


def test_blockwise_in_a_scan(cpu):
  out = _attention_count(cpu, "blockwise", jnp.float32, layers=3)
  assert out["attention_flops"] == _expected(CAUSAL_BLOCKS, FA2_BWD, calls=3)


CUDNN_HLO = """HloModule cudnn

ENTRY %main (q: bf16[1,1024,4,128]) -> bf16[1,1024,4,128] {
  %q = bf16[1,1024,4,128]{3,2,1,0} parameter(0)
  %f = (bf16[1,4,1024,128]{3,2,1,0}, u8[0]{0}) custom-call(%q, %q, %q), custom_call_target="__cudnn$fmhaSoftmax", metadata={op_name="jit(f)/lctx_attention/lctx_flops=100/lctx_bwd_flops=250/dot_product_attention"}
  %o = bf16[1,4,1024,128]{3,2,1,0} get-tuple-element(%f), index=0
  %b = (bf16[1,4,1024,128]{3,2,1,0}, u8[0]{0}) custom-call(%o, %o), custom_call_target="__cudnn$fmhaSoftmaxBackward", metadata={op_name="jit(f)/transpose(jvp(lctx_attention))/lctx_flops=100/lctx_bwd_flops=250/dot_product_attention"}
  ROOT %r = bf16[1,1024,4,128]{3,2,1,0} bitcast(%o)
}
"""


def test_cudnn_calls_take_their_pass_tag():
  """cuDNN's backward call is emitted by jax under the forward's scope: the
  backward target takes lctx_bwd_flops."""
  out = hlo_flops.matmul_flops(CUDNN_HLO)
  assert out["attention_kernel_flops"] == 100 + 250 and out["kernel_calls_counted"] == 2


def test_blockwise_shard_against_the_whole_sequence(cpu):
  """all_gather's call: one device's 512 queries (two block rows) against all
  1024 keys, positions traced. The count is the mean over the 2 shards the
  queries may be: rows 0-1 (1 + 2 live blocks) or rows 2-3 (3 + 4), 5 on average."""
  from lctx import kernels  # pylint: disable=g-import-not-at-top

  def loss(q, k, v, qp, kp):
    out = kernels.flash_attention(
      q, k, v, q_positions=qp, kv_positions=kp, backend="blockwise", block_q=BLOCK, block_kv=BLOCK
    )
    return jnp.sum(out)

  shapes = [(B, T // 2, NQ, HD), (B, T, NKV, HD), (B, T, NKV, HD)]
  args = [jax.ShapeDtypeStruct(x, jnp.float32) for x in shapes]
  args += [jax.ShapeDtypeStruct((B, T // 2), jnp.int32), jax.ShapeDtypeStruct((B, T), jnp.int32)]
  compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
  out = hlo_flops.matmul_flops(compiled.as_text())
  assert out["attention_flops"] == B * NQ * 5 * PAIRS * (FWD + FA2_BWD)


COLLECTIVE_HLO = """HloModule coll

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body (t: (s32[], f32[64,8])) -> (s32[], f32[64,8]) {
  %t = (s32[], f32[64,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[64,8]{1,0} get-tuple-element(%t), index=1
  %z = f32[64,8]{1,0} constant({...})
  %dus = f32[64,8]{1,0} dynamic-update-slice(%z, %x, %i, %i)
  %ag = f32[64,8]{1,0} all-reduce(%dus), replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, to_apply=%add
  %cp = f32[64,8]{1,0} collective-permute(%ag), source_target_pairs={{0,1},{1,0}}
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %r = (s32[], f32[64,8]{1,0}) tuple(%next, %cp)
}

%cond (u: (s32[], f32[64,8])) -> pred[] {
  %u = (s32[], f32[64,8]{1,0}) parameter(0)
  %j = s32[] get-tuple-element(%u), index=0
  %lim = s32[] constant(3)
  ROOT %lt = pred[] compare(%j, %lim), direction=LT
}

ENTRY %main (x: f32[64,8]) -> f32[64,8] {
  %x = f32[64,8]{1,0} parameter(0)
  %ar = f32[64,8]{1,0} all-reduce(%x), replica_groups=[2,4]<=[4,2]T(1,0), to_apply=%add
  %zero = s32[] constant(0)
  %init = (s32[], f32[64,8]{1,0}) tuple(%zero, %ar)
  %loop = (s32[], f32[64,8]{1,0}) while(%init), condition=%cond, body=%body
  %y = f32[64,8]{1,0} get-tuple-element(%loop), index=1
  ROOT %a2a = f32[64,8]{1,0} all-to-all(%y), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
}
"""


def test_collective_bytes_by_kind_with_trip_counts():
  """Ring-algorithm bytes one device sends (X = 2 KiB operand, n = group size):
  all-reduce 2 (n-1)/n X; an all-reduce of a slice placed in zeros is an
  all-gather of X / n per device, (n-1) X / n; collective-permute X; all-to-all
  (n-1)/n X; the loop's collectives 3 times."""
  x = 64 * 8 * 4
  rows = {r["kind"]: r for r in hlo_flops.matmul_flops(COLLECTIVE_HLO)["collectives"]}
  assert rows["all-reduce"]["bytes"] == 2 * 3 / 4 * x
  assert rows["all-gather"]["bytes"] == 3 * (3 / 4) * x
  assert rows["collective-permute"]["bytes"] == 3 * x
  assert rows["all-to-all"]["bytes"] == 7 / 8 * x
  # Groups as device ids: iota with a transpose, and the mesh form.
  assert hlo_flops.expand_groups("[2,4]<=[4,2]T(1,0)", 8) == [[0, 2, 4, 6], [1, 3, 5, 7]]
  assert hlo_flops.expand_groups("mesh['axis_0'=2,'axis_1'=4] {'axis_1'}", 8) == [
    [0, 1, 2, 3],
    [4, 5, 6, 7],
  ]
  assert hlo_flops.expand_groups("mesh['axis_0'=2,'axis_1'=4] {'axis_0'}", 8)[0] == [0, 4]


def _unnamed_gather_hlo(producer_name: str) -> str:
  meta = f', metadata={{op_name="{producer_name}"}}' if producer_name else ""
  return f"""HloModule unnamed

%add (a: f32[], b: f32[]) -> f32[] {{
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}}

ENTRY %main (x: f32[16,8], i: s32[]) -> f32[64,8] {{
  %x = f32[16,8]{{1,0}} parameter(0)
  %i = s32[] parameter(1)
  %f = f32[16,8]{{1,0}} negate(%x){meta}
  %c = f32[16,8]{{1,0}} copy(%f)
  %z = f32[64,8]{{1,0}} constant({{...}})
  %dus = f32[64,8]{{1,0}} dynamic-update-slice(%z, %c, %i, %i)
  ROOT %ag = f32[64,8]{{1,0}} all-reduce(%dus), replica_groups={{{{0,1,2,3}}}}, to_apply=%add
}}
"""


def test_an_unnamed_gather_takes_its_slice_producers_scope():
  """libtpu writes a large all-gather as an all-reduce of a zero buffer holding
  the slice, without metadata (the full-size hybrid compiles counted the linear
  layers' summary gathers as 0.0): the slice's producer, through a copy, names
  the scope. Without a named producer it stays outside the linear layers."""
  x = 64 * 8 * 4
  linear = hlo_flops.matmul_flops(
    _unnamed_gather_hlo("jit(step)/layer_0/linear_attention/lctx_linear/shard_map/concatenate")
  )
  assert linear["linear_collective_bytes"]["all-gather"] == 3 / 4 * x
  for name in ("", "jit(step)/layer_1/mlp/convert", "jit(step)/lctx_linear/lctx_attention/x"):
    other = hlo_flops.matmul_flops(_unnamed_gather_hlo(name))
    assert other["linear_collective_bytes"]["all-gather"] == 0.0, name
    assert sum(r["bytes"] for r in other["collectives"]) == 3 / 4 * x

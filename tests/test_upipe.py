"""Head-chunked ulysses / usp (UPipe) equals the unchunked strategies; its working set
is one stage's; the natural-order load-balanced call costs no O(T) per device.

8 fake CPU devices (tests/conftest.py).
"""

import functools

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lctx.kernels import reference_attention
from lctx.parallel import SequenceMixer, context_attention
from lctx.parallel.context import stage_heads
from lctx.parallel.upipe import stage_shape
from lctx.parallel.zigzag import zigzag_permute_local, zigzag_reorder

AUTO = jax.sharding.AxisType.Auto
MESHES = helpers.MESHES


def _qkvw(n, kh, b=2, t=32, h=16, seed=0):
  ks = jax.random.split(jax.random.key(seed), 4)
  return (
    jax.random.normal(ks[0], (b, t, n, h)),
    jax.random.normal(ks[1], (b, t, kh, h)),
    jax.random.normal(ks[2], (b, t, kh, h)),
    jax.random.normal(ks[3], (b, t, n, h)),
  )


@pytest.mark.parametrize(
  "strategy,mesh_name,n,kh,chunks",
  [
    ("ulysses", "d2c4", 8, 8, 2),  # MHA: 2 heads per device, one per stage
    ("ulysses", "d2c4", 16, 8, 4),  # GQA: 2 q stages share each kv head, 2 K/V groups
    ("ulysses", "d2c4", 16, 4, 2),  # GQA: 2 q heads per stage, one K/V group of each
    ("ulysses", "t2c4", 16, 8, 2),  # with tensor parallel heads
    ("usp", "usp2x4", 8, 4, 2),  # usp: each stage is a ring over `context`
    ("usp", "usp2x4", 16, 16, 4),
  ],
)
def test_head_chunks_equal_unchunked_and_reference(strategy, mesh_name, n, kh, chunks):
  mesh = helpers.mesh(mesh_name)
  q, k, v, w = _qkvw(n, kh)
  seg, pos = helpers.packed_segments(q.shape[0], q.shape[1])
  kw = dict(segment_ids=seg, positions=pos)
  chunked = helpers.strategy_attention_fn(mesh, strategy, head_chunks=chunks, block_q=8, block_kv=8)
  plain = helpers.strategy_attention_fn(mesh, strategy, block_q=8, block_kv=8)

  def ref(q, k, v):
    return reference_attention(q, k, v, segment_ids=seg, q_positions=pos, kv_positions=pos)

  out, vjp = jax.vjp(lambda *a: chunked(*a, **kw), q, k, v)
  want, want_vjp = jax.vjp(lambda *a: plain(*a, **kw), q, k, v)
  ref_out, ref_vjp = jax.vjp(ref, q, k, v)
  np.testing.assert_allclose(out, want, atol=1e-6, rtol=1e-6)
  np.testing.assert_allclose(out, ref_out, atol=2e-5, rtol=2e-5)
  for name, a, b, c in zip("qkv", vjp(w), want_vjp(w), ref_vjp(w)):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5, err_msg=f"d{name}")
    np.testing.assert_allclose(a, c, atol=5e-5, rtol=5e-5, err_msg=f"d{name} vs reference")


def test_context_attention_takes_head_chunks():
  mesh = helpers.mesh("c8")
  q, k, v, _ = _qkvw(16, 8, b=1, t=64)
  out = context_attention(q, k, v, mesh=mesh, strategy="ulysses", ulysses_head_chunks=2)
  want = reference_attention(q, k, v)
  np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(
  "args,message",
  [
    ((8, 8, 4, 3), r"head_chunks \(3\) must divide the q heads per device .* = 2\)"),
    ((16, 4, 4, 1), None),
    ((24, 8, 2, 3), r"4 q heads per stage must be a multiple of the GQA group \(3"),
    ((24, 4, 2, 3), r"4 q heads per stage must divide the GQA group \(6"),
  ],
)
def test_stage_shape_rules(args, message):
  if message is None:
    assert stage_shape(*args) == (4, 1, 1)
    return
  with pytest.raises(ValueError, match=message):
    stage_shape(*args)


def test_head_chunks_only_for_all_to_all_strategies():
  with pytest.raises(ValueError, match=r"\[head-chunks\].*not 'ring'"):
    helpers.strategy_attention_fn(helpers.mesh("c8"), "ring", head_chunks=2)


def _compiled_temp(fn, *shapes):
  lowered = jax.jit(fn).lower(*shapes)
  return lowered.compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("strategy,mesh_name", [("ulysses", "c8"), ("usp", "usp2x4")])
def test_head_chunks_shrink_the_compiled_working_set(strategy, mesh_name):
  # 64 q / 8 kv heads, 8192 tokens, the pure-JAX kernel: per device 8 q heads of
  # the whole sequence at once unchunked (usp: 16 of half of it), one (two) per
  # stage with 8 stages. What remains is the local [T/A, n] layout: q's stage-major
  # copy, the output buffer and dq, each as large as all heads of the full sequence.
  mesh = helpers.mesh(mesh_name)
  b, t, n, kh, h = 1, 8192, 64, 8, 64
  q = jax.ShapeDtypeStruct((b, t, n, h), jnp.float32)
  kv = jax.ShapeDtypeStruct((b, t, kh, h), jnp.float32)

  def temp(chunks):
    attn = helpers.strategy_attention_fn(mesh, strategy, head_chunks=chunks, backend="blockwise")
    return _compiled_temp(jax.grad(lambda q, k, v: attn(q, k, v).sum(), (0, 1, 2)), q, kv, kv)

  plain, chunked = temp(None), temp(8)
  print(f"{strategy}: compiled temp {plain / 2**20:.1f} MiB unchunked, {chunked / 2**20:.1f} MiB")
  assert chunked < 0.85 * plain, (plain, chunked)


@pytest.mark.parametrize("strategy,mesh_name", [("ring", "c8"), ("usp", "usp2x4")])
def test_load_balanced_natural_order_call_costs_no_gather(strategy, mesh_name):
  # q/k/v sharded over the context axes; zigzag by collective permutes of half
  # shards keeps the compiled temp near the plain call's (a gather made it 6.6x
  # at 32K tokens on 8 devices).
  mesh = helpers.mesh(mesh_name)
  b, t, n, h = 1, 16384, 4, 16
  spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, MESHES[mesh_name][1]))
  q = jax.ShapeDtypeStruct((b, t, n, h), jnp.float32, sharding=spec)

  def temp(load_balance):
    def loss(q, k, v):
      out = context_attention(q, k, v, mesh=mesh, strategy=strategy, load_balance=load_balance)
      return out.sum()

    return _compiled_temp(jax.grad(loss, (0, 1, 2)), q, q, q)

  plain, balanced = temp(False), temp(True)
  print(f"{strategy}: compiled temp {plain / 2**20:.2f} MiB plain, {balanced / 2**20:.2f} MiB lb")
  assert balanced <= 1.25 * plain, (plain, balanced)


@pytest.mark.parametrize("ring,ways", [(8, 8), (4, 8), (2, 8), (4, 4), (1, 8)])
def test_zigzag_permute_local_matches_the_host_reorder(ring, ways):
  axes = ("context", "context_ulysses")
  mesh = jax.make_mesh((ring, ways // ring), axes, axis_types=(AUTO, AUTO))
  x = jnp.arange(2 * 4 * ways * 3, dtype=jnp.float32).reshape(2, 4 * ways, 3)
  spec = jax.sharding.PartitionSpec(None, axes)

  def run(x, inverse):
    local = functools.partial(
      zigzag_permute_local, ring_size=ring, axis_names=axes, ways=ways, inverse=inverse
    )
    return jax.shard_map(local, mesh=mesh, in_specs=spec, out_specs=spec)(x)

  zz = run(x, False)
  np.testing.assert_array_equal(zz, zigzag_reorder(np.asarray(x), ring, axis=1))
  np.testing.assert_array_equal(run(zz, True), x)


@pytest.mark.parametrize(
  "strategy,mesh_name,n,kh,chunks,gate",
  [
    ("ulysses", "d2c4", 8, 8, 2, False),  # MHA
    # GQA, u < G: 2 q stages per kv head; Qwen3.5's output gate projected per stage
    ("ulysses", "d2c4", 16, 8, 4, True),
    pytest.param("ulysses", "d2c4", 16, 4, 2, False, marks=pytest.mark.slow),  # GQA, u = G
    pytest.param("usp", "usp2x4", 8, 4, 2, False, marks=pytest.mark.slow),  # each stage a ring
    # gated, u < G, with q/k/v biases (random: the gate's columns take none)
    pytest.param("usp", "usp2x4", 16, 4, 4, "bias", marks=pytest.mark.slow),
    # ring: stages of heads without an all-to-all (4 q heads and their kv head each)
    ("ring", "c8", 16, 4, 4, True),
  ],
)
def test_stage_projections_equal_the_whole_layer(strategy, mesh_name, n, kh, chunks, gate):
  """ContextOptions.stage_projections: the attention layer projecting q/k/v (and
  with attention_output_gate its gate) and the output one head stage at a time
  equals the layer run whole (plain strategy) and the plain-jnp reference, values
  and gradients (input and weights), packed."""
  from lctx.models.attention import GQAAttention, reference_attention_fn
  from lctx.models.config import ModelConfig

  mesh = helpers.mesh(mesh_name)
  cfg = ModelConfig(
    vocab_size=64, d_model=32, num_layers=1, num_heads=n, num_kv_heads=kh, head_dim=8,
    mlp_dim=64, dtype="float32", param_dtype="float32", attention_output_gate=bool(gate),
    qkv_bias=gate == "bias",
  )  # fmt: skip
  b, t = 2, 32
  x = jax.random.normal(jax.random.key(1), (b, t, cfg.d_model))
  seg, pos = helpers.packed_segments(b, t)
  plain = helpers.strategy_attention_fn(mesh, strategy, block_q=8, block_kv=8)
  staged = SequenceMixer(attention=plain, head_stages=stage_heads(mesh, strategy, chunks))
  assert staged.head_stages(n, kh)[0].shape == (chunks, n // chunks)
  params = GQAAttention(cfg, reference_attention_fn).init(jax.random.key(0), x, seg, pos)
  assert ("wg" in params["params"]) == bool(gate)
  if gate == "bias":  # zeros at init: draw them, so a misplaced bias shows
    layer = dict(params["params"])
    for i, name in enumerate(("bq", "bk", "bv")):
      box = layer[name]  # flax's LogicallyPartitioned
      layer[name] = box.replace_boxed(jax.random.normal(jax.random.key(2 + i), box.value.shape))
    params = {"params": layer}

  def run(fn):
    layer = GQAAttention(cfg, fn)
    loss = lambda p, x: (layer.apply(p, x, seg, pos) ** 2).sum()  # noqa: E731
    return jax.value_and_grad(loss, argnums=(0, 1))(params, x)

  (got, g_got), (want, g_want), (ref, g_ref) = (
    run(f) for f in (staged, plain, reference_attention_fn)
  )
  np.testing.assert_allclose(got, want, rtol=1e-5)
  np.testing.assert_allclose(got, ref, rtol=2e-5)
  flat = lambda g: jax.tree.leaves(g)  # noqa: E731
  for a, w_, r in zip(flat(g_got), flat(g_want), flat(g_ref)):
    np.testing.assert_allclose(a, w_, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(a, r, atol=2e-4, rtol=2e-4)


def test_stage_projections_rules():
  with pytest.raises(ValueError, match=r"\[head-chunks\].*needs head_chunks >= 2"):
    stage_heads(helpers.mesh("c8"), "ulysses", None)
  with pytest.raises(ValueError, match=r"\[head-chunks\].*needs tensor = 1"):
    stage_heads(helpers.mesh("t2c4"), "ulysses", 2)
  with pytest.raises(ValueError, match=r"\[head-chunks\].*strategy 'all_gather' takes every"):
    stage_heads(helpers.mesh("c8"), "all_gather", 2)
  q, kv = stage_heads(helpers.mesh("c8"), "ring", 4)(16, 4)  # no all-to-all: degree 1
  assert q.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
  assert kv.tolist() == [[0], [1], [2], [3]]


def test_stage_projections_refused_without_an_all_to_all():
  from lctx.parallel import AttentionDims, ContextOptions, make_context_plan

  mesh = jax.make_mesh((8,), ("data",), axis_types=(AUTO,))
  dims = AttentionDims(num_heads=8, num_kv_heads=8, head_dim=16, v_head_dim=16)
  with pytest.raises(ValueError, match=r"\[head-chunks\].*strategy\s+'none' has none"):
    make_context_plan(
      mesh, dims, seq_len=64, batch_size=8, context=ContextOptions(stage_projections=True)
    )


def test_stage_projections_plan_checks_the_strategy_rules_too():
  from lctx.parallel import AttentionDims, ContextOptions, make_context_plan

  dims = AttentionDims(num_heads=8, num_kv_heads=8, head_dim=16, v_head_dim=16)
  context = ContextOptions(strategy="ulysses", head_chunks=2, stage_projections=True)
  # 60 tokens do not split over 8 devices: refused when the plan is made, not
  # left to the attention call (which does not check the plan's own length).
  with pytest.raises(ValueError, match=r"\[seq-divisible\]"):
    make_context_plan(helpers.mesh("c8"), dims, seq_len=60, batch_size=1, context=context)
  plan = make_context_plan(helpers.mesh("c8"), dims, seq_len=64, batch_size=1, context=context)
  assert plan.mixer.head_stages is not None

"""Compiled memory of one context-parallel delta-rule layer (forward + backward) on
fake CPU devices: what the state prefix holds and sends as the number of sequence
shards grows at a fixed per-device length. Prints a table and writes JSON.

  python scripts/linear_cp_memory.py [--out=/tmp/linear_cp_memory.json]
  python scripts/linear_cp_memory.py --topology=v5p:4x4x4 --tokens=1048576
  flock /work/wt/bigjob.lock nice -n 10 python scripts/linear_cp_memory.py \
      --topology=v5p:4x4x4 --tokens=16777216        # a few GiB of host memory
  ... --topology=v5p:4x4x4 --tokens=16777216 --layer   # the whole GDN layer
  ... --layer --chunk=4096   # the layer over sequence chunks (linear_chunk_size)

With --topology: one GDN-shaped layer (32 heads, head dims 128, bf16 inputs, zigzag)
compiled for that TPU slice (compile only, context = every device): the TPU
compiler's memory figures and the collective bytes one device sends. The
context-parallel delta rule alone, or with --layer the whole `GatedDeltaNet` at
gin/models/qwen3_5_9b.gin's shape (bf16 x `[1, T, 4096]`, projections, convs,
L2 norms, gated norm, output projection; gradients of x and every weight; no
remat inside the layer): what one linear layer of the hybrid holds per token in
its backward.
"""

import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from lctx.parallel.linear_context import make_linear_fns, state_exchange_bytes  # noqa: E402

B, N, H, V, LOCAL = 1, 4, 64, 64, 2048


def measure(ways: int, load_balance: bool) -> dict:
  mesh = jax.make_mesh(
    (ways,), ("context",), devices=jax.devices()[:ways], axis_types=(jax.sharding.AxisType.Auto,)
  )
  fns = make_linear_fns(mesh, load_balance=load_balance)
  t = LOCAL * ways
  s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731

  def loss(q, k, v, g, beta):
    return jnp.sum(fns.delta_rule(q, k, v, g, beta, segment_ids=None))

  step = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
  mem = step.lower(s(B, t, N, H), s(B, t, N, H), s(B, t, N, V), s(B, t, N), s(B, t, N)).compile()
  mem = mem.memory_analysis()
  sent = state_exchange_bytes(
    batch=B, heads=N, key_dim=H, value_dim=V, ways=ways, load_balance=load_balance
  )
  return {
    "ways": ways,
    "load_balance": load_balance,
    "tokens_per_device": LOCAL,
    "temp_bytes": int(mem.temp_size_in_bytes),
    "argument_bytes": int(mem.argument_size_in_bytes),
    "summary_bytes": sent["summary_bytes"],
    "prefix_bytes_sent": sent["prefix_bytes"],
  }


def compile_tpu(topology: str, tokens: int) -> dict:
  from lctx.parallel.linear_context import ring_attention_bytes
  from lctx.parallel.mesh import MeshConfig, make_mesh
  from lctx.sizing import hlo_flops
  from lctx.sizing.compile import collective_bytes
  from lctx.sizing.devices import compile_only_env
  from lctx.sizing.tpu import topology_devices

  compile_only_env()

  devices = topology_devices(topology)
  mesh = make_mesh(MeshConfig(context=-1), devices)
  ways = len(devices)
  heads, dim = 32, 128
  fns = make_linear_fns(mesh, load_balance=True)
  s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)  # noqa: E731

  def loss(q, k, v, g, beta):
    o = fns.delta_rule(q, k, v, g, beta, segment_ids=None)
    return jnp.sum(o.astype(jnp.float32))

  step = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
  args = (s(1, tokens, heads, dim),) * 3 + (s(1, tokens, heads),) * 2
  t0 = time.perf_counter()
  compiled = step.lower(*args).compile()
  seconds = time.perf_counter() - t0
  mem = compiled.memory_analysis()
  coll = collective_bytes(hlo_flops.matmul_flops(compiled.as_text()), mesh)
  local = tokens // ways
  ring = ring_attention_bytes(
    batch=1, tokens=local, kv_heads=heads, head_dim=dim, value_dim=dim, ways=ways
  )
  return {
    "topology": topology,
    "tokens": tokens,
    "ways": ways,
    "heads": heads,
    "head_dim": dim,
    "temp_bytes": int(mem.temp_size_in_bytes),
    "argument_bytes": int(mem.argument_size_in_bytes),
    "output_bytes": int(mem.output_size_in_bytes),
    "collective_bytes_per_device": coll["collective_bytes_per_device"],
    "collective_bytes_by_kind": coll["collective_bytes_by_kind"],
    "counted_state_exchange_bytes_fwd": state_exchange_bytes(
      batch=1, heads=heads, key_dim=dim, value_dim=dim, ways=ways, load_balance=True
    )["total"],
    "ring_attention_pass_bytes_fwd": ring,
    "exchange_over_one_ring_pass": coll["collective_bytes_per_device"] / ring,
    "compile_seconds": round(seconds, 1),
    "jax_version": jax.__version__,
  }


def compile_layer(topology: str, tokens: int, chunk: int | None = None) -> dict:
  """The whole GDN layer (Qwen3.5-9B shape) under context parallelism, fwd + bwd;
  chunk: ModelConfig.linear_chunk_size (None: the layer whole)."""
  import flax.linen as nn

  from lctx.models.config import ModelConfig
  from lctx.models.linear_attention import GatedDeltaNet
  from lctx.parallel.mesh import LOGICAL_RULES, MeshConfig, make_mesh
  from lctx.parallel.mixer import SequenceMixer
  from lctx.sizing.devices import compile_only_env
  from lctx.sizing.tpu import topology_devices

  compile_only_env()
  devices = topology_devices(topology)
  mesh = make_mesh(MeshConfig(context=-1), devices)
  c = ModelConfig(
    d_model=4096,
    num_layers=4,
    num_heads=16,
    num_kv_heads=4,
    head_dim=256,
    mlp_dim=12288,
    vocab_size=1024,
    layer_types=("linear_attention",) * 3 + ("full_attention",),
    linear_attention="gated_deltanet",
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    norm_eps=1e-6,
    dtype="bfloat16",
    param_dtype="float32",
    linear_chunk_size=chunk,
  )
  mixer = SequenceMixer(attention=None, linear=make_linear_fns(mesh, load_balance=True))
  layer = GatedDeltaNet(c, mixer)
  x = jax.ShapeDtypeStruct((1, tokens, c.d_model), jnp.bfloat16)
  seg = jax.ShapeDtypeStruct((1, tokens), jnp.int32)
  with jax.set_mesh(mesh), nn.logical_axis_rules(LOGICAL_RULES):
    params = jax.eval_shape(lambda x, s: layer.init(jax.random.key(0), x, s, None), x, seg)

    def loss(p, x, s):
      return jnp.sum(layer.apply(p, x, s, None).astype(jnp.float32))

    step = jax.jit(jax.grad(loss, argnums=(0, 1)))
    t0 = time.perf_counter()
    compiled = step.lower(params, x, seg).compile()
  seconds = time.perf_counter() - t0
  mem = compiled.memory_analysis()
  return {
    "topology": topology,
    "what": "GatedDeltaNet layer (Qwen3.5-9B shape), fwd + bwd",
    "tokens": tokens,
    "tokens_per_device": tokens // len(devices),
    "linear_chunk_size": chunk,
    "temp_bytes": int(mem.temp_size_in_bytes),
    "argument_bytes": int(mem.argument_size_in_bytes),
    "output_bytes": int(mem.output_size_in_bytes),
    "compile_seconds": round(seconds, 1),
    "jax_version": jax.__version__,
  }


def main():
  out = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--out=")), None)
  topo = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--topology=")), None)
  if topo:
    tokens = int(next(a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--tokens=")))
    chunk = next((int(a.split("=", 1)[1]) for a in sys.argv[1:] if a.startswith("--chunk=")), None)
    if "--layer" in sys.argv[1:]:
      rec = compile_layer(topo, tokens, chunk)
    else:
      rec = compile_tpu(topo, tokens)
    print(json.dumps(rec, indent=1))
    if out:
      with open(out, "w") as f:
        json.dump(rec, f, indent=1)
    return
  rows = [measure(w, lb) for w in (2, 4, 8) for lb in (False, True)]
  print(f"B={B} N={N} H={H} V={V}, {LOCAL} tokens per device, float32, fwd+bwd")
  print(f"{'ways':>4} {'zigzag':>6} {'temp MiB':>9} {'summary MiB':>12} {'sent MiB':>9}")
  for r in rows:
    print(
      f"{r['ways']:>4} {r['load_balance']!s:>6} {r['temp_bytes'] / 2**20:>9.2f} "
      f"{r['summary_bytes'] / 2**20:>12.2f} {r['prefix_bytes_sent'] / 2**20:>9.2f}"
    )
  if out:
    with open(out, "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  main()

#!/usr/bin/env python
"""Context-parallel strategies on 8 fake CPU devices: time, memory, traffic, balance.

    python scripts/bench_context.py              # 8K, 32K timed; 128K compiled only
    python scripts/bench_context.py --quick      # 8K only, small scaling check
    python scripts/bench_context.py --time-max 131072   # also time 128K (slow)

Per strategy and length (causal, MHA 8 heads x 64, --dtype float32, batch 1):
  fwd+bwd seconds (median of --reps after a warm-up), per-device argument and temp
  bytes (compiled memory_analysis), bytes of collective results per device counted
  from the compiled HLO (ops inside scan loops x their trip count), and attention
  blocks (--block squared) computed per device, max / mean, counted by the kernel's
  own block loop. A second table: ring/usp per-device memory
  at fixed tokens per device for context degree 2, 4, 8: argument, output and temp
  bytes, and their total (what the device holds for the step). Optional column: the public
  JAX RingAttention (PyPI ringattention==0.1.2) through a jax.lib.xla_bridge shim.
Writes JSON to --out. The 8 "devices" share the host's cores, so times measure total
work, not parallel speed-up; compare rows of the same run only.
"""

import os

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P

from lctx.kernels import blockwise_block_counts  # noqa: E402
from lctx.kernels.options import AttentionOptions  # noqa: E402
from lctx.parallel.block_ops import maybe_visible  # noqa: E402
from lctx.parallel.context import make_attention_fn  # noqa: E402
from lctx.parallel.options import ContextOptions  # noqa: E402
from lctx.parallel.validation import zigzag_ring_size  # noqa: E402
from lctx.parallel.zigzag import zigzag_reorder  # noqa: E402

SEQ = ("context", "context_ulysses")
# name -> (strategy, mesh shape over SEQ, load balance[, ring sub_chunks])
VARIANTS = {
  "all_gather": ("all_gather", (8, 1), False),
  "ulysses": ("ulysses", (8, 1), False),
  "ring": ("ring", (8, 1), True),
  "ring_nolb": ("ring", (8, 1), False),
  "ring_1sub": ("ring", (8, 1), True, 1),  # one kernel call per hop (no sub-chunks)
  "usp_4x2": ("usp", (4, 2), True),
  "lwm_ring": ("lwm", (8, 1), False),
}


# ---------------------------------------------------------------- HLO traffic
_DTYPE_BYTES = {
  "f32": 4,
  "bf16": 2,
  "f16": 2,
  "s32": 4,
  "u32": 4,
  "f64": 8,
  "s64": 8,
  "pred": 1,
  "s8": 1,
  "u8": 1,
}
_SHAPE = re.compile(r"\b(f32|bf16|f16|s32|u32|f64|s64|pred|s8|u8)\[([\d,]*)\]")
_COLL = re.compile(
  r"=\s*(.*?)\s(all-gather|all-reduce|reduce-scatter|all-to-all|"
  r"collective-permute)(-start)?\("
)
_WHILE = re.compile(r"\swhile\(.*body=%?([\w.\-]+).*?\"known_trip_count\":\{\"n\":\"(\d+)\"")
_CALLS = re.compile(
  r"(?:branch_computations=\{([^}]*)\}|calls=%?([\w.\-]+)|"
  r"body=%?([\w.\-]+))"
)


def _bytes_of(types: str, start: bool) -> int:
  arrays = [
    _DTYPE_BYTES[d] * int(np.prod([int(s) for s in dims.split(",") if s] or [1]))
    for d, dims in _SHAPE.findall(types)
  ]
  if start and len(arrays) >= 2:  # async start: (operand, result, ...) -> result
    return arrays[1]
  return sum(arrays)


def collective_bytes(hlo: str) -> dict:
  """Bytes of collective results per device, by op kind, loops unrolled by trip count."""
  comps, current, entry = {}, None, None
  for line in hlo.splitlines():
    if line and not line[0].isspace() and line.rstrip().endswith("{"):
      current = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
      entry = current if line.startswith("ENTRY") else entry
      comps[current] = {"own": {}, "calls": []}
      continue
    if current is None:
      continue
    m = _COLL.search(line)
    if m:
      kind = m.group(2)
      own = comps[current]["own"]
      own[kind] = own.get(kind, 0) + _bytes_of(m.group(1), bool(m.group(3)))
    w = _WHILE.search(line)
    if w:
      comps[current]["calls"].append((w.group(1), int(w.group(2))))
      continue
    for branches, call, body in _CALLS.findall(line):
      for name in branches.split(",") if branches else [call or body]:
        if name.strip():
          comps[current]["calls"].append((name.strip().lstrip("%"), 1))

  @functools.cache
  def total(name):
    out = dict(comps.get(name, {"own": {}})["own"])
    for callee, mult in comps.get(name, {"calls": []})["calls"]:
      for k, v in total(callee).items():
        out[k] = out.get(k, 0) + mult * v
    return out

  return total(entry)


# ---------------------------------------------------------------- block balance
def block_balance(strategy, shape, seg, pos, block):
  """(max / mean, max) of attention blocks computed per device.

  Counted by the kernel's own loop (lctx.kernels.blockwise_block_counts, the same
  block map the ring's block functions use) on tiny 1-head stand-ins with the real
  segment ids and positions; ring hops the ring skips (block_ops.maybe_visible)
  count 0. usp: per ring group (its devices split the heads of the same blocks).
  """
  counter = jax.jit(
    functools.partial(
      blockwise_block_counts, options=AttentionOptions(causal=True, block_q=block, block_kv=block)
    )
  )

  def count(qs, qp, ks, kp):
    z = lambda n: jnp.zeros((qs.shape[0], n, 1, 1), jnp.float32)  # noqa: E731
    c, _ = counter(
      z(qs.shape[1]),
      z(ks.shape[1]),
      z(ks.shape[1]),
      segment_ids=(qs, ks),
      q_positions=qp,
      kv_positions=kp,
    )
    return int(np.asarray(c)[:, 0].sum())

  c, u = shape
  if strategy == "ulysses":  # every device: the full sequence, 1/P of the heads
    return 1.0, count(seg, pos, seg, pos)
  if strategy in ("ring", "usp"):
    sd, pd = np.split(seg, c, 1), np.split(pos, c, 1)
    cfg = AttentionOptions(causal=True)
    counts = np.array(
      [
        sum(
          count(sd[r], pd[r], sd[(r - s) % c], pd[(r - s) % c])
          for s in range(c)
          if maybe_visible(sd[r], sd[(r - s) % c], pd[r], pd[(r - s) % c], cfg, xp=np)
        )
        for r in range(c)
      ]
    )
  else:  # all_gather, lwm: local q chunk against the whole sequence
    sd, pd = np.split(seg, c * u, 1), np.split(pos, c * u, 1)
    counts = np.array([count(sd[r], pd[r], seg, pos) for r in range(c * u)])
  return float(counts.max() / counts.mean()), int(counts.max())


# ---------------------------------------------------------------- strategies
def _lwm_attention(mesh, block):
  """ringattention==0.1.2 (Large World Model) ring attention, causal, no segments."""
  if not hasattr(jax.lib, "xla_bridge"):  # the shim: removed from jax.lib in new jax
    import jax._src.xla_bridge as xb

    jax.lib.xla_bridge = xb
  from ringattention import ring_attention

  kwargs = dict(
    causal_block_size=1,
    deterministic=True,
    dropout_rng=None,
    attn_pdrop=0.0,
    query_chunk_size=block,
    key_chunk_size=block,
    policy=jax.checkpoint_policies.nothing_saveable,
    dtype=jnp.float32,
    precision=None,
    prevent_cse=True,
  )
  spec = P(None, "context", None, None)

  def local(q, k, v):
    return ring_attention(q, k, v, None, None, None, "context", True, kwargs)

  fn = jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec, check_vma=False)
  return lambda q, k, v, **_: fn(q, k, v)


def build(name, t, heads, head_dim, block, sub_chunks=None, dtype=jnp.float32):
  strategy, shape, lb, *sub = VARIANTS[name]
  sub_chunks = sub[0] if sub else sub_chunks
  mesh = jax.make_mesh(shape, SEQ, axis_types=(jax.sharding.AxisType.Auto,) * 2)
  if strategy == "lwm":
    attn = _lwm_attention(mesh, block)
  else:
    order = zigzag_ring_size(dict(zip(SEQ, shape))) if lb else 0
    context = ContextOptions(
      strategy=strategy, load_balance=lb, sub_chunks=sub_chunks, token_order=order
    )
    attn = make_attention_fn(mesh, context, AttentionOptions(block_q=block, block_kv=block))
  seg = np.ones((1, t), np.int32)
  pos = np.arange(t, dtype=np.int32)[None]
  if lb:
    seg, pos = (zigzag_reorder(x, shape[0]) for x in (seg, pos))  # ring = context

  def loss(q, k, v, w, seg, pos):
    out = attn(q, k, v, segment_ids=seg, positions=pos, causal=True)
    return jnp.sum(out * w)

  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
  sh = NamedSharding(mesh, P(None, SEQ))
  abstract = [jax.ShapeDtypeStruct((1, t, heads, head_dim), dtype, sharding=sh)] * 4
  abstract += [jax.ShapeDtypeStruct((1, t), jnp.int32, sharding=sh)] * 2
  return step, abstract, (seg, pos), sh, strategy, shape


def measure(name, t, args, timed):
  step, abstract, (seg, pos), sh, strategy, shape = build(
    name, t, args.heads, args.head_dim, args.block, args.sub_chunks, jnp.dtype(args.dtype)
  )
  t0 = time.perf_counter()
  compiled = step.lower(*abstract).compile()
  row = {"variant": name, "tokens": t, "compile_s": round(time.perf_counter() - t0, 1)}
  mem = compiled.memory_analysis()
  row["arg_bytes"] = int(mem.argument_size_in_bytes)
  row["temp_bytes"] = int(mem.temp_size_in_bytes)
  coll = collective_bytes(compiled.as_text())
  row["collective_bytes"] = int(sum(coll.values()))
  row["collectives"] = coll
  row["blocks_max_over_mean"], row["blocks_max"] = block_balance(
    strategy, shape, seg, pos, args.block
  )
  if timed:
    keys = jax.random.split(jax.random.key(0), 4)
    arrays = [
      jax.device_put(
        jax.random.normal(k_, (1, t, args.heads, args.head_dim), jnp.dtype(args.dtype)), sh
      )
      for k_ in keys
    ] + [jax.device_put(x, sh) for x in (seg, pos)]
    for _ in range(args.warmup):
      jax.block_until_ready(compiled(*arrays))
    times = []
    for _ in range(args.reps):
      t0 = time.perf_counter()
      jax.block_until_ready(compiled(*arrays))
      times.append(time.perf_counter() - t0)
    row["fwd_bwd_s"] = round(float(np.median(times)), 3)
  return row


def scaling(args):
  """ring / usp per-device bytes at fixed tokens per device, degree 2, 4, 8."""
  rows = []
  for strategy, shapes in (("ring", [(2, 1), (4, 1), (8, 1)]), ("usp", [(2, 2), (4, 2)])):
    for shape in shapes:
      n = shape[0] * shape[1]
      t = args.scaling_tokens * n
      mesh = jax.make_mesh(
        shape, SEQ, axis_types=(jax.sharding.AxisType.Auto,) * 2, devices=jax.devices()[:n]
      )
      attn = make_attention_fn(mesh, strategy, block_q=args.block, block_kv=args.block)
      sh = NamedSharding(mesh, P(None, SEQ))

      def loss(q, k, v, seg, pos, attn=attn):
        return jnp.sum(attn(q, k, v, segment_ids=seg, positions=pos))

      ab = [
        jax.ShapeDtypeStruct((1, t, args.heads, args.head_dim), jnp.dtype(args.dtype), sharding=sh)
      ] * 3
      ab += [jax.ShapeDtypeStruct((1, t), jnp.int32, sharding=sh)] * 2
      mem = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*ab).compile().memory_analysis()
      row = {
        "strategy": strategy,
        "degree": n,
        "tokens": t,
        "arg_bytes": int(mem.argument_size_in_bytes),
        "output_bytes": int(mem.output_size_in_bytes),
        "temp_bytes": int(mem.temp_size_in_bytes),
        "alias_bytes": int(mem.alias_size_in_bytes),
      }
      # Everything the device holds for this step: inputs, gradients out,
      # scratch (outputs aliased onto inputs counted once).
      row["total_bytes"] = (
        row["arg_bytes"] + row["output_bytes"] + row["temp_bytes"] - row["alias_bytes"]
      )
      rows.append(row)
      print(
        f"  scaling {strategy:5s} degree {n}  tokens {t:7d}  arg "
        f"{row['arg_bytes'] / 2**20:7.2f} MiB  out {row['output_bytes'] / 2**20:7.2f}"
        f" MiB  temp {row['temp_bytes'] / 2**20:7.2f} MiB  total "
        f"{row['total_bytes'] / 2**20:7.2f} MiB",
        flush=True,
      )
  for strategy in ("ring", "usp"):
    got = [r for r in rows if r["strategy"] == strategy]
    for key in ("temp_bytes", "total_bytes"):
      vals = [r[key] for r in got]
      print(
        f"  scaling {strategy:5s} {key:11s} max/min over degrees "
        f"{[r['degree'] for r in got]}: {max(vals) / min(vals):.3f}",
        flush=True,
      )
  return rows


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--lengths", default="8192,32768,131072")
  ap.add_argument(
    "--time-max",
    type=int,
    default=32768,
    help="time fwd+bwd only up to this length (longer: compile only)",
  )
  ap.add_argument("--variants", default=",".join(v for v in VARIANTS if v != "ring_1sub"))
  ap.add_argument("--lwm-max", type=int, default=8192, help="longest length for lwm_ring")
  ap.add_argument("--heads", type=int, default=8)
  ap.add_argument("--head-dim", type=int, default=64)
  ap.add_argument("--block", type=int, default=512)
  ap.add_argument("--reps", type=int, default=2)
  ap.add_argument("--warmup", type=int, default=1)
  ap.add_argument(
    "--sub-chunks",
    type=int,
    default=None,
    help="ring hop split into sub_chunks^2 pairs (default: auto)",
  )
  ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  ap.add_argument("--scaling-tokens", type=int, default=4096)
  ap.add_argument("--quick", action="store_true")
  ap.add_argument("--out", default="bench_context.json")
  args = ap.parse_args()
  if args.quick:
    args.lengths, args.reps, args.warmup, args.scaling_tokens = "8192", 1, 0, 1024
  rows = []
  print(
    f"{'variant':11s} {'tokens':>7s} {'fwd+bwd s':>9s} {'arg MiB':>8s} "
    f"{'temp MiB':>9s} {'coll MiB':>9s} {'blk max/mean':>12s}",
    flush=True,
  )
  for t in (int(x) for x in args.lengths.split(",")):
    for name in args.variants.split(","):
      if name == "lwm_ring" and t > args.lwm_max:
        continue
      try:
        row = measure(name, t, args, timed=t <= args.time_max)
      except Exception as err:  # report and keep going (e.g. lwm import)
        row = {"variant": name, "tokens": t, "error": f"{type(err).__name__}: {err}"}
        print(f"{name:11s} {t:7d} ERROR {row['error'][:200]}", flush=True)
        rows.append(row)
        continue
      rows.append(row)
      print(
        f"{name:11s} {t:7d} {row.get('fwd_bwd_s', float('nan')):9.3f} "
        f"{row['arg_bytes'] / 2**20:8.2f} {row['temp_bytes'] / 2**20:9.2f} "
        f"{row['collective_bytes'] / 2**20:9.2f} "
        f"{row['blocks_max_over_mean']:12.2f}",
        flush=True,
      )
  result = {"config": vars(args), "rows": rows, "scaling": scaling(args)}
  with open(args.out, "w") as f:
    json.dump(result, f, indent=1)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()

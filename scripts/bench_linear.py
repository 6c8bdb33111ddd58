"""One Gated DeltaNet layer against one flash-attention layer on this CPU, same run.

    nice -n 10 python scripts/bench_linear.py                    # 8K, 32K, 128K tokens
    python scripts/bench_linear.py --lengths 2048 --quick        # smoke run

Both layers take x `[1, T, D]` float32 and return `[1, T, D]`; forward + backward
(gradients of a fixed projection of the output with respect to x and every
weight) is timed after a warm-up call (none above --warmup_max_tokens), best of --repeats, the two layers
interleaved at each length (gdn, attention, gdn, attention, ...) so that load
swings on the shared cores hit both:

- gdn: lctx.models.linear_attention.GatedDeltaNet (single-device ops: the
  causal conv and the chunked delta rule, chunks of 64), Q q/k heads and N value
  heads of `--head_dim`;
- attention: q, k, v, o projections around lctx.kernels.flash_attention (causal,
  backend 'auto': on CPU the fused C++ kernel where it applies, else blockwise),
  N q heads and Q kv heads of `--head_dim` (the same d_model and head counts).

Memory: the compiled fwd+bwd program's memory_analysis() (arguments + outputs +
temporaries), the peak the executable allocates. A same-run 2048^3 f32 matmul
rate (lctx.metrics.measure_matmul_flops) is printed as the yardstick.
Output: a printed table and a JSON file (--out).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from lctx import models  # noqa: E402
from lctx.kernels import flash_attention  # noqa: E402
from lctx.kernels.flash import choose_backend  # noqa: E402
from lctx.metrics import measure_matmul_flops  # noqa: E402
from lctx.models.linear_attention import GatedDeltaNet  # noqa: E402
from lctx.parallel.mixer import SequenceMixer  # noqa: E402


def _gdn(d, q_heads, v_heads, head_dim):
  cfg = models.ModelConfig(
    vocab_size=16,
    d_model=d,
    num_layers=1,
    num_heads=v_heads,
    num_kv_heads=q_heads,
    head_dim=head_dim,
    layer_types=("linear_attention",),
    linear_num_key_heads=q_heads,
    linear_num_value_heads=v_heads,
    linear_key_head_dim=head_dim,
    linear_value_head_dim=head_dim,
    mlp_dim=d,
    dtype="float32",
    param_dtype="float32",
  )
  layer = GatedDeltaNet(cfg, SequenceMixer(attention=None))
  x = jnp.zeros((1, 128, d), jnp.float32)
  ids = jnp.ones((1, 128), jnp.int32)
  params = layer.init(jax.random.PRNGKey(0), x, ids, ids)["params"]

  def apply(p, x):
    t = x.shape[1]
    ids = jnp.ones((1, t), jnp.int32)
    return layer.apply({"params": p}, x, ids, ids)

  return params, apply


def _attention(d, q_heads, v_heads, head_dim):
  """N = v_heads q heads, Q = q_heads kv heads (GQA), projections around flash."""
  ks = jax.random.split(jax.random.PRNGKey(1), 4)
  s = d**-0.5
  params = {
    "wq": jax.random.normal(ks[0], (d, v_heads, head_dim)) * s,
    "wk": jax.random.normal(ks[1], (d, q_heads, head_dim)) * s,
    "wv": jax.random.normal(ks[2], (d, q_heads, head_dim)) * s,
    "wo": jax.random.normal(ks[3], (v_heads, head_dim, d)) * s,
  }

  def apply(p, x):
    q = jnp.einsum("btd,dnh->btnh", x, p["wq"])
    k = jnp.einsum("btd,dnh->btnh", x, p["wk"])
    v = jnp.einsum("btd,dnh->btnh", x, p["wv"])
    o = flash_attention(q, k, v, causal=True)
    return jnp.einsum("btnh,nhd->btd", o, p["wo"])

  return params, apply


def _fwd_bwd(apply):
  def loss(p, x):
    out = apply(p, x)
    return jnp.sum(out * jnp.cos(jnp.arange(out.shape[-1], dtype=out.dtype)))

  return jax.jit(jax.grad(loss, argnums=(0, 1)))


def _compiled(apply, params, x):
  c = _fwd_bwd(apply).lower(params, x).compile()
  m = c.memory_analysis()
  total = (
    m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
  )
  return c, {"temp_bytes": int(m.temp_size_in_bytes), "total_bytes": int(total)}


def _once(c, params, x) -> float:
  t0 = time.perf_counter()
  jax.block_until_ready(c(params, x))
  return time.perf_counter() - t0


def bench_length(t, args) -> dict:
  d, qh, vh, hd = args.d_model, args.q_heads, args.v_heads, args.head_dim
  x = jax.random.normal(jax.random.PRNGKey(2), (1, t, d), jnp.float32)
  layers = {"gdn": _gdn(d, qh, vh, hd), "attention": _attention(d, qh, vh, hd)}
  row = {"T": t, "d_model": d, "q_heads": qh, "v_heads": vh, "head_dim": hd, "dtype": "float32"}
  probe = jnp.zeros((1, t, vh, hd)), jnp.zeros((1, t, qh, hd))
  row["attention_backend"] = choose_backend(probe[0], probe[1], probe[1])
  compiled = {}
  for name, (params, apply) in layers.items():
    t0 = time.perf_counter()
    compiled[name], mem = _compiled(apply, params, x)
    row[f"{name}_compile_s"] = round(time.perf_counter() - t0, 1)
    row.update({f"{name}_{k}": v for k, v in mem.items()})
  if t <= args.warmup_max_tokens:
    for name, (params, _) in layers.items():  # warm-up, interleaved
      _once(compiled[name], params, x)
  row["warmed_up"] = t <= args.warmup_max_tokens
  best = dict.fromkeys(layers, float("inf"))
  for _ in range(args.repeats):
    for name, (params, _) in layers.items():
      best[name] = min(best[name], _once(compiled[name], params, x))
  row.update({f"{name}_fwd_bwd_s": round(s, 3) for name, s in best.items()})
  row["attention_over_gdn"] = round(best["attention"] / best["gdn"], 2)
  return row


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768, 131072])
  p.add_argument("--d_model", type=int, default=256)
  p.add_argument("--q_heads", type=int, default=2, help="GDN q/k heads = attention kv heads")
  p.add_argument("--v_heads", type=int, default=4, help="GDN value heads = attention q heads")
  p.add_argument("--head_dim", type=int, default=64)
  p.add_argument("--repeats", type=int, default=2)
  p.add_argument("--quick", action="store_true", help="one repeat")
  p.add_argument(
    "--warmup_max_tokens",
    type=int,
    default=1 << 20,
    help="no warm-up call above this length (the programs are compiled ahead of time)",
  )
  p.add_argument("--out", default="/tmp/bench_linear.json")
  args = p.parse_args()
  if args.quick:
    args.repeats = 1
  rate_before = measure_matmul_flops(repeats=3)
  rows = []
  for t in args.lengths:
    rows.append(bench_length(t, args))
    print(json.dumps(rows[-1]), flush=True)
  rate_after = measure_matmul_flops(repeats=3)
  print(f"matmul 2048^3 f32: {rate_before / 1e9:.1f} GFLOP/s before, {rate_after / 1e9:.1f} after")
  print(f"{'T':>7} {'gdn s':>8} {'attn s':>8} {'attn/gdn':>8} {'gdn MiB':>9} {'attn MiB':>9}")
  for r in rows:
    print(
      f"{r['T']:>7} {r['gdn_fwd_bwd_s']:>8.3f} {r['attention_fwd_bwd_s']:>8.3f} "
      f"{r['attention_over_gdn']:>8.2f} {r['gdn_total_bytes'] / 2**20:>9.1f} "
      f"{r['attention_total_bytes'] / 2**20:>9.1f}"
    )
  meta = {
    "machine": f"{platform.machine()}, {os.cpu_count()} cores ({platform.processor() or 'cpu'})",
    "jax_version": jax.__version__,
    "matmul_gflops_before": rate_before / 1e9,
    "matmul_gflops_after": rate_after / 1e9,
    "numpy": np.__version__,
  }
  with open(args.out, "w") as f:
    json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
  main()

"""Benchmark lctx flash attention against a same-run matmul, XLA and tokamax.

    python scripts/bench_attention.py                      # T in {2K, 8K, 32K}
    python scripts/bench_attention.py --lengths 8192       # the headline figures
    python scripts/bench_attention.py --quick              # small shapes, smoke run

Shape (the issue's): batch 1, 8 q heads, 2 kv heads, head dim 64, float32.
Modes: `causal`, and `packed` (8 equal documents per row, causal inside each).
For each length and mode it reports forward and forward+backward seconds
(best of --repeats after a warm-up), useful GFLOP/s (visible query-key pairs
only: forward 2*N*(H+V) flops per pair, forward+backward 3x that), the ratio to a
2048^3 f32 matmul timed in the same run (the higher of a rate taken at the start
and at the end, so ratios are conservative; and, because the cores are shared and
load swings, also against the best matmul rate timed right before/after each
row's own timing), the speed-up over
`jax.nn.dot_product_attention(implementation="xla")` and tokamax `xla_chunked`
(when importable), and the per-device temp bytes of the compiled fwd+bwd.
Baselines whose compiled temp memory exceeds --baseline-mem-gb are not run; their
memory is still reported. Output: a printed table and a JSON file.
Expect noise: the CPU cores are shared; the same-run matmul rate is the yardstick.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from lctx.kernels import flash_attention, xla_attention  # noqa: E402
from lctx.metrics import measure_matmul_flops  # noqa: E402  (the baseline every bench uses)

try:
  import tokamax  # noqa: E402
except Exception as e:  # noqa: BLE001  (any import failure means: no column)
  tokamax, TOKAMAX_ERROR = None, f"{type(e).__name__}: {e}"
else:
  TOKAMAX_ERROR = None


def _time(fn, args, repeats):
  jax.block_until_ready(fn(*args))  # compile + warm-up
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    best = min(best, time.perf_counter() - t0)
  return best


def _segments(t, mode):
  if mode == "causal":
    return None
  return np.repeat(np.arange(1, 9, dtype=np.int32), t // 8)[None, :]


def _visible_pairs(t, mode):
  if mode == "causal":
    return t * (t + 1) // 2
  d = t // 8
  return 8 * d * (d + 1) // 2


def _tokamax_fn(seg):
  def fn(q, k, v):
    mask = None
    if seg is not None:
      s = jnp.asarray(seg)
      mask = s[:, None, :, None] == s[:, None, None, :]
    return tokamax.dot_product_attention(
      q, k, v, mask=mask, is_causal=True, implementation="xla_chunked"
    )

  return fn


def _impls(seg, block_q, block_kv):
  impls = {
    "lctx": lambda q, k, v: flash_attention(
      q, k, v, segment_ids=seg, block_q=block_q, block_kv=block_kv, backend="blockwise"
    ),
    "xla": lambda q, k, v: xla_attention(q, k, v, segment_ids=seg),
  }
  if tokamax is not None:
    impls["tokamax_xla_chunked"] = _tokamax_fn(seg)
  return impls


def _fwd_bwd(fn):
  def loss(q, k, v):
    out = fn(q, k, v)
    return jnp.sum(out * jnp.cos(jnp.arange(out.shape[-1], dtype=out.dtype)))

  return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def bench_one(t, mode, args):
  b, n, kh, h = 1, 8, 2, 64
  ks = jax.random.split(jax.random.PRNGKey(0), 3)
  q = jax.random.normal(ks[0], (b, t, n, h), jnp.float32)
  k = jax.random.normal(ks[1], (b, t, kh, h), jnp.float32)
  v = jax.random.normal(ks[2], (b, t, kh, h), jnp.float32)
  seg = _segments(t, mode)
  fwd_flops = 2 * n * (h + h) * _visible_pairs(t, mode)
  row = dict(
    T=t,
    mode=mode,
    batch=b,
    q_heads=n,
    kv_heads=kh,
    head_dim=h,
    dtype="float32",
    useful_fwd_gflop=fwd_flops / 1e9,
  )
  for name, fn in _impls(seg, args.block_q, args.block_kv).items():
    fb = _fwd_bwd(fn)
    temp = fb.lower(q, k, v).compile().memory_analysis().temp_size_in_bytes
    row[f"{name}_temp_bytes"] = int(temp)
    if args.memory_only:
      continue
    if name != "lctx" and (args.no_baselines or temp > args.baseline_mem_gb * 2**30):
      row[f"{name}_skipped"] = f"temp {temp / 2**30:.1f} GiB > --baseline-mem-gb"
      continue
    if name == "lctx":  # the yardstick right before and after our own timing
      rate_pre = measure_matmul_flops(repeats=5)
    row[f"{name}_fwd_s"] = _time(jax.jit(fn), (q, k, v), args.repeats)
    row[f"{name}_fwdbwd_s"] = _time(fb, (q, k, v), args.repeats)
    if name == "lctx":
      row["matmul_gflops_adjacent"] = max(rate_pre, measure_matmul_flops(repeats=5)) / 1e9
    print(
      f"  T={t} {mode} {name}: fwd {row[f'{name}_fwd_s']:.3f}s "
      f"fwd+bwd {row[f'{name}_fwdbwd_s']:.3f}s temp {temp / 2**20:.0f} MiB",
      flush=True,
    )
  qkvo = 4 * t * (n + kh + kh + n) * h
  row["lctx_temp_over_qkvo"] = row["lctx_temp_bytes"] / qkvo
  if args.memory_only:
    return row
  row["lctx_fwd_gflops"] = fwd_flops / row["lctx_fwd_s"] / 1e9
  row["lctx_fwdbwd_gflops"] = 3 * fwd_flops / row["lctx_fwdbwd_s"] / 1e9
  adj = row["matmul_gflops_adjacent"]
  row["lctx_fwd_vs_adjacent_matmul"] = row["lctx_fwd_gflops"] / adj
  row["lctx_fwdbwd_vs_adjacent_matmul"] = row["lctx_fwdbwd_gflops"] / adj
  for base in ("xla", "tokamax_xla_chunked"):
    if f"{base}_fwdbwd_s" in row:
      row[f"speedup_vs_{base}_fwd"] = row[f"{base}_fwd_s"] / row["lctx_fwd_s"]
      row[f"speedup_vs_{base}_fwdbwd"] = row[f"{base}_fwdbwd_s"] / row["lctx_fwdbwd_s"]
  return row


def _fmt(x, spec):
  return "-" if x is None else format(x, spec)


def print_memory_table(rows):
  names = [k[: -len("_temp_bytes")] for k in rows[0] if k.endswith("_temp_bytes")]
  print(
    f"{'T':>6} {'mode':>6} " + " ".join(f"{n + ' MiB':>24}" for n in names) + f" {'lctx/qkvo':>10}"
  )
  for r in rows:
    print(
      f"{r['T']:>6} {r['mode']:>6} "
      + " ".join(f"{r[n + '_temp_bytes'] / 2**20:>24.1f}" for n in names)
      + f" {r['lctx_temp_over_qkvo']:>10.2f}"
    )


def print_table(rows, rate):
  print(f"\nsame-run 2048^3 f32 matmul: {rate / 1e9:.1f} GFLOP/s")
  hdr = (
    f"{'T':>6} {'mode':>6} {'fwd s':>8} {'f+b s':>8} {'f+b GF/s':>9} {'f+b/mm':>7} "
    f"{'fwd/mm':>7} {'adj mm':>7} {'f+b/adj':>7} {'xla x':>6} {'tkmx x':>6} "
    f"{'temp MiB':>9} {'xla MiB':>9}"
  )
  print(hdr)
  for r in rows:
    print(
      f"{r['T']:>6} {r['mode']:>6} {r['lctx_fwd_s']:>8.3f} {r['lctx_fwdbwd_s']:>8.3f} "
      f"{r['lctx_fwdbwd_gflops']:>9.1f} {r['lctx_fwdbwd_vs_matmul']:>7.2f} "
      f"{r['lctx_fwd_vs_matmul']:>7.2f} {r['matmul_gflops_adjacent']:>7.1f} "
      f"{r['lctx_fwdbwd_vs_adjacent_matmul']:>7.2f} "
      f"{_fmt(r.get('speedup_vs_xla_fwdbwd'), '6.1f'):>6} "
      f"{_fmt(r.get('speedup_vs_tokamax_xla_chunked_fwdbwd'), '6.1f'):>6} "
      f"{r['lctx_temp_bytes'] / 2**20:>9.0f} {r['xla_temp_bytes'] / 2**20:>9.0f}"
    )
  by = {(r["T"], r["mode"]): r for r in rows}
  for t in sorted({r["T"] for r in rows}):
    if (t, "causal") in by and (t, "packed") in by:
      ratio = by[(t, "packed")]["lctx_fwdbwd_s"] / by[(t, "causal")]["lctx_fwdbwd_s"]
      print(f"T={t}: packed(8 docs)/causal fwd+bwd time = {ratio:.3f}")
  print(
    "(x = baseline time / lctx time, fwd+bwd; /mm = useful FLOP/s over the run's best "
    "matmul rate; adj mm = best matmul GFLOP/s timed right before/after this row's lctx "
    "timing, f+b/adj = fwd+bwd useful FLOP/s over it)"
  )


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument(
    "--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[2048, 8192, 32768]
  )
  p.add_argument("--modes", default="causal,packed")
  p.add_argument("--quick", action="store_true", help="lengths 1024,2048; 1 repeat")
  p.add_argument("--repeats", type=int, default=2)
  p.add_argument("--block-q", type=int, default=512)
  p.add_argument("--block-kv", type=int, default=512)
  p.add_argument("--baseline-mem-gb", type=float, default=12.0)
  p.add_argument("--no-baselines", action="store_true", help="report baseline memory only")
  p.add_argument(
    "--memory-only",
    action="store_true",
    help="compile only: temp bytes of every implementation, no timing",
  )
  p.add_argument("--out", default="bench_results/attention.json")
  args = p.parse_args()
  if args.quick:
    args.lengths, args.repeats = [1024, 2048], 1
  if tokamax is None:
    print(f"tokamax not importable ({TOKAMAX_ERROR}); its column is skipped")
  else:  # tokamax reads absl flags from sys.argv; ours are argparse's
    from absl import flags

    flags.FLAGS(sys.argv[:1], known_only=True)
  rate_before = 0.0 if args.memory_only else measure_matmul_flops(repeats=5)
  rows = [bench_one(t, m, args) for t in args.lengths for m in args.modes.split(",")]
  if args.memory_only:
    print_memory_table(rows)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
      json.dump(dict(memory_only=True, jax_version=jax.__version__, rows=rows), f, indent=1)
    print(f"wrote {args.out}")
    return
  rate_after = measure_matmul_flops(repeats=5)
  rate = max(rate_before, rate_after)
  for r in rows:  # re-normalise with the conservative (higher) rate
    r["lctx_fwd_vs_matmul"] = r["lctx_fwd_gflops"] * 1e9 / rate
    r["lctx_fwdbwd_vs_matmul"] = r["lctx_fwdbwd_gflops"] * 1e9 / rate
  print_table(rows, rate)
  result = dict(
    matmul_gflops_before=rate_before / 1e9,
    matmul_gflops_after=rate_after / 1e9,
    matmul_gflops_used=rate / 1e9,
    jax_version=jax.__version__,
    backend=jax.default_backend(),
    tokamax=tokamax is not None,
    tokamax_error=TOKAMAX_ERROR,
    load_avg=os.getloadavg(),
    rows=rows,
  )
  os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=1)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()

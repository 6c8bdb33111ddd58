"""Benchmark the chunked cross-entropy against the unchunked loss (and tokamax).

    python scripts/bench_loss.py            # memory at 32K tokens x vocab 128256
    python scripts/bench_loss.py --quick    # small shapes, smoke run

Memory: per-device temp bytes of the compiled loss+grad (w.r.t. hidden and
unembed) at --tokens x --vocab, lowered from shapes only (the unchunked loss
would need ~2 x tokens x vocab x 4 bytes: 32K x 128256 is 16 GiB per copy, more
than these machines have, so nothing runs at that size).
Speed and agreement: both losses are run at --time-tokens (default 4096) with the
same vocab; values and gradients are compared; times are best of --repeats.
A 2048^3 matmul is timed in the same run. tokamax's
`linear_softmax_cross_entropy_loss(implementation="xla")` is included when
importable (no z-loss there; compared on the plain loss).
Output: a printed table and a JSON file.
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
from lctx.kernels import chunked_cross_entropy, reference_cross_entropy  # noqa: E402
from lctx.metrics import measure_matmul_flops  # noqa: E402  (the baseline every bench uses)

try:
  import tokamax  # noqa: E402
except Exception as e:  # noqa: BLE001
  tokamax, TOKAMAX_ERROR = None, f"{type(e).__name__}: {e}"
else:
  TOKAMAX_ERROR = None


def _time(fn, args, repeats):
  jax.block_until_ready(fn(*args))
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    best = min(best, time.perf_counter() - t0)
  return best


def _losses(chunk_size, z_loss):
  def lctx(h, u, tg, m):
    s, z, w = chunked_cross_entropy(h, u, tg, m, chunk_size=chunk_size, z_loss=z_loss)
    return (s + z) / w

  def unchunked(h, u, tg, m):
    s, z, w = reference_cross_entropy(h, u, tg, m, z_loss=z_loss)
    return (s + z) / w

  fns = {"lctx_chunked": lctx, "unchunked": unchunked}
  if tokamax is not None and z_loss == 0.0:

    def tkmx(h, u, tg, m):
      del m  # tokamax takes no mask; the bench's mask is all ones
      loss = tokamax.linear_softmax_cross_entropy_loss(
        h.reshape(-1, h.shape[-1]), tg.reshape(-1), u, reduction="sum", implementation="xla"
      )
      return loss / tg.size

    fns["tokamax_xla"] = tkmx
  return fns


def _grad_fn(loss):
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def _shapes(tokens, d, vocab):
  return (
    jax.ShapeDtypeStruct((1, tokens, d), jnp.float32),
    jax.ShapeDtypeStruct((d, vocab), jnp.float32),
    jax.ShapeDtypeStruct((1, tokens), jnp.int32),
    jax.ShapeDtypeStruct((1, tokens), jnp.float32),
  )


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--tokens", type=int, default=32768)
  p.add_argument("--vocab", type=int, default=128256)
  p.add_argument("--d-model", type=int, default=256)
  p.add_argument("--chunk-size", type=int, default=2048)
  p.add_argument("--z-loss", type=float, default=0.0)
  p.add_argument("--time-tokens", type=int, default=4096)
  p.add_argument("--repeats", type=int, default=2)
  p.add_argument("--quick", action="store_true", help="4096 tokens, vocab 32000")
  p.add_argument("--out", default="bench_results/loss.json")
  args = p.parse_args()
  if args.quick:
    args.tokens, args.vocab, args.time_tokens, args.repeats = 4096, 32000, 2048, 1
  if tokamax is not None:  # tokamax reads absl flags from sys.argv
    from absl import flags

    flags.FLAGS(sys.argv[:1], known_only=True)
  chunk = min(args.chunk_size, args.time_tokens)
  rate = measure_matmul_flops(repeats=5)
  fns = _losses(args.chunk_size, args.z_loss)
  result = dict(
    tokens=args.tokens,
    vocab=args.vocab,
    d_model=args.d_model,
    chunk_size=args.chunk_size,
    z_loss=args.z_loss,
    time_tokens=args.time_tokens,
    tokamax_error=TOKAMAX_ERROR,
    jax_version=jax.__version__,
    impls={},
  )
  print(f"memory at {args.tokens} tokens x vocab {args.vocab}, d_model {args.d_model}:")
  for name, fn in fns.items():
    mem = (
      _grad_fn(fn)
      .lower(*_shapes(args.tokens, args.d_model, args.vocab))
      .compile()
      .memory_analysis()
    )
    result["impls"][name] = dict(temp_bytes=int(mem.temp_size_in_bytes))
    print(f"  {name:>14}: temp {mem.temp_size_in_bytes / 2**20:10.1f} MiB", flush=True)

  ks = jax.random.split(jax.random.PRNGKey(0), 3)
  n, d, e = args.time_tokens, args.d_model, args.vocab
  h = jax.random.normal(ks[0], (1, n, d), jnp.float32)
  u = jax.random.normal(ks[1], (d, e), jnp.float32) / np.sqrt(d)
  tg = jax.random.randint(ks[2], (1, n), 0, e)
  m = jnp.ones((1, n), jnp.float32)
  fns = _losses(chunk, args.z_loss)
  vals = {}
  flops = 3 * 2 * n * d * e  # forward logits matmul + two backward matmuls
  print(f"speed at {n} tokens (chunk {chunk}):")
  for name, fn in fns.items():
    g = _grad_fn(fn)
    vals[name] = g(h, u, tg, m)
    t = _time(g, (h, u, tg, m), args.repeats)
    r = result["impls"][name]
    r.update(time_s=t, gflops=flops / t / 1e9, vs_matmul=flops / t / rate)
    print(f"  {name:>14}: {t:.3f} s  ({r['gflops']:.1f} GFLOP/s useful)", flush=True)
  ref_val, ref_grads = vals["unchunked"]
  got_val, got_grads = vals["lctx_chunked"]
  result["abs_err_loss"] = float(abs(got_val - ref_val))
  result["max_rel_err_grads"] = [
    float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-12))
    for a, b in zip(got_grads, ref_grads)
  ]
  c, r = result["impls"]["lctx_chunked"], result["impls"]["unchunked"]
  result["temp_ratio_chunked_over_unchunked"] = c["temp_bytes"] / r["temp_bytes"]
  result["time_ratio_chunked_over_unchunked"] = c["time_s"] / r["time_s"]
  result["matmul_gflops"] = rate / 1e9
  result["load_avg"] = os.getloadavg()
  print(f"\nsame-run 2048^3 f32 matmul: {rate / 1e9:.1f} GFLOP/s")
  print(
    f"temp memory chunked/unchunked at {args.tokens} tokens: "
    f"{result['temp_ratio_chunked_over_unchunked']:.4f}"
  )
  print(f"time chunked/unchunked at {n} tokens: {result['time_ratio_chunked_over_unchunked']:.3f}")
  print(
    f"loss abs err {result['abs_err_loss']:.2e}; grad max rel err "
    f"{', '.join(f'{x:.2e}' for x in result['max_rel_err_grads'])}"
  )
  os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=1)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()

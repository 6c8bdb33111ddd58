"""Compiled memory of one context-parallel delta-rule layer (forward + backward) on
fake CPU devices: how the all-gathered summaries grow with the number of sequence
shards at a fixed per-device length. Prints a table and writes JSON.

  python scripts/linear_cp_memory.py [--out=/tmp/linear_cp_memory.json]
"""

import json
import os
import sys

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
    "gathered_summary_bytes": ways * sent["summary_bytes"],
    "all_gather_bytes_sent": sent["all_gather_bytes"],
  }


def main():
  out = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--out=")), None)
  rows = [measure(w, lb) for w in (2, 4, 8) for lb in (False, True)]
  print(f"B={B} N={N} H={H} V={V}, {LOCAL} tokens per device, float32, fwd+bwd")
  print(f"{'ways':>4} {'zigzag':>6} {'temp MiB':>9} {'gathered MiB':>12} {'sent MiB':>9}")
  for r in rows:
    print(
      f"{r['ways']:>4} {r['load_balance']!s:>6} {r['temp_bytes'] / 2**20:>9.2f} "
      f"{r['gathered_summary_bytes'] / 2**20:>12.2f} {r['all_gather_bytes_sent'] / 2**20:>9.2f}"
    )
  if out:
    with open(out, "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  main()

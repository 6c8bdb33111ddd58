"""Typing helpers for values created inside `jax.shard_map`.

Inside shard_map every value carries the set of mesh axes it varies over. A loop
carry created from constants (zeros) varies over none, so a lax loop that mixes it
with sharded inputs fails to type-check; a custom_vjp cotangent must vary exactly
like its primal. The kernels (blockwise, fused CPU, splash) and the ring strategy
use these three helpers; outside shard_map they are no-ops.
"""

from __future__ import annotations

import jax


def vma(x) -> set:
  """The shard_map mesh axes along which x varies (empty outside shard_map)."""
  aval = jax.typeof(x)
  mat = getattr(aval, "manual_axis_type", None)  # jax 0.10; older: aval.vma
  return set(mat.varying if mat is not None else getattr(aval, "vma", ()) or ())


def varying_like(x, *refs):
  """Marks a fresh loop carry (zeros) as varying over the same shard_map mesh axes
  as the inputs, so lax loops type-check inside shard_map (a no-op outside)."""
  axes = set()
  for r in refs:
    if r is not None:
      axes |= vma(r)
  axes -= vma(x)
  return jax.lax.pcast(x, tuple(sorted(axes)), to="varying") if axes else x


def cotangent_like(ct, primal, *refs):
  """A custom_vjp cotangent typed like its primal inside shard_map: varying over
  the axes of every input (refs), then summed over the axes along which the
  primal does not vary (e.g. K/V replicated while q is sharded)."""
  ct = varying_like(ct, *refs)
  extra = tuple(sorted(vma(ct) - vma(primal)))
  return jax.lax.psum(ct, extra) if extra else ct

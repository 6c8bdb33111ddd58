"""The planner's step-time estimate: FLOPs, collective and host bytes of a Setup.

`--mode=compile` reads these figures from the compiled program (lctx/sizing/compile.py);
the planner has no program, so it counts them from the setup's arithmetic and
hands them to the same `hardware.step_time`:

- FLOPs per device: the trainer's model FLOPs (ModelConfig.flops_per_token, 3 x
  forward) with the attention part at the kernel's own cost (lctx/kernels/
  flop_tags.py: a forward of 2H + 2V per visible pair; a backward of 6H + 4V,
  splash's dkv + dq passes 8H + 6V, where the formula assumes 2 x forward), plus
  the forward the remat policy recomputes: each projection or MLP matmul whose
  output the policy does not keep, and the attention kernel unless its output is
  kept (every policy but 'none' recomputes the elementwise rest, not counted).
- collective bytes per device (ICI; ring algorithms, (n-1)/n of the data): FSDP
  gathers the parameters in the forward and the backward and reduce-scatters the
  gradients; all_gather gathers K/V per layer and reduce-scatters dK/dV;
  ulysses moves q, k, v and out through all-to-alls, forward and backward; ring
  passes K/V round the ring (and dK/dV with them in the backward); usp both on
  its sub-axes. Recomputed attention repeats its forward collectives.
- host bytes: what an offloading setup keeps in pinned host memory crosses PCIe
  twice a step (out in the forward, back in the backward).

It ranks setups; `--mode=compile` is the figure to trust for one.
"""

from __future__ import annotations

from typing import Any

from lctx import hardware as hw
from lctx.sizing import memory_model as mm

_PROJ_TAGS = ("query_proj", "key_proj", "value_proj", "out_proj", "mlp_gate", "mlp_up", "mlp_out")


def _kept(setup: mm.Setup) -> set[str]:
  if setup.remat_policy == "none":
    return set(mm.LAYER_TENSORS) | {"attention_out"}
  return set(mm.remat_table(setup))


def flops_per_device(model, dims: mm.ModelDims, setup: mm.Setup, devices: int) -> dict[str, float]:
  """{'model', 'attention_extra', 'recompute', 'total'} FLOPs per device per step."""
  tokens = setup.batch_size * setup.seq_len / devices
  per_token = model.flops_per_token(setup.seq_len, causal=True)
  attn_fwd = model.flops_per_token(setup.seq_len, causal=True, training=False)
  attn_fwd -= model.flops_per_token(1, causal=True, training=False)  # the attention part only
  h, v = dims.head_dim, dims.v_head_dim
  bwd = (8 * h + 6 * v) if setup.kernel == "splash" else (6 * h + 4 * v)
  extra = attn_fwd * (bwd / (2 * h + 2 * v) - 2)  # the formula counts the backward as 2 x
  d, n, k, f = dims.d_model, dims.num_heads, dims.num_kv_heads, dims.mlp_dim
  proj = {
    "query_proj": 2 * d * n * h,
    "key_proj": 2 * d * k * h,
    "value_proj": 2 * d * k * v,
    "out_proj": 2 * n * v * d,
    "mlp_gate": 2 * d * f,
    "mlp_up": 2 * d * f,
    "mlp_out": 2 * f * d,
  }
  kept = _kept(setup)
  recompute = 0.0
  if setup.remat_policy != "none":
    recompute = dims.num_layers * sum(x for t, x in proj.items() if t not in kept)
    if "attention_out" not in kept:
      recompute += attn_fwd
  model_flops = per_token * tokens
  total = model_flops + (extra + recompute) * tokens
  return {
    "model": model_flops,
    "attention_extra": extra * tokens,
    "recompute": recompute * tokens,
    "total": total,
  }


def collective_bytes_per_device(dims: mm.ModelDims, setup: mm.Setup) -> float:
  """ICI bytes one device sends per step (see the module docstring)."""
  a = setup.dtype_bytes
  c, u = setup.axis("context"), setup.axis("context_ulysses")
  devices = max(1, setup.batch_ways * setup.context_degree * setup.axis("tensor"))
  tokens = setup.batch_size * setup.seq_len / devices  # per device
  layers = dims.num_layers
  out = 0.0
  shards = setup.param_shards
  if shards > 1:
    params = dims.num_params * a
    out += 3 * params * (shards - 1) / shards  # gather fwd + bwd, reduce-scatter grads
  kv = 2 * dims.num_kv_heads * dims.head_dim * a  # K and V per token
  q_out = 2 * dims.num_heads * dims.head_dim * a
  recompute = 0 if "attention_out" in _kept(setup) else 1
  passes_fwd = 1 + recompute
  if setup.strategy == "all_gather":
    p = setup.context_degree
    out += layers * tokens * kv * (p - 1) * (passes_fwd + 2)  # gather K/V; RS dK/dV (f32)
  if setup.strategy in ("ulysses", "usp") and u > 1:
    out += layers * tokens * (q_out + kv) * (u - 1) / u * (passes_fwd + 1)
  if setup.strategy in ("ring", "usp"):
    ring = c if setup.strategy == "usp" else setup.context_degree
    if ring > 1:
      out += layers * tokens * kv * (ring - 1) * (passes_fwd + 2)
  return out


def estimate(model, dims: mm.ModelDims, setup: mm.Setup, target: hw.Target, host_bytes: float):
  """hardware.step_time of the setup, with the FLOP parts shown."""
  flops = flops_per_device(model, dims, setup, target.devices)
  out: dict[str, Any] = hw.step_time(
    target.accelerator,
    flops=flops["total"],
    host_bytes=2 * host_bytes,
    ici_bytes=collective_bytes_per_device(dims, setup),
    tokens_per_step=setup.batch_size * setup.seq_len,
  )
  out["flops_per_device"] = flops
  return out

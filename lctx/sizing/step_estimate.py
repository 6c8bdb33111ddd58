"""The planner's step-time estimate: FLOPs, collective and host bytes of a Setup.

`--mode=compile` reads these figures from the compiled program (lctx/sizing/compile.py);
the planner has no program, so it counts them from the setup's arithmetic and
hands them to the same `hardware.step_time`:

- FLOPs per device: the trainer's model FLOPs (ModelConfig.flops_per_token, 3 x
  forward) with the attention part at the kernel's own cost (lctx/kernels/
  flop_tags.py, per visible pair; forward 2H + 2V = 1 unit at H = V; a backward
  in one pass of 6H + 4V = 2.5 units: blockwise, CPU and splash's fused kernel;
  splash's two-pass form (fused_bwd=False) 8H + 6V = 3.5 units, where the
  formula assumes 2 x forward), plus the forward the remat policy recomputes:
  each projection or MLP matmul whose output the policy does not keep, and the
  attention forward (1 unit) unless the policy keeps the kernel's residuals,
  output and lse (lctx/kernels/remat_tags.py); a remat group of k > 1 layers
  replays its layers' whole forward once more (its layers then recompute what
  their own policy drops); UPipe's head stages (head_chunks > 1 under ulysses
  or usp, lctx/parallel/upipe.py) are checkpoints of their own: their backward
  runs the attention forward once more, under 'none' too, unless the layer's
  policy keeps the attention residuals; every policy but 'none' recomputes the
  elementwise rest, not counted.
- collective bytes per device (ICI; ring algorithms, (n-1)/n of the data): FSDP
  gathers the parameters in the forward and the backward and reduce-scatters the
  gradients; all_gather gathers K/V per layer and reduce-scatters dK/dV;
  ulysses moves q, k, v and out through all-to-alls, forward and backward; ring
  passes K/V round the ring (and dK/dV with them in the backward); usp both on
  its sub-axes. Recomputed attention repeats its forward collectives.
- linear-attention layers (hybrids; lctx/sizing/linear_layers.py): the model's
  figure counts their chunked delta rule; beyond it the kernel's remat levels (one or two),
  the context-parallel summary pass, the forward the layer's remat redoes, and
  their state exchange and conv halos (forward passes once, backward twice).
- host bytes: what an offloading setup keeps in pinned host memory crosses PCIe
  twice a step (out in the forward, back in the backward).

It ranks setups; `--mode=compile` is the figure to trust for one.
"""

from __future__ import annotations

from typing import Any

from lctx import hardware as hw
from lctx.kernels import flop_tags
from lctx.models import config as models_config
from lctx.sizing import linear_layers
from lctx.sizing import memory_model as mm

_MLP_TAGS = ("mlp_gate", "mlp_up", "mlp_out")
_PROJ_TAGS = ("query_proj", "key_proj", "value_proj", "out_proj", "mlp_gate", "mlp_up", "mlp_out")


def _kept(setup: mm.Setup) -> set[str]:
  if setup.remat_policy == "none":
    return set(mm.LAYER_TENSORS)
  return set(mm.remat_table(setup))


def attention_kept(setup: mm.Setup) -> bool:
  """Whether the policy keeps the attention residuals (output and lse), so the
  backward does not re-run the attention forward."""
  return set(models_config.ATTENTION_RESIDUALS) <= _kept(setup)


def backward_pair_flops(setup: mm.Setup, h: int, v: int) -> int:
  """The attention backward's FLOPs per visible pair and q head (flop_tags.py)."""
  if setup.kernel == "splash" and not getattr(setup, "fused_bwd", True):
    return flop_tags.splash_dkv_pair_flops(h, v) + flop_tags.splash_dq_pair_flops(h, v)
  return flop_tags.fa2_backward_pair_flops(h, v)


def flops_per_device(model, dims: mm.ModelDims, setup: mm.Setup, devices: int) -> dict[str, float]:
  """{'model', 'attention_extra', 'recompute', 'total'} FLOPs per device per step."""
  tokens = setup.batch_size * setup.seq_len / devices
  per_token = model.flops_per_token(setup.seq_len, causal=True)
  attn_fwd = model.flops_per_token(setup.seq_len, causal=True, training=False)
  attn_fwd -= model.flops_per_token(1, causal=True, training=False)  # the attention part only
  h, v = dims.head_dim, dims.v_head_dim
  bwd = backward_pair_flops(setup, h, v)
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
  attn_layers = dims.attention_layers
  lin = linear_layers.flops_per_token(model, setup, kept)
  recompute = 0.0
  if setup.remat_policy != "none":
    recompute = attn_layers * sum(x for t, x in proj.items() if t not in kept)
    recompute += lin["recompute"]
    if not attention_kept(setup):
      recompute += attn_fwd
    if setup.remat_group_size > 1:  # the group replays its layers' whole forward once more
      recompute += attn_layers * sum(proj.values()) + attn_fwd
      if dims.linear_layers:  # and the linear layers' whole forward
        mixer = models_config.linear_layer_flops(model, setup.seq_len)
        recompute += dims.linear_layers * (mixer + sum(proj[t] for t in _MLP_TAGS))
  upipe = (setup.head_chunks or 1) > 1
  if upipe and (setup.remat_policy == "none" or not attention_kept(setup)):
    recompute += attn_fwd  # each UPipe stage, a checkpoint, replays its attention
  model_flops = per_token * tokens
  total = model_flops + (extra + lin["extra"] + recompute) * tokens
  return {
    "model": model_flops,
    "attention_extra": extra * tokens,
    "linear_extra": lin["extra"] * tokens,
    "recompute": recompute * tokens,
    "total": total,
  }


def collective_bytes_per_device(dims: mm.ModelDims, setup: mm.Setup) -> float:
  """ICI bytes one device sends per step (see the module docstring)."""
  a = setup.dtype_bytes
  c, u = setup.axis("context"), setup.axis("context_ulysses")
  devices = max(1, setup.batch_ways * setup.context_degree * setup.axis("tensor"))
  tokens = setup.batch_size * setup.seq_len / devices  # per device
  layers = dims.attention_layers  # linear layers: their state exchange, below
  out = 0.0
  shards = setup.param_shards
  if shards > 1:
    params = dims.num_params * a
    out += 3 * params * (shards - 1) / shards  # gather fwd + bwd, reduce-scatter grads
  kv = 2 * dims.num_kv_heads * dims.head_dim * a  # K and V per token
  q_out = 2 * dims.num_heads * dims.head_dim * a
  recompute = 0 if attention_kept(setup) else 1
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
  if dims.linear_layers:
    linear_fwd = 1 + (0 if setup.remat_policy == "none" else 1)
    out += linear_layers.exchange_bytes(dims.linear, setup, linear_fwd)
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

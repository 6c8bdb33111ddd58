"""Analytic per-device memory of one train step: the planner's arithmetic.

Plain numbers in (model dims, mesh shape, batch, length, dtypes, remat policy,
chunk sizes, strategy), bytes out, split by what holds them. `--mode=plan`
(lctx/planner.py) searches setups with it and strategy 'auto'
(lctx/parallel/auto.py) sizes candidates with it; `scripts/bench_memory.py`
prints it beside the TPU compiler's figure. Estimates, not measurements: the
compiler's `memory_analysis()` (`--mode=compile`) is the word that counts.

What the step holds, per device (lctx/trainer.py, lctx/models/transformer.py):
  - arguments: f32 master parameters and AdamW's two f32 moments, sharded like
    the parameters (LOGICAL_RULES: `embed` over fsdp x context x
    context_ulysses, heads / mlp / vocab over tensor), plus the int32 batch;
  - gradients: the same sharding as the parameters;
  - gathered weights: FSDP all-gathers one layer's weights at a time (and the
    [D, E] unembedding for the loss) and reduce-scatters their gradients;
  - saved activations: per layer, the tensors the remat policy keeps on device
    (`REMAT_POLICIES`; offloaded ones count as host bytes);
  - the layer being back-propagated: its recomputed residuals and cotangents,
    the MLP over `mlp_chunk_size` tokens at a time;
  - attention buffers per strategy: all_gather holds the whole sequence's K/V
    and its f32 gradient; ulysses the all-to-all'd q/k/v/out of a head group
    over the whole sequence; ring / usp the visiting K/V block and the next,
    travelling f32 dK/dV, f32 output and dQ accumulators;
  - the loss: one chunk of f32 logits and their gradient at a time.

The per-token coefficients below count the buffers the code creates; the few
that XLA's buffer assignment decides (how many copies of a tensor are live at
the peak) were fitted to TPU compiles (`memory_analysis()` of compile-only
v5p / TPU7x devices, libtpu 0.0.42.1, 2026-12-01) and are checked against the
compiler by tests/test_planner.py and scripts/bench_memory.py.

Shapes legend: B rows per device, T tokens per device (sequence shard), D
d_model, F MLP hidden, N / K q / kv heads per tensor shard, H / V qk / value
head dim, E vocab per tensor shard, a activation bytes, p parameter bytes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

STRATEGIES = ("all_gather", "ulysses", "ring", "usp", "none")
F32 = 4
INT32 = 4
BATCH_ARRAYS = 5  # inputs, targets, segment_ids, positions (int32), loss_mask (f32)


# ----------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ModelDims:
  """What the memory model needs of a ModelConfig (lctx.planner.model_dims builds it).

  Attributes:
    vocab_size, d_model, num_layers, mlp_dim: E, D, layers, F.
    num_heads, num_kv_heads: N and K (MLA: K = N, its up-projected heads).
    head_dim, v_head_dim: H (q/k) and V.
    layer_params: parameters of one decoder layer.
    embedding_params: the input table plus the untied unembedding (E x D each).
  """

  vocab_size: int
  d_model: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  v_head_dim: int
  mlp_dim: int
  layer_params: int
  embedding_params: int

  @property
  def num_params(self) -> int:
    return self.num_layers * self.layer_params + self.embedding_params + self.d_model


@dataclasses.dataclass(frozen=True)
class Setup:
  """One way to run the step.

  Attributes:
    strategy: context-parallel strategy ('none': no context parallelism).
    mesh: axis sizes (data, fsdp, tensor, context, context_ulysses); absent = 1.
    batch_size, seq_len: global rows per step and tokens per row.
    remat_policy: a key of REMAT_POLICIES.
    dtype_bytes, param_bytes: activation (compute) and parameter bytes.
    loss_chunk_size, mlp_chunk_size: tokens per loss / MLP chunk (None: whole).
    block_q, block_kv: attention kernel blocks (the per-block f32 scratch).
  """

  strategy: str
  mesh: Mapping[str, int]
  batch_size: int
  seq_len: int
  remat_policy: str = "full"
  dtype_bytes: int = 2
  param_bytes: int = 4
  loss_chunk_size: int | None = None
  mlp_chunk_size: int | None = None
  block_q: int = 512
  block_kv: int = 512

  def axis(self, name: str) -> int:
    return int(self.mesh.get(name, 1))

  @property
  def context_degree(self) -> int:
    return self.axis("context") * self.axis("context_ulysses")

  @property
  def batch_ways(self) -> int:
    return self.axis("data") * self.axis("fsdp")

  @property
  def param_shards(self) -> int:
    """Ways the `embed` dimension (so nearly every weight) is split."""
    return self.axis("fsdp") * self.context_degree

  def describe(self) -> str:
    mesh = " x ".join(f"{a} {s}" for a, s in self.mesh.items() if s > 1) or "1 device"
    return f"{self.strategy} on {mesh}, remat {self.remat_policy}"


# ----------------------------------------------------------------------------
# Remat policies: which per-layer tensors stay on device, go to host, or are
# recomputed. A new policy is one entry: {tensor name: 'device' | 'offload'}.
# ----------------------------------------------------------------------------
# Names follow the checkpoint_name tags of lctx/models (MaxText's names).
# 'residuals' stands for everything a layer's backward needs that has no name
# (norm statistics, rotated q/k, the kernel's lse, SwiGLU's product ...).
LAYER_TENSORS = (
  "layer_input",
  "query_proj",
  "key_proj",
  "value_proj",
  "context",
  "out_proj",
  "mlpwi",
  "mlpwo",
  "residuals",
)
_ALL_DEVICE = {name: "device" for name in LAYER_TENSORS}
_DOTS = {
  n: "device"
  for n in ("layer_input", "query_proj", "key_proj", "value_proj", "out_proj", "mlpwi", "mlpwo")
}
REMAT_POLICIES: dict[str, dict[str, str]] = {
  "none": _ALL_DEVICE,
  # The remat'd layer's input is its saved argument (the scan carry).
  "full": {"layer_input": "device"},
  "dots": _DOTS,
  # Our projections are plain 2-D matmuls (no dot batch dims): the same saves.
  "dots_no_batch": _DOTS,
  "offload_layer_inputs": {"layer_input": "offload"},
}


def tensor_bytes_per_token(name: str, dims: ModelDims, setup: Setup) -> float:
  """Bytes one token of one layer's tensor `name` takes (per tensor shard)."""
  tp = setup.axis("tensor")
  a = setup.dtype_bytes
  d, f = dims.d_model, dims.mlp_dim / tp
  n = dims.num_heads / tp
  k = dims.num_kv_heads / tp if dims.num_kv_heads % tp == 0 else dims.num_kv_heads
  h, v = dims.head_dim, dims.v_head_dim
  sizes = {
    "layer_input": d * a,
    "query_proj": n * h * a,
    "key_proj": k * h * a,
    "value_proj": k * v * a,
    "context": n * v * a,
    "out_proj": d * a,
    "mlpwi": 2 * f * a,
    "mlpwo": d * a,
    # Two RMSNorms (f32 normalised input + bf16 output each), RoPE'd q and k,
    # lse, the residual sum and SwiGLU's product.
    "residuals": 2 * d * (F32 + a) + (n + k) * h * a + n * F32 + d * a + f * a,
  }
  if name not in sizes:
    raise ValueError(f"unknown layer tensor {name!r}; known: {', '.join(LAYER_TENSORS)}")
  return sizes[name]


def remat_saved_bytes_per_token(dims: ModelDims, setup: Setup) -> tuple[float, float]:
  """(device, host) bytes one layer keeps per token for the backward pass."""
  if setup.remat_policy not in REMAT_POLICIES:
    raise ValueError(
      f"unknown remat policy {setup.remat_policy!r}; known: {', '.join(REMAT_POLICIES)}"
    )
  device = host = 0.0
  for name, where in REMAT_POLICIES[setup.remat_policy].items():
    b = tensor_bytes_per_token(name, dims, setup)
    if where == "offload":
      host += b
    elif where == "device":
      device += b
    else:
      raise ValueError(f"remat policy {setup.remat_policy!r}: {name} -> {where!r}")
  return device, host


# ----------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Breakdown:
  """Per-device bytes of one train step (`total` = device HBM); host per device."""

  parameters: int
  optimizer_state: int
  batch: int
  gradients: int
  gathered_weights: int
  saved_activations: int
  layer_backward: int
  attention_buffers: int
  loss: int
  host: int

  DEVICE_FIELDS = (
    "parameters",
    "optimizer_state",
    "batch",
    "gradients",
    "gathered_weights",
    "saved_activations",
    "layer_backward",
    "attention_buffers",
    "loss",
  )

  @property
  def total(self) -> int:
    return sum(getattr(self, f) for f in self.DEVICE_FIELDS)

  @property
  def argument_bytes(self) -> int:
    """What the compiler calls arguments (the donated state and the batch)."""
    return self.parameters + self.optimizer_state + self.batch

  def as_dict(self) -> dict[str, int]:
    out = {f: getattr(self, f) for f in (*self.DEVICE_FIELDS, "host")}
    out["total"] = self.total
    return out


# ----------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------
# Live copies at the peak that XLA's schedule decides, fitted to compiles:
_GATHERED_LAYER_COPIES = 3.0  # gathered f32 weights (+ bf16 cast) and their f32 grads
_LOSS_CHUNK_COPIES = 2.0  # f32 logits and their f32 gradient
_KERNEL_BLOCK_COPIES = 4.0  # f32 [G*bq, bk] score blocks per kv head in flight
_LAYER_BACKWARD_D = 6.0  # cotangent and residual D-vectors per token (bytes / a)
_LAYER_BACKWARD_F = 4.0  # MLP hidden-sized buffers per MLP-chunk token (bytes / a)


def estimate(dims: ModelDims, setup: Setup) -> Breakdown:
  """The per-device breakdown of one train step of `dims` run as `setup`."""
  if setup.strategy not in STRATEGIES:
    raise ValueError(f"unknown strategy {setup.strategy!r}; known: {', '.join(STRATEGIES)}")
  a, p = setup.dtype_bytes, setup.param_bytes
  tp = setup.axis("tensor")
  b = max(1, setup.batch_size // setup.batch_ways)  # rows per device
  t = math.ceil(setup.seq_len / setup.context_degree)  # tokens per device per row
  tokens = b * t

  # Parameters, optimizer state, gradients: sharded over embed x tensor.
  shards = setup.param_shards * tp
  params = math.ceil(dims.num_params / shards)
  parameters = params * p
  optimizer_state = 2 * params * p
  gradients = params * p
  batch = BATCH_ARRAYS * tokens * INT32

  # FSDP: one layer gathered at a time, and the unembedding for the loss.
  gathered = 0.0
  if setup.param_shards > 1:
    gathered += _GATHERED_LAYER_COPIES * dims.layer_params / tp * p
  e = dims.vocab_size / tp
  gathered += e * dims.d_model * (a + F32 + (p if setup.param_shards > 1 else 0))

  # Saved activations across layers.
  dev_tok, host_tok = remat_saved_bytes_per_token(dims, setup)
  saved = dims.num_layers * tokens * dev_tok
  host = dims.num_layers * tokens * host_tok

  # The layer in its backward pass: recomputed residuals and cotangents.
  layer_tok = sum(
    tensor_bytes_per_token(n, dims, setup) for n in LAYER_TENSORS if n not in ("mlpwi",)
  )
  mlp_tokens = b * min(t, setup.mlp_chunk_size or t)
  f = dims.mlp_dim / tp
  layer_backward = tokens * (layer_tok + _LAYER_BACKWARD_D * dims.d_model * a)
  layer_backward += mlp_tokens * _LAYER_BACKWARD_F * f * a

  attention = attention_buffer_bytes(dims, setup, rows=b)

  # Loss: one chunk of the flattened local tokens at a time.
  chunk = min(tokens, setup.loss_chunk_size or tokens)
  loss = chunk * e * F32 * _LOSS_CHUNK_COPIES + tokens * dims.d_model * F32

  return Breakdown(
    parameters=int(parameters),
    optimizer_state=int(optimizer_state),
    batch=int(batch),
    gradients=int(gradients),
    gathered_weights=int(gathered),
    saved_activations=int(saved),
    layer_backward=int(layer_backward),
    attention_buffers=int(attention),
    loss=int(loss),
    host=int(host),
  )


def attention_buffer_bytes(dims: ModelDims, setup: Setup, rows: int = 1) -> float:
  """Per-device bytes attention adds while one layer runs backward, by strategy.

  Beyond the layer's own q/k/v/out (counted in the layer's tensors).
  """
  a = setup.dtype_bytes
  tp = setup.axis("tensor")
  c, u = setup.axis("context"), setup.axis("context_ulysses")
  n = dims.num_heads / tp
  k = dims.num_kv_heads / tp if dims.num_kv_heads % tp == 0 else dims.num_kv_heads
  h, v = dims.head_dim, dims.v_head_dim
  seq = setup.seq_len
  t = seq / (c * u)  # local tokens
  qo = n * (h + v)  # q and out elements per token
  kv = k * (h + v)  # k and v elements per token
  if setup.strategy in ("none", "all_gather"):
    # The whole sequence's K/V (bf16, gathered, in block layout) and its f32
    # gradient before the reduce-scatter; q/out/dout/dq of the local tokens.
    per = seq * kv * (2 * a + 2 * F32) + t * qo * (a + F32)
    heads_in_kernel = n
  elif setup.strategy == "ulysses":
    # All-to-all'd q/k/v/out of N/P heads over the whole sequence (the same
    # bytes as the local shard) and the kernel's f32 gradients.
    per = t * (qo + kv) * (a + F32)
    heads_in_kernel = n / c
  else:
    # ring / usp: after usp's all-to-all a ring group's chunk of seq / c tokens
    # with N/u heads: the same bytes as t tokens of N heads. K/V current + next
    # (bf16), dK/dV travelling and arriving (f32), the f32 output and dQ
    # accumulators, and the kernel's layout copies.
    per = t * kv * (2 * a + 2 * F32) + t * qo * (a + 2 * F32)
    heads_in_kernel = n / u
  # The kernel's per-block f32 score tiles (GQA groups folded into q rows).
  blocks = _KERNEL_BLOCK_COPIES * heads_in_kernel * setup.block_q * setup.block_kv * F32
  return rows * per + blocks


def fits(breakdown: Breakdown, hbm_bytes_per_device: int) -> bool:
  return breakdown.total <= hbm_bytes_per_device

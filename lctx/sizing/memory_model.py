"""Analytic per-device memory of one train step: the planner's arithmetic.

Plain numbers in (model dims, mesh shape, batch, length, dtypes, remat policy,
chunk sizes, strategy), bytes out, split by what holds them. `--mode=plan`
(lctx/sizing/planner.py) searches setups with it and strategy 'auto'
(lctx/parallel/auto.py) sizes candidates with it; `scripts/bench_memory.py`
prints it beside the TPU compiler's figure. Estimates, not measurements: the
compiler's `memory_analysis()` (`--mode=compile`) is the word that counts.

What the step holds, per device (lctx/trainer.py, lctx/models/transformer.py):
  - arguments: f32 master parameters and AdamW's two f32 moments, sharded like
    the parameters (LOGICAL_RULES: `embed` over fsdp x context x
    context_ulysses, heads / mlp / vocab over tensor), plus the int32 batch;
  - gradients: the same sharding as the parameters;
  - gathered weights: FSDP all-gathers one layer's weights at a time and
    reduce-scatters their gradients; the embedding tables are gathered whole
    (f32 [vocab, D]: the unembedding and the embeddings' gradients);
  - saved activations: per layer, the tensors the remat policy keeps on device
    (`REMAT_POLICIES`, or ModelConfig's per-tag `remat_choices`; offloaded ones
    count as host bytes, as do offloaded parameters / optimizer state);
  - the layer being back-propagated: its residual stream and cotangents, the
    MLP over `mlp_chunk_size` tokens at a time;
  - attention buffers per strategy: all_gather holds the whole sequence's K/V
    (and part of their f32 gradient); ulysses the all-to-all'd q/k/v/out of a
    head group over the whole sequence; ring / usp the visiting K/V block and
    the next, travelling f32 dK/dV, f32 output and dQ accumulators (usp also
    both layouts around its all-to-alls). By kernel (Setup.kernel, resolved
    from AttentionOptions.backend like the trainer: 'auto' is splash on
    TPU): blockwise adds its f32 [bq, bk] score tiles per kv-head group;
    splash keeps its tiles in VMEM, and holds lane-wide f32 statistics
    ([heads, tokens, 128]) and f32 output / dq accumulators in HBM;
  - remat groups (ModelConfig.remat_group_size k): one saved input per group,
    and the group's backward holds its k carries (`group_input_copies` per
    extra layer); offloaded layer inputs with groups of 1 keep more of the
    attention's buffers live (`offload_attention_copies`);
  - the loss (lctx/trainer.py `_cross_entropy`): each device scans its own
    tokens, TrainConfig.loss_chunk_size per chunk, with the whole unembedding
    (`loss_bytes`): one chunk of f32 logits and their gradient, the gathered
    table and its f32 gradient accumulator, the cotangent of the local
    hidden states; with the tensor axis in use, chunks of the global tokens.
    Added to the layer's backward, not overlapped with it (memory_analysis'
    total sums the program's buffer slots, and the compiles keep the loss's
    slots apart).

Shapes fix the bytes per element; how many buffers XLA keeps live is a
per-element coefficient (COEFFICIENTS, read from
lctx/parallel/memory_coefficients.json), which scripts/fit_memory_model.py fits
to TPU compiles (`memory_analysis()` totals of compile-only v5p / TPU7x
devices, both kernels) and writes; checked against the compiler by
tests/test_planner.py (small cases in the default run, a held-out set under
`slow`) and scripts/bench_memory.py. Per-head arrays ([..., heads, H]: q/k/v,
the attention output, the attention buffers) count head dims lane-padded to
128 (TPU tiling; no padding for head dim 128). GPU targets use the same
coefficients and padding (their kernels counted as blockwise): an
approximation.

Shapes legend: B rows per device, T tokens per device (sequence shard), D
d_model, F MLP hidden, N / K q / kv heads per tensor shard, H / V qk / value
head dim, E vocab per tensor shard, a activation bytes, p parameter bytes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from lctx.models import config as models_config
from lctx.parallel.attention_memory import (  # noqa: F401  (re-exported: one definition)
  F32,
  KERNELS,
  STRATEGIES,
  attention_buffer_bytes,
  dq_partials_bytes,
  fitted_coefficients,
  head_chunk_fractions,
  lanes,
  resolve_kernel,
)

INT32 = 4
BATCH_ARRAYS = 5  # inputs, targets, segment_ids, positions (int32), loss_mask (f32)


# ----------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ModelDims:
  """What the memory model needs of a ModelConfig (lctx.sizing.planner.model_dims builds it).

  Attributes:
    vocab_size, d_model, num_layers, mlp_dim: E, D, layers, F.
    num_heads, num_kv_heads: N and K (MLA: K = N, its up-projected heads).
    head_dim, v_head_dim: H (q/k) and V.
    layer_params: parameters of one decoder layer.
    embedding_params: the input table plus the untied unembedding (E x D each).
    linear_layers: how many layers are linear attention (hybrids); their
      shapes are read from `linear`, the ModelConfig (lctx/sizing/linear_layers.py).
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
  linear_layers: int = 0
  linear: Any = None

  @property
  def attention_layers(self) -> int:
    return self.num_layers - self.linear_layers

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
    remat_policy: a key of REMAT_POLICIES, or any name when `remat_choices`
      is given.
    remat_choices: per-tag choices {tag: 'device' | 'offload' | 'remat'}
      (ModelConfig.remat_choices for presets and 'custom'); None: the table.
    remat_group_size: layers per rematerialised group (one saved input each).
    offload_optimizer_state, offload_params: AdamW state / f32 parameters kept
      in pinned host memory between steps.
    dtype_bytes, param_bytes: activation (compute) and parameter bytes.
    loss_chunk_size, mlp_chunk_size: tokens per loss / MLP chunk (None: whole).
    block_q, block_kv: attention kernel blocks (the per-block f32 scratch).
    block_q_bwd, block_kv_bwd: the backward's blocks (None: the forward's);
      the fused splash backward writes one dq partial per kv block.
    kernel: the attention kernel the step runs, 'blockwise' (pure JAX: f32
      score tiles in HBM) or 'splash' (TPU Pallas: tiles in VMEM; lane-wide
      f32 softmax statistics in HBM); see KERNELS and `resolve_kernel`.
    head_chunks: ContextOptions.head_chunks (ulysses / usp UPipe stages;
      see head_chunk_fractions); None: all heads at once.
    fused_bwd: splash's fused dq+dkv backward (AttentionOptions.fused_bwd):
      5 matmuls per block pair instead of 7, and dq partials of at most
      dq_partial_bytes while one call's backward runs (Breakdown.dq_partials).
  """

  strategy: str
  mesh: Mapping[str, int]
  batch_size: int
  seq_len: int
  remat_policy: str = "full"
  remat_choices: Mapping[str, str] | None = None
  remat_group_size: int = 1
  offload_optimizer_state: bool = False
  offload_params: bool = False
  dtype_bytes: int = 2
  param_bytes: int = 4
  loss_chunk_size: int | None = None
  mlp_chunk_size: int | None = None
  block_q: int = 512
  block_kv: int = 512
  kernel: str = "blockwise"
  head_chunks: int | None = None
  block_q_bwd: int | None = None
  block_kv_bwd: int | None = None
  fused_bwd: bool = True
  dq_partial_bytes: int = 1 << 30

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
# The tables are lctx/models' (REMAT_TAGS, DOT_TAGS, REMAT_PRESETS), read here.
# 'residuals' stands for what a layer's backward needs that has no tag (norm
# statistics, RoPE's f32 intermediates ...): only 'none' keeps it. The kernel's
# lse has its own tag (attention_lse).
LAYER_TENSORS = (*models_config.REMAT_TAGS, "residuals")


def _kept(choices: Mapping[str, str]) -> dict[str, str]:
  """The tensors per-tag choices keep ('device' | 'offload'); a rematerialised
  layer restarts from its input, so that is kept unless offloaded."""
  kept = {t: c for t, c in choices.items() if c != "remat"}
  kept.setdefault("layer_input", "device")
  return kept


def _preset(pairs) -> dict[str, str]:
  choices = dict.fromkeys(models_config.REMAT_TAGS, "remat")
  choices.update(dict(pairs))
  return _kept(choices)


REMAT_POLICIES: dict[str, dict[str, str]] = {
  "none": dict.fromkeys(LAYER_TENSORS, "device"),
  # JAX's dot policies save the matmul outputs; our projections are plain 2-D
  # matmuls (no dot batch dims), so both save the same.
  "dots": {"layer_input": "device", **dict.fromkeys(models_config.DOT_TAGS, "device")},
  "dots_no_batch": {"layer_input": "device", **dict.fromkeys(models_config.DOT_TAGS, "device")},
  **{name: _preset(pairs) for name, pairs in models_config.REMAT_PRESETS.items()},
}


def tensor_bytes_per_token(
  name: str, dims: ModelDims, setup: Setup, lane_padded: bool = True
) -> float:
  """Bytes one token of one layer's tensor `name` takes (per tensor shard).

  lane_padded=False: the logical size, as pinned host memory holds an
  offloaded copy (the compiler moves the unpadded [T, heads, H] bytes: a head
  dim of 32 moves 32, not 128)."""
  tp = setup.axis("tensor")
  a = setup.dtype_bytes
  d, f = dims.d_model, dims.mlp_dim / tp
  n = dims.num_heads / tp
  k = dims.num_kv_heads / tp if dims.num_kv_heads % tp == 0 else dims.num_kv_heads
  # Per-head tensors are [B, T, heads, H] with H minor: lane-padded on TPU
  # (a head dim of 64 takes the room of 128; Llama's 128 is exact).
  h, v = dims.head_dim, dims.v_head_dim
  if lane_padded:
    h, v = lanes(h), lanes(v)
  sizes = {
    "layer_input": d * a,
    "query_proj": n * h * a,
    "key_proj": k * h * a,
    "value_proj": k * v * a,
    "attention_out": n * v * a,
    "attention_lse": n * F32,  # the kernel's logsumexp (remat_tags.py)
    "out_proj": d * a,
    "mlp_gate": f * a,
    "mlp_up": f * a,
    "mlp_hidden": f * a,
    "mlp_out": d * a,
    # Two RMSNorms (f32 normalised input + bf16 output each), q and k before
    # RoPE and the f32 they rotate in, the residual sum, SwiGLU's sigmoid.
    "residuals": 2 * d * (F32 + a) + (n + k) * h * (a + F32) + d * a + f * a,
  }
  if name not in sizes:
    raise ValueError(f"unknown layer tensor {name!r}; known: {', '.join(LAYER_TENSORS)}")
  return sizes[name]


def remat_table(setup: Setup) -> dict[str, str]:
  """{tensor: 'device' | 'offload'} the setup's remat policy keeps (others: remat)."""
  if setup.remat_choices is not None:
    return _kept(setup.remat_choices)
  if setup.remat_policy not in REMAT_POLICIES:
    raise ValueError(
      f"unknown remat policy {setup.remat_policy!r}; known: {', '.join(REMAT_POLICIES)} "
      "(or pass remat_choices)"
    )
  return REMAT_POLICIES[setup.remat_policy]


def remat_saved_bytes_per_token(
  dims: ModelDims,
  setup: Setup,
  device_scale: float = 1.0,
  residual_scale: float | None = None,
  sizes=None,
  part: str = "all",
) -> tuple[float, float]:
  """(device, host) bytes one layer keeps per token for the backward pass.

  part: 'all', 'layer_input' (the saved layer inputs alone) or 'inner' (the
  other kept tensors: with remat groups, what the inner policy keeps while the
  group's backward runs, so one group's layers at a time; see `estimate`).
  With remat groups of k layers only one layer input in k is saved. The
  device bytes of the tagged tensors other than the layer input are
  multiplied by `device_scale` (COEFFICIENTS['saved_tensor_scale']: XLA keeps
  some of them twice, or in f32), those of the untagged 'residuals' (remat
  'none') by `residual_scale` (COEFFICIENTS['residual_scale']; None: as the
  tagged ones). The attention kernel's own residuals (ATTENTION_RESIDUALS: its
  output and lse, the custom VJP's) are kept once, as the kernel wrote them.
  sizes(name) -> bytes per token: a linear layer's tensors
  (lctx/sizing/linear_layers.py); None: an attention layer's."""
  host_sizes = sizes
  if sizes is None:
    sizes = lambda name: tensor_bytes_per_token(name, dims, setup)  # noqa: E731
    host_sizes = lambda name: tensor_bytes_per_token(name, dims, setup, lane_padded=False)  # noqa: E731
  scale = {"layer_input": 1.0, **dict.fromkeys(models_config.ATTENTION_RESIDUALS, 1.0)}
  scale["residuals"] = device_scale if residual_scale is None else residual_scale
  device = host = 0.0
  k = max(1, setup.remat_group_size)
  for name, where in remat_table(setup).items():
    if part != "all" and (name == "layer_input") != (part == "layer_input"):
      continue
    per = k if name == "layer_input" else 1
    b = sizes(name) / per
    if where == "offload":
      host += host_sizes(name) / per
    elif where == "device":
      device += b * scale.get(name, device_scale)
    else:
      raise ValueError(f"remat policy {setup.remat_policy!r}: {name} -> {where!r}")
  return device, host


# ----------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Breakdown:
  """Per-device bytes of one train step; host bytes per device.

  `total` is what the compiler's memory_analysis() totals: the state,
  gradients, saved activations and whole f32 embedding tables (`embeddings`:
  FSDP-gathered unembedding, embedding gradients before their reduce-scatter),
  a layer's backward (gathered weights, the layer's residual stream and
  cotangents, its MLP chunk's and its attention's buffers) and the loss (one
  chunk of logits). The two phases are added, not maxed: memory_analysis sums
  the temporary slots of the whole program, and the TPU compiles
  (scripts/fit_memory_model.py) keep the logits' slots apart from the layer's.
  `peak_phase` names the larger phase. `dq_partials`: the fused splash
  backward's dq partials, live while one attention call's backward runs: with
  the attention buffers, in place of the MLP chunk's (the layer's MLP backward
  is not running then), so the layer phase holds the larger of the two.
  """

  parameters: int
  optimizer_state: int
  batch: int
  gradients: int
  saved_activations: int
  gathered_weights: int
  layer_backward: int
  mlp_backward: int
  attention_buffers: int
  loss: int
  host: int
  embeddings: int = 0
  linear_buffers: int = 0
  dq_partials: int = 0

  STATE_FIELDS = (
    "parameters",
    "optimizer_state",
    "batch",
    "gradients",
    "saved_activations",
    "embeddings",
  )
  LAYER_FIELDS = ("gathered_weights", "layer_backward", "mlp_backward", "attention_buffers")
  # A hybrid's layer phase holds one layer's backward at a time: the attention
  # layer's buffers or the linear layer's (linear_buffers), the larger of the two.

  @property
  def layer_phase(self) -> int:
    """Gathered weights, the layer's residual stream, its MLP's and attention's
    buffers (or a linear layer's, where larger); the dq partials where they
    outgrow the MLP chunk's buffers."""
    base = self.gathered_weights + self.layer_backward
    attention = self.attention_buffers + max(self.mlp_backward, self.dq_partials)
    return base + max(attention, self.linear_buffers + self.mlp_backward)

  @property
  def peak_phase(self) -> str:
    return "layer backward" if self.layer_phase >= self.loss else "loss"

  @property
  def total(self) -> int:
    state = sum(getattr(self, f) for f in self.STATE_FIELDS)
    return state + self.layer_phase + self.loss

  @property
  def argument_bytes(self) -> int:
    """What the compiler calls arguments (the donated state and the batch)."""
    return self.parameters + self.optimizer_state + self.batch

  def as_dict(self) -> dict[str, Any]:
    out: dict[str, Any] = {
      f: getattr(self, f)
      for f in (
        *self.STATE_FIELDS,
        *self.LAYER_FIELDS,
        "dq_partials",
        "linear_buffers",
        "loss",
        "host",
      )
    }
    out["peak_phase"] = self.peak_phase
    out["total"] = self.total
    return out


# ----------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------
# What the code fixes (buffer shapes) is counted above and below; what XLA's
# schedule decides (how many such buffers it keeps) is a coefficient, fitted by
# scripts/fit_memory_model.py (bounded least squares on the relative error) to
# TPU compiles of small Llama-shaped models and of the flagship gin files, and
# written to lctx/parallel/memory_coefficients.json (attention's coefficients
# are read there by `auto` too). The fit's cases and its errors against the
# compiler are in docs/benchmarks.md. Coefficients the fit puts near 0 are
# buffers that share slots with larger ones.
COEFFICIENT_NAMES = (
  # Saved tensors other than the layer input (remat 'none', 'dots', presets):
  # device bytes per byte of the tagged tensors.
  "saved_tensor_scale",
  # The untagged residuals remat 'none' keeps (norm statistics, f32 RoPE
  # intermediates, ...): device bytes per byte counted in tensor_bytes_per_token.
  "residual_scale",
  # FSDP: copies of one layer's f32 weights live (gathered, bf16 cast, grads).
  "gathered_layer_copies",
  # Bytes per token per d_model element the layer in backward holds (residual
  # stream and its cotangent, norm outputs, projections' inputs and outputs).
  "layer_bytes_per_d",
  # Bytes per MLP-chunk token per hidden (F) element: gate, up, their product
  # and cotangents.
  "mlp_bytes_per_f",
  # ring / usp, per local token and lane-padded element: per q/out element
  # N(H+V) (the f32 output and dQ accumulators: 8 bytes) and per k/v element
  # K(H+V) (the visiting block and the next, dK/dV travelling in f32).
  "ring_bytes_per_q_elem",
  "ring_bytes_per_kv_elem",
  # usp on top of its ring, per (q + kv) element: both layouts of q/k/v/out
  # around the all-to-alls (the blockwise fit puts them at 0: they share
  # slots with the ring's buffers).
  "usp_a2a_bytes_per_elem",
  # ulysses, per local token per (q + kv) element: the all-to-all'd copies.
  "ulysses_bytes_per_elem",
  # all_gather: per whole-sequence token per k/v element (gathered bf16 K/V,
  # and part of their f32 gradient: XLA does not hold all of it at once).
  "all_gather_bytes_per_kv_elem",
  # f32 [G*bq, bk] score tiles live per kv-head group (the kernel's blocks).
  "kernel_block_copies",
  # Loss: bytes per logit of one chunk (f32 partial sums over D, bf16 grad).
  "loss_bytes_per_logit",
  # Per-device loss: bytes per element of the whole [D, vocab] unembedding
  # (its gathered bf16 copy, the f32 gradient accumulator).
  "loss_table_bytes_per_elem",
  # Remat groups: layer inputs the group's backward holds beyond a single
  # layer's, per extra layer in the group (the inner scan's carries).
  "group_input_copies",
  # ... and MLP [chunk, F] activations per extra layer.
  "group_mlp_copies",
  # Offloaded layer inputs, groups of 1: extra attention buffers live, per
  # attention_buffers (see estimate).
  "offload_attention_copies",
  # Whole f32 [vocab, D] tables live through the step (FSDP-gathered
  # unembedding, embedding gradients before their reduce-scatter).
  "embedding_copies",
  # The splash kernel (TPU Pallas; its [bq, bk] tiles stay in VMEM). Per
  # element as for blockwise; q-side elements are lane-padded (its softmax
  # statistics are f32 [heads, tokens, 128] arrays).
  "splash_ring_bytes_per_q_elem",
  "splash_ring_bytes_per_kv_elem",
  "splash_usp_a2a_bytes_per_elem",
  "splash_ulysses_bytes_per_elem",
  "splash_all_gather_bytes_per_kv_elem",
  # all_gather / ulysses: per local query token per lane-padded q element
  # (f32 dq and output, the statistics).
  "splash_q_bytes_per_elem",
)
COEFFICIENTS = fitted_coefficients()
if set(COEFFICIENTS) != set(COEFFICIENT_NAMES):
  raise ValueError(
    "lctx/parallel/memory_coefficients.json does not hold the memory model's coefficients: "
    f"missing {sorted(set(COEFFICIENT_NAMES) - set(COEFFICIENTS))}, "
    f"unknown {sorted(set(COEFFICIENTS) - set(COEFFICIENT_NAMES))}"
  )


def estimate(dims: ModelDims, setup: Setup, coefficients: Mapping[str, float] | None = None):
  """The per-device Breakdown of one train step of `dims` run as `setup`."""
  co = fitted_coefficients(coefficients)
  if setup.strategy not in STRATEGIES:
    raise ValueError(f"unknown strategy {setup.strategy!r}; known: {', '.join(STRATEGIES)}")
  if setup.kernel not in KERNELS:
    raise ValueError(f"unknown attention kernel {setup.kernel!r}; known: {', '.join(KERNELS)}")
  a, p = setup.dtype_bytes, setup.param_bytes
  tp = setup.axis("tensor")
  b = max(1, setup.batch_size // setup.batch_ways)  # rows per device
  t = math.ceil(setup.seq_len / setup.context_degree)  # tokens per device per row
  tokens = b * t

  # Parameters, optimizer state, gradients: sharded over embed x tensor.
  params = math.ceil(dims.num_params / (setup.param_shards * tp))

  # Saved activations across layers (device) and offloaded ones (host). The
  # layer inputs are saved for every layer (one in k with groups of k); the
  # other kept tensors too with groups of 1, but inside a remat group the inner
  # policy keeps them only while that group's backward runs (the group replays
  # its forward from its input): one group's layers at a time.
  k = max(1, setup.remat_group_size)
  inner_share = 1.0 if k == 1 else min(k, dims.num_layers) / dims.num_layers

  def saved(layers: int, sizes=None) -> tuple[float, float]:
    parts = [
      remat_saved_bytes_per_token(
        dims, setup, co["saved_tensor_scale"], co["residual_scale"], sizes=sizes, part=part
      )
      for part in ("layer_input", "inner")
    ]
    (in_dev, in_host), (rest_dev, rest_host) = parts
    held = layers * inner_share
    return layers * in_dev + held * rest_dev, layers * in_host + held * rest_host

  saved_dev, saved_host = saved(dims.attention_layers)
  linear_buffers = 0.0
  if dims.linear_layers:
    from lctx.sizing import linear_layers as ll  # pylint: disable=g-import-not-at-top

    lin_dev, lin_host = saved(
      dims.linear_layers, sizes=lambda name: ll.tensor_bytes_per_token(name, dims.linear, tp, a)
    )
    saved_dev += lin_dev
    saved_host += lin_host
    linear_buffers = ll.linear_buffer_bytes(dims.linear, setup, rows=b, tokens=tokens)

  # A remat group of k layers recomputes its forward from its one saved input:
  # the inner scan keeps the k layer inputs (the carries) while the group runs
  # backward, k - 1 more than a single remat'd layer, and the compiles keep
  # more MLP [chunk, F] buffers live per extra layer (transformer.py
  # _grouped_layers; fitted to groups of 1, 2, 4 on v5p ring / TPU7x usp).
  extra_layers = max(1, setup.remat_group_size) - 1
  layer_input = tokens * tensor_bytes_per_token("layer_input", dims, setup)
  mlp_rows = b * min(t, setup.mlp_chunk_size or t)
  group_extra = extra_layers * (
    co["group_input_copies"] * layer_input
    + co["group_mlp_copies"] * mlp_rows * tensor_bytes_per_token("mlp_hidden", dims, setup)
  )

  # FSDP gathers one layer's weights at a time, and the embedding tables whole.
  gathered = embeddings = 0.0
  if setup.param_shards > 1:
    gathered = co["gathered_layer_copies"] * dims.layer_params / tp * p
    embeddings = co["embedding_copies"] * dims.vocab_size / tp * dims.d_model * F32

  # The layer in its backward pass: the residual stream and its cotangent for
  # every token; then either the MLP (over one chunk) or attention.
  # Per-element coefficients are for bf16 activations; f32 ones scale them.
  act = a / 2
  layer = act * tokens * co["layer_bytes_per_d"] * dims.d_model
  mlp = act * b * min(t, setup.mlp_chunk_size or t) * co["mlp_bytes_per_f"] * dims.mlp_dim / tp
  attention = dq_partials = 0.0
  if dims.attention_layers:
    attention = attention_buffer_bytes(dims, setup, rows=b, coefficients=co)
    dq_partials = dq_partials_bytes(dims, setup, rows=b)
  # Offloaded layer inputs with per-layer remat (groups of 1): the compiles
  # keep more of the attention's buffers live at once (the schedule around the
  # host transfers: the ring's f32 accumulators appear in more slots of the
  # v5p compile than with remat 'full'); fitted as a multiple of them.
  # Groups move their one input per group and show no such growth.
  if setup.remat_group_size == 1 and remat_table(setup).get("layer_input") == "offload":
    attention *= 1.0 + co["offload_attention_copies"]

  loss = loss_bytes(dims, setup, tokens, co)

  # State offload (TrainConfig.offload_*): between steps on the host; the step
  # streams it in (not counted on the device).
  state_host = (params * p if setup.offload_params else 0) + (
    2 * params * p if setup.offload_optimizer_state else 0
  )
  return Breakdown(
    parameters=0 if setup.offload_params else int(params * p),
    optimizer_state=0 if setup.offload_optimizer_state else int(2 * params * p),
    batch=int(BATCH_ARRAYS * tokens * INT32),
    gradients=int(params * p),
    saved_activations=int(tokens * saved_dev),
    gathered_weights=int(gathered),
    layer_backward=int(layer + group_extra),
    mlp_backward=int(mlp),
    attention_buffers=int(attention),
    dq_partials=int(dq_partials),
    loss=int(loss),
    host=int(tokens * saved_host + state_host),
    embeddings=int(embeddings),
    linear_buffers=int(linear_buffers),
  )


def per_device_loss(setup: Setup) -> bool:
  """Whether the step computes the loss over each device's own tokens
  (lctx/trainer.py `_cross_entropy`: a shard_map over the batch and sequence
  axes in use, unless the tensor axis shards the vocabulary)."""
  sharded = setup.batch_ways * setup.context_degree > 1
  return sharded and setup.axis("tensor") == 1


def loss_bytes(dims: ModelDims, setup: Setup, tokens: int, co: Mapping[str, float]) -> float:
  """The chunked cross-entropy's bytes per device (lctx/kernels/chunked.py).

  Per-device loss (per_device_loss): each device scans its own `tokens` in
  chunks of loss_chunk_size (TrainConfig: tokens per chunk per device), with
  the whole unembedding: a bf16 copy of the gathered [D, vocab] table and the
  f32 accumulator of its gradient (`loss_table_bytes_per_elem` per element),
  one chunk's logits and their gradient (`loss_bytes_per_logit`), and the
  cotangent of the local hidden states: the chunk scan's stacked output, one
  [tokens, D] in the compute dtype (f32 until the final norm moved into the
  loss chunks: the norm's f32 cotangent was the long_v5p compile's largest
  buffer).
  Plain SPMD (tensor axis in use, or one device): chunks of the flattened
  global tokens, each device a whole chunk's logits (vocab / tensor wide) and
  its f32 unembedding shard.
  """
  e = dims.vocab_size / setup.axis("tensor")
  chunk = setup.loss_chunk_size
  if per_device_loss(setup):
    rows = tokens if chunk is None else min(chunk, tokens)
    table = dims.d_model * dims.vocab_size * co["loss_table_bytes_per_elem"]
    return rows * e * co["loss_bytes_per_logit"] + table + tokens * dims.d_model * setup.dtype_bytes
  rows = tokens if chunk is None or chunk >= setup.batch_size * setup.seq_len else chunk
  return rows * e * co["loss_bytes_per_logit"] + e * dims.d_model / setup.param_shards * F32


def fits(breakdown: Breakdown, hbm_bytes_per_device: int) -> bool:
  return breakdown.total <= hbm_bytes_per_device

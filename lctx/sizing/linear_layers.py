"""What linear-attention layers (Gated DeltaNet, KDA) cost the planner: their
saved tensors, their backward's buffers, their FLOPs and their state exchange.

`--mode=plan` (lctx/sizing/memory_model.py, step_estimate.py) prices the layers of
a hybrid by type: full / sliding attention layers by the attention arithmetic,
linear layers by this module's. The counts are shapes (no fitted coefficient:
the compile checks, tests/test_sizing_linear.py, say how far they are):

- saved tensors per token (the remat tags a linear layer places,
  lctx/models/linear_attention.py): query_proj / key_proj are the L2-normed q and
  k with their own Q heads (the delta rule repeats them per chunk), Q K each;
  value_proj and attention_out N V; out_proj D; no attention_lse; 'residuals'
  (kept by remat 'none' only): the projections before the conv (2 Q K + N V), z
  (N V), the conv outputs of q and k (the L2 norm's input), the norms' f32 input
  and the SwiGLU's, as for attention;
- the layer's backward (`linear_buffer_bytes`): the delta rule's inputs and their
  cotangents per token in the compute dtype, g and beta and theirs in f32, the chunk scan's kept chunk states (T / C
  of [N, K, V] f32 in one level, about 2 sqrt(T / C) in two, and as many
  [N, K, V] and [N, K, K] ones for
  the context-parallel summary pass), the state prefix's maps (O(log devices):
  lctx/parallel/linear_context.py);
- FLOPs: the chunked delta rule's forward (models.config.linear_mixer_flops),
  its backward (2 x), the remat levels inside the kernel (+1 forward per level:
  two from lctx.kernels.delta_rule.TWO_LEVEL_MIN_CHUNKS chunks a piece), and
  under context parallelism the summary pass (one final-state scan per piece,
  `summary_flops_per_token`) with the same factors;
- bytes: `state_exchange_bytes` per pass (forward, each recompute) and twice that
  in the backward (the prefix's ppermutes transpose to ppermutes; the conv halos'
  gather to an all-reduce).

Shapes legend: T tokens per device, N value heads per tensor shard, Q q/k heads,
K / V key / value head dims, C chunk, D d_model.
"""

from __future__ import annotations

import math

from lctx.kernels.delta_rule import TWO_LEVEL_MIN_CHUNKS, scan_group
from lctx.models import config as models_config
from lctx.parallel.linear_context import state_exchange_bytes

F32 = 4


def linear_layers(model) -> int:
  return sum(t == "linear_attention" for t in getattr(model, "layer_types", ()) or ())


def _scan_levels(chunks: float) -> int:
  """Levels of the delta rule's chunk scan (lctx.kernels.delta_rule: one below
  TWO_LEVEL_MIN_CHUNKS chunks, or where no group divides them; else two)."""
  if chunks < TWO_LEVEL_MIN_CHUNKS or chunks != int(chunks):
    return 1
  return 2 if scan_group(int(chunks)) > 1 else 1


def _scan_states(chunks: float) -> float:
  """States the chunk scan keeps in its backward: one per chunk in one level;
  groups + one group's chunks in two."""
  if _scan_levels(chunks) == 1:
    return max(1.0, chunks)
  return 2.0 * math.sqrt(chunks)


def _chunks_per_piece(setup) -> float:
  """Chunks of one row's piece of the sequence on one device."""
  pieces = 2 if setup.strategy in ("ring", "usp") and setup.axis("context") > 1 else 1
  return setup.seq_len / max(1, setup.context_degree) / pieces / models_config.LINEAR_CHUNK


def summary_flops_per_token(model, chunk: int = models_config.LINEAR_CHUNK) -> float:
  """Forward FLOPs per token of the context-parallel summary pass
  (lctx.kernels.delta_rule.delta_rule_summary: one scan, no output reads, over a
  state of V + K columns whose K extra columns read v = 0): per chunk and head
  k k^T, the in-chunk solve with [beta V | beta Gamma K] (V + K columns) and the
  two state products (models.config.delta_rule_flops_per_token less q's terms)."""
  n, k, v = model.linear_num_value_heads, model.linear_key_head_dim, model.linear_value_head_dim
  c = chunk
  per_chunk = 2 * c * c * k + models_config.unit_lower_solve_flops(c, v + k)
  per_chunk += 2 * 2 * c * k * (v + k)
  return n * per_chunk / c


def _seq_chunk(model) -> int | None:
  """ModelConfig.linear_chunk_size (None: the layer runs whole)."""
  return getattr(model, "linear_chunk_size", None) or None


def tensor_bytes_per_token(name: str, model, tp: int, a: int) -> float:
  """Bytes per token of one linear layer's tensor `name` (a remat tag or 'residuals').
  Over sequence chunks (linear_chunk_size) the mixer keeps none of its inner tensors
  (the chunk bodies are rematerialised): its inner tags and its share of the
  residuals are 0."""
  d, q_heads = model.d_model, model.linear_num_key_heads
  n = model.linear_num_value_heads / tp if model.linear_num_value_heads % tp == 0 else None
  n = n or model.linear_num_value_heads
  qh = q_heads / tp if q_heads % tp == 0 else q_heads
  k, v, f = model.linear_key_head_dim, model.linear_value_head_dim, model.mlp_dim / tp
  sizes = {
    "layer_input": d * a,
    "query_proj": qh * k * a,
    "key_proj": qh * k * a,
    "value_proj": n * v * a,
    "attention_out": n * v * a,
    "attention_lse": 0.0,
    "out_proj": d * a,
    "mlp_gate": f * a,
    "mlp_up": f * a,
    "mlp_hidden": f * a,
    "mlp_out": d * a,
    "residuals": 2 * d * (F32 + a)
    + (2 * q_heads * k + n * v) * a
    + n * v * a
    + 2 * qh * k * a
    + d * a
    + f * a,
  }
  if _seq_chunk(model):
    for inner in ("query_proj", "key_proj", "value_proj", "attention_out"):
      sizes[inner] = 0.0
    sizes["residuals"] = 2 * d * (F32 + a) + d * a + f * a
  return sizes[name]


def linear_buffer_bytes(model, setup, rows: int, tokens: int) -> float:
  """Per-device bytes one linear layer holds while it runs backward."""
  tp = setup.axis("tensor")
  n, qh = model.linear_num_value_heads, model.linear_num_key_heads
  n, qh = (n / tp, qh / tp) if n % tp == 0 and qh % tp == 0 else (n, qh)
  k, v = model.linear_key_head_dim, model.linear_value_head_dim
  a = setup.dtype_bytes
  ways = setup.context_degree
  pieces = 2 if setup.strategy in ("ring", "usp") and setup.axis("context") > 1 else 1
  # q, k (Q heads), v and their cotangents in the compute dtype; g, beta in f32.
  per_token = (2 * qh * k + n * v) * 2 * a + 2 * n * 2 * F32
  summary = n * k * (k + v) * F32
  piece = tokens / rows / pieces
  seq_chunk = _seq_chunk(model)
  if seq_chunk and seq_chunk < piece:
    # Over sequence chunks (linear_context.chunked_layer): one chunk's working set,
    # one carried state per chunk (and summary, under context parallelism), and
    # the stacked outputs and x's cotangent of each pass over the whole sequence.
    chunks = seq_chunk / models_config.LINEAR_CHUNK
    out = rows * seq_chunk * per_token + rows * _scan_states(chunks) * n * k * v * F32
    out += tokens / seq_chunk * n * k * v * F32
    out += tokens * model.d_model * a * (3 if ways > 1 else 2)
    if ways > 1:
      out += rows * _scan_states(chunks) * summary + tokens / seq_chunk * summary
  else:
    chunks = piece / models_config.LINEAR_CHUNK
    out = tokens * per_token + rows * pieces * _scan_states(chunks) * n * k * v * F32
    if ways > 1:
      out += rows * pieces * _scan_states(chunks) * summary  # the summary pass's chunk states
  if ways > 1:
    # The state prefix (linear_context._incoming_states): each of its log2(pieces)
    # rounds keeps the local maps and the ones it received for the backward.
    rounds = math.ceil(math.log2(ways * pieces))
    out += 2 * rows * pieces * rounds * summary
    out += rows * pieces * n * k * v * F32  # the incoming states
  return out


def flops_per_token(model, setup, kept: set[str]) -> dict[str, float]:
  """{'extra', 'recompute'} forward-equivalent FLOPs per token of all linear
  layers beyond the model's 3 x forward: the kernel's own remat levels and the
  context-parallel summary pass (extra), the forward the layer's remat redoes
  (recompute: projections whose tags are not kept, and the delta rule unless
  attention_out is kept)."""
  layers = linear_layers(model)
  if not layers:
    return {"extra": 0.0, "recompute": 0.0}
  mixer = models_config.linear_mixer_flops(model)
  d, hq, hv = model.d_model, model.linear_num_key_heads, model.linear_num_value_heads
  k, v = model.linear_key_head_dim, model.linear_value_head_dim
  chunks = _chunks_per_piece(setup)
  seq_chunk = _seq_chunk(model)
  if seq_chunk:
    chunks = min(chunks, seq_chunk / models_config.LINEAR_CHUNK)
  levels = _scan_levels(chunks)
  extra = levels * mixer  # the chunk body's (and the group's) rematerialised forwards
  if setup.context_degree > 1:
    extra += (3 + levels) * summary_flops_per_token(model)  # forward, remat levels, backward
  if seq_chunk:
    # The sequence chunks' bodies run their forward again in the backward: every
    # projection and the mixer; under context parallelism the summary pass also
    # projects k, v, a and b (forward, that recompute and the backward's two).
    extra += 2 * d * (2 * hq * k + 2 * hv * v + 2 * hv) + 2 * hv * v * d + mixer
    if setup.context_degree > 1:
      extra += 4 * 2 * d * (hq * k + hv * v + 2 * hv)
  recompute = 0.0
  if seq_chunk:  # the mixer's inner tags are not placed over sequence chunks
    kept = set(kept) - {"query_proj", "key_proj", "value_proj", "attention_out"}
  if setup.remat_policy != "none":
    proj = {"query_proj": 2 * d * hq * k, "key_proj": 2 * d * hq * k, "value_proj": 2 * d * hv * v}
    proj["out_proj"] = 2 * hv * v * d
    for name, flops in proj.items():
      recompute += 0 if name in kept else flops
    recompute += 2 * d * hv * v + 4 * d * hv  # z, a, b: untagged, always recomputed
    for name in ("mlp_gate", "mlp_up", "mlp_out"):
      recompute += 0 if name in kept else 2 * d * model.mlp_dim
    if "attention_out" not in kept:
      recompute += mixer
      if setup.context_degree > 1:
        recompute += summary_flops_per_token(model)
        if seq_chunk:  # the summary pass projects k, v, a and b again
          recompute += 2 * d * (hq * k + hv * v + 2 * hv)
  return {"extra": layers * extra, "recompute": layers * recompute}


def exchange_bytes(model, setup, passes_fwd: int) -> float:
  """ICI bytes one device sends per step for all linear layers' state exchange
  and conv halos: each forward pass once, the backward twice."""
  layers = linear_layers(model)
  ways = setup.context_degree
  if not layers or ways <= 1:
    return 0.0
  tp = setup.axis("tensor")
  rows = max(1, setup.batch_size // setup.batch_ways)
  n = model.linear_num_value_heads
  n = n // tp if n % tp == 0 else n
  lb = setup.strategy in ("ring", "usp") and setup.axis("context") > 1
  k, v, hq = model.linear_key_head_dim, model.linear_value_head_dim, model.linear_num_key_heads
  w = model.linear_conv_kernel_dim
  ring = setup.axis("context") if lb else ways
  per = state_exchange_bytes(
    batch=rows, heads=n, key_dim=k, value_dim=v, ways=ways, load_balance=lb, ring=ring
  )["total"]
  for channels in (hq * k, hq * k, model.linear_num_value_heads * v):  # the three convs
    per += state_exchange_bytes(
      batch=rows,
      heads=0,
      key_dim=0,
      value_dim=0,
      ways=ways,
      load_balance=lb,
      conv_channels=channels,
      conv_width=w,
      ring=ring,
    )["halo_bytes"]
  return layers * per * (passes_fwd + 2)

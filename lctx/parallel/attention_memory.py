"""Per-device bytes of one attention layer's buffers, by strategy and kernel.

One definition for both users: strategy `auto` (lctx/parallel/auto.py) sizes its
candidates with it, and the whole-step memory model (lctx/sizing/memory_model.py)
adds it to the rest of the step. The per-element coefficients are fitted to TPU
compiles by scripts/fit_memory_model.py, which writes them, with the memory
model's other coefficients, to memory_coefficients.json beside this file.

`dims` is anything with num_heads, num_kv_heads, head_dim and v_head_dim
(AttentionDims, or the memory model's ModelDims); `setup` anything with strategy,
seq_len, kernel, dtype_bytes, block_q, block_kv, head_chunks and axis(name)
(AttentionSetup, or the memory model's Setup).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Mapping

from lctx.parallel.options import ContextOptions
from lctx.parallel.validation import PLAN_STRATEGIES

# The memory model counts 'none' (no context parallelism) like all_gather.
STRATEGIES = PLAN_STRATEGIES
KERNELS = ("blockwise", "splash")
F32 = 4
COEFFICIENTS_FILE = os.path.join(
  os.path.dirname(os.path.abspath(__file__)), "memory_coefficients.json"
)


@functools.cache
def _load_coefficients() -> dict[str, float]:
  with open(COEFFICIENTS_FILE) as f:
    return {k: float(v) for k, v in json.load(f).items()}


def fitted_coefficients(overrides: Mapping[str, float] | None = None) -> dict[str, float]:
  """The fitted coefficients (memory_coefficients.json), with `overrides` on top."""
  return {**_load_coefficients(), **(overrides or {})}


@dataclasses.dataclass(frozen=True)
class AttentionDims:
  """Attention heads as the kernels see them: the one head-dimensions type of
  lctx.parallel (the strategy decision, the plan and the attention buffers).

  Attributes:
    num_heads: N, the q heads.
    num_kv_heads: K (MLA: N; its K/V are per head).
    head_dim: H, the q/k head dim (MLA: nope + rope).
    v_head_dim: V (equal to H except for MLA).
    bytes_per_element: activation bytes (2 for bf16, 4 for f32).
    activation_bytes_per_token: bytes per local token saved across a layer
      besides attention (residual stream + MLP hidden), for `auto`'s estimate.
  """

  num_heads: int
  num_kv_heads: int
  head_dim: int
  v_head_dim: int
  bytes_per_element: int = 2
  activation_bytes_per_token: int = 0

  @classmethod
  def of_model(cls, model) -> AttentionDims:
    """The dims of a lctx.models.ModelConfig (read by attribute: parallel does
    not import models)."""
    n, k, h, v = model.attention_head_dims
    act_bytes = 2 if model.dtype == "bfloat16" else 4
    return cls(
      num_heads=n,
      num_kv_heads=k,
      head_dim=h,
      v_head_dim=v,
      bytes_per_element=act_bytes,
      # Residual stream + MLP hidden per token, saved across one layer.
      activation_bytes_per_token=act_bytes * (2 * model.d_model + model.mlp_dim),
    )


@dataclasses.dataclass(frozen=True)
class AttentionSetup:
  """What the attention buffers depend on besides the heads (see memory_model.Setup)."""

  strategy: str
  mesh: Mapping[str, int]
  seq_len: int
  dtype_bytes: int = 2
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


def resolve_kernel(backend: str, platform: str) -> str:
  """The kernel (KERNELS) the memory model counts for AttentionOptions.backend
  on a platform ('tpu', 'gpu', 'cpu'), as lctx/kernels/flash.py resolves 'auto':
  splash on TPU, blockwise elsewhere. The kernels without a model of their own
  (cudnn, xla, cpu, reference) are counted as blockwise: an approximation."""
  if backend == "splash" or (backend == "auto" and platform == "tpu"):
    return "splash"
  return "blockwise"


def lanes(width: int) -> int:
  """Width of a minor dimension in TPU memory: tiles are 128 lanes wide, so a
  head dim of 32 takes the room of 128 (XLA's layout for [..., H] arrays)."""
  return -(-int(width) // 128) * 128


def attention_buffer_bytes(
  dims: AttentionDims,
  setup: AttentionSetup,
  rows: int = 1,
  coefficients: Mapping[str, float] | None = None,
) -> float:
  """Per-device bytes attention holds while one layer runs backward, by strategy."""
  co = fitted_coefficients(coefficients)
  tp = setup.axis("tensor")
  c, u = setup.axis("context"), setup.axis("context_ulysses")
  n = dims.num_heads / tp
  k = dims.num_kv_heads / tp if dims.num_kv_heads % tp == 0 else dims.num_kv_heads
  hv_lanes = lanes(dims.head_dim) + lanes(dims.v_head_dim)  # [..., H] arrays, lane-padded
  seq = setup.seq_len
  t = seq / (c * u)  # local tokens
  qf, kf = head_chunk_fractions(dims, setup)
  n, k = n * qf, k * kf  # one UPipe stage's heads live at a time
  if setup.kernel == "splash":
    # The fused backward's dq partials are counted apart (dq_partials_bytes).
    return rows * _splash_bytes(dims, setup, co, n, k, t) * setup.dtype_bytes / 2
  if setup.strategy in ("none", "all_gather"):
    # The whole sequence's K/V, and the local queries' q/out/dout/dq.
    # The blockwise kernel's gathered K/V blocks are laid out unpadded (the
    # head-dim 32 compiles fit the unpadded count far better).
    per = seq * k * (dims.head_dim + dims.v_head_dim) * co["all_gather_bytes_per_kv_elem"]
    per += t * n * hv_lanes * co["ulysses_bytes_per_elem"]
    heads_in_kernel = n
  elif setup.strategy == "ulysses":
    # After the all-to-all: N/P heads of the whole sequence, the same bytes
    # as the local shard of all heads.
    per = t * (n + k) * hv_lanes * co["ulysses_bytes_per_elem"]
    heads_in_kernel = n / c
  else:
    # ring / usp (after usp's all-to-all, a ring group's chunk of N/u heads:
    # again the same bytes as the local shard).
    per = t * hv_lanes * (n * co["ring_bytes_per_q_elem"] + k * co["ring_bytes_per_kv_elem"])
    if setup.strategy == "usp":
      per += t * (n + k) * hv_lanes * co["usp_a2a_bytes_per_elem"]
    heads_in_kernel = n / u
  blocks = co["kernel_block_copies"] * heads_in_kernel * setup.block_q * setup.block_kv * F32
  return rows * per * setup.dtype_bytes / 2 + blocks


def head_chunk_fractions(dims: AttentionDims, setup: AttentionSetup) -> tuple[float, float]:
  """(q, kv) fractions of the heads whose attention buffers one UPipe stage holds
  (ContextOptions.head_chunks, lctx/parallel/upipe.py): the stages run in
  a scan, so buffers are one stage's; K/V go once per GQA group of stages; under
  ring (stage_projections) the same with a degree of 1. (1, 1) without head
  chunks or for other strategies. A shape count, not fitted
  to compiles: the stage bookkeeping (slices, the output buffer) is not counted."""
  stages = setup.head_chunks or 1
  if stages <= 1 or setup.strategy not in ("ulysses", "usp", "ring"):
    return 1.0, 1.0
  # ring: the stages of ContextOptions.stage_projections, without an all-to-all.
  degree = {"usp": "context_ulysses", "ulysses": "context"}.get(setup.strategy)
  degree = setup.axis(degree) if degree else 1
  tp = setup.axis("tensor")
  q_dev = dims.num_heads / (tp * degree)  # q heads per device after the all-to-all
  kv_dev = max(dims.num_kv_heads / (tp * degree), 1.0)
  u, g = q_dev / stages, dims.num_heads / dims.num_kv_heads
  w = u / g if u >= g else 1.0  # kv heads per stage
  return 1.0 / stages, min(1.0, w / kv_dev)


def dq_partials_bytes(dims: AttentionDims, setup, rows: int = 1) -> float:
  """Per-device bytes of the dq partials one fused splash backward call writes
  (AttentionOptions.fused_bwd): [kv blocks, *q piece] in q's dtype, the kv
  blocks of the backward's kv block (block_kv_bwd), the call cut into pieces
  as the kernel cuts it (lctx/kernels/splash_tiling.py `bwd_tiles`: SMEM block
  maps, then at most dq_partial_bytes). Live while that call runs: one
  attention call's backward at a time. A shape count, not fitted: one call's
  q and kv per strategy (ring / usp: per hop and sub-chunk at the default
  sub-chunking, kv in the zigzag order's natural runs, the default load
  balance for both); the head dim lane-padded in HBM. 0 with the two-pass
  form or the blockwise kernel."""
  if setup.kernel != "splash" or not getattr(setup, "fused_bwd", True):
    return 0.0
  from lctx.kernels import splash_tiling as st  # pylint: disable=g-import-not-at-top
  from lctx.kernels.token_order import TokenOrder  # pylint: disable=g-import-not-at-top
  from lctx.parallel.block_ops import ring_sub_chunks  # pylint: disable=g-import-not-at-top

  tp = setup.axis("tensor")
  c, u, seq = setup.axis("context"), setup.axis("context_ulysses"), setup.seq_len
  qf, _ = head_chunk_fractions(dims, setup)
  heads = dims.num_heads / tp * qf
  if setup.strategy in ("none", "all_gather"):
    q_len, kv_len = seq // (c * u), seq
  elif setup.strategy == "ulysses":
    q_len, kv_len, heads = seq, seq, heads / c  # the whole sequence on N / c heads
  else:  # ring / usp (a ring group's chunk of N / u heads): per hop, in sub-chunks
    local = seq // c
    if setup.strategy == "usp":
      heads /= u
    pieces = ring_sub_chunks(ContextOptions(), local)
    q_len = kv_len = local // pieces
    kv_len = min(kv_len, seq // (2 * c))  # splash_tiling.kv_run: zigzag's natural runs
  block_q, block_kv = setup.block_q, setup.block_kv
  cfg = st.SplashCall(
    causal=True,
    window=None,
    scale=1.0,
    block_q=block_q,
    block_kv=block_kv,
    block_q_bwd=getattr(setup, "block_q_bwd", None) or block_q,
    block_kv_bwd=getattr(setup, "block_kv_bwd", None) or block_kv,
    order=TokenOrder(max(int(q_len), int(kv_len))),
    interpret=False,
    fused_bwd=True,
    dq_partial_bytes=int(getattr(setup, "dq_partial_bytes", 1 << 30)),
  )
  # The kernel cuts on its own q row (unpadded head dim, whole heads); HBM
  # holds the head dim lane-padded.
  kernel_row = rows * max(1, round(heads)) * dims.head_dim * setup.dtype_bytes
  tq, ts = st.bwd_tiles(cfg, int(q_len), int(kv_len), kernel_row)
  return float(
    st.dq_partials_bytes(cfg, tq, ts, rows * heads * lanes(dims.head_dim) * setup.dtype_bytes)
  )


def _splash_bytes(
  dims: AttentionDims, setup: AttentionSetup, co, n: float, k: float, t: float
) -> float:
  """Attention's per-row bytes with the splash kernel (no HBM score tiles)."""
  hv_lanes = lanes(dims.head_dim) + lanes(dims.v_head_dim)
  if setup.strategy in ("none", "all_gather"):
    per = setup.seq_len * k * hv_lanes * co["splash_all_gather_bytes_per_kv_elem"]
    return per + t * n * hv_lanes * co["splash_q_bytes_per_elem"]
  if setup.strategy == "ulysses":
    per = t * (n + k) * hv_lanes * co["splash_ulysses_bytes_per_elem"]
    return per + t * n * hv_lanes * co["splash_q_bytes_per_elem"]
  per = (
    t
    * hv_lanes
    * (n * co["splash_ring_bytes_per_q_elem"] + k * co["splash_ring_bytes_per_kv_elem"])
  )
  if setup.strategy == "usp":
    per += t * (n + k) * hv_lanes * co["splash_usp_a2a_bytes_per_elem"]
  return per

"""TrainConfig: the loop, optimizer and parallelism settings, and their checks.

lctx/configs.py registers it with gin under the name `TrainConfig`; every gin
file binds `TrainConfig.<field>`. lctx.trainer re-exports it.
"""

from __future__ import annotations

import dataclasses

from lctx import metrics, parallel
from lctx.kernels.options import AttentionOptions


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Loop, optimizer and parallelism settings.

  Attributes:
    batch_size: global rows per step (all hosts together).
    seq_len: tokens per row. Tokens per step = batch_size x seq_len.
    steps: total optimizer steps.
    learning_rate: peak learning rate after warm-up.
    warmup_steps: linear warm-up steps from 0.
    end_lr_ratio: cosine decay ends at learning_rate x end_lr_ratio.
    weight_decay: AdamW decoupled weight decay (not applied to norm scales).
    b1, b2, eps: AdamW moments.
    grad_clip: global-norm clipping threshold (0 disables).
    z_loss: weight of the log(Z)^2 auxiliary loss (0 disables).
    loss_chunk_size: tokens per chunk of the chunked cross-entropy, over each
      device's own tokens (rows x sequence shard); None computes the logits of
      all of them at once.
    seed: parameter-init and data seed.
    log_every: steps between logged metrics.
    eval_every: steps between held-out evaluations (0: only at the end of
      train_and_eval).
    eval_batches: held-out batches per evaluation.
    retrieval_eval_every: steps between retrieval eval grids (0: never during
      training; `--mode=eval` still runs them when an EvalConfig is bound).
    checkpoint_every: steps between checkpoints (0: only at the end).
    keep_checkpoints: how many recent checkpoints to keep.
    async_checkpoint: write checkpoints in the background.
    context_parallel_strategy: 'all_gather' | 'ulysses' | 'ring' | 'usp' |
      'auto' | 'none' (no context parallelism: attention on one device).
    load_balance: zigzag reorder for causal load balance; None picks the
      strategy's default (on for ring and usp).
    attention_backend: kernel backend, 'auto' | 'blockwise' | 'cpu' |
      'reference' | 'splash' | 'cudnn' | 'xla' (lctx.kernels.flash_attention).
    attention_block_q, attention_block_kv: kernel block sizes.
    attention_block_q_bwd, attention_block_kv_bwd: the backward pass's (None:
      the same); it holds about twice the forward's temporaries per block.
    attention_fused_bwd: splash's fused dq+dkv backward (AttentionOptions.fused_bwd);
      False: its two-pass dkv then dq kernels.
    device_memory_gib: per-device memory budget used by strategy 'auto'.
    max_skipped_steps: a step whose loss or gradient norm is not finite leaves
      the parameters and optimizer state unchanged and is counted
      (`skipped_steps` in metrics.jsonl); this many such steps in a row stop
      the run with an error (the last checkpoint is kept as it is).
    profile_steps: (start, stop): a jax.profiler trace of steps start+1 ..
      stop under <workdir>/profile (TensorBoard's profile tab); None: no trace.
    cpu_keep_freed_memory: on the CPU backend, make glibc malloc reuse freed
      memory rather than unmap it and page-fault it in again every step
      (lctx/host.py). The process keeps its peak footprint.
    ulysses_head_chunks: ulysses/usp: run each layer's attention in this many
      head stages (UPipe: the all-to-all, kernel and inverse all-to-all of one
      head group at a time, buffers reused; lctx/parallel/upipe.py). None: all
      heads at once.
    ulysses_stage_projections: with ulysses_head_chunks, each stage also
      projects its own q/k/v heads and its share of the output projection
      (lctx/models/attention.py), so the layer's whole q, attention output and
      their gradients are never held; K/V are re-projected and re-exchanged
      for every q stage. False: the stages slice the layer's projected q/k/v
      and exchange K/V once per GQA group.
    offload_optimizer_state, offload_params: keep the optimizer state / the
      parameters in pinned host memory between steps; the step moves them to
      the device where it uses them (params for the forward and backward, the
      optimizer state for the update) and the updated values back to host.
    cpu_vector_width: on the CPU backend, the vector width in bits XLA
      prefers for the elementwise code it generates (XLA's default is 256;
      512 uses AVX-512 where the CPU has it, which speeds up the attention
      softmax's exp; docs/benchmarks.md has the measurement). None keeps XLA's default.
    init_params_from: a fresh workdir starts at step 0 (fresh optimizer state,
      this config's own LR schedule and data) from these parameters: a Hugging
      Face directory (config.json + safetensors; the model's shape fields then
      come from its config.json) or an lctx checkpoint (a workdir or its
      checkpoints directory: the latest step; or a step directory), params only
      (lctx/init_from.py). A workdir that has checkpoints resumes from them and
      ignores this. None: random initialisation from `seed`.
  """

  batch_size: int = 8
  seq_len: int = 512
  steps: int = 100
  learning_rate: float = 3e-3
  warmup_steps: int = 10
  end_lr_ratio: float = 0.1
  weight_decay: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  grad_clip: float = 1.0
  z_loss: float = 0.0
  loss_chunk_size: int | None = None
  seed: int = 0
  log_every: int = 10
  eval_every: int = 0
  eval_batches: int = 2
  retrieval_eval_every: int = 0
  checkpoint_every: int = 0
  keep_checkpoints: int = 3
  async_checkpoint: bool = True
  context_parallel_strategy: str = "auto"
  load_balance: bool | None = None
  attention_backend: str = "auto"
  attention_block_q: int = 512
  attention_block_kv: int = 512
  attention_block_q_bwd: int | None = None
  attention_block_kv_bwd: int | None = None
  attention_fused_bwd: bool = True
  device_memory_gib: float = 16.0
  max_skipped_steps: int = 5
  profile_steps: tuple[int, int] | None = None
  cpu_keep_freed_memory: bool = True
  cpu_vector_width: int | None = 512
  offload_optimizer_state: bool = False
  offload_params: bool = False
  ulysses_head_chunks: int | None = None
  ulysses_stage_projections: bool = False
  init_params_from: str | None = None

  def __post_init__(self):
    validate_train_config(self)

  def kernel_options(self) -> AttentionOptions:
    """The attention_* settings as the one attention-options object (it checks them)."""
    return AttentionOptions(
      backend=self.attention_backend,
      block_q=self.attention_block_q,
      block_kv=self.attention_block_kv,
      block_q_bwd=self.attention_block_q_bwd,
      block_kv_bwd=self.attention_block_kv_bwd,
      fused_bwd=self.attention_fused_bwd,
    )


def validate_train_config(c: TrainConfig) -> None:
  """Raises one ValueError naming the field and the value."""
  for name in (
    "batch_size",
    "seq_len",
    "steps",
    "log_every",
    "eval_batches",
    "keep_checkpoints",
    "max_skipped_steps",
  ):
    value = getattr(c, name)
    if not isinstance(value, int) or value < 1:
      raise ValueError(f"TrainConfig.{name} must be a positive int; got {value!r}.")
  for name in ("warmup_steps", "eval_every", "retrieval_eval_every", "checkpoint_every"):
    value = getattr(c, name)
    if not isinstance(value, int) or value < 0:
      raise ValueError(f"TrainConfig.{name} must be an int >= 0; got {value!r}.")
  if not c.learning_rate > 0:
    raise ValueError(f"TrainConfig.learning_rate must be > 0; got {c.learning_rate!r}.")
  strategies = ("auto", *parallel.PLAN_STRATEGIES)
  if c.context_parallel_strategy not in strategies:
    raise ValueError(
      f"TrainConfig.context_parallel_strategy must be one of {strategies}; "
      f"got {c.context_parallel_strategy!r}."
    )
  if c.loss_chunk_size is not None and (
    not isinstance(c.loss_chunk_size, int) or c.loss_chunk_size < 1
  ):
    raise ValueError(
      f"TrainConfig.loss_chunk_size must be None or >= 1; got {c.loss_chunk_size!r}."
    )
  if c.cpu_vector_width not in (None, 128, 256, 512):
    raise ValueError(
      f"TrainConfig.cpu_vector_width must be None, 128, 256 or 512 (bits); got {c.cpu_vector_width!r}."
    )
  if c.init_params_from is not None and (
    not isinstance(c.init_params_from, str) or not c.init_params_from
  ):
    raise ValueError(
      f"TrainConfig.init_params_from must be None or a path; got {c.init_params_from!r}."
    )
  metrics.check_profile_steps(c.profile_steps)
  # Kernel backend and block sizes: one rule, in AttentionOptions, whose field
  # <name> is TrainConfig's attention_<name>.
  try:
    c.kernel_options()
  except ValueError as err:
    raise ValueError(f"TrainConfig.attention_{err}.") from None

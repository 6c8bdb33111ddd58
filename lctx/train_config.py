"""TrainConfig: the loop, optimizer and parallelism settings, and their checks.

lctx/configs.py registers it with gin under the name `TrainConfig`; every gin
file binds `TrainConfig.<field>`. lctx.trainer re-exports it.
"""

from __future__ import annotations

import dataclasses

from lctx import metrics, parallel
from lctx.errors import ConfigError
from lctx.kernels.options import AttentionOptions
from lctx.parallel.options import ContextOptions


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
      The user's name for ContextOptions.strategy (`context()`).
    attention_options: the attention kernel settings (lctx/kernels/options.py):
      backend ('auto' | 'blockwise' | 'cpu' | 'reference' | 'splash' | 'cudnn'
      | 'xla'), block_q / block_kv, block_q_bwd / block_kv_bwd (the backward
      pass's; None: the same), fused_bwd, dq_partial_bytes. In gin:
      `TrainConfig.attention_options = @AttentionOptions()` and
      `AttentionOptions.block_q = 1024`. The mask fields (causal, window,
      scale) are the model's, per call: leave them unbound.
    context_options: the context-parallel settings (lctx/parallel/options.py):
      load_balance (zigzag; None: the strategy's default, on for ring and usp),
      head_chunks and stage_projections (ulysses / usp UPipe stages), the
      ring's sub_chunks. In gin: `TrainConfig.context_options =
      @ContextOptions()` and `ContextOptions.head_chunks = 4`. Its strategy
      is context_parallel_strategy.
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
  attention_options: AttentionOptions = AttentionOptions()
  context_options: ContextOptions = ContextOptions()
  device_memory_gib: float = 16.0
  max_skipped_steps: int = 5
  profile_steps: tuple[int, int] | None = None
  cpu_keep_freed_memory: bool = True
  cpu_vector_width: int | None = 512
  offload_optimizer_state: bool = False
  offload_params: bool = False
  init_params_from: str | None = None

  def __post_init__(self):
    validate_train_config(self)

  def context(self) -> ContextOptions:
    """context_options with the strategy this config names."""
    return dataclasses.replace(self.context_options, strategy=self.context_parallel_strategy)


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
  # The options objects check their own fields when they are made.
  if not isinstance(c.attention_options, AttentionOptions):
    raise ConfigError(
      f"TrainConfig.attention_options must be an AttentionOptions; got {c.attention_options!r}.",
      fix="Bind TrainConfig.attention_options = @AttentionOptions().",
    )
  if not isinstance(c.context_options, ContextOptions):
    raise ConfigError(
      f"TrainConfig.context_options must be a ContextOptions; got {c.context_options!r}.",
      fix="Bind TrainConfig.context_options = @ContextOptions().",
    )
  mask = AttentionOptions()
  set_mask = [
    f
    for f in ("causal", "window_size", "softmax_scale")
    if getattr(c.attention_options, f) != getattr(mask, f)
  ]
  if set_mask:
    raise ConfigError(
      f"AttentionOptions.{set_mask[0]} is the model's, set per call (ModelConfig); "
      "TrainConfig.attention_options carries the kernel settings only.",
      fix=f"Remove the AttentionOptions.{set_mask[0]} binding.",
    )
  if c.attention_options.platform is not None:
    raise ConfigError(
      "AttentionOptions.platform is the mesh's (the context plan sets it).",
      fix="Remove the AttentionOptions.platform binding.",
    )
  if c.context_options.strategy != ContextOptions.strategy:
    raise ConfigError(
      "ContextOptions.strategy is bound; the strategy's name is "
      "TrainConfig.context_parallel_strategy.",
      fix=f"Bind TrainConfig.context_parallel_strategy = {c.context_options.strategy!r}.",
    )
  if c.context_options.token_order is not None:
    raise ConfigError(
      "ContextOptions.token_order is the plan's (from load_balance and the ring size).",
      fix="Remove the ContextOptions.token_order binding.",
    )

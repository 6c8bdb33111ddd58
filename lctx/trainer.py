"""The Trainer: attention plug-in, optimizer, sharded state and jitted steps.

Everything the loop in lctx/train.py needs, built with explicit shardings:
`jax.eval_shape` gives the state shapes, the logical axis names give the
shardings, and the train step is lowered and compiled once before the loop.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lctx import host, metrics, models, parallel
from lctx.kernels import chunked_cross_entropy, chunked_token_scores
from lctx.parallel import mesh as mesh_lib

BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")
# The eval step's batch (lctx/evals/scoring.py): [B, T] token arrays, then the
# answer positions [B, K]; it returns [B, K] scores and [B, NUM_BUCKETS] sums.
SCORE_KEYS = ("inputs", "positions", "segment_ids", "targets", "bucket")
SCORE_BUCKETS = 32  # = lctx.evals.scoring.NUM_BUCKETS
# Tokens per chunk of logits in the eval step when TrainConfig.loss_chunk_size
# is None: the step never holds more than [chunk, E] logits.
SCORE_CHUNK_TOKENS = 2048


# ----------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------
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
      512 uses AVX-512 where the CPU has it: the attention softmax's exp ran
      ~1.4x faster). None keeps XLA's default.
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
  # Kernel backend and block sizes: one rule, in KernelOptions.
  try:
    parallel.KernelOptions(
      backend=c.attention_backend,
      block_q=c.attention_block_q,
      block_kv=c.attention_block_kv,
      block_q_bwd=c.attention_block_q_bwd,
      block_kv_bwd=c.attention_block_kv_bwd,
    )
  except ValueError as err:
    raise ValueError(f"TrainConfig.{err}.") from None


# ----------------------------------------------------------------------------
# Building blocks
# ----------------------------------------------------------------------------
def make_optimizer(cfg: TrainConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """AdamW with linear warm-up, cosine decay and global-norm clipping."""
  schedule = optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=cfg.learning_rate,
    warmup_steps=max(cfg.warmup_steps, 1),
    decay_steps=max(cfg.steps, cfg.warmup_steps + 1),
    end_value=cfg.learning_rate * cfg.end_lr_ratio,
  )

  def decay_mask(params):
    # Norm scales and biases are not decayed; stacked (scanned) norm scales
    # are 2-D, so decide by name rather than by rank.
    def keep(path, _):
      names = [str(getattr(p, "key", p)) for p in path]
      return not any(n in ("scale", "bias") for n in names)

    return jax.tree_util.tree_map_with_path(keep, params)

  parts = []
  if cfg.grad_clip > 0:
    parts.append(optax.clip_by_global_norm(cfg.grad_clip))
  parts.append(
    optax.adamw(
      schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=decay_mask
    )
  )
  return optax.chain(*parts), schedule


def context_plan(cfg: TrainConfig, mesh, model_cfg: models.ModelConfig) -> parallel.ContextPlan:
  """The run's ContextPlan (lctx/parallel/plan.py) from the train and model configs."""
  dims = parallel.AttentionDims.of_model(model_cfg)
  kernel = parallel.KernelOptions(
    backend=cfg.attention_backend,
    block_q=cfg.attention_block_q,
    block_kv=cfg.attention_block_kv,
    block_q_bwd=cfg.attention_block_q_bwd,
    block_kv_bwd=cfg.attention_block_kv_bwd,
  )
  return parallel.make_context_plan(
    mesh,
    dims,
    seq_len=cfg.seq_len,
    batch_size=cfg.batch_size,
    strategy=cfg.context_parallel_strategy,
    load_balance=cfg.load_balance,
    kernel=kernel,
    memory_budget_bytes=int(cfg.device_memory_gib * 2**30),
    head_chunks=cfg.ulysses_head_chunks,
    stage_projections=cfg.ulysses_stage_projections,
  )


# ----------------------------------------------------------------------------
# The trainer object: everything jitted, with explicit shardings.
# ----------------------------------------------------------------------------
# libtpu 0.0.42.1 aborts the whole process (llo_loop.cc:165, no Python error)
# compiling a layer scan that offloads one value of this many elements or more
# per device (measured: Llama-8B at 524,288 tokens per device on v5p:4x4x4).
OFFLOAD_ELEMENT_LIMIT = 2**31


def _check_offloaded_input_size(model_cfg, train_cfg, mesh, batch_ways, seq_ways) -> None:
  """Refuses, before the compiler can abort, a TPU setup whose offloaded layer
  input (per piece) reaches OFFLOAD_ELEMENT_LIMIT elements per device."""
  choices = model_cfg.remat_choices or {}
  if mesh.devices.flat[0].platform != "tpu" or choices.get("layer_input") != "offload":
    return
  rows = max(1, train_cfg.batch_size // batch_ways)
  tokens = train_cfg.seq_len // seq_ways
  per_piece = rows * tokens * model_cfg.d_model // model_cfg.layer_input_pieces
  if per_piece >= OFFLOAD_ELEMENT_LIMIT:
    need = next(
      k
      for k in range(model_cfg.layer_input_pieces + 1, model_cfg.d_model + 1)
      if model_cfg.d_model % k == 0
      and rows * tokens * model_cfg.d_model // k < OFFLOAD_ELEMENT_LIMIT
    )
    raise ValueError(
      f"the offloaded layer input is {rows} x {tokens:,} x {model_cfg.d_model} = "
      f"{rows * tokens * model_cfg.d_model:,} elements per device in "
      f"{model_cfg.layer_input_pieces} piece(s); libtpu aborts the compile at 2**31 "
      f"elements per offloaded value. Set ModelConfig.layer_input_pieces = {need}."
    )


class Trainer:
  """Holds the model, optimizer, shardings and the compiled steps."""

  def __init__(self, model_cfg: models.ModelConfig, train_cfg: TrainConfig, mesh):
    self.model_cfg, self.cfg, self.mesh = model_cfg, train_cfg, mesh
    on_cpu = mesh.devices.flat[0].platform == "cpu"
    if train_cfg.cpu_keep_freed_memory and on_cpu:
      host.keep_freed_memory()
    # XLA options of every step this trainer compiles.
    self.compiler_options = {}
    if on_cpu and train_cfg.cpu_vector_width:
      self.compiler_options["xla_cpu_prefer_vector_width"] = int(train_cfg.cpu_vector_width)
    self.plan = context_plan(train_cfg, mesh, model_cfg)
    self.attention_fn = self.plan.attention_fn
    self.model = models.Transformer(model_cfg, self.attention_fn)
    self.tx, self.schedule = make_optimizer(train_cfg)
    self.batch_sharding = mesh_lib.batch_sharding(mesh)
    batch_ways, seq_ways = mesh_lib.batch_shard_counts(mesh)
    if train_cfg.batch_size % batch_ways:
      raise ValueError(
        f"batch_size={train_cfg.batch_size} is not divisible by the batch "
        f"sharding data x fsdp = {batch_ways}."
      )
    _check_offloaded_input_size(model_cfg, train_cfg, mesh, batch_ways, seq_ways)
    self.rules = mesh_lib.LOGICAL_RULES

    # Shapes first (no memory), then shardings from the logical names.
    abstract = jax.eval_shape(self._init_boxed, jax.random.key(0))
    specs = nn.get_partition_spec(abstract)
    with self._context():
      self.state_sharding = nn.logical_to_mesh_sharding(specs, mesh, self.rules)
    # Host offload: the stored state's shardings say pinned_host; _on_device
    # gives the steps device copies of those parts.
    self.device_state_sharding = self.state_sharding
    self.state_sharding = dict(self.state_sharding)
    for part in self._offloaded_parts():
      self.state_sharding[part] = jax.tree.map(
        lambda s: s.with_memory_kind("pinned_host"), self.state_sharding[part]
      )
    self.abstract_state = jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
      nn.unbox(abstract),
      self.state_sharding,
    )
    self._train_step = None
    self._logits_apply = None
    self._score_steps = {}  # with / without per-position loss buckets
    self._eval_step = jax.jit(
      self._eval_step_impl,
      in_shardings=(self.state_sharding, self.batch_sharding),
      out_shardings=None,
      compiler_options=self.compiler_options,
    )

  @property
  def strategy(self) -> str:
    return self.plan.strategy

  @property
  def load_balance(self) -> bool:
    return self.plan.load_balance

  def _context(self):
    return _MeshRules(self.mesh, self.rules)

  def _offloaded_parts(self) -> tuple[str, ...]:
    return tuple(
      part
      for part, on in (
        ("params", self.cfg.offload_params),
        ("opt_state", self.cfg.offload_optimizer_state),
      )
      if on
    )

  def _on_device(self, tree, part: str):
    """A state part in device memory (a no-op unless it is offloaded)."""
    if part not in self._offloaded_parts():
      return tree
    try:
      kind = self.mesh.devices.flat[0].default_memory().kind
    except jax.errors.JaxRuntimeError:  # compile-only GPU devices list no memories
      kind = "device"
    shardings = jax.tree.map(lambda s: s.with_memory_kind(kind), self.device_state_sharding[part])
    return jax.device_put(tree, shardings)

  # -- state ------------------------------------------------------------------
  def _init_boxed(self, rng):
    # Init on a batch the mesh divides, so the activation constraints hold.
    b, t = mesh_lib.batch_shard_counts(self.mesh)[0], self.cfg.seq_len
    dummy = jnp.zeros((b, t), jnp.int32)
    params = self.model.init(rng, dummy, dummy, dummy + 1)["params"]
    return {
      "step": jnp.zeros((), jnp.int32),
      "params": params,
      "opt_state": self.tx.init(params),
      # Raw key data (checkpointable as a plain array); split every step
      # for stochastic layers and data-dependent noise.
      "rng": jax.random.key_data(jax.random.fold_in(rng, 1)),
    }

  def init_state(self, seed: int):
    with self._context():
      init = jax.jit(lambda r: nn.unbox(self._init_boxed(r)), out_shardings=self.state_sharding)
      return init(jax.random.key(seed))

  def state_from_params(self, params, seed: int):
    """The step-0 state around given params (TrainConfig.init_params_from): fresh
    optimizer state and the rng init_state(seed) would have. `params` must carry
    state_sharding['params']; they are donated (no second copy on the devices)."""

    def build(params, rng):
      return {
        "step": jnp.zeros((), jnp.int32),
        "params": params,
        "opt_state": self.tx.init(self._on_device(params, "params")),
        "rng": jax.random.key_data(jax.random.fold_in(rng, 1)),
      }

    with self._context():
      make = jax.jit(
        build,
        in_shardings=(self.state_sharding["params"], None),
        out_shardings=self.state_sharding,
        donate_argnums=(0,),
      )
      return make(params, jax.random.key(seed))

  # -- steps ------------------------------------------------------------------
  def loss_fn(self, params, batch):
    """Mean next-token loss over loss_mask; returns (total, aux)."""
    hidden, final_norm = self.model.apply(
      {"params": params},
      batch["inputs"],
      batch["positions"],
      batch["segment_ids"],
      return_hidden="pre_norm",
    )
    unembed = models.unembed_matrix(params, self.model_cfg)
    loss_sum, z_sum, weight = self._cross_entropy(
      hidden, final_norm, unembed.astype(hidden.dtype), batch["targets"], batch["loss_mask"]
    )
    denom = jnp.maximum(weight, 1.0)
    return (loss_sum + z_sum) / denom, {"loss": loss_sum / denom, "tokens": weight}

  def _cross_entropy(self, hidden, final_norm, unembed, targets, loss_mask):
    """(sum_loss, sum_z, sum_weights) of the chunked cross-entropy of
    final_norm(hidden), each device over its own tokens.

    The final norm runs inside the loss chunks (chunked_cross_entropy's
    prologue): applied to the whole sequence, its float32 cotangent was one
    [T, D] f32 value at the top of the backward pass (8 GiB per device at
    Llama-8B, 524,288 tokens per device).

    Under plain SPMD the chunks of the flattened global tokens each lay on one
    device, and XLA ran every chunk on all devices with d_model split and the
    chunk's f32 logits all-reduced (at Llama-8B: [8192, 128256] f32 per chunk,
    4,096 chunks at 32M tokens). In a shard_map over the batch and sequence axes
    each device scans its own tokens (loss_chunk_size per chunk) with the whole
    unembedding (gathered once, as FSDP gathers any weight), and only the three
    sums and the unembedding's gradient cross devices. With the tensor axis in
    use (vocab-sharded logits) the plain SPMD path stays.
    """

    # norm: a pytree (lctx.models.layers.RMSNormFn), so it crosses the shard_map.
    def fn(h, u, t, w, norm):
      return chunked_cross_entropy(
        h, u, t, w, chunk_size=self.cfg.loss_chunk_size, z_loss=self.cfg.z_loss, prologue=norm
      )

    shape = mesh_lib.mesh_shape(self.mesh)
    axes = tuple(a for a in (*mesh_lib.BATCH_AXES, *mesh_lib.SEQ_AXES) if shape.get(a, 1) > 1)
    if not axes or shape.get("tensor", 1) > 1:
      return fn(hidden, unembed, targets, loss_mask, final_norm)
    batch_axes = tuple(a for a in mesh_lib.BATCH_AXES if a in axes) or None
    seq_axes = tuple(a for a in mesh_lib.SEQ_AXES if a in axes) or None
    tokens = P(batch_axes, seq_axes)

    def local(h, u, t, w, norm):
      return tuple(jax.lax.psum(x, axes) for x in fn(h, u, t, w, norm))

    return jax.shard_map(
      local,
      mesh=self.mesh,
      in_specs=(P(batch_axes, seq_axes, None), P(None, None), tokens, tokens, P()),
      out_specs=(P(), P(), P()),
      axis_names=set(axes),
      check_vma=False,
    )(hidden, unembed, targets, loss_mask, final_norm)

  def _token_axes(self):
    """(batch axes, sequence axes) of the mesh in use (size > 1), None for none."""
    shape = mesh_lib.mesh_shape(self.mesh)
    batch_axes = tuple(a for a in mesh_lib.BATCH_AXES if shape.get(a, 1) > 1) or None
    seq_axes = tuple(a for a in mesh_lib.SEQ_AXES if shape.get(a, 1) > 1) or None
    return batch_axes, seq_axes

  def _token_logp(self, hidden, final_norm, unembed, targets):
    """logp float32 [B, T] of each target under final_norm(hidden) @ unembed,
    chunk by chunk (lctx.kernels.chunked_token_scores, no argmax), sharded like
    _cross_entropy: each device over its own tokens."""
    chunk = self.cfg.loss_chunk_size or SCORE_CHUNK_TOKENS

    def fn(h, u, t, norm):
      return chunked_token_scores(h, u, t, chunk_size=chunk, prologue=norm, greedy=False)[0]

    batch_axes, seq_axes = self._token_axes()
    if not (batch_axes or seq_axes) or mesh_lib.mesh_shape(self.mesh).get("tensor", 1) > 1:
      return fn(hidden, unembed, targets, final_norm)
    tokens = P(batch_axes, seq_axes)
    return jax.shard_map(
      fn,
      mesh=self.mesh,
      in_specs=(P(batch_axes, seq_axes, None), P(None, None), tokens, P()),
      out_specs=tokens,
      axis_names=set((batch_axes or ()) + (seq_axes or ())),
      check_vma=False,
    )(hidden, unembed, targets, final_norm)

  def _gather_positions(self, x, index):
    """x [B, T, C] (rows over the batch axes, T over the sequence axes) at
    index int32 [B, K] (global positions along T) -> [B, K, C].

    Each device picks the positions that fall in its own slice of T and the
    sequence axes sum the picks (one non-zero term each, so the sum is exact):
    only [B, K, C] moves, never x."""
    batch_axes, seq_axes = self._token_axes()
    if seq_axes is None:
      return jnp.take_along_axis(x, index[:, :, None], axis=1)

    def local(x, idx):
      n = x.shape[1]
      rel = idx - jax.lax.axis_index(seq_axes) * n
      inside = (rel >= 0) & (rel < n)
      picked = jnp.take_along_axis(x, jnp.clip(rel, 0, n - 1)[:, :, None], axis=1)
      return jax.lax.psum(jnp.where(inside[:, :, None], picked, jnp.zeros_like(picked)), seq_axes)

    return jax.shard_map(
      local,
      mesh=self.mesh,
      in_specs=(P(batch_axes, seq_axes, None), P(batch_axes, None)),
      out_specs=P(batch_axes, None, None),
      axis_names=set((batch_axes or ()) + seq_axes),
      check_vma=False,
    )(x, index)

  def _score_step_impl(self, params, batch, *, buckets: bool):
    """The eval step: only what the evals score (lctx/evals/scoring.py).

    batch (device order): inputs, positions, segment_ids, targets, bucket int32
    [B, T]; score_index int32 [B, K] (device-order positions). Returns logp
    float32 [B, K], correct bool [B, K] at score_index and bucket_loss float32
    [B, SCORE_BUCKETS] (sum of -logp per bucket id). The answer positions'
    hidden states are gathered first ([B, K, D]) and only they meet the whole
    unembedding; with `buckets` (per-position loss) every token's logp is
    computed too, chunk by chunk; without, bucket_loss is zeros. No [B, T, E]
    value exists either way.
    """
    params = self._on_device(params, "params")
    hidden, final_norm = self.model.apply(
      {"params": params},
      batch["inputs"],
      batch["positions"],
      batch["segment_ids"],
      return_hidden="pre_norm",
    )
    unembed = models.unembed_matrix(params, self.model_cfg).astype(hidden.dtype)
    index = batch["score_index"]
    h_k = self._gather_positions(hidden, index)  # [B, K, D]
    t_k = self._gather_positions(batch["targets"][:, :, None], index)[:, :, 0]  # [B, K]
    chunk = self.cfg.loss_chunk_size or SCORE_CHUNK_TOKENS
    logp, correct = chunked_token_scores(h_k, unembed, t_k, chunk_size=chunk, prologue=final_norm)
    b = index.shape[0]
    bucket_loss = jnp.zeros((b, SCORE_BUCKETS), jnp.float32)
    if buckets:
      every = self._token_logp(hidden, final_norm, unembed, batch["targets"])
      bucket = batch["bucket"]
      bucket_loss = jnp.stack(
        [jnp.sum(jnp.where(bucket == k, -every, 0.0), axis=1) for k in range(SCORE_BUCKETS)],
        axis=1,
      )
    return {"logp": logp, "correct": correct, "bucket_loss": bucket_loss}

  def _score_jit(self, buckets: bool):
    if buckets not in self._score_steps:
      rows = NamedSharding(self.mesh, P(mesh_lib.BATCH_AXES))
      shardings = {k: self.batch_sharding for k in SCORE_KEYS} | {"score_index": rows}
      self._score_steps[buckets] = jax.jit(
        functools.partial(self._score_step_impl, buckets=buckets),
        in_shardings=(self.state_sharding["params"], shardings),
        # Replicated: every process reads the whole (small) result.
        out_shardings=NamedSharding(self.mesh, P()),
        compiler_options=self.compiler_options,
      )
    return self._score_steps[buckets]

  def abstract_score_batch(self, batch_size: int | None = None, width: int = 64):
    """ShapeDtypeStructs of one eval-step batch: [B, seq_len], K = width answer positions."""
    b, t = batch_size or self.cfg.batch_size, self.cfg.seq_len
    rows = NamedSharding(self.mesh, P(mesh_lib.BATCH_AXES))
    out = {
      k: jax.ShapeDtypeStruct((b, t), jnp.int32, sharding=self.batch_sharding) for k in SCORE_KEYS
    }
    out["score_index"] = jax.ShapeDtypeStruct((b, width), jnp.int32, sharding=rows)
    return out

  def lower_score_step(self, batch_size: int | None = None, width: int = 64, buckets: bool = True):
    """Lowers the eval step on abstract inputs (`--compile_step=eval`); by
    default the variant with per-position loss, the larger of the two."""
    with self._context():
      return self._score_jit(buckets).lower(
        self.abstract_state["params"], self.abstract_score_batch(batch_size, width)
      )

  def _train_step_impl(self, state, batch):
    # Offloaded parts (TrainConfig.offload_*) come to the device where used.
    state = dict(state, params=self._on_device(state["params"], "params"))
    grad_fn = jax.value_and_grad(self.loss_fn, has_aux=True)
    (total, aux), grads = grad_fn(state["params"], batch)
    state["opt_state"] = self._on_device(state["opt_state"], "opt_state")
    updates, opt_state = self.tx.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    # Non-finite guard: a step whose loss or gradient norm is not finite keeps
    # the parameters and optimizer state; the loop counts and limits such steps.
    grad_norm = optax.global_norm(grads)
    finite = jnp.isfinite(total) & jnp.isfinite(grad_norm)
    params, opt_state = jax.tree.map(
      lambda new, old: jnp.where(finite, new, old),
      (params, opt_state),
      (state["params"], state["opt_state"]),
    )
    rng, _ = jax.random.split(jax.random.wrap_key_data(state["rng"]))
    new_state = {
      "step": state["step"] + 1,
      "params": params,
      "opt_state": opt_state,
      "rng": jax.random.key_data(rng),
    }
    metrics = {
      "loss": aux["loss"],
      "tokens": aux["tokens"],
      "grad_norm": grad_norm,
      "learning_rate": self.schedule(state["step"]),
      "skipped": jnp.logical_not(finite).astype(jnp.int32),
    }
    return new_state, metrics

  def _eval_step_impl(self, state, batch):
    _, aux = self.loss_fn(self._on_device(state["params"], "params"), batch)
    return aux

  def abstract_batch(self, batch_size: int | None = None):
    b = batch_size or self.cfg.batch_size
    shapes = {k: (jnp.float32 if k == "loss_mask" else jnp.int32) for k in BATCH_KEYS}
    return {
      k: jax.ShapeDtypeStruct((b, self.cfg.seq_len), dt, sharding=self.batch_sharding)
      for k, dt in shapes.items()
    }

  def lower_train_step(self):
    """Lowers the train step on abstract inputs (no device memory needed)."""
    jitted = jax.jit(
      self._train_step_impl,
      in_shardings=(self.state_sharding, self.batch_sharding),
      out_shardings=(self.state_sharding, None),
      donate_argnums=(0,),
      compiler_options=self.compiler_options,
    )
    with self._context():
      return jitted.lower(self.abstract_state, self.abstract_batch())

  def compile_train_step(self):
    """Lowers and compiles the train step once; returns the compiled step."""
    if self._train_step is None:
      self._train_step = self.lower_train_step().compile()
    return self._train_step

  def train_step(self, state, batch):
    return self.compile_train_step()(state, batch)

  def eval_step(self, state, batch):
    with self._context():
      return self._eval_step(state, batch)

  def device_batch(self, host_batch: Mapping[str, np.ndarray]):
    """Host-local numpy rows -> one global array per key on the mesh."""
    return {
      k: jax.make_array_from_process_local_data(self.batch_sharding, np.asarray(host_batch[k]))
      for k in BATCH_KEYS
    }

  def logits_fn(self, state) -> Callable[[Mapping[str, np.ndarray]], np.ndarray]:
    """Natural-order batch -> float32 logits, through the training forward.

    Rows are padded to the batch sharding and put in the plan's device order in
    and out, so evals see exactly the training path. The forward is jitted once
    per trainer (compiled once per batch shape), not per call.
    """
    batch_ways, _ = mesh_lib.batch_shard_counts(self.mesh)
    if self._logits_apply is None:
      self._logits_apply = jax.jit(
        lambda p, x, pos, seg: self.model.apply(
          {"params": self._on_device(p, "params")}, x, pos, seg
        ).astype(jnp.float32),
        compiler_options=self.compiler_options,
      )
    apply = self._logits_apply

    def fn(batch):
      x = {k: np.asarray(batch[k]) for k in ("inputs", "positions", "segment_ids")}
      b = x["inputs"].shape[0]
      pad = (-b) % batch_ways
      if pad:
        x = {k: np.concatenate([v, np.zeros((pad,) + v.shape[1:], v.dtype)]) for k, v in x.items()}
      x = self.plan.to_device_order(x)
      arrays = {
        k: jax.make_array_from_process_local_data(self.batch_sharding, v) for k, v in x.items()
      }
      with self._context():
        logits = apply(
          state["params"], arrays["inputs"], arrays["positions"], arrays["segment_ids"]
        )
      return self.plan.to_natural_order(np.asarray(jax.device_get(logits)))[:b]

    return fn

  def score_fn(self, state):
    """The evals' Scorer (lctx/evals/scoring.py) through the eval step.

    Natural-order host rows are padded to the batch sharding, put in the plan's
    device order (answer positions mapped through the same permutation) and
    fed per process: each process passes only the rows its devices hold. The
    step returns replicated [B, K] scores, so the host reads O(answer tokens).
    """
    from lctx.evals.scoring import Scorer  # pylint: disable=g-import-not-at-top

    batch_ways, _ = mesh_lib.batch_shard_counts(self.mesh)
    rows_sharding = NamedSharding(self.mesh, P(mesh_lib.BATCH_AXES))

    def fn(batch):
      x = {k: np.asarray(batch[k], np.int32) for k in (*SCORE_KEYS, "score_index")}
      if int(x["inputs"].max()) >= self.model_cfg.vocab_size:
        raise ValueError(
          f"the model scores {self.model_cfg.vocab_size} token ids but a token id is "
          f"{int(x['inputs'].max())}: the model's vocab_size must be at least the "
          "tokenizer's vocab_size."
        )
      b, t = x["inputs"].shape
      pad = (-b) % batch_ways
      if pad:
        x = {k: np.concatenate([v, np.zeros((pad,) + v.shape[1:], v.dtype)]) for k, v in x.items()}
      index = x.pop("score_index")
      x = self.plan.to_device_order(x)
      # slot[p]: where natural position p sits in device order.
      order = self.plan.to_device_order({"p": np.arange(t)[None]})["p"][0]
      slot = np.argsort(order).astype(np.int32)
      x["score_index"] = slot[index]
      lo, hi = _process_rows(self.batch_sharding, x["inputs"].shape)
      arrays = {
        k: jax.make_array_from_process_local_data(
          rows_sharding if k == "score_index" else self.batch_sharding, v[lo:hi], v.shape
        )
        for k, v in x.items()
      }
      step = self._score_jit(bool((x["bucket"] >= 0).any()))
      with self._context():
        out = step(state["params"], arrays)
      return {k: np.asarray(v.addressable_data(0))[:b] for k, v in out.items()}

    return Scorer(fn)


def _process_rows(sharding, shape) -> tuple[int, int]:
  """[lo, hi): the global rows this process's devices hold (whole rows only)."""
  spans = sharding.addressable_devices_indices_map(shape).values()
  rows = {(s[0].start or 0, shape[0] if s[0].stop is None else s[0].stop) for s in spans}
  cols = {(s[1].start or 0, shape[1] if s[1].stop is None else s[1].stop) for s in spans}
  lo, hi = min(r[0] for r in rows), max(r[1] for r in rows)
  covered = sum(b - a for a, b in sorted(rows))
  if covered != hi - lo or min(c[0] for c in cols) != 0 or max(c[1] for c in cols) != shape[1]:
    raise ValueError(
      f"this process's devices hold rows {sorted(rows)} and sequence slices {sorted(cols)} "
      f"of a {shape} eval batch; the evals feed whole, contiguous rows per process "
      "(put the context axes within a host)."
    )
  return lo, hi


class _MeshRules:
  """`with` block that sets the mesh and the logical axis rules."""

  def __init__(self, mesh, rules):
    self._mesh_cm = jax.set_mesh(mesh)
    self._rules_cm = nn.logical_axis_rules(rules)

  def __enter__(self):
    self._mesh_cm.__enter__()
    self._rules_cm.__enter__()
    return self

  def __exit__(self, *exc):
    self._rules_cm.__exit__(*exc)
    self._mesh_cm.__exit__(*exc)
    return False

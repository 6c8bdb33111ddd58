"""The Trainer: attention plug-in, optimizer, sharded state and jitted steps.

Everything the loop in lctx/train.py needs, built with explicit shardings:
`jax.eval_shape` gives the state shapes, the logical axis names give the
shardings, and the train step is lowered and compiled once before the loop.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging

from lctx import host, models
from lctx.kernels import chunked_cross_entropy, cpu_fused
from lctx.parallel import mesh as mesh_lib
from lctx.parallel.local import local_attention_fn

BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")


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
    loss_chunk_size: tokens per chunk of the chunked cross-entropy; None
      computes the logits of a whole row at once.
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
    cpu_keep_freed_memory: on the CPU backend, make glibc malloc reuse freed
      memory rather than unmap it and page-fault it in again every step
      (lctx/host.py). The process keeps its peak footprint.
    cpu_vector_width: on the CPU backend, the vector width in bits XLA
      prefers for the elementwise code it generates (XLA's default is 256;
      512 uses AVX-512 where the CPU has it: the attention softmax's exp ran
      ~1.4x faster). None keeps XLA's default.
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
  cpu_keep_freed_memory: bool = True
  cpu_vector_width: int | None = 512


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


def make_attention_fn(
  cfg: TrainConfig, mesh, model_cfg: models.ModelConfig
) -> tuple[Callable, str, bool]:
  """Chooses and builds the attention plug-in: (fn, strategy, load_balance)."""
  from lctx import parallel  # pylint: disable=g-import-not-at-top

  shape = mesh_lib.mesh_shape(mesh)
  strategy = cfg.context_parallel_strategy
  mla = model_cfg.attention == "mla"
  num_kv_heads = model_cfg.num_heads if mla else model_cfg.num_kv_heads
  if strategy == "auto" and shape["context"] * shape["context_ulysses"] == 1:
    strategy = "none"
    logging.info("context_parallel_strategy=auto: context degree 1, so no context parallelism.")
  if strategy == "auto":
    batch_ways, _ = mesh_lib.batch_shard_counts(mesh)
    act_bytes = 2 if model_cfg.dtype == "bfloat16" else 4
    strategy, reason = parallel.choose_strategy(
      mesh_shape=shape,
      num_q_heads=model_cfg.num_heads,
      num_kv_heads=num_kv_heads,
      seq_len=cfg.seq_len,
      head_dim=(
        model_cfg.qk_nope_head_dim + model_cfg.qk_rope_head_dim if mla else model_cfg.head_dim
      ),
      v_head_dim=model_cfg.v_head_dim if mla else None,
      batch_per_device=max(1, cfg.batch_size // batch_ways),
      bytes_per_element=act_bytes,
      memory_budget_bytes=int(cfg.device_memory_gib * 2**30),
      # Residual stream + MLP hidden per token, saved across one layer.
      activation_bytes_per_token=act_bytes * (2 * model_cfg.d_model + model_cfg.mlp_dim),
      load_balance=cfg.load_balance,
    )
    logging.info("context_parallel_strategy=auto chose %r: %s", strategy, reason)
  load_balance = cfg.load_balance
  if load_balance is None:
    load_balance = strategy in ("ring", "usp")
  if strategy != "none":
    parallel.validate_context_parallel(
      strategy=strategy,
      mesh_shape=shape,
      num_q_heads=model_cfg.num_heads,
      num_kv_heads=num_kv_heads,
      seq_len=cfg.seq_len,
      load_balance=load_balance,
    )
  elif shape["context"] * shape["context_ulysses"] > 1:
    raise ValueError(
      f"context_parallel_strategy='none' needs context = context_ulysses = 1, got mesh {shape}."
    )
  kernel_args = dict(
    kernel_backend=cfg.attention_backend,
    block_q=cfg.attention_block_q,
    block_kv=cfg.attention_block_kv,
    block_q_bwd=cfg.attention_block_q_bwd,
    block_kv_bwd=cfg.attention_block_kv_bwd,
  )
  if cfg.attention_backend == "auto" and jax.default_backend() == "cpu":
    if cpu_fused.available():
      logging.info(
        "attention: float32 calls run the fused C++ CPU kernel (lctx/kernels/cpu_attention.cc)"
      )
    else:
      logging.warning(
        "attention: the fused C++ CPU kernel is unavailable (%s); "
        "using the pure-JAX blockwise kernel",
        cpu_fused.unavailable_reason(),
      )
  if strategy == "none":
    fn = local_attention_fn(**kernel_args)
  else:
    fn = parallel.make_attention_fn(mesh, strategy, load_balance=load_balance, **kernel_args)
  return fn, strategy, load_balance


def ring_size(mesh) -> int:
  return mesh_lib.mesh_shape(mesh)["context"]


# ----------------------------------------------------------------------------
# The trainer object: everything jitted, with explicit shardings.
# ----------------------------------------------------------------------------
class Trainer:
  """Holds the model, optimizer, shardings and the compiled steps."""

  def __init__(self, model_cfg: models.ModelConfig, train_cfg: TrainConfig, mesh):
    self.model_cfg, self.cfg, self.mesh = model_cfg, train_cfg, mesh
    if train_cfg.cpu_vector_width not in (None, 128, 256, 512):
      raise ValueError(
        "TrainConfig.cpu_vector_width must be None, 128, 256 or "
        f"512 (bits); got {train_cfg.cpu_vector_width!r}."
      )
    for name in ("attention_block_q_bwd", "attention_block_kv_bwd"):
      value = getattr(train_cfg, name)
      if value is not None and (not isinstance(value, int) or value < 1):
        raise ValueError(f"TrainConfig.{name} must be None or a positive int; got {value!r}.")
    on_cpu = mesh.devices.flat[0].platform == "cpu"
    if train_cfg.cpu_keep_freed_memory and on_cpu:
      host.keep_freed_memory()
    # XLA options of every step this trainer compiles.
    self.compiler_options = {}
    if on_cpu and train_cfg.cpu_vector_width:
      self.compiler_options["xla_cpu_prefer_vector_width"] = int(train_cfg.cpu_vector_width)
    self.attention_fn, self.strategy, self.load_balance = make_attention_fn(
      train_cfg, mesh, model_cfg
    )
    self.model = models.Transformer(model_cfg, self.attention_fn)
    self.tx, self.schedule = make_optimizer(train_cfg)
    self.batch_sharding = mesh_lib.batch_sharding(mesh)
    batch_ways, _ = mesh_lib.batch_shard_counts(mesh)
    if train_cfg.batch_size % batch_ways:
      raise ValueError(
        f"batch_size={train_cfg.batch_size} is not divisible by the batch "
        f"sharding data x fsdp = {batch_ways}."
      )
    self.rules = mesh_lib.LOGICAL_RULES

    # Shapes first (no memory), then shardings from the logical names.
    abstract = jax.eval_shape(self._init_boxed, jax.random.key(0))
    specs = nn.get_partition_spec(abstract)
    with self._context():
      self.state_sharding = nn.logical_to_mesh_sharding(specs, mesh, self.rules)
    self.abstract_state = jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
      nn.unbox(abstract),
      self.state_sharding,
    )
    self._train_step = None
    self._eval_step = jax.jit(
      self._eval_step_impl,
      in_shardings=(self.state_sharding, self.batch_sharding),
      out_shardings=None,
      compiler_options=self.compiler_options,
    )

  def _context(self):
    return _MeshRules(self.mesh, self.rules)

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

  # -- steps ------------------------------------------------------------------
  def loss_fn(self, params, batch):
    """Mean next-token loss over loss_mask; returns (total, aux)."""
    hidden = self.model.apply(
      {"params": params},
      batch["inputs"],
      batch["positions"],
      batch["segment_ids"],
      return_hidden=True,
    )
    unembed = models.unembed_matrix(params, self.model_cfg)
    loss_sum, z_sum, weight = chunked_cross_entropy(
      hidden,
      unembed.astype(hidden.dtype),
      batch["targets"],
      batch["loss_mask"],
      chunk_size=self.cfg.loss_chunk_size,
      z_loss=self.cfg.z_loss,
    )
    denom = jnp.maximum(weight, 1.0)
    return (loss_sum + z_sum) / denom, {"loss": loss_sum / denom, "tokens": weight}

  def _train_step_impl(self, state, batch):
    grad_fn = jax.value_and_grad(self.loss_fn, has_aux=True)
    (_, aux), grads = grad_fn(state["params"], batch)
    updates, opt_state = self.tx.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
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
      "grad_norm": optax.global_norm(grads),
      "learning_rate": self.schedule(state["step"]),
    }
    return new_state, metrics

  def _eval_step_impl(self, state, batch):
    _, aux = self.loss_fn(state["params"], batch)
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

    Rows are padded to the batch sharding and, when the run load-balances,
    zigzag-reordered in and out, so evals see exactly the training path.
    """
    from lctx import parallel  # pylint: disable=g-import-not-at-top

    batch_ways, _ = mesh_lib.batch_shard_counts(self.mesh)
    ring = ring_size(self.mesh)
    apply = jax.jit(
      lambda p, x, pos, seg: self.model.apply({"params": p}, x, pos, seg).astype(jnp.float32),
      compiler_options=self.compiler_options,
    )

    def fn(batch):
      x = {k: np.asarray(batch[k]) for k in ("inputs", "positions", "segment_ids")}
      b = x["inputs"].shape[0]
      pad = (-b) % batch_ways
      if pad:
        x = {k: np.concatenate([v, np.zeros((pad,) + v.shape[1:], v.dtype)]) for k, v in x.items()}
      if self.load_balance:
        x = {k: parallel.zigzag_reorder(v, ring) for k, v in x.items()}
      arrays = {
        k: jax.make_array_from_process_local_data(self.batch_sharding, v) for k, v in x.items()
      }
      with self._context():
        logits = apply(
          state["params"], arrays["inputs"], arrays["positions"], arrays["segment_ids"]
        )
      logits = np.asarray(jax.device_get(logits))
      if self.load_balance:
        logits = parallel.zigzag_inverse(logits, ring)
      return logits[:b]

    return fn


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

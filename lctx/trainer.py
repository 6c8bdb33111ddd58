"""The Trainer: attention plug-in, optimizer, sharded state and jitted steps.

Everything the loop in lctx/train.py needs, built with explicit shardings:
`jax.eval_shape` gives the state shapes, the logical axis names give the
shardings, and the train step is lowered and compiled once before the loop.
The settings are a TrainConfig (lctx/train_config.py, re-exported here), the
optimizer comes from lctx/optimizer.py and the token-sharded loss and eval
scores from lctx/loss.py.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lctx import host, loss, models, parallel, platforms
from lctx.kernels import chunked_token_scores
from lctx.optimizer import make_optimizer
from lctx.parallel import mesh as mesh_lib
from lctx.train_config import TrainConfig, validate_train_config

__all__ = ["Trainer", "TrainConfig", "context_plan", "make_optimizer", "validate_train_config"]

BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")
# The eval step's batch (lctx/evals/scoring.py): [B, T] token arrays, then the
# answer positions [B, K]; it returns [B, K] scores and [B, NUM_BUCKETS] sums.
SCORE_KEYS = ("inputs", "positions", "segment_ids", "targets", "bucket")
SCORE_BUCKETS = 32  # = lctx.evals.scoring.NUM_BUCKETS
# Tokens per chunk of logits in the eval step when TrainConfig.loss_chunk_size
# is None: the step never holds more than [chunk, E] logits.
SCORE_CHUNK_TOKENS = 2048


def context_plan(cfg: TrainConfig, mesh, model_cfg: models.ModelConfig) -> parallel.ContextPlan:
  """The run's ContextPlan (lctx/parallel/plan.py) from the train and model configs."""
  dims = parallel.AttentionDims.of_model(model_cfg)
  return parallel.make_context_plan(
    mesh,
    dims,
    seq_len=cfg.seq_len,
    batch_size=cfg.batch_size,
    context=cfg.context(),
    attention=cfg.attention_options,
    memory_budget_bytes=int(cfg.device_memory_gib * 2**30),
  )


# ----------------------------------------------------------------------------
# The trainer object: everything jitted, with explicit shardings.
# ----------------------------------------------------------------------------
class Trainer:
  """Holds the model, optimizer, shardings and the compiled steps."""

  def __init__(self, model_cfg: models.ModelConfig, train_cfg: TrainConfig, mesh):
    self.model_cfg, self.cfg, self.mesh = model_cfg, train_cfg, mesh
    if model_cfg.final_logit_softcap is not None:
      raise ValueError(
        "ModelConfig.final_logit_softcap: the trainer's chunked loss and scores take "
        "the hidden state and the unembedding, not the model's logits, and do not "
        "apply the cap; train with final_logit_softcap=None"
      )
    on_cpu = mesh.devices.flat[0].platform == "cpu"
    if train_cfg.cpu_keep_freed_memory and on_cpu:
      host.keep_freed_memory()
    # XLA options of every step this trainer compiles.
    self.compiler_options = {}
    if on_cpu and train_cfg.cpu_vector_width:
      self.compiler_options["xla_cpu_prefer_vector_width"] = int(train_cfg.cpu_vector_width)
    self.plan = context_plan(train_cfg, mesh, model_cfg)
    self.attention_fn = self.plan.attention_fn
    self.model = models.Transformer(model_cfg, self.plan.mixer)
    self.tx, self.schedule = make_optimizer(train_cfg)
    self.batch_sharding = mesh_lib.batch_sharding(mesh)
    batch_ways, seq_ways = mesh_lib.batch_shard_counts(mesh)
    if train_cfg.batch_size % batch_ways:
      raise ValueError(
        f"batch_size={train_cfg.batch_size} is not divisible by the batch "
        f"sharding data x fsdp = {batch_ways}."
      )
    platforms.check_offloaded_input_size(model_cfg, train_cfg, mesh, batch_ways, seq_ways)
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
    """(sum_loss, sum_z, sum_weights) over this trainer's mesh (lctx.loss.cross_entropy)."""
    return loss.cross_entropy(
      self.mesh,
      hidden,
      final_norm,
      unembed,
      targets,
      loss_mask,
      chunk_size=self.cfg.loss_chunk_size,
      z_loss=self.cfg.z_loss,
    )

  def _score_step_impl(self, params, batch, *, buckets: bool):
    """The eval step: only what the evals score (lctx/evals/scoring.py).

    batch (device order): inputs, positions, segment_ids, targets, bucket int32
    [B, T]; score_index int32 [B, K] (device-order positions). Returns logp
    float32 [B, K], correct bool [B, K], argmax int32 [B, K] (the greedy next
    token, for decoding) at score_index and bucket_loss float32
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
    h_k = loss.gather_positions(self.mesh, hidden, index)  # [B, K, D]
    t_k = loss.gather_positions(self.mesh, batch["targets"][:, :, None], index)[:, :, 0]  # [B, K]
    chunk = self.cfg.loss_chunk_size or SCORE_CHUNK_TOKENS
    logp, correct, top = chunked_token_scores(
      h_k, unembed, t_k, chunk_size=chunk, prologue=final_norm, return_argmax=True
    )
    b = index.shape[0]
    bucket_loss = jnp.zeros((b, SCORE_BUCKETS), jnp.float32)
    if buckets:
      every = loss.token_logp(
        self.mesh, hidden, final_norm, unembed, batch["targets"], chunk_size=chunk
      )
      bucket = batch["bucket"]
      bucket_loss = jnp.stack(
        [jnp.sum(jnp.where(bucket == k, -every, 0.0), axis=1) for k in range(SCORE_BUCKETS)],
        axis=1,
      )
    return {"logp": logp, "correct": correct, "argmax": top, "bucket_loss": bucket_loss}

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

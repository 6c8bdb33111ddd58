"""`--mode=plan`: will this config fit, and what is the smallest setup that does?

`run_plan(exp, workdir, hardware='v5p-64')` evaluates the analytic memory model
(lctx/sizing/memory_model.py) for the setup the gin file configures on the
named hardware (lctx/hardware.py), then searches strategy x context degree (x
the ulysses factor for usp) x remat/offload for the smallest setup that fits:
the smallest context degree that fits HBM (and host RAM), and at equal degree
the least recompute, then the least communication. It prints the per-device
breakdown and the choice, writes `<workdir>/plan.json`, and prints the
`--mode=compile` command (with `--gin_param` overrides) that asks the TPU
compiler about the winner; `plan_then_compile=True` runs that compile too.

The attention kernel counted is the one the step will run:
AttentionOptions.backend (TrainConfig.attention_options), with 'auto' resolved by the target's platform as
the trainer resolves it (splash on TPU slices, blockwise elsewhere);
plan.json's setups name it (`attention_kernel`).

Every figure here is a planner estimate; `--mode=compile` is the compiler's word.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

from absl import logging

from lctx import errors
from lctx import hardware as hw
from lctx.models import config as models_config
from lctx.parallel import mesh as mesh_lib
from lctx.parallel.auto import AttentionDims, decide_strategy
from lctx.parallel.validation import STRATEGIES, default_load_balance, validate_context_parallel
from lctx.sizing import memory_model as mm
from lctx.sizing import step_estimate

GiB = 2**30
# Search order at equal context degree: least recompute first, then least
# communication (validation.STRATEGIES, auto's order), then the widest
# all-to-all for usp.
# Remat policies the search tries, least recompute first (those ModelConfig
# knows; offloading ones last: they also move bytes over PCIe).
REMAT_ORDER = (
  "none",
  "save_dots",
  "dots",
  "minimal",
  "save_qkv_proj",
  "save_attention_out",
  "full",
  "minimal_offloaded",
  "qkv_proj_offloaded",
  "offload_layer_inputs",
  "offload_layer_inputs_and_attention_out",
)
# The seed articles' order for spending memory, as one walk ('offload_order'):
# keep every activation but offload the attention output (with its lse) first,
# then the optimizer state, then the layer inputs, then the parameters; remat
# last. Each step is (remat policy, offload_optimizer_state, offload_params),
# adding to the one before; the search tries them after REMAT_ORDER.
OFFLOAD_ORDER_NAME = "offload_order"
OFFLOAD_ORDER = (
  ("attention_out_offloaded", False, False),
  ("attention_out_offloaded", True, False),
  ("offload_layer_inputs_and_attention_out", True, False),
  ("offload_layer_inputs_and_attention_out", True, True),
  ("full", True, True),
)
ESTIMATE_LABEL = "planner estimate (analytic model, lctx/sizing/memory_model.py)"


# ----------------------------------------------------------------------------
# From configs to the memory model's plain numbers
# ----------------------------------------------------------------------------
def model_dims(model) -> mm.ModelDims:
  """ModelDims of a lctx.models.ModelConfig."""
  embedding = model.vocab_size * model.d_model * (1 if model.tie_embeddings else 2)
  layer = (model.num_params() - embedding - model.d_model) // model.num_layers
  mla = model.attention == "mla"
  return mm.ModelDims(
    vocab_size=model.vocab_size,
    d_model=model.d_model,
    num_layers=model.num_layers,
    num_heads=model.num_heads,
    num_kv_heads=model.num_heads if mla else model.num_kv_heads,
    head_dim=model.qk_nope_head_dim + model.qk_rope_head_dim if mla else model.head_dim,
    v_head_dim=model.v_head_dim if mla else model.head_dim,
    mlp_dim=model.mlp_dim,
    layer_params=layer,
    embedding_params=embedding,
    linear_layers=sum(t == "linear_attention" for t in getattr(model, "layer_types", ()) or ()),
    linear=model if "linear_attention" in (getattr(model, "layer_types", ()) or ()) else None,
  )


def _dtype_bytes(name: str) -> int:
  return 4 if name == "float32" else 2


def remat_policies() -> tuple[str, ...]:
  """REMAT_ORDER less the policies this ModelConfig does not know."""
  known = getattr(models_config, "REMAT_POLICIES", mm.REMAT_POLICIES)
  return tuple(r for r in REMAT_ORDER if r in known and r != "custom")


def _remat_choices(model, remat_policy: str):
  """ModelConfig's per-tag choices for a policy (None for 'none' / dots ones)."""
  if remat_policy == model.remat_policy:
    return getattr(model, "remat_choices", None)
  if remat_policy in mm.REMAT_POLICIES and remat_policy != "full":
    return None
  other = dataclasses.replace(
    model,
    remat_policy=remat_policy,
    remat_group_size=_group_size(model, remat_policy),
    **_no_custom(model),
  )
  return getattr(other, "remat_choices", None)


def _no_custom(model) -> dict[str, Any]:
  """Overrides that let a model with custom remat choices take a named policy."""
  return {"remat_custom": ()} if getattr(model, "remat_custom", ()) else {}


def _group_size(model, remat_policy: str) -> int:
  return 1 if remat_policy == "none" else getattr(model, "remat_group_size", 1)


def make_setup(
  exp,
  *,
  strategy: str,
  mesh: dict[str, int],
  remat_policy: str,
  platform: str = "tpu",
  offload_optimizer_state: bool | None = None,
  offload_params: bool | None = None,
) -> mm.Setup:
  """A memory-model Setup of the experiment with these choices on `platform`'s
  devices ('tpu', 'gpu'; the attention kernel follows AttentionOptions.backend
  as the trainer resolves it: 'auto' is splash on TPU, blockwise elsewhere).
  offload_optimizer_state / offload_params: None keeps the TrainConfig's."""
  train = exp.train
  attention = train.attention_options
  if offload_optimizer_state is None:
    offload_optimizer_state = getattr(train, "offload_optimizer_state", False)
  if offload_params is None:
    offload_params = getattr(train, "offload_params", False)
  return mm.Setup(
    strategy=strategy,
    mesh=dict(mesh),
    batch_size=exp.train.batch_size,
    seq_len=exp.train.seq_len,
    remat_policy=remat_policy,
    remat_choices=_remat_choices(exp.model, remat_policy),
    remat_group_size=_group_size(exp.model, remat_policy),
    offload_optimizer_state=bool(offload_optimizer_state),
    offload_params=bool(offload_params),
    dtype_bytes=_dtype_bytes(exp.model.dtype),
    param_bytes=_dtype_bytes(exp.model.param_dtype),
    loss_chunk_size=exp.train.loss_chunk_size,
    mlp_chunk_size=exp.model.mlp_chunk_size,
    block_q=attention.block_q,
    block_kv=attention.block_kv,
    kernel=mm.resolve_kernel(attention.backend, platform),
    head_chunks=_head_chunks(train.context_options, strategy),
    block_q_bwd=attention.block_q_bwd,
    block_kv_bwd=attention.block_kv_bwd,
    fused_bwd=attention.fused_bwd,
    dq_partial_bytes=attention.dq_partial_bytes,
  )


def setup_record(setup: mm.Setup) -> dict[str, Any]:
  mesh = {a: setup.axis(a) for a in mesh_lib.MESH_AXES}
  return {
    "strategy": setup.strategy,
    "mesh": mesh,
    "context_degree": setup.context_degree,
    "remat_policy": setup.remat_policy,
    "remat_group_size": setup.remat_group_size,
    "offload_optimizer_state": setup.offload_optimizer_state,
    "offload_params": setup.offload_params,
    "batch_size": setup.batch_size,
    "seq_len": setup.seq_len,
    "loss_chunk_size": setup.loss_chunk_size,
    "mlp_chunk_size": setup.mlp_chunk_size,
    "attention_kernel": setup.kernel,
    "ulysses_head_chunks": setup.head_chunks,
  }


def gin_overrides(setup: mm.Setup) -> list[str]:
  """The `--gin_param` bindings that make a gin file run `setup`."""
  out = [f"MeshConfig.{a}={setup.axis(a)}" for a in mesh_lib.MESH_AXES]
  out += ["MeshConfig.dcn_data=1", "MeshConfig.dcn_fsdp=1"]
  out.append(f"TrainConfig.context_parallel_strategy='{setup.strategy}'")
  out.append(f"ModelConfig.remat_policy='{setup.remat_policy}'")
  out.append(f"TrainConfig.offload_optimizer_state={setup.offload_optimizer_state}")
  out.append(f"TrainConfig.offload_params={setup.offload_params}")
  return out


def compile_topology(target: hw.Target, hardware: str) -> str | None:
  """A topology name the TPU compiler takes for the target (None for GPUs)."""
  if target.accelerator.platform != "tpu":
    return None
  if ":" in hardware:
    return hardware
  chips = target.chips
  if chips & (chips - 1):
    return None  # not a power of two: no standard slice shape
  two_d = target.accelerator.name in ("v5e", "v6e")
  dims = [1, 1] if two_d else [1, 1, 1]
  i = 0
  while math.prod(dims) < chips:  # double the axes round-robin: 4 -> 2x2x1, 64 -> 4x4x4
    dims[i % len(dims)] *= 2
    i += 1
  dims = sorted(d for d in dims if d > 1) + [d for d in dims if d == 1]
  return f"{target.accelerator.name}:{'x'.join(str(d) for d in dims)}"


# ----------------------------------------------------------------------------
# Evaluating one setup
# ----------------------------------------------------------------------------
def evaluate(dims: mm.ModelDims, setup: mm.Setup, target: hw.Target, model=None) -> dict[str, Any]:
  """Breakdown, totals, whether it fits HBM and host RAM, and (given the
  ModelConfig) the step-time estimate (lctx/sizing/step_estimate.py)."""
  bd = mm.estimate(dims, setup)
  acc = target.accelerator
  host_per_vm = bd.host * min(acc.devices_per_host, target.devices)
  fits = bd.total <= acc.hbm_bytes_per_device and host_per_vm <= acc.host_ram_bytes_per_host
  return {
    "setup": setup_record(setup),
    "per_device_total_bytes": bd.total,
    "fits": bool(fits),
    "breakdown": bd.as_dict(),
    "host_bytes_per_device": bd.host,
    "host_bytes_per_vm": host_per_vm,
  } | (_step(model, dims, setup, target, bd.host) if model is not None else {})


def _step(model, dims, setup, target, host_bytes) -> dict[str, Any]:
  est = step_estimate.estimate(model, dims, setup, target, host_bytes)
  return {
    "step_seconds_estimate": est["step_seconds_estimate"],
    "step_seconds_lower_bound": est["step_seconds_lower_bound"],
    "step_time_bound_by": est["step_time_bound_by"],
    "step_time": est,
  }


def check_valid(dims: mm.ModelDims, setup: mm.Setup) -> str:
  """'' if the strategy can run this mesh/heads/length, else the rule it breaks."""
  if setup.batch_size % setup.batch_ways:
    return f"batch_size={setup.batch_size} is not divisible by data x fsdp = {setup.batch_ways}"
  if setup.strategy == "none":
    return "" if setup.context_degree == 1 else "strategy 'none' needs context degree 1"
  try:
    validate_context_parallel(
      strategy=setup.strategy,
      mesh_shape=dict(setup.mesh),
      num_q_heads=dims.num_heads,
      num_kv_heads=dims.num_kv_heads,
      seq_len=setup.seq_len,
      load_balance=default_load_balance(setup.strategy),
    )
  except ValueError as err:
    return str(err)
  return ""


def candidates(exp, target: hw.Target):
  """Every setup the search considers, smallest first (see the module doc)."""
  devices = target.devices
  tensor, data = max(1, exp.mesh.tensor), max(1, exp.mesh.data)
  free = devices // (tensor * data) if devices % (tensor * data) == 0 else 0
  for degree in sorted(d for d in range(1, free + 1) if free and free % d == 0):
    fsdp = free // degree
    for remat, state in _remat_steps():
      for strategy in ("none",) if degree == 1 else STRATEGIES:
        ulysses = [1]
        if strategy == "usp":
          ulysses = sorted((u for u in range(2, degree) if degree % u == 0), reverse=True)
        for u in ulysses:
          mesh = {"data": data, "fsdp": fsdp, "tensor": tensor}
          mesh.update(context=degree // u, context_ulysses=u)
          yield make_setup(
            exp,
            strategy=strategy,
            mesh=mesh,
            remat_policy=remat,
            platform=_platform(target),
            **state,
          )


def _remat_steps():
  """(remat policy, state-offload overrides) in search order: REMAT_ORDER with the
  TrainConfig's state offload, then the OFFLOAD_ORDER walk."""
  for remat in remat_policies():
    yield remat, {}
  known = getattr(models_config, "REMAT_POLICIES", mm.REMAT_POLICIES)
  for remat, opt, params in OFFLOAD_ORDER:
    if remat in known:
      yield remat, dict(offload_optimizer_state=opt, offload_params=params)


def configured_setup(exp, dims: mm.ModelDims, target: hw.Target) -> tuple[mm.Setup | None, str]:
  """The gin file's own setup on the target, or (None, why it cannot run there)."""
  try:
    mesh = mesh_lib.resolve_mesh_shape(exp.mesh, target.devices)
  except ValueError as err:
    return None, str(err)
  strategy, _ = run_strategy(exp, mesh, _platform(target))
  setup = make_setup(
    exp,
    strategy=strategy,
    mesh=mesh,
    remat_policy=exp.model.remat_policy,
    platform=_platform(target),
  )
  return setup, ""


def run_strategy(exp, mesh_shape: dict[str, int], platform: str) -> tuple[str, str]:
  """(strategy, reason) the run's ContextPlan takes on this mesh: the one
  decision (lctx/parallel/auto.py decide_strategy), with the trainer's inputs."""
  train = exp.train
  return decide_strategy(
    train.context_parallel_strategy,
    mesh_shape=mesh_shape,
    platform=platform,
    dims=AttentionDims.of_model(exp.model),
    seq_len=train.seq_len,
    batch_size=train.batch_size,
    load_balance=train.context_options.load_balance,
    attention_backend=train.attention_options.backend,
    memory_budget_bytes=int(train.device_memory_gib * 2**30),
  )


def _platform(target: hw.Target) -> str:
  return target.accelerator.platform


# ----------------------------------------------------------------------------
# The mode
# ----------------------------------------------------------------------------
def plan(exp, *, hardware: str) -> dict[str, Any]:
  """The plan.json record (no files written)."""
  target = hw.parse_target(hardware)
  acc = target.accelerator
  dims = model_dims(exp.model)
  setup, why = configured_setup(exp, dims, target)
  if setup is None:
    configured = {"setup": None, "per_device_total_bytes": None, "fits": False, "error": why}
  else:
    problem = check_valid(dims, setup)
    configured = evaluate(dims, setup, target, exp.model)
    if problem:
      configured.update(fits=False, error=problem)
  smallest, fastest, checked, fitting = None, None, 0, 0
  for cand in candidates(exp, target):
    if check_valid(dims, cand):
      continue
    checked += smallest is None
    result = evaluate(dims, cand, target, exp.model)
    if not result["fits"]:
      continue
    fitting += 1
    smallest = smallest or result
    # Ties go to the earlier (smaller) candidate.
    if fastest is None or result["step_seconds_estimate"] < fastest["step_seconds_estimate"]:
      fastest = result
  topology = compile_topology(target, hardware)
  for chosen in (smallest, fastest):
    if chosen is not None:
      overrides = gin_overrides(_setup_from_record(exp, chosen["setup"], _platform(target)))
      chosen["gin_params"] = overrides
      chosen["compile_topology"] = topology
  return {
    "label": ESTIMATE_LABEL,
    "hardware": hardware,
    "target": {
      "accelerator": acc.name,
      "chips": target.chips,
      "devices": target.devices,
      "hosts": target.hosts,
      "hbm_bytes_per_device": acc.hbm_bytes_per_device,
      "host_ram_bytes_per_vm": acc.host_ram_bytes_per_host,
      "devices_per_vm": acc.devices_per_host,
    },
    "model": dataclasses.asdict(dims) | {"num_params": dims.num_params},
    "batch_size": exp.train.batch_size,
    "seq_len": exp.train.seq_len,
    "tokens_per_step": exp.train.batch_size * exp.train.seq_len,
    "configured": configured,
    "smallest": smallest,
    "fastest": fastest,
    "candidates_checked": checked,
    "candidates_fitting": fitting,
  }


def _setup_from_record(exp, rec: dict[str, Any], platform: str) -> mm.Setup:
  return make_setup(
    exp,
    strategy=rec["strategy"],
    mesh=rec["mesh"],
    remat_policy=rec["remat_policy"],
    platform=platform,
    offload_optimizer_state=rec.get("offload_optimizer_state"),
    offload_params=rec.get("offload_params"),
  )


def apply_setup(exp, rec: dict[str, Any]):
  """The experiment with a plan's setup (mesh, strategy, remat) put in."""
  mesh = mesh_lib.MeshConfig(**rec["mesh"])
  state = {k: rec[k] for k in ("offload_optimizer_state", "offload_params") if k in rec}
  train = dataclasses.replace(exp.train, context_parallel_strategy=rec["strategy"], **state)
  model = dataclasses.replace(
    exp.model,
    remat_policy=rec["remat_policy"],
    remat_group_size=rec["remat_group_size"],
    **_no_custom(exp.model),
  )
  return dataclasses.replace(exp, mesh=mesh, train=train, model=model)


def _gib(x) -> str:
  return "-" if x is None else f"{x / GiB:.2f} GiB"


def summary(record: dict[str, Any], gin_files: list[str] | None = None) -> str:
  """The printed report."""
  t = record["target"]
  lines = [
    f"Plan for {record['hardware']}: {t['devices']} devices of "
    f"{_gib(t['hbm_bytes_per_device'])} HBM, {_gib(t['host_ram_bytes_per_vm'])} host RAM per "
    f"VM of {t['devices_per_vm']} devices; batch {record['batch_size']} x "
    f"{record['seq_len']:,} tokens. All figures: {record['label']}.",
  ]
  for name in ("configured", "smallest", "fastest"):
    r = record.get(name)
    if r is None:
      lines.append(f"{name}: nothing in the search fits {record['hardware']}.")
      continue
    if r.get("setup") is None:
      lines.append(f"{name}: cannot run on {record['hardware']}: {r.get('error')}")
      continue
    s = r["setup"]
    mesh = ", ".join(f"{a}={v}" for a, v in s["mesh"].items() if v > 1) or "1 device"
    verdict = "fits" if r["fits"] else "does NOT fit"
    lines.append(
      f"{name}: {s['strategy']} on {mesh}, remat {s['remat_policy']}, "
      f"{s.get('attention_kernel', 'blockwise')} attention: "
      f"{_gib(r['per_device_total_bytes'])} per device ({verdict}), host "
      f"{_gib(r['host_bytes_per_device'])} per device / {_gib(r['host_bytes_per_vm'])} per VM"
      + (f"; {r['error']}" if r.get("error") else "")
      + (
        f"; step ESTIMATE {r['step_seconds_estimate']:.4g} s (bound by "
        f"{r['step_time_bound_by'].removesuffix('_seconds')})"
        if r.get("step_seconds_estimate") is not None
        else ""
      )
    )
    if name == "fastest":
      continue
    for k, v in r["breakdown"].items():
      lines.append(f"    {k:18s} {v / GiB:9.2f} GiB" if isinstance(v, int) else f"    {k:18s} {v}")
  sm = record["smallest"]
  if sm and sm.get("compile_topology"):
    files = " ".join(f"--gin_file={g}" for g in gin_files or ["G"])
    params = " ".join(f'--gin_param="{p}"' for p in sm["gin_params"])
    lines.append(
      "Ask the compiler: python main.py --mode=compile "
      f"{files} --compile_topology={sm['compile_topology']} {params}"
    )
  return "\n".join(lines)


def run_plan(
  exp, workdir: str, *, hardware: str, plan_then_compile: bool = False, gin_files=None
) -> dict[str, Any]:
  """`--mode=plan`: prints the plan, writes <workdir>/plan.json, returns the record."""
  # Bad input from the command line: ConfigError, so main prints one `error:`
  # line and exits 2 (not a traceback).
  if not hardware:
    raise errors.ConfigError(
      "--mode=plan needs --plan_hardware, e.g. v5p-64, tpu7x-64, h100x8 or a "
      "topology such as v5p:4x4x4"
    )
  try:
    hw.parse_target(hardware)
  except ValueError as err:
    raise errors.ConfigError(f"--plan_hardware={hardware}: {err}") from err
  record = plan(exp, hardware=hardware)
  if plan_then_compile:
    record["compiled"] = _compile_winner(exp, record)
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "plan.json"), "w") as f:
    json.dump(record, f, indent=2)
  text = summary(record, gin_files)
  print(text)
  logging.info("Plan written to %s", os.path.join(workdir, "plan.json"))
  return record


def _compile_winner(exp, record) -> dict[str, Any] | None:
  sm = record["smallest"]
  if sm is None or not sm.get("compile_topology"):
    logging.warning("plan_then_compile: nothing to compile (no fitting TPU setup).")
    return None
  from lctx.sizing import compile as compile_lib  # pylint: disable=g-import-not-at-top

  compiled = compile_lib.compile_step(
    apply_setup(exp, sm["setup"]), topology=sm["compile_topology"]
  )
  est = sm["per_device_total_bytes"]
  got = compiled["per_device"]["total_bytes"]
  compiled["planner_error_pct"] = 100.0 * (est - got) / got if got else None
  return compiled


def _head_chunks(context, strategy: str) -> int | None:
  """The head stages the memory model counts: UPipe's under ulysses / usp, and
  under ring the stages of ContextOptions.stage_projections (no all-to-all)."""
  if strategy in ("ulysses", "usp") or (strategy == "ring" and context.stage_projections):
    return context.head_chunks
  return None

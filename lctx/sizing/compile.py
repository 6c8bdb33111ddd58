r"""`--mode=compile`: the train step compiled for a named TPU slice or GPU node, from any machine.

python main.py --mode=compile --gin_file=gin/ring_v5p.gin --compile_topology=v5p:4x4x4
python main.py --mode=compile --gin_file=gin/long_h100.gin --compile_topology=h100x8

libtpu describes a TPU slice without one (lctx/sizing/tpu.py), and the CUDA
plugin a GPU node without a GPU (lctx/sizing/gpu.py): their compile-only devices
take the real mesh, the real model and the real sequence length, and the
compiler itself says how much device memory (and pinned host memory) each
device needs. No parameter is materialised: the step is lowered on
`ShapeDtypeStruct`s. MaxText's `train_compile.py` is the same tool.

`compile_step` returns the record that `run_compile` writes to
`<workdir>/compile.json`; a compile-time out-of-memory is a result there
(`fits: false`), not an exception.
"""

from __future__ import annotations

import dataclasses
import datetime
import glob
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from typing import Any

import numpy as np

from lctx import hardware, progress
from lctx.errors import ConfigError
from lctx.sizing import gpu, tpu

GiB = hardware.GiB
# The compiler's own HBM check: "Ran out of memory on HBM, the total memory
# required for HLO temporaries (97.88G) exceeds available HBM (95.74G)." G is
# GiB (T, TiB, past 1024 G). The first figure is the whole program's (arguments + outputs - aliased
# + temporaries), not temporaries alone.
_HBM_OOM = re.compile(r"\(([\d.]+)([KMGT]?)\) exceeds available HBM \(([\d.]+)([KMGT]?)\)")
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
# Other RESOURCE_EXHAUSTED phrasings: "Used 120.5G of 95.74G hbm."
_USED_OF = re.compile(r"Used ([\d.]+)([KMGT]?)i?B? of ([\d.]+)([KMGT]?)i?B? hbm", re.I)


# ----------------------------------------------------------------------------
# Devices
# ----------------------------------------------------------------------------
# The sources that decide a compiled train step (paths from the repository root).
COMPILED_CODE = (
  "lctx/kernels",
  "lctx/parallel",
  "lctx/models",
  "lctx/trainer.py",
  "lctx/train_config.py",
  "lctx/optimizer.py",
  "lctx/loss.py",
  "lctx/sizing/compile.py",
)


def code_hash(exclude=("lctx/parallel/attention_memory.py",)) -> str:
  """Short hash of the COMPILED_CODE sources but `exclude` (by default the
  planner's arithmetic, which compiles nothing): the key under which the
  benchmark scripts cache compiled figures, which are only as good as the code
  they came from."""
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  h = hashlib.sha256()
  for rel in COMPILED_CODE:
    path = os.path.join(root, rel)
    files = (
      sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if f.endswith(".py"))
      if os.path.isdir(path)
      else [path]
    )
    for name in files:
      rel_name = os.path.relpath(name, root)
      if rel_name in exclude:
        continue
      h.update(rel_name.encode())
      with open(name, "rb") as f:
        h.update(f.read())
  return h.hexdigest()[:16]


def compile_devices(topology: str, num_slices: int = 1):
  """(devices, accelerator row, HBM bytes per device, chips) to compile for.

  `topology` is a TPU slice ('v5p:4x4x4': libtpu's compile-only devices,
  lctx/sizing/tpu.py) or a GPU node ('h100x8': the CUDA plugin's,
  lctx/sizing/gpu.py). For GPUs the HBM is the device memory CUDA reports (a
  little under the table's nominal size).
  """
  if ":" in topology:
    accel = hardware.topology_accelerator(topology)
    devices = tpu.topology_devices(topology, num_slices)
    chips = hardware.topology_chips(topology) * num_slices
    return devices, accel, accel.hbm_bytes_per_device, chips
  target = hardware.parse_target(topology)
  accel = target.accelerator
  if accel.platform != "gpu":
    raise ConfigError(
      f"--compile_topology={topology!r}: a TPU slice is named by its topology, "
      "e.g. 'v5p:4x4x4' or 'tpu7x:4x4x4'; GPU nodes by '<kind>x<gpus>', e.g. 'h100x8'."
    )
  if num_slices != 1:
    raise ConfigError(
      f"--compile_topology_num_slices={num_slices}: GPU nodes are named whole "
      f"('h100x16' for two nodes), not as slices; got {topology!r}."
    )
  devices = gpu.gpu_topology_devices(accel.name, target.chips)
  return devices, accel, gpu.GPU_SPECS[accel.name].device_memory_size, target.chips


def _mesh_config(exp, topology: str, num_slices: int):
  """The gin file's MeshConfig; across slices, data parallel over DCN unless set."""
  cfg = exp.mesh
  dcn = cfg.dcn_data * cfg.dcn_fsdp
  if num_slices > 1 and dcn == 1:
    return dataclasses.replace(cfg, dcn_data=num_slices), (
      f"MeshConfig.dcn_data = {num_slices}: data parallel across the slices"
    )
  if dcn != num_slices:
    raise ConfigError(
      f"MeshConfig.dcn_data x dcn_fsdp = {cfg.dcn_data} x {cfg.dcn_fsdp} = {dcn} slices, "
      f"but --compile_topology_num_slices={num_slices} ({topology})."
    )
  return cfg, ""


# ----------------------------------------------------------------------------
# What the compiled program says
# ----------------------------------------------------------------------------
def attention_backend_of(hlo_text: str, configured: str = "auto") -> str:
  """The attention kernel a compiled (optimised) HLO module really runs.

  The fast kernels leave their mark in the module: 'splash' (Mosaic calls
  named splash_*), 'splash_interpret' (splash run by the Pallas interpreter,
  as plain HLO), 'cudnn' (cuDNN fused attention), 'cpu' (lctx's fused C++
  kernel, an XLA FFI call); several are joined by '+'. The pure-JAX kernels
  compile to plain XLA ops with no name of their own, so where no fast kernel
  is found the answer is the configured pure-JAX backend: 'blockwise' for
  'auto' (what auto falls back to), else 'reference' or 'xla' as configured.
  """
  found = []
  mosaic = re.findall(r"%(\S+) = .*custom_call_target=\"tpu_custom_call\"", hlo_text)
  if any("splash" in name for name in mosaic):
    found.append("splash")
  elif "splash" in hlo_text:
    found.append("splash_interpret")
  if "__cudnn$fmha" in hlo_text:
    found.append("cudnn")
  if "lctx_cpu_attention" in hlo_text:
    found.append("cpu")
  if found:
    return "+".join(found)
  return configured if configured in ("reference", "xla") else "blockwise"


def _memory(compiled) -> dict[str, int]:
  m = compiled.memory_analysis()
  get = lambda name: int(getattr(m, name, 0) or 0)  # noqa: E731
  per_device = {
    "argument_bytes": get("argument_size_in_bytes"),
    "output_bytes": get("output_size_in_bytes"),
    "alias_bytes": get("alias_size_in_bytes"),
    "temp_bytes": get("temp_size_in_bytes"),
  }
  per_device["total_bytes"] = (
    per_device["argument_bytes"]
    + per_device["output_bytes"]
    - per_device["alias_bytes"]
    + per_device["temp_bytes"]
  )
  per_device["host_bytes"] = (
    get("host_argument_size_in_bytes")
    + get("host_output_size_in_bytes")
    - get("host_alias_size_in_bytes")
    + get("host_temp_size_in_bytes")
  )
  return per_device


_LARGEST = 8  # largest HBM slots reported


def _allocated(dump_dir: str, program: str = "train_step") -> dict[str, Any]:
  """What the executable really allocates, from XLA's buffer-assignment dump.

  `hbm_bytes`: every HBM allocation (arguments, the temporary heap, constants),
  the "Total bytes" of the default memory space in the memory-usage report;
  `temp_bytes`: the preallocated temporary heap in HBM. `hbm_bytes` is the figure
  the compiler's first out-of-memory check measures (its second adds the code
  overlays) and the one `fits` is judged by (docs/memory.md);
  `host_bytes`: the pinned host memory the program allocates (memory space 5),
  absent when nothing is offloaded;
  `largest_buffers`: the largest slots of that memory and the values sharing
  them (the report is written even when the compile runs out of memory).
  """
  out = {}
  for path in glob.glob(os.path.join(dump_dir, f"*{program}*memory-usage-report.txt")):
    with open(path) as f:
      report = f.read()  # the host memory space comes after the HBM slots
    m = re.search(r"Memory Space: default \(color=0\)\nTotal bytes: (\d+)", report)
    if m:
      out["hbm_bytes"] = int(m.group(1))
    # Pinned host memory (XLA's memory space 5, S(5) in the HLO; the report names it
    # 'cmem'): the host values offloading allocates, packed by their live ranges.
    m = re.search(r"Memory Space: \w+ \(color=5\)\nTotal bytes: (\d+)", report)
    if m:
      out["host_bytes"] = int(m.group(1))
    # The largest HBM slots: "cumulative; size; offset; n_values; shapes".
    hbm = report.split("Memory Space:")[1] if "Memory Space:" in report else ""
    rows = re.findall(r"^\s*[\d.]+\w+\(\s*\d+%\);\s*([\d.]+\w+);\s*\d+;\s*\d+; (.*)$", hbm, re.M)
    out["largest_buffers"] = [f"{size}: {shapes[:200]}" for size, shapes in rows[:_LARGEST]]
  for path in glob.glob(os.path.join(dump_dir, f"*{program}*buffer-assignment.txt")):
    with open(path) as f:
      for line in f:
        m = re.match(r"allocation \d+: size (\d+), preallocated-temp:", line)
        if m:
          out["temp_bytes"] = int(m.group(1))
  return out


def _oom_bytes(message: str) -> tuple[int | None, int | None]:
  """(needed, available) bytes per device from a RESOURCE_EXHAUSTED message."""
  m = _HBM_OOM.search(message) or _USED_OF.search(message)
  if m:
    return (
      int(float(m.group(1)) * _UNITS[m.group(2).upper()]),
      int(float(m.group(3)) * _UNITS[m.group(4).upper()]),
    )
  return None, None


def _matmul_flops(hlo: str) -> dict[str, Any]:
  """Extras: the matmul FLOPs one device executes, loops at their trip counts
  (`lctx/sizing/hlo_flops.py`), and the Mosaic kernel calls whose FLOPs HLO hides."""
  from lctx.sizing import hlo_flops  # pylint: disable=g-import-not-at-top

  try:
    count = hlo_flops.matmul_flops(hlo)
  except Exception as err:  # pylint: disable=broad-except
    return {"matmul_flops_error": f"{type(err).__name__}: {err}"[:500]}
  return {
    "matmul_flops_per_device": count["dot_flops"],
    "matmul_flops_per_device_min": count["dot_flops_min"],
    "kernel_custom_calls": count["custom_calls"],
    "kernel_custom_calls_by_kernel": count["custom_calls_by_kernel"],
    "unknown_trip_count_loops": count["unknown_trip_count_loops"],
    "_count": count,
  }


def collective_bytes(count: dict[str, Any], mesh) -> dict[str, Any]:
  """Collective bytes one device sends per step (hlo_flops.collective), by kind,
  by the mesh axes its groups span, and over ICI or DCN (a group whose devices
  sit in more than one slice). Group ids are positions in the mesh's device
  array, as XLA's SPMD partitioner numbers them."""
  from lctx.sizing import hlo_flops  # pylint: disable=g-import-not-at-top

  devs = mesh.devices
  n = devs.size
  coords = np.stack(np.unravel_index(np.arange(n), devs.shape), axis=1)
  slices = np.array([getattr(d, "slice_index", 0) or 0 for d in devs.flat])
  by_kind = dict.fromkeys(hlo_flops.COLLECTIVES, 0.0)
  by_axis: dict[str, float] = {}
  link = {"ici": 0.0, "dcn": 0.0}
  for row in count.get("collectives", []):
    groups = [g for g in hlo_flops.expand_groups(row["groups"], n) if g]
    varying, dcn = set(), False
    for g in groups:
      g = [i for i in g if i < n]
      c = coords[g]
      varying |= {mesh.axis_names[a] for a in range(c.shape[1]) if len(set(c[:, a])) > 1}
      dcn |= len(set(slices[g])) > 1
    axes = "+".join(a for a in mesh.axis_names if a in varying) or "none"
    by_kind[row["kind"]] += row["bytes"]
    by_axis[axes] = by_axis.get(axes, 0.0) + row["bytes"]
    link["dcn" if dcn else "ici"] += row["bytes"]
  return {
    "collective_bytes_per_device": sum(by_kind.values()),
    "collective_bytes_by_kind": by_kind,
    "collective_bytes_by_axis": by_axis,
    "ici_bytes_per_device": link["ici"],
    "dcn_bytes_per_device": link["dcn"],
  }


def step_figures(
  count: dict[str, Any],
  *,
  mesh,
  accel,
  model,
  train,
  peak_flops_per_device=None,
  training: bool = True,
) -> dict[str, Any]:
  """compile.json's FLOP, byte and step-time keys from an hlo_flops count.

  total = dense matmuls + attention (both with every recompute the program
  does); model = the trainer's formula (ModelConfig.flops_per_token: 3 x forward
  for a train step, the forward alone for the eval step, training=False; no
  recompute; linear-attention layers at their chunked delta rule's count,
  models.config.linear_mixer_flops); recompute_ratio = total / model. Linear
  layers' sequence work (LINEAR_SCOPE: conv and delta rule, with the context-
  parallel summaries) is part of dense, also reported alone beside the model's
  figure for it, with the collective bytes of their state exchange and halos.
  The step time is hardware.step_time's estimate (labelled as one)."""
  from lctx.models import config as models_config  # pylint: disable=g-import-not-at-top

  devices = mesh.devices.size
  tokens = train.batch_size * train.seq_len
  per_token = model.flops_per_token(train.seq_len, causal=True, training=training)
  model_flops = per_token * tokens / devices
  total = count["dense_flops"] + count["attention_flops"]
  linear_layers = sum(t == "linear_attention" for t in model.layer_types)
  model_linear = (
    (3 if training else 1) * linear_layers * models_config.linear_mixer_flops(model) * tokens
  ) / devices
  linear_bytes = count.get("linear_collective_bytes", {})
  out = {
    "dense_flops_per_device": count["dense_flops"],
    "attention_flops_per_device": count["attention_flops"],
    "total_flops_per_device": total,
    "model_flops_per_device": model_flops,
    "recompute_ratio": total / model_flops if model_flops else None,
    "estimated_trip_count_loops": count["estimated_trip_count_loops"],
    "linear_layers": linear_layers,
    "linear_flops_per_device": count.get("linear_dot_flops", 0.0),
    "model_linear_flops_per_device": model_linear,
    "linear_collective_bytes_per_device": sum(linear_bytes.values()),
    "linear_collective_bytes_by_kind": {k: v for k, v in linear_bytes.items() if v},
  }
  out.update(collective_bytes(count, mesh))
  host = count["host_transfer_bytes"]
  out["host_transfer_bytes_per_device"] = host
  out.update(
    hardware.step_time(
      accel,
      flops=total,
      host_bytes=host["to_host"] + host["to_device"],
      ici_bytes=out["ici_bytes_per_device"],
      dcn_bytes=out["dcn_bytes_per_device"],
      tokens_per_step=tokens,
      peak_flops_per_device=peak_flops_per_device,
    )
  )
  return out


def _flops(compiled) -> float | None:
  """cost_analysis() flops: every loop body counted once, Mosaic kernels as zero."""
  try:
    cost = compiled.cost_analysis()
  except Exception:  # pylint: disable=broad-except
    return None
  if isinstance(cost, list):
    cost = cost[0] if cost else {}
  flops = (cost or {}).get("flops")
  return float(flops) if flops is not None else None


# ----------------------------------------------------------------------------
# The mode
# ----------------------------------------------------------------------------
COMPILE_STEPS = ("train", "eval")
# Answer positions per row the eval step is compiled for (its [B, K] inputs).
EVAL_SCORE_WIDTH = 64


def compile_step(exp, *, topology: str, num_slices: int = 1, step: str = "train") -> dict[str, Any]:
  """Compiles `exp`'s train step (or, with step='eval', the eval step that
  scores answers inside the program: Trainer.lower_score_step) for
  `num_slices` slices of `topology`.

  Returns the compile.json record (see README "Will it fit?"). A compile that
  runs out of HBM returns `fits: False` with the compiler's figures; invalid
  configs (mesh, strategy, shapes) raise ValueError as in every mode.
  """
  import jax  # pylint: disable=g-import-not-at-top

  from lctx.parallel import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
  from lctx.trainer import Trainer  # pylint: disable=g-import-not-at-top

  if step not in COMPILE_STEPS:
    raise ValueError(f"--compile_step={step!r} is not one of {COMPILE_STEPS}.")
  devices, accel, hbm, chips = compile_devices(topology, num_slices)
  mesh_cfg, mesh_note = _mesh_config(exp, topology, num_slices)
  try:
    mesh = mesh_lib.make_mesh(mesh_cfg, devices=devices)
  except ValueError as err:
    raise ConfigError(f"--compile_topology={topology} ({len(devices)} devices): {err}") from err
  trainer = Trainer(exp.model, exp.train, mesh)
  devices_per_vm = min(accel.devices_per_host, len(devices) // num_slices)
  record: dict[str, Any] = {
    "topology": topology,
    "num_slices": num_slices,
    "device_kind": devices[0].device_kind,
    "devices": len(devices),
    "devices_per_chip": len(devices) // chips,
    "batch_size": exp.train.batch_size,
    "seq_len": exp.train.seq_len,
    "tokens_per_step": exp.train.batch_size * exp.train.seq_len,
    "step": step,
    "strategy": trainer.strategy,
    "attention_backend": None,
    "per_device": None,
    "hbm_bytes_per_device": hbm,
    "host_bytes_per_vm": None,
    "host_ram_bytes_per_vm": accel.host_ram_bytes_per_host,
    "fits": False,
    "compile_seconds": None,
    # Extras (not part of the contract).
    "mesh": mesh_lib.mesh_shape(mesh),
    "devices_per_vm": devices_per_vm,
    "remat_policy": getattr(exp.model, "remat_policy", None),
    "jax_version": jax.__version__,
    "libtpu_version": _libtpu_version(),
    "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
    "notes": [mesh_note] if mesh_note else [],
  }
  t0 = time.perf_counter()
  # The buffer assignment is dumped so that what the executable allocates can
  # be compared with memory_analysis() (they differ; see _allocated). With
  # LCTX_COMPILE_DUMP_DIR set, the dump (optimized HLO, buffer assignment, live
  # ranges) is kept there for a closer look at what is live at the peak.
  keep = os.environ.get("LCTX_COMPILE_DUMP_DIR")
  dump_dir = keep or tempfile.mkdtemp(prefix="lctx-compile-")
  dump = {"xla_dump_to": dump_dir, "xla_dump_hlo_as_text": True, "xla_dump_hlo_pass_re": "^$"}
  try:
    try:
      with progress.Heartbeat(f"compile {topology}") as beat:  # minutes at full size
        lowered = (
          trainer.lower_score_step(width=EVAL_SCORE_WIDTH)
          if step == "eval"
          else trainer.lower_train_step()
        )
        beat.phase("compiling")
        compiled, message = lowered.compile(compiler_options=dump), ""
    except jax.errors.JaxRuntimeError as err:
      if "RESOURCE_EXHAUSTED" not in str(err):
        raise
      compiled, message = None, str(err)
    allocated = _allocated(dump_dir, "score_step" if step == "eval" else "train_step")
  finally:
    if not keep:
      shutil.rmtree(dump_dir, ignore_errors=True)
  record["compile_seconds"] = round(time.perf_counter() - t0, 1)
  record["largest_buffers"] = allocated.get("largest_buffers", [])
  if compiled is None:
    needed, available = _oom_bytes(message)
    record["error"] = message.strip().splitlines()[0][:1000]
    record["compiler_needed_bytes"] = needed
    record["compiler_available_bytes"] = available
    record["per_device"] = dict.fromkeys(
      ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "host_bytes"), None
    )
    # The compiler's figure for the whole program (see _HBM_OOM): the buffer
    # assignment's HBM allocation when its first check refuses, the allocation
    # plus the code overlays when the second (after code generation) does.
    record["per_device"]["total_bytes"] = needed
    record["allocated_hbm_bytes_per_device"] = allocated.get("hbm_bytes")
    record["allocated_temp_bytes_per_device"] = allocated.get("temp_bytes")
    record["fits_figure"] = "compiler"
    record["hbm_checked_bytes_per_device"] = needed
    return record
  per_device = _memory(compiled)
  hlo = compiled.as_text()
  record["attention_backend"] = attention_backend_of(hlo, exp.train.attention_options.backend)
  record["per_device"] = per_device
  record["host_bytes_per_vm"] = per_device["host_bytes"] * devices_per_vm
  record["flops_per_device"] = _flops(compiled)
  flops = _matmul_flops(hlo)
  count = flops.pop("_count", None)
  record.update(flops)
  if count is not None:
    record.update(
      step_figures(
        count,
        mesh=mesh,
        accel=accel,
        model=exp.model,
        train=exp.train,
        training=step == "train",
      )
    )
  record["allocated_hbm_bytes_per_device"] = allocated.get("hbm_bytes")
  record["allocated_temp_bytes_per_device"] = allocated.get("temp_bytes")
  record["generated_code_bytes_per_device"] = int(
    getattr(compiled.memory_analysis(), "generated_code_size_in_bytes", 0) or 0
  )
  # The HBM figure `fits` is judged by. On TPU: the buffer assignment's HBM
  # allocation (arguments, outputs, the temporary heap). The TPU compiler checks
  # HBM twice and refuses a program that fails either: before code generation
  # the allocation itself ("HLO temporaries (X G) exceeds available HBM"), after
  # it the allocation plus the program's code overlays ("CompileTimeHbmOom ...
  # Used X of Y hbm", its breakdown in the dump's
  # *oom_top_memory_consuming_instructions). A program it accepted therefore
  # allocates no more than the HBM. memory_analysis()' temporaries exceed the
  # allocation on programs with loops, and the compiler accepts programs whose
  # memory_analysis total is far above the HBM
  # (tests/test_compile.py::test_the_compilers_hbm_check_is_the_buffer_assignment;
  # docs/memory.md). Without the dump, and on GPU (whose compiler has no such
  # check), memory_analysis' total.
  if accel.platform == "tpu" and allocated.get("hbm_bytes"):
    record["fits_figure"] = "allocation"
    checked = allocated["hbm_bytes"]
  else:
    record["fits_figure"] = "memory_analysis"
    checked = per_device["total_bytes"]
  record["hbm_checked_bytes_per_device"] = checked
  hbm_ok = checked <= hbm
  # Pinned host memory likewise: on TPU the buffer assignment's host allocation,
  # which memory_analysis()' host temporaries exceed on programs with loops as its
  # HBM temporaries do (Qwen3.5-shaped hybrid, v5p, 1,048,576 tokens per device:
  # 96 GiB allocated, 128 by memory_analysis).
  record["allocated_host_bytes_per_device"] = allocated.get("host_bytes")
  if record["fits_figure"] == "allocation" and allocated.get("host_bytes") is not None:
    record["host_bytes_per_vm"] = allocated["host_bytes"] * devices_per_vm
  host_ok = record["host_bytes_per_vm"] <= accel.host_ram_bytes_per_host
  record["fits"] = hbm_ok and host_ok
  if accel.platform == "gpu":
    record["notes"].append(
      "compile-only GPU devices (lctx/sizing/gpu.py): the XLA GPU compiler raises no "
      "out-of-memory, so fits is memory_analysis()' total against the device memory CUDA "
      f"reports ({_gib(hbm)} GiB); no autotuning, and cuDNN workspaces are not counted"
    )
  elif record["fits_figure"] == "memory_analysis":
    record["notes"].append(
      "no buffer-assignment report was found in the compile's dump, so fits is judged by "
      f"memory_analysis()' total ({_gib(per_device['total_bytes'])} GiB), which is at least "
      "the allocation the compiler checks"
    )
  elif per_device["total_bytes"] > hbm:
    record["notes"].append(
      f"memory_analysis() reports {_gib(per_device['total_bytes'])} GiB per device (temporaries "
      f"{_gib(per_device['temp_bytes'])} GiB), more than the {_gib(hbm)} GiB of HBM; the "
      f"buffer assignment allocates {_gib(checked)} GiB (temporary heap "
      f"{_gib(allocated.get('temp_bytes'))} GiB). The compiler's out-of-memory checks measure "
      "the allocation (and after code generation its code overlays besides) and accepted the "
      "program; fits is judged by the allocation (docs/memory.md)"
    )
  return record


def _libtpu_version() -> str | None:
  try:
    from importlib import metadata  # pylint: disable=g-import-not-at-top

    return metadata.version("libtpu")
  except Exception:  # pylint: disable=broad-except
    return None


def _gib(n: int | None) -> str:
  return "?" if n is None else f"{n / GiB:.2f}"


def _size(n: int | None) -> str:
  """Bytes as GiB, or MiB below 1 GiB (tiny test models)."""
  if n is None or abs(n) >= GiB:
    return f"{_gib(n)} GiB"
  return f"{n / 2**20:.1f} MiB"


def _host_size(r: dict[str, Any]) -> str:
  """Pinned host per device: the allocation (what fits is judged by on TPU) and
  memory_analysis' figure where they differ."""
  analysis = r["per_device"]["host_bytes"]
  allocated = r.get("allocated_host_bytes_per_device")
  if allocated is None or r.get("fits_figure") != "allocation" or allocated == analysis:
    return _size(analysis)
  return f"{_size(allocated)} allocated (memory_analysis {_size(analysis)})"


def summary(record: dict[str, Any]) -> str:
  """The readable report of one compile record."""
  r, d = record, record["per_device"]
  lines = [
    f"compile {r['topology']} x {r['num_slices']} slice(s): {r['devices']} devices "
    f"({r['device_kind']}, {r['devices_per_chip']} per chip), mesh {r['mesh']}",
    f"  batch {r['batch_size']:,} x seq {r['seq_len']:,} = {r['tokens_per_step']:,} tokens per "
    f"step; strategy {r['strategy']}; attention kernel compiled: "
    f"{r['attention_backend'] or '(no program: the compile ran out of memory)'}; "
    f"remat {r['remat_policy']}",
  ]
  hbm = r["hbm_bytes_per_device"]
  if d["argument_bytes"] is not None:
    lines += [
      f"  per device: arguments {_size(d['argument_bytes'])} + outputs {_size(d['output_bytes'])}"
      f" - aliased {_size(d['alias_bytes'])} + temporaries {_size(d['temp_bytes'])}"
      f" = {_size(d['total_bytes'])} of {_gib(hbm)} GiB HBM "
      f"({100 * d['total_bytes'] / hbm:.1f}%)",
      f"  buffer assignment: {_size(r.get('allocated_hbm_bytes_per_device'))} of HBM allocated "
      f"per device (temporary heap {_size(r.get('allocated_temp_bytes_per_device'))})",
      f"  pinned host memory: {_host_size(r)} per device, "
      f"{_size(r['host_bytes_per_vm'])} per VM ({r['devices_per_vm']} devices) of "
      f"{_gib(r['host_ram_bytes_per_vm'])} GiB RAM",
    ]
  else:
    lines.append(f"  compiler: {r.get('error')}")
  if r.get("largest_buffers"):
    lines.append("  largest HBM slots per device (size: the values sharing it):")
    lines += [f"    {row}" for row in r["largest_buffers"][:5]]
  if r.get("matmul_flops_per_device") is not None:
    lines.append(
      f"  matmul FLOPs per device: {r['matmul_flops_per_device']:.4g} (HLO dots x loop trip "
      f"counts) + {r['kernel_custom_calls']} Mosaic kernel calls not counted; cost_analysis: "
      f"{r['flops_per_device'] or 0:.4g} (each loop body once)"
    )
  if r.get("total_flops_per_device") is not None:
    b = r["step_time_bounds"]
    lines += [
      f"  FLOPs per device: total {r['total_flops_per_device']:.4g} = dense "
      f"{r['dense_flops_per_device']:.4g} + attention {r['attention_flops_per_device']:.4g}; "
      f"model (trainer's formula) {r['model_flops_per_device']:.4g}; recompute ratio "
      f"{r['recompute_ratio']:.3f}",
    ]
    if r.get("linear_layers"):
      lines.append(
        f"  linear layers ({r['linear_layers']}): conv + delta rule FLOPs per device "
        f"{r['linear_flops_per_device']:.4g} (in dense; model {r['model_linear_flops_per_device']:.4g}); "
        f"state exchange and halos {_size(r['linear_collective_bytes_per_device'])} per device ("
        + ", ".join(f"{k} {_size(v)}" for k, v in r["linear_collective_bytes_by_kind"].items())
        + ")"
      )
    lines += [
      f"  bytes per device per step: collectives {_size(r['collective_bytes_per_device'])} "
      f"(ICI {_size(r['ici_bytes_per_device'])}, DCN {_size(r['dcn_bytes_per_device'])}; "
      + ", ".join(f"{k} {_size(v)}" for k, v in r["collective_bytes_by_axis"].items())
      + f"), host transfers {_size(sum(r['host_transfer_bytes_per_device'].values()))}",
      f"  step time ESTIMATE: lower bound {r['step_seconds_lower_bound']:.4g} s (FLOPs "
      f"{b['flops_seconds']:.4g} s, host {b['host_transfer_seconds']:.4g} s, ICI "
      f"{b['ici_seconds']:.4g} s, DCN {b['dcn_seconds']:.4g} s); at "
      f"{100 * r['step_time_efficiency']:.0f}% efficiency {r['step_seconds_estimate']:.4g} s, "
      f"{r['tokens_per_second_estimate']:.4g} tokens/s",
    ]
  elif r.get("matmul_flops_error"):
    lines.append(f"  matmul FLOPs: not counted ({r['matmul_flops_error']})")
  lines.append(f"  compiler ran {r['compile_seconds']} s")
  lines += [f"  note: {n}" for n in r["notes"]]
  checked = r.get("hbm_checked_bytes_per_device", d["total_bytes"])
  by = {"allocation": " allocated", "memory_analysis": " (memory_analysis)"}.get(
    r.get("fits_figure"), ""
  )
  if r["fits"]:
    lines.append(f"fits: {_gib(checked)} GiB{by} of {_gib(hbm)} GiB per device")
  elif checked is not None and checked > hbm:
    lines.append(f"does not fit: needs {_gib(checked)} GiB{by} of {_gib(hbm)} GiB per device")
  elif d["total_bytes"] is None:
    lines.append(f"does not fit: out of HBM ({_gib(hbm)} GiB per device)")
  else:
    lines.append(
      f"does not fit: needs {_gib(r['host_bytes_per_vm'])} GiB of pinned host memory of "
      f"{_gib(r['host_ram_bytes_per_vm'])} GiB RAM per VM"
    )
  return "\n".join(lines)


def run_compile(
  exp, workdir: str, *, topology: str, num_slices: int = 1, step: str = "train"
) -> dict[str, Any]:
  """`--mode=compile`: compiles, prints the summary, writes <workdir>/compile.json."""
  if not topology:
    raise ConfigError(
      "--mode=compile needs --compile_topology, e.g. --compile_topology=v5p:4x4x4 "
      "(optionally --compile_topology_num_slices=N)."
    )
  record = compile_step(exp, topology=topology, num_slices=num_slices, step=step)
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "compile.json"), "w") as f:
    json.dump(record, f, indent=2)
  print(summary(record), flush=True)
  return record

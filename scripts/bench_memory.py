r"""Will Llama-3.1-8B fit? Per-device and per-host memory by strategy, length and slice.

For each TPU slice (`v5p:4x4x4`: 64 devices; `tpu7x:4x4x4`: 128 devices), each
length (1M, 4M, 16M tokens) and each context strategy on a mesh it can take,
the row holds the planner's estimate (lctx/sizing/memory_model.py) and, where
compiled, the TPU compiler's figures (`--mode=compile` on compile-only devices:
`python main.py --mode=compile ...` in a subprocess, one per cell). Writes
bench_results/bench_memory.json and prints a table.

Meshes (batch 1 unless a strategy needs more rows to use every device):
  all_gather  context = every device;
  ulysses     context = 8 (the kv heads), fsdp = the rest, batch = fsdp rows
              (so tokens per step = batch x length);
  ring        context = every device (zigzag load balance);
  usp         ulysses 8 x ring (devices / 8).
Model and run settings are gin/models/llama3_8b.gin + gin/runs/tpu_pg19.gin
(bf16, remat 'full', loss chunks of 8,192, MLP chunks of 32,768, attention
blocks of 2,048), as the TPU gin files use.

Compiled results are cached in bench_results/bench_memory_cache.json, keyed by
a hash of the operative config (model, train, mesh), the topology and the
sources that shape the step (lctx.sizing.compile.code_hash), so a rerun compiles only the cells
whose config or code changed. A full-size compile takes
minutes and several GiB on 2 cores: run it under the shared lock, and pick
cells with --only / --lengths / --strategies / --topologies; --planner_only
compiles nothing (rows then say 'planner only').

  flock /tmp/lctx-heavy.lock python scripts/bench_memory.py --lengths=4M,16M \
      --strategies=ring,usp
  python scripts/bench_memory.py --planner_only
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import gin  # noqa: E402

from lctx import configs, gin_utils, hardware  # noqa: E402
from lctx.sizing import compile as compile_lib  # noqa: E402
from lctx.sizing import devices, planner  # noqa: E402

GiB = 2**30
GIN_FILES = ("gin/runs/tpu_pg19.gin", "gin/models/llama3_8b.gin")
TOPOLOGIES = ("v5p:4x4x4", "tpu7x:4x4x4")
STRATEGIES = ("all_gather", "ulysses", "ring", "usp")
LENGTHS = {"1M": 1 << 20, "4M": 1 << 22, "16M": 1 << 24}
ULYSSES = 8  # Llama-3.1-8B's kv heads: the widest all-to-all the heads allow
# The length records: gin file -> the slice or node its header names
# (GPU nodes compile on the CUDA plugin's compile-only devices, lctx/sizing/gpu.py).
RECORDS = {
  "gin/long_v5p.gin": "v5p:4x4x4",
  "gin/long_ironwood.gin": "tpu7x:4x4x4",
  "gin/long_h100.gin": "h100x8",
}


def mesh_for(strategy: str, devices: int) -> tuple[dict[str, int], int]:
  """(mesh, batch rows) for a strategy on `devices` devices."""
  if strategy in ("all_gather", "ring"):
    return {"context": devices, "fsdp": 1, "context_ulysses": 1}, 1
  if strategy == "ulysses":
    return {"context": ULYSSES, "fsdp": devices // ULYSSES, "context_ulysses": 1}, (
      devices // ULYSSES
    )
  if strategy == "usp":
    return {"context": devices // ULYSSES, "fsdp": 1, "context_ulysses": ULYSSES}, 1
  raise ValueError(f"unknown strategy {strategy!r}")


def cell_params(strategy: str, topology: str, seq_len: int, backend: str = "") -> list[str]:
  """The --gin_param bindings of one cell."""
  target = hardware.parse_target(topology)
  mesh, batch = mesh_for(strategy, target.devices)
  extra = [f"AttentionOptions.backend = '{backend}'"] if backend else []
  return extra + [
    "MeshConfig.data = 1",
    "MeshConfig.tensor = 1",
    f"MeshConfig.fsdp = {mesh['fsdp']}",
    f"MeshConfig.context = {mesh['context']}",
    f"MeshConfig.context_ulysses = {mesh['context_ulysses']}",
    f"TrainConfig.batch_size = {batch}",
    f"TrainConfig.seq_len = {seq_len}",
    f"TrainConfig.context_parallel_strategy = '{strategy}'",
  ]


def experiment(params: list[str], gin_files=GIN_FILES):
  gin.clear_config()
  gin_utils.parse(list(gin_files), params, search_paths=[ROOT])
  return configs.experiment()


def cache_key(exp, topology: str) -> str:
  """Hash of what decides the compiled program: model, train and mesh configs,
  the topology and the code (code_hash)."""
  body = {
    "model": dataclasses.asdict(exp.model),
    "train": dataclasses.asdict(exp.train),
    "mesh": dataclasses.asdict(exp.mesh),
    "topology": topology,
    "code": compile_lib.code_hash(),
  }
  return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:16]


def compile_cell(params: list[str], topology: str, timeout: int, gin_files=GIN_FILES) -> dict:
  """--mode=compile in a subprocess; the compile.json record (or an error)."""
  with tempfile.TemporaryDirectory() as workdir:
    cmd = [sys.executable, os.path.join(ROOT, "main.py"), "--mode=compile"]
    cmd += [f"--gin_file={g}" for g in gin_files]
    cmd += [f"--gin_param={p}" for p in params]
    cmd += [f"--compile_topology={topology}", f"--workdir={workdir}"]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    t0 = time.time()
    try:
      proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
      return {"error": f"compile timed out after {timeout} s"}
    path = os.path.join(workdir, "compile.json")
    if not os.path.exists(path):
      tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
      return {"error": f"exit {proc.returncode}: {' | '.join(tail)[:600]}"}
    with open(path) as f:
      record = json.load(f)
    record["wall_seconds"] = round(time.time() - t0, 1)
    return record


def planner_row(exp, topology: str) -> dict:
  target = hardware.parse_target(topology)
  dims = planner.model_dims(exp.model)
  mesh = {
    "data": exp.mesh.data,
    "fsdp": exp.mesh.fsdp,
    "tensor": exp.mesh.tensor,
    "context": exp.mesh.context,
    "context_ulysses": exp.mesh.context_ulysses,
  }
  setup = planner.make_setup(
    exp,
    strategy=exp.train.context_parallel_strategy,
    mesh=mesh,
    remat_policy=exp.model.remat_policy,
    platform=target.accelerator.platform,  # the kernel 'auto' runs there
  )
  problem = planner.check_valid(dims, setup)
  ev = planner.evaluate(dims, setup, target)
  return {
    "planner_total_bytes": ev["per_device_total_bytes"],
    "planner_host_bytes_per_device": ev["host_bytes_per_device"],
    "planner_host_bytes_per_vm": ev["host_bytes_per_vm"],
    "planner_fits": ev["fits"] and not problem,
    "planner_breakdown": ev["breakdown"],
    "invalid": problem or None,
  }


def record_rows(cache, args) -> list[dict]:
  """The record gin files compiled for their slices (cached like the cells)."""
  rows = []
  for path, topology in RECORDS.items():
    exp = experiment([], gin_files=(path,))
    key = cache_key(exp, topology)
    record = cache.get(key)
    if record is None and not args.planner_only:
      print(f"compiling {path} for {topology} ...", flush=True)
      record = compile_cell([], topology, args.timeout, gin_files=(path,))
      if "per_device" in record:
        cache[key] = record
        with open(args.cache, "w") as f:
          json.dump(cache, f, indent=1)
    m = exp.model
    row = {
      "gin_file": path,
      "topology": topology,
      "seq_len": exp.train.seq_len,
      "tokens_per_step": exp.train.batch_size * exp.train.seq_len,
      "strategy": exp.train.context_parallel_strategy,
      "mesh": dataclasses.asdict(exp.mesh),
      "policy": f"{m.remat_policy}, groups of {m.remat_group_size}, "
      f"input in {m.layer_input_pieces} piece(s)",
      "source": "compiled" if record and "per_device" in record else "not compiled",
      **planner_row(exp, topology),
    }
    if record and "per_device" in record:
      pd = record["per_device"]
      row.update(
        fits=record["fits"],
        total_bytes=pd["total_bytes"],
        allocated_hbm_bytes=record.get("allocated_hbm_bytes_per_device"),
        hbm_bytes_per_device=record["hbm_bytes_per_device"],
        host_bytes_per_device=pd["host_bytes"],
        host_bytes_per_vm=record["host_bytes_per_vm"],
        host_ram_bytes_per_vm=record["host_ram_bytes_per_vm"],
        attention_backend=record["attention_backend"],
        compile_seconds=record["compile_seconds"],
        # cost_analysis() counts each loop body once: see matmul_flops_per_device.
        flops_per_device_cost_analysis=record.get("flops_per_device"),
        matmul_flops_per_device=record.get("matmul_flops_per_device"),
      )
    elif record:
      row["error"] = record.get("error")
    rows.append(row)
  return rows


def records_table(rows: list[dict]) -> str:
  head = (
    f"{'gin file':24s} {'slice':12s} {'tokens':>12s} {'HBM GiB':>8s} {'alloc':>6s} "
    f"{'host/VM GiB':>11s} {'fits':>5s} {'planner':>7s} {'matmul TFLOP/dev':>16s}  source"
  )
  lines = [head, "-" * len(head)]
  for r in rows:
    flops = r.get("matmul_flops_per_device")
    lines.append(
      f"{r['gin_file']:24s} {r['topology']:12s} {r.get('seq_len') or 0:>12,d} "
      f"{_g(r.get('total_bytes')):>8s} {_g(r.get('allocated_hbm_bytes')):>6s} "
      f"{_g(r.get('host_bytes_per_vm')):>11s} "
      f"{'-' if r.get('fits') is None else ('yes' if r['fits'] else 'NO'):>5s} "
      f"{_g(r.get('planner_total_bytes')):>7s} "
      f"{'-' if flops is None else f'{flops / 1e12:,.0f}':>16s}  {r['source']}"
    )
  return "\n".join(lines)


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--topologies", default=",".join(TOPOLOGIES))
  ap.add_argument("--strategies", default=",".join(STRATEGIES))
  ap.add_argument("--lengths", default=",".join(LENGTHS), help="of " + ", ".join(LENGTHS))
  ap.add_argument(
    "--only",
    default="",
    help="comma list of cells 'strategy@topology@length' (e.g. ring@v5p:4x4x4@4M) to compile; "
    "the other rows are planner only",
  )
  ap.add_argument("--planner_only", action="store_true", help="compile nothing")
  ap.add_argument(
    "--attention_backend",
    default="",
    help="override AttentionOptions.backend (e.g. 'blockwise', the kernel the planner's "
    "coefficients were fitted to); default: the gin files' ('auto')",
  )
  ap.add_argument(
    "--compare_blockwise",
    action="store_true",
    help="also compile each compiled cell with attention_backend 'blockwise' (the pure-JAX "
    "fallback), so the row shows the TPU kernel's memory against it at the same length",
  )
  ap.add_argument(
    "--records",
    action="store_true",
    help="the length records instead of the matrix: the RECORDS gin files compiled for "
    "their slices and node, with the planner's estimate beside each",
  )
  ap.add_argument("--timeout", type=int, default=1500, help="seconds per compile")
  ap.add_argument("--out", default=os.path.join(ROOT, "bench_results", "bench_memory.json"))
  ap.add_argument("--cache", default=os.path.join(ROOT, "bench_results", "bench_memory_cache.json"))
  args = ap.parse_args(argv)
  devices.compile_only_env()
  only = {c.strip() for c in args.only.split(",") if c.strip()}
  cache = {}
  if os.path.exists(args.cache):
    with open(args.cache) as f:
      cache = json.load(f)

  if args.records:
    rows = record_rows(cache, args)
    out_path = args.out.replace(".json", "_records.json")
    with open(out_path, "w") as f:
      json.dump({"model": "Llama-3.1-8B", "rows": rows}, f, indent=1)
    print(records_table(rows))
    print(f"wrote {out_path}")
    return

  rows = []
  for topology in args.topologies.split(","):
    for name in args.lengths.split(","):
      seq_len = LENGTHS[name]
      for strategy in args.strategies.split(","):
        params = cell_params(strategy, topology, seq_len, args.attention_backend)
        exp = experiment(params)
        key = cache_key(exp, topology)
        cell = f"{strategy}@{topology}@{name}"
        row = {
          "cell": cell,
          "topology": topology,
          "strategy": strategy,
          "length": name,
          "seq_len": seq_len,
          "batch_size": exp.train.batch_size,
          "tokens_per_step": exp.train.batch_size * seq_len,
          "mesh": dataclasses.asdict(exp.mesh),
          "remat_policy": exp.model.remat_policy,
          "attention_backend_configured": exp.train.attention_options.backend,
          "config_key": key,
          **planner_row(exp, topology),
        }
        wanted = not args.planner_only and (not only or cell in only)
        record = cache.get(key)
        source = "cached" if record else "planner only"
        if record is None and wanted and not row["invalid"]:
          print(f"compiling {cell} ...", flush=True)
          record = compile_cell(params, topology, args.timeout)
          if "per_device" in record:  # compiled, or a compile-time OOM (a result too)
            cache[key] = record
            os.makedirs(os.path.dirname(args.cache), exist_ok=True)
            with open(args.cache, "w") as f:
              json.dump(cache, f, indent=1)
          source = "compiled"
        compiled = record is not None and "per_device" in record
        row["source"] = source if compiled else "planner only"
        if record and "error" in record:
          row["compile_error"] = record["error"][:300]
        if compiled:
          pd = record["per_device"]
          row.update(
            compiled_total_bytes=pd["total_bytes"],
            compiled_temp_bytes=pd["temp_bytes"],
            compiled_host_bytes_per_device=pd["host_bytes"],
            compiled_host_bytes_per_vm=record["host_bytes_per_vm"],
            compiled_fits=record["fits"],
            attention_backend=record["attention_backend"],
            compile_seconds=record["compile_seconds"],
            compiler_error=record.get("error"),
          )
          if pd["total_bytes"]:
            row["planner_error_pct"] = round(
              100.0 * (row["planner_total_bytes"] - pd["total_bytes"]) / pd["total_bytes"], 1
            )
        if compiled and args.compare_blockwise and not args.attention_backend:
          row.update(_blockwise_cell(strategy, topology, seq_len, cache, args))
        rows.append(row)

  out = {
    "model": "Llama-3.1-8B (" + " + ".join(GIN_FILES) + ")",
    "planner": planner.ESTIMATE_LABEL,
    "hbm_bytes_per_device": {
      t: hardware.topology_accelerator(t).hbm_bytes_per_device for t in args.topologies.split(",")
    },
    "rows": rows,
  }
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(out, f, indent=1)
  print(table(rows))
  print(f"wrote {args.out}")


def _cached_compile(params, topology, cache, args, label) -> dict | None:
  """The compile.json record of `params` on `topology`, from the cache or compiled
  now (and cached); None when it neither compiled nor ran out of memory."""
  key = cache_key(experiment(params), topology)
  record = cache.get(key)
  if record is None:
    print(f"compiling {label} ...", flush=True)
    record = compile_cell(params, topology, args.timeout)
    if "per_device" not in record:
      return None
    cache[key] = record
    os.makedirs(os.path.dirname(args.cache), exist_ok=True)
    with open(args.cache, "w") as f:
      json.dump(cache, f, indent=1)
  return record


def _blockwise_cell(strategy, topology, seq_len, cache, args) -> dict:
  """The same cell with the blockwise kernel: its compiled total and fit."""
  params = cell_params(strategy, topology, seq_len, "blockwise")
  record = _cached_compile(params, topology, cache, args, f"{strategy}@{topology} blockwise")
  if record is None:
    return {"blockwise_total_bytes": None, "blockwise_fits": None}
  return {
    "blockwise_total_bytes": record["per_device"]["total_bytes"],
    "blockwise_fits": record["fits"],
  }


def _g(x) -> str:
  return "-" if x is None else f"{x / GiB:.1f}"


def table(rows: list[dict]) -> str:
  head = (
    f"{'topology':12s} {'len':>4s} {'strategy':10s} {'mesh (f x c x u)':>16s} {'B':>3s} "
    f"{'planner GiB':>11s} {'fits':>5s} {'compiled GiB':>12s} {'fits':>5s} {'err %':>6s} "
    f"{'host/VM GiB':>11s} {'blockwise GiB':>13s}  source"
  )
  lines = [head, "-" * len(head)]
  for r in rows:
    m = r["mesh"]
    mesh = f"{m['fsdp']}x{m['context']}x{m['context_ulysses']}"
    fits_c = r.get("compiled_fits")
    lines.append(
      f"{r['topology']:12s} {r['length']:>4s} {r['strategy']:10s} {mesh:>16s} "
      f"{r['batch_size']:>3d} {_g(r['planner_total_bytes']):>11s} "
      f"{'yes' if r['planner_fits'] else 'NO':>5s} {_g(r.get('compiled_total_bytes')):>12s} "
      f"{'-' if fits_c is None else ('yes' if fits_c else 'NO'):>5s} "
      f"{r.get('planner_error_pct', '-')!s:>6s} "
      f"{_g(r.get('compiled_host_bytes_per_vm', r['planner_host_bytes_per_vm'])):>11s} "
      f"{_g(r.get('blockwise_total_bytes')):>13s}  "
      f"{r['source']}" + (f" ({r['invalid']})" if r["invalid"] else "")
    )
  return "\n".join(lines)


if __name__ == "__main__":
  main()

r"""Fit the memory planner's coefficients (lctx/sizing/memory_model.py) to TPU compiles.

The planner counts buffer shapes; how many of each XLA keeps live is a
per-element coefficient (memory_model.COEFFICIENTS). This script compiles small
Llama-shaped models (FIT_CASES: d_model 256-1024, head dim 32-128, 2-4 layers,
16K-32K tokens; remat groups of 1 / 2 / 4, offloaded layer inputs, loss chunks
of 256-4096 tokens per device) on compile-only `v5p:2x2x1` / `tpu7x:2x2x1`
devices with `lctx.sizing.compile.compile_step`, for both attention kernels (blockwise
and splash) and all four strategies, caches each compiled record in
bench_results/fit_memory_model.json (keyed by the case; a case compiled from
other sources is reported as stale and recompiled with --refresh), adds the
full-size Llama-3.1-8B figures measured with `--mode=compile`
(lctx/sizing/full_size_compiles.json: the flagship gin files, fitted, and
gin/long_v5p.gin, reported, not fitted; `--record=GIN_FILE=WORKDIR` adds a
compile.json and rewrites that gin file's `# Figures` header line and README's
table from the records: scripts/write_gin_figures.py), and fits the coefficients by bounded least squares on the
relative error (est / compiled - 1; Gauss-Newton rounds, since the offload
term multiplies the attention ones; LOWER floors). It prints each case's
compiled and fitted figures and the coefficient table (--write writes it to
lctx/parallel/memory_coefficients.json, the memory model's data file).

  flock /tmp/lctx-heavy.lock timeout 1200 python scripts/fit_memory_model.py
  python scripts/fit_memory_model.py --no_compile   # fit to the cache only
  python scripts/fit_memory_model.py --no_compile --write  # and write the data file
  python scripts/fit_memory_model.py --only=splash  # cases whose name has 'splash'
  python main.py --mode=compile --gin_file=gin/ring_v5p.gin --workdir=/tmp/c/ring
  python scripts/fit_memory_model.py --record=gin/ring_v5p.gin=/tmp/c/ring --no_compile

Every small compile takes 10-60 s on 2 CPU cores and under 2 GiB.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from lctx.sizing import devices  # noqa: E402

devices.compile_only_env()

import numpy as np  # noqa: E402

from lctx import data as data_lib  # noqa: E402
from lctx import hardware, models  # noqa: E402
from lctx import train as train_lib  # noqa: E402
from lctx.kernels.options import AttentionOptions  # noqa: E402
from lctx.parallel import attention_memory  # noqa: E402
from lctx.parallel.mesh import MeshConfig  # noqa: E402
from lctx.sizing import compile as compile_lib  # noqa: E402
from lctx.sizing import memory_model as mm  # noqa: E402
from lctx.sizing import planner  # noqa: E402
from lctx.trainer import TrainConfig  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import write_gin_figures  # noqa: E402

GiB = 2**30
MiB = 2**20
CACHE = os.path.join(ROOT, "bench_results", "fit_memory_model.json")
# The code that decides the compiled step (memory_model / planner excluded:
# they do not change what compiles).
# auto.py only picks strategies; the cases name theirs.
CODE_EXCLUDE = ("lctx/parallel/attention_memory.py", "lctx/parallel/auto.py")

SMALL = dict(
  vocab_size=4096,
  d_model=256,
  num_layers=2,
  num_heads=8,
  num_kv_heads=4,
  head_dim=32,
  mlp_dim=768,
  dtype="bfloat16",
  param_dtype="float32",
)
# d_model 512 / 768 with a larger vocabulary: the embedding and loss terms.
WIDE = dict(SMALL, d_model=512, num_heads=8, num_kv_heads=4, head_dim=64, mlp_dim=1536)
WIDER = dict(SMALL, d_model=768, num_heads=12, num_kv_heads=4, head_dim=64, mlp_dim=2048)
# d_model 1024 at 16K tokens (the slow held-out set of tests/test_planner.py
# is d_model 1024 at 32K-64K on other meshes).
LARGE = dict(
  SMALL, vocab_size=16384, d_model=1024, num_heads=16, num_kv_heads=8, head_dim=64, mlp_dim=2816
)


@dataclasses.dataclass(frozen=True)
class Case:
  """One compile of the fit set."""

  topology: str
  strategy: str
  mesh: tuple[tuple[str, int], ...]
  seq_len: int
  remat: str = "full"
  model: tuple[tuple[str, object], ...] = tuple(SMALL.items())
  kernel: str = "blockwise"
  batch_size: int = 1
  loss_chunk: int | None = 1024
  block: int = 512
  group: int = 1  # ModelConfig.remat_group_size

  @property
  def name(self) -> str:
    m = dict(self.model)
    mesh = "x".join(f"{a[:3]}{s}" for a, s in self.mesh)
    name = (
      f"{self.kernel}/{self.topology}/{self.strategy}/{mesh}/{self.seq_len // 1024}K/"
      f"{self.remat}/d{m['d_model']}v{m['vocab_size']}/b{self.batch_size}"
    )
    if m["head_dim"] == 128:
      name += "/h128"
    if m["num_layers"] != 2:
      name += f"/L{m['num_layers']}"
    if self.group > 1:
      name += f"/g{self.group}"
    if self.loss_chunk != _default_loss_chunk(self.topology):
      name += f"/lc{self.loss_chunk}"
    return name

  def key(self) -> str:
    fields = dataclasses.asdict(self)
    if fields["group"] == 1:  # the cases cached before groups were added keep their keys
      del fields["group"]
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def _default_loss_chunk(topology: str) -> int | None:
  # libtpu 0.0.42.1 rejected the global-token chunked loss's mask reshape on
  # tpu7x:2x2x1 (tests/test_planner.py): one loss chunk in the cases compiled
  # before the per-device loss (which compiles there: LOSS_CASES).
  return None if topology.startswith("tpu7x") else 1024


def _case(topology, strategy, mesh, seq_len, **kw) -> Case:
  if "model" in kw:
    kw["model"] = tuple(kw["model"].items())
  kw.setdefault("loss_chunk", _default_loss_chunk(topology))
  return Case(topology, strategy, tuple(mesh.items()), seq_len, **kw)


def _cases_for(kernel: str) -> list[Case]:
  k = dict(kernel=kernel)
  return [
    _case("v5p:2x2x1", "ring", dict(context=4), 16384, **k),
    _case("v5p:2x2x1", "ring", dict(context=4), 32768, model=WIDE, **k),
    _case("v5p:2x2x1", "ring", dict(context=4), 16384, remat="none", **k),
    _case("v5p:2x2x1", "ring", dict(fsdp=2, context=2), 16384, batch_size=2, **k),
    _case("v5p:2x2x1", "all_gather", dict(context=4), 16384, **k),
    _case("v5p:2x2x1", "all_gather", dict(context=4), 32768, model=WIDER, **k),
    _case("v5p:2x2x1", "all_gather", dict(context=4), 16384, remat="offload_layer_inputs", **k),
    _case("v5p:2x2x1", "ulysses", dict(context=4), 16384, **k),
    _case("v5p:2x2x1", "ulysses", dict(context=4), 32768, model=WIDER, remat="dots", **k),
    _case("v5p:2x2x1", "usp", dict(context=2, context_ulysses=2), 32768, **k),
    _case("tpu7x:2x2x1", "usp", dict(context=4, context_ulysses=2), 16384, **k),
    _case("tpu7x:2x2x1", "usp", dict(context=2, context_ulysses=4), 32768, model=WIDE, **k),
    _case("tpu7x:2x2x1", "ring", dict(context=8), 32768, model=WIDE, **k),
    _case("tpu7x:2x2x1", "ulysses", dict(fsdp=2, context=4), 16384, batch_size=2, **k),
    _case("tpu7x:2x2x1", "all_gather", dict(context=8), 32768, **k),
    _case("v5p:2x2x1", "ring", dict(context=4), 16384, model=LARGE, **k),
    _case(
      "v5p:2x2x1", "all_gather", dict(fsdp=2, context=2), 16384, model=LARGE, batch_size=2, **k
    ),
    _case("v5p:2x2x1", "ulysses", dict(context=4), 16384, model=LARGE, **k),
    _case("tpu7x:2x2x1", "usp", dict(context=2, context_ulysses=4), 16384, model=LARGE, **k),
    # A larger vocabulary: the loss chunk and the whole embedding tables.
    _case("v5p:2x2x1", "ring", dict(context=4), 16384, model=dict(WIDE, vocab_size=16384), **k),
    _case(
      "tpu7x:2x2x1",
      "usp",
      dict(context=4, context_ulysses=2),
      16384,
      model=dict(WIDE, vocab_size=16384),
      **k,
    ),
  ]


# Remat groups and offloaded layer inputs (4 layers, so groups of 1, 2 and 4),
# and the loss chunk (tokens per chunk per device, lctx/trainer.py
# _cross_entropy): the terms the long-sequence records lean on.
WIDE4 = dict(WIDE, num_layers=4)
GROUP_CASES = [
  _case("v5p:2x2x1", "ring", dict(context=4), 32768, model=WIDE4, remat=r, group=g, kernel=k)
  for k, r, g in (
    ("splash", "full", 1),
    ("splash", "full", 2),
    ("splash", "full", 4),
    ("splash", "offload_layer_inputs", 1),
    ("splash", "offload_layer_inputs", 2),
    ("splash", "offload_layer_inputs", 4),
    ("blockwise", "full", 1),
    ("blockwise", "full", 4),
    ("blockwise", "offload_layer_inputs", 2),
  )
] + [
  _case(
    "tpu7x:2x2x1",
    "usp",
    dict(context=2, context_ulysses=4),
    32768,
    model=WIDE4,
    remat=r,
    group=g,
    kernel="splash",
    loss_chunk=1024,
  )
  for r, g in (("full", 2), ("offload_layer_inputs", 1), ("offload_layer_inputs", 2))
]
LOSS_CASES = [
  _case(
    "v5p:2x2x1",
    "ring",
    dict(context=4),
    16384,
    model=dict(WIDE, vocab_size=16384),
    kernel="splash",
    loss_chunk=chunk,
  )
  for chunk in (256, 4096)
] + [
  _case(
    "tpu7x:2x2x1",
    "usp",
    dict(context=4, context_ulysses=2),
    16384,
    model=dict(WIDE, vocab_size=16384),
    kernel="splash",
    loss_chunk=1024,
  )
]
# Head dim 128, as Llama's (the models above have 32 and 64, which TPU tiling
# pads to 128 lanes): the per-head terms at the full-size layout.
H128 = dict(
  SMALL, vocab_size=16384, d_model=1024, num_heads=8, num_kv_heads=4, head_dim=128, mlp_dim=2816
)
H128_CASES = [
  _case(topology, strategy, mesh, seq_len, model=H128, kernel=k)
  for k in ("splash", "blockwise")
  for topology, strategy, mesh, seq_len in (
    ("v5p:2x2x1", "ring", dict(context=4), 16384),
    ("v5p:2x2x1", "ulysses", dict(context=4), 16384),
    ("v5p:2x2x1", "all_gather", dict(context=4), 16384),
    ("v5p:2x2x1", "usp", dict(context=2, context_ulysses=2), 32768),
  )
]
FIT_CASES = _cases_for("blockwise") + _cases_for("splash") + GROUP_CASES + LOSS_CASES + H128_CASES

# Full-size Llama-3.1-8B, `python main.py --mode=compile --gin_file=G
# --compile_topology=T` (memory_analysis total per device, GiB), one record per
# gin file in lctx/sizing/full_size_compiles.json, which
# `--record=GIN_FILE=WORKDIR` writes from a compile's compile.json. "fitted": false rows (gin/long_v5p.gin,
# remat groups and offload) are reported, not fitted; "fitted": null rows are
# recorded for their figures alone (the planner neither fits nor checks them).
# The file is the figures' one home: --record rewrites the gin file's `# Figures`
# header line and README's table from it (scripts/write_gin_figures.py).
FULL_SIZE_FILE = os.path.join(ROOT, "lctx", "sizing", "full_size_compiles.json")
FIGURES_ROOT = ROOT  # where --record rewrites the gin header and README


def full_size_records() -> dict[str, dict]:
  with open(FULL_SIZE_FILE) as f:
    return json.load(f)


def _full_size_rows(fitted: bool) -> list[tuple[str, str, str, float]]:
  return [
    (gin_file, r["topology"], r["kernel"], r["total_gib"])
    for gin_file, r in full_size_records().items()
    if r["fitted"] == fitted
  ]


FULL_SIZE = _full_size_rows(fitted=True)
FULL_SIZE_CHECK = _full_size_rows(fitted=False)


def record_full_size(gin_file: str, workdir: str) -> dict:
  """Adds (or replaces) GIN_FILE's record in FULL_SIZE_FILE from WORKDIR/compile.json,
  a `--mode=compile --gin_file=GIN_FILE` (no overrides) train step that fits; a
  replaced record keeps its "fitted" flag (new ones are fitted)."""
  path = os.path.join(workdir, "compile.json")
  with open(path) as f:
    rec = json.load(f)
  if not rec.get("fits") or rec.get("step", "train") != "train":
    raise ValueError(
      f"{path}: not a train-step compile that fits (fits {rec.get('fits')}, "
      f"step {rec.get('step')}); only those are full-size records."
    )
  gin_file = os.path.relpath(os.path.abspath(gin_file), FIGURES_ROOT)
  if not os.path.isfile(os.path.join(FIGURES_ROOT, gin_file)):
    raise ValueError(f"--record: no gin file {gin_file}")
  records = full_size_records()
  old = records.get(gin_file, {})
  per_device = rec["per_device"]
  records[gin_file] = {
    "topology": rec["topology"],
    "kernel": rec["attention_backend"],
    "total_gib": round(per_device["total_bytes"] / GiB, 2),
    "allocated_gib": (
      round(rec["allocated_hbm_bytes_per_device"] / GiB, 2)
      if rec.get("fits_figure") == "allocation"
      else None
    ),
    "fitted": old.get("fitted", True),
    "libtpu_version": rec.get("libtpu_version"),
    "devices": rec.get("devices"),
    "strategy": rec.get("strategy"),
    "tokens_per_step": rec.get("tokens_per_step"),
    "hbm_gib": round(rec["hbm_bytes_per_device"] / GiB, 2),
    # Pinned host per device: the allocation on TPU (as host_bytes_per_vm), else
    # memory_analysis.
    "host_gib": round(
      (rec.get("allocated_host_bytes_per_device") or per_device.get("host_bytes") or 0) / GiB, 2
    ),
    "total_flops": rec.get("total_flops_per_device"),
    "recompute_ratio": rec.get("recompute_ratio"),
    "step_seconds_estimate": rec.get("step_seconds_estimate"),
    "date": rec.get("date"),
    "jax_version": rec.get("jax_version"),
  }
  with open(FULL_SIZE_FILE, "w") as f:
    f.write("{\n")
    rows = [f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in records.items()]
    f.write(",\n".join(rows) + "\n}\n")
  r = records[gin_file]
  memory = (
    f"{r['allocated_gib']} GiB allocated, memory_analysis {r['total_gib']}"
    if r["allocated_gib"] is not None
    else f"{r['total_gib']} GiB"
  )
  print(f"wrote {gin_file} ({memory}) to {FULL_SIZE_FILE}")
  for name in write_gin_figures.write([gin_file], root=FIGURES_ROOT, records=records):
    print(f"wrote its figures to {name}")
  return records[gin_file]


# ----------------------------------------------------------------------------
# Experiments and compiles
# ----------------------------------------------------------------------------
def experiment(case: Case):
  model = dict(case.model, remat_policy=case.remat, remat_group_size=case.group)
  train = TrainConfig(
    batch_size=case.batch_size,
    seq_len=case.seq_len,
    context_parallel_strategy=case.strategy,
    loss_chunk_size=case.loss_chunk,
    attention_options=AttentionOptions(
      block_q=case.block, block_kv=case.block, backend=case.kernel
    ),
  )
  return train_lib.Experiment(
    model=models.ModelConfig(**model),
    data=data_lib.DataConfig(),
    train=train,
    mesh=MeshConfig(**dict(case.mesh)),
  )


def gin_experiment(gin_file: str):
  import gin  # pylint: disable=g-import-not-at-top

  from lctx import configs, gin_utils  # pylint: disable=g-import-not-at-top

  gin.clear_config()
  gin_utils.parse([gin_file], [], search_paths=[ROOT])
  return configs.experiment()


def compile_case(case: Case) -> dict:
  import jax  # pylint: disable=g-import-not-at-top

  t0 = time.time()
  # Mosaic (splash) refuses matmul precision 'highest' for bf16.
  with jax.default_matmul_precision("default"):
    rec = compile_lib.compile_step(experiment(case), topology=case.topology)
  return {
    "case": dataclasses.asdict(case),
    "name": case.name,
    "per_device": rec["per_device"],
    "attention_backend": rec["attention_backend"],
    "fits": rec["fits"],
    "largest_buffers": rec.get("largest_buffers", [])[:6],
    "libtpu_version": rec.get("libtpu_version"),
    "date": rec.get("date"),
    "wall_seconds": round(time.time() - t0, 1),
  }


def load_cache() -> dict:
  if os.path.exists(CACHE):
    with open(CACHE) as f:
      return json.load(f)
  return {}


def save_cache(cache: dict) -> None:
  os.makedirs(os.path.dirname(CACHE), exist_ok=True)
  tmp = CACHE + ".tmp"
  with open(tmp, "w") as f:
    json.dump(cache, f, indent=1)
  os.replace(tmp, CACHE)


# ----------------------------------------------------------------------------
# The fit
# ----------------------------------------------------------------------------
@dataclasses.dataclass
class Point:
  name: str
  dims: mm.ModelDims
  setup: mm.Setup
  compiled: float


def case_point(case: Case, compiled: float) -> Point:
  exp = experiment(case)
  mesh = dict(case.mesh)
  setup = planner.make_setup(
    exp, strategy=case.strategy, mesh=mesh, remat_policy=case.remat, platform="tpu"
  )
  return Point(case.name, planner.model_dims(exp.model), setup, compiled)


def gin_point(gin_file: str, topology: str, kernel: str, gib: float) -> Point:
  exp = gin_experiment(gin_file)
  target = hardware.parse_target(topology)
  setup, why = planner.configured_setup(exp, planner.model_dims(exp.model), target)
  if setup is None:
    raise ValueError(f"{gin_file} on {topology}: {why}")
  if setup.kernel != kernel:
    raise ValueError(f"{gin_file}: the planner resolves kernel {setup.kernel}, measured {kernel}")
  return Point(f"{kernel}/{topology}/{gin_file}", planner.model_dims(exp.model), setup, gib * GiB)


_FIELDS = (*mm.Breakdown.STATE_FIELDS, *mm.Breakdown.LAYER_FIELDS, "loss")


def _fields(p: Point, co: dict) -> np.ndarray:
  bd = mm.estimate(p.dims, p.setup, co)
  return np.array([float(getattr(bd, f)) for f in _FIELDS])


def linear_parts(p: Point, names: list[str], at: dict):
  """(value, per-coefficient slope) of each Breakdown field at the
  coefficients `at`. Every field is affine in each coefficient alone; the
  offload term multiplies the attention coefficients (bilinear), so the fit
  re-linearises at each round's values (unit steps give exact partials)."""
  value = _fields(p, at)
  slopes = np.stack([_fields(p, {**at, n: at[n] + 1.0}) - value for n in names], axis=1)
  return value, slopes


def fit(
  points: list[Point], names: list[str], prior: dict, ridge: float = 0.02, rounds: int = 30
) -> dict:
  """Non-negative least squares on est / compiled - 1 over `names`; the other
  coefficients keep their `prior` values. Each round solves the problem
  linearised at the previous round's coefficients (Gauss-Newton; one round is
  exact while the total is affine in the coefficients).

  A small ridge pulls each coefficient towards its prior (relative to
  max(prior, 1)): the small compiles alone cannot tell some terms apart (the
  layer's residual stream and the attention buffers both grow with the local
  tokens), and an unpulled fit trades them off into values no buffer count
  explains."""
  from scipy.optimize import nnls  # pylint: disable=g-import-not-at-top

  all_names = list(mm.COEFFICIENTS)
  idx = [all_names.index(n) for n in names]
  lb = np.array([LOWER.get(n, 0.0) for n in all_names], dtype=float)
  co = np.maximum(np.array([prior[n] for n in all_names], dtype=float), lb)
  for _ in range(rounds):
    at = {n: float(co[i]) for i, n in enumerate(all_names)}
    rows, rhs = [], []
    for p in points:
      value, slopes = linear_parts(p, all_names, at)
      total, g = value.sum(), slopes.sum(0)
      # total(c) ~ total(co) + g . (c - co): solve for c over idx.
      # c = lb + x with x >= 0 (LOWER: buffers the step cannot do without).
      fixed = total - sum(g[j] * co[j] for j in idx) + sum(g[j] * lb[j] for j in idx)
      rows.append(g[idx] / p.compiled)
      rhs.append(1.0 - fixed / p.compiled)
    for j in idx:
      scale = max(prior[all_names[j]], 1.0)
      reg = np.zeros(len(idx))
      reg[idx.index(j)] = np.sqrt(ridge) / scale
      rows.append(reg)
      rhs.append(np.sqrt(ridge) * (prior[all_names[j]] - lb[j]) / scale)
    sol, _ = nnls(np.array(rows), np.array(rhs))
    new = co.copy()
    new[idx] = sol + lb[idx]
    if np.allclose(new, co, rtol=1e-9, atol=1e-12):
      break
    co = new
  return {n: float(co[i]) for i, n in enumerate(all_names)}


def report(points: list[Point], co: dict, title: str) -> list[float]:
  print(f"\n{title}")
  print(f"  {'case':72s} {'compiled':>10s} {'planner':>10s} {'error':>7s}")
  errs = []
  for p in points:
    est = mm.estimate(p.dims, p.setup, co).total
    err = 100.0 * (est - p.compiled) / p.compiled
    errs.append(err)
    unit, div = ("GiB", GiB) if p.compiled > GiB else ("MiB", MiB)
    print(f"  {p.name:72s} {p.compiled / div:7.2f}{unit} {est / div:7.2f}{unit} {err:+6.1f}%")
  if errs:
    print(
      f"  error range {min(errs):+.1f}% .. {max(errs):+.1f}%, mean |error| "
      f"{np.mean(np.abs(errs)):.1f}%"
    )
  return errs


# Where the ridge pulls: a blockwise-only fit to 11 small and 6 Llama-3.1-8B usp
# compiles; splash starts from the blockwise values, the new terms from 0.
PRIOR = {
  "saved_tensor_scale": 1.0,
  "residual_scale": 1.0,
  "gathered_layer_copies": 3.0,
  "layer_bytes_per_d": 11.3,
  "mlp_bytes_per_f": 4.6,
  "ring_bytes_per_q_elem": 8.1,
  "ring_bytes_per_kv_elem": 8.9,
  "usp_a2a_bytes_per_elem": 9.1,
  "ulysses_bytes_per_elem": 4.2,
  "all_gather_bytes_per_kv_elem": 4.6,
  "kernel_block_copies": 1.6,
  "loss_bytes_per_logit": 6.0,
  "loss_table_bytes_per_elem": 6.0,  # bf16 copy + f32 gradient accumulator
  "group_input_copies": 1.0,  # the inner scan's extra carries
  "group_mlp_copies": 1.0,
  "offload_attention_copies": 0.5,
  "embedding_copies": 0.0,
  "splash_ring_bytes_per_q_elem": 8.1,
  "splash_ring_bytes_per_kv_elem": 8.9,
  "splash_usp_a2a_bytes_per_elem": 9.1,
  "splash_ulysses_bytes_per_elem": 4.2,
  "splash_all_gather_bytes_per_kv_elem": 4.6,
  "splash_q_bytes_per_elem": 4.0,
}
# Floors the fit keeps, buffers the step cannot do without: all_gather holds
# the whole sequence's gathered K and V in bf16 (2 bytes per element) while a
# layer runs backward; the blockwise kernel at least one f32 [bq, bk] score
# tile per head in flight; ulysses the bf16 q, k, v and output of its heads
# over the whole sequence after the all-to-all (2 bytes per element). Below
# them the small compiles' noise, not a buffer count, would be fitted.
LOWER = {
  "all_gather_bytes_per_kv_elem": 2.0,
  "splash_all_gather_bytes_per_kv_elem": 2.0,
  "kernel_block_copies": 1.0,
  "ulysses_bytes_per_elem": 2.0,
  "splash_ulysses_bytes_per_elem": 2.0,
}
# Coefficients the fit moves (all of them).
FITTED = (
  "saved_tensor_scale",
  "residual_scale",
  "gathered_layer_copies",
  "layer_bytes_per_d",
  "mlp_bytes_per_f",
  "loss_bytes_per_logit",
  "loss_table_bytes_per_elem",
  "group_input_copies",
  "group_mlp_copies",
  "offload_attention_copies",
  "embedding_copies",
  "ring_bytes_per_q_elem",
  "ring_bytes_per_kv_elem",
  "usp_a2a_bytes_per_elem",
  "ulysses_bytes_per_elem",
  "all_gather_bytes_per_kv_elem",
  "kernel_block_copies",
  "splash_ring_bytes_per_q_elem",
  "splash_ring_bytes_per_kv_elem",
  "splash_usp_a2a_bytes_per_elem",
  "splash_ulysses_bytes_per_elem",
  "splash_all_gather_bytes_per_kv_elem",
  "splash_q_bytes_per_elem",
)


def write_coefficients(co: dict) -> None:
  """Writes the fitted values (2 decimals) to the memory model's data file
  (lctx/parallel/memory_coefficients.json), keeping coefficients not fitted."""
  path = attention_memory.COEFFICIENTS_FILE
  with open(path) as f:
    current = json.load(f)
  unknown = sorted(set(co) - set(current))
  if unknown:
    raise ValueError(f"{path} has no coefficients {unknown}")
  current.update({name: round(float(value), 2) for name, value in co.items()})
  with open(path, "w") as f:
    json.dump(current, f, indent=2)
    f.write("\n")
  print(f"wrote {path}")


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--no_compile", action="store_true", help="fit to the cached compiles only")
  ap.add_argument("--refresh", action="store_true", help="recompile cases of other sources")
  ap.add_argument("--only", default="", help="compile only cases whose name contains this")
  ap.add_argument("--no_full_size", action="store_true", help="leave FULL_SIZE out of the fit")
  ap.add_argument(
    "--write", action="store_true", help="write the fit to lctx/parallel/memory_coefficients.json"
  )
  ap.add_argument("--ridge", type=float, default=0.02, help="pull towards PRIOR")
  ap.add_argument(
    "--record",
    action="append",
    default=[],
    help="GIN_FILE=WORKDIR of a full-size --mode=compile: add its compile.json to "
    "lctx/sizing/full_size_compiles.json (repeatable)",
  )
  args = ap.parse_args(argv)

  for arg in args.record:
    gin_file, sep, workdir = arg.partition("=")
    if not sep:
      raise SystemExit(f"--record={arg!r}: expected GIN_FILE=WORKDIR")
    record_full_size(gin_file, workdir)

  cache = load_cache()
  code = compile_lib.code_hash(CODE_EXCLUDE)
  for case in FIT_CASES:
    if args.only and args.only not in case.name:
      continue
    hit = cache.get(case.key())
    if hit and (hit.get("code") == code or not args.refresh):
      if hit.get("code") != code:
        print(f"stale (compiled from other sources): {case.name}")
      continue
    if args.no_compile:
      continue
    print(f"compiling {case.name} ...", flush=True)
    try:
      rec = compile_case(case)
    except Exception as err:  # pylint: disable=broad-except
      print(f"  failed: {type(err).__name__}: {str(err)[:300]}")
      continue
    rec["code"] = code
    cache[case.key()] = rec
    save_cache(cache)
    pd = rec["per_device"]
    print(
      f"  {pd['total_bytes'] / MiB:.1f} MiB ({rec['attention_backend']}, {rec['wall_seconds']} s)",
      flush=True,
    )

  points = []
  for case in FIT_CASES:
    hit = cache.get(case.key())
    if hit and hit["fits"] and hit["per_device"]["total_bytes"]:
      if hit["attention_backend"] != case.kernel:
        print(f"skipped {case.name}: compiled {hit['attention_backend']}")
        continue
      points.append(case_point(case, float(hit["per_device"]["total_bytes"])))
  # Read again: --record may have just changed the file.
  full = [gin_point(*row) for row in _full_size_rows(fitted=True)]
  check = [gin_point(*row) for row in _full_size_rows(fitted=False)]

  report(points + full + check, dict(mm.COEFFICIENTS), "memory_model.COEFFICIENTS as they are")
  co = fit(points + ([] if args.no_full_size else full), list(FITTED), PRIOR, ridge=args.ridge)
  report(points + full + check, co, "fitted (the last rows: checked, not fitted)")
  if args.write:
    write_coefficients(co)
  print("\nCOEFFICIENTS = {")
  for n, v in co.items():
    print(f'  "{n}": {v:.2f},')
  print("}")


if __name__ == "__main__":
  main()

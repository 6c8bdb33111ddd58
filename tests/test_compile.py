"""`--mode=compile`: the train step compiled by the real TPU compiler, no TPU needed.

libtpu (from the test extras) describes TPU slices as compile-only devices;
these tests use small slices ('v5p:2x2x1' = 4 devices, 'tpu7x:2x2x1' = 8) and
tiny models, so each compile takes seconds. The full-size compiles of the gin
files are measured by hand and recorded in their headers.
"""

import dataclasses
import functools
import json
import math
import os
import re
import subprocess
import sys

import helpers
import pytest

# Read when libtpu loads (the first topology call), so before any test runs.
from lctx.sizing import devices as devices_lib  # noqa: E402  (no jax import)

devices_lib.compile_only_env()

import gin  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from lctx import configs, gin_utils, hardware, kernels  # noqa: E402
from lctx.parallel import mesh as mesh_lib  # noqa: E402
from lctx.sizing import compile as compile_lib  # noqa: E402
from lctx.sizing import tpu as tpu_lib  # noqa: E402
from lctx.trainer import Trainer  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 2**30

# The tiny model in the gin files' own dtypes (bf16 compute, f32 master weights).
TINY = helpers.TINY_GIN
# Each TPU gin file on a small slice of its own kind, every mesh axis it uses
# kept above 1.
SMALL_SLICE = {
  "gin/long_v5p.gin": (
    "v5p:2x2x1",
    ["MeshConfig.context = 2", "MeshConfig.context_ulysses = 2", "TrainConfig.batch_size = 1"],
  ),
  "gin/long_ironwood.gin": (
    "tpu7x:2x2x1",
    ["MeshConfig.context = 8", "TrainConfig.batch_size = 1"],
  ),
  "gin/ring_v5p.gin": ("v5p:2x2x1", ["MeshConfig.fsdp = 2", "MeshConfig.context = 2"]),
  "gin/allgather_v5p.gin": ("v5p:2x2x1", ["MeshConfig.fsdp = 2", "MeshConfig.context = 2"]),
  "gin/ulysses_v5p.gin": ("v5p:2x2x1", ["MeshConfig.fsdp = 2", "MeshConfig.context = 2"]),
  "gin/usp_ironwood.gin": (
    "tpu7x:2x2x1",
    ["MeshConfig.context = 4", "MeshConfig.context_ulysses = 2", "TrainConfig.batch_size = 1"],
  ),
}
RECORD_KEYS = {
  "topology",
  "num_slices",
  "device_kind",
  "devices",
  "devices_per_chip",
  "batch_size",
  "seq_len",
  "tokens_per_step",
  "strategy",
  "attention_backend",
  "per_device",
  "hbm_bytes_per_device",
  "host_bytes_per_vm",
  "host_ram_bytes_per_vm",
  "fits",
  "compile_seconds",
}
PER_DEVICE_KEYS = {
  "argument_bytes",
  "output_bytes",
  "alias_bytes",
  "temp_bytes",
  "total_bytes",
  "host_bytes",
}


def _experiment(path, params=()):
  gin.clear_config()
  gin_utils.parse([path], list(params), [ROOT])
  exp = configs.experiment()
  gin.clear_config()
  return exp


def _topology_of(path):
  """The slice a gin file is for: its COMPILE_TOPOLOGY macro ('v5p:4x4x4')."""
  gin.clear_config()
  gin_utils.parse([path], [], [ROOT])
  topology = configs.target()
  gin.clear_config()
  assert topology, f"{path}: a TPU/GPU gin file names its hardware in COMPILE_TOPOLOGY"
  return topology


# Under the slow mark: files whose small-slice compile repeats what the default run
# compiles elsewhere. After TINY and the small meshes, ring_v5p.gin and
# allgather_v5p.gin are ulysses_v5p.gin with another strategy; ring on v5p is
# compiled by tests/test_main_cli.py (ring_v5p.gin itself, on its own slice),
# tests/test_planner.py and tests/test_sizing_linear.py, all_gather on v5p by
# tests/test_planner.py (twice). usp_ironwood.gin is usp (long_v5p.gin here, and
# tests/test_planner.py's usp on tpu7x:2x2x1) on tpu7x (long_ironwood.gin here).
SLOW_SLICE = {"gin/ring_v5p.gin", "gin/allgather_v5p.gin", "gin/usp_ironwood.gin"}


@pytest.mark.parametrize(
  "path",
  [pytest.param(p, marks=pytest.mark.slow) if p in SLOW_SLICE else p for p in sorted(SMALL_SLICE)],
)
def test_tpu_gin_file_compiles_for_its_kind(path, tmp_path, capsys):
  """Each TPU gin file through `--mode=compile` (run_compile) on a small slice of
  the kind its header names: its strategy and mesh axes, a tiny model in the
  gin file's dtypes; compile.json holds every key of the record."""
  topology, mesh_params = SMALL_SLICE[path]
  assert topology.split(":")[0] == _topology_of(path).split(":")[0]
  exp = _experiment(path, [*TINY, *mesh_params])
  record = compile_lib.run_compile(exp, str(tmp_path), topology=topology)
  with open(tmp_path / "compile.json") as f:
    saved = json.load(f)
  assert saved == json.loads(json.dumps(record))
  assert set(saved) >= RECORD_KEYS and set(saved["per_device"]) == PER_DEVICE_KEYS
  accel = hardware.topology_accelerator(topology)
  chips = hardware.topology_chips(topology)
  assert saved["fits"] is True, saved
  assert saved["topology"] == topology and saved["num_slices"] == 1
  assert saved["device_kind"] == {"v5p": "TPU v5", "tpu7x": "TPU7x"}[accel.name]
  assert saved["devices"] == chips * accel.devices_per_chip
  assert saved["devices_per_chip"] == accel.devices_per_chip
  b, t = exp.train.batch_size, exp.train.seq_len
  assert (saved["batch_size"], saved["seq_len"], saved["tokens_per_step"]) == (b, t, b * t)
  assert saved["strategy"] == exp.train.context_parallel_strategy
  used = {a for a, size in saved["mesh"].items() if size > 1}
  assert used == {a for a, size in exp.mesh.ici_shape().items() if size > 1}
  # 'auto' on TPU devices from this CPU host: the TPU kernel (or what the gin
  # file pins).
  configured = exp.train.attention_options.backend
  assert saved["attention_backend"] == ("splash" if configured == "auto" else configured)
  d = saved["per_device"]
  assert d["total_bytes"] == (
    d["argument_bytes"] + d["output_bytes"] - d["alias_bytes"] + d["temp_bytes"]
  )
  # Arguments hold this device's shards of the train state (params, Adam moments).
  mesh = mesh_lib.make_mesh(exp.mesh, devices=tpu_lib.topology_devices(topology))
  state = Trainer(exp.model, exp.train, mesh).abstract_state
  state_bytes = sum(
    math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(state)
  )
  assert d["argument_bytes"] >= state_bytes
  assert d["alias_bytes"] > 0 and d["temp_bytes"] > 0  # donated state; activations
  # What the executable allocates (buffer assignment): the arguments and a heap
  # no larger than memory_analysis' temporaries.
  assert saved["allocated_hbm_bytes_per_device"] >= d["argument_bytes"]
  assert 0 < saved["allocated_temp_bytes_per_device"] <= d["temp_bytes"]
  # fits is judged by that allocation, the figure the compiler checks.
  assert saved["fits_figure"] == "allocation"
  assert saved["hbm_checked_bytes_per_device"] == saved["allocated_hbm_bytes_per_device"]
  assert saved["fits"] == (
    saved["allocated_hbm_bytes_per_device"] <= saved["hbm_bytes_per_device"]
    and saved["host_bytes_per_vm"] <= saved["host_ram_bytes_per_vm"]
  )
  if (exp.model.remat_choices or {}).get("layer_input") == "offload":  # the long-context files
    # Pinned host as allocated (the buffer assignment's host memory space), no
    # more than memory_analysis' host figure.
    host = saved["allocated_host_bytes_per_device"]
    assert 0 < host <= d["host_bytes"]
    assert saved["host_bytes_per_vm"] == host * saved["devices_per_vm"]
  else:
    assert d["host_bytes"] == 0 and saved["host_bytes_per_vm"] == 0
    assert saved["allocated_host_bytes_per_device"] is None
  assert saved["hbm_bytes_per_device"] == accel.hbm_bytes_per_device
  assert saved["host_ram_bytes_per_vm"] == accel.host_ram_bytes_per_host
  assert saved["compile_seconds"] > 0
  out = capsys.readouterr().out
  assert f"strategy {saved['strategy']}" in out and "\nfits: " in out
  assert "does not fit" not in out


def test_too_long_a_sequence_does_not_fit(tmp_path):
  """main.py end to end: the compiler's OOM is a result, with a non-zero exit code."""
  params = [
    "include 'gin/models/tiny.gin'",
    "ModelConfig.dtype = 'bfloat16'",
    "ModelConfig.mlp_chunk_size = None",
    "MeshConfig.fsdp = 1",
    "MeshConfig.context = 4",
    "TrainConfig.batch_size = 1",
    # 256K tokens per device with whole-row logits (f32, vocab 32,768): 32 GiB of
    # logits alone, more than v5e's 15.75 GiB (a short row compiles quickly).
    "ModelConfig.vocab_size = 32768",
    "TrainConfig.loss_chunk_size = None",
    f"TrainConfig.seq_len = {2**20}",
  ]
  cmd = [
    sys.executable,
    os.path.join(ROOT, "main.py"),
    "--mode=compile",
    "--gin_file=gin/ring_v5p.gin",
    "--compile_topology=v5e:2x2",
    f"--workdir={tmp_path}",
    *[f"--gin_param={p}" for p in params],
  ]
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  env.pop("XLA_FLAGS", None)
  proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  out = proc.stdout + proc.stderr
  assert proc.returncode != 0, out[-3000:]
  m = re.search(r"does not fit: needs ([\d.]+) GiB of ([\d.]+) GiB per device", proc.stdout)
  assert m, out[-3000:]
  assert float(m.group(2)) == 15.75 and float(m.group(1)) > 15.75
  assert "Traceback" not in out
  with open(tmp_path / "compile.json") as f:
    record = json.load(f)
  assert record["fits"] is False and record["tokens_per_step"] == 2**20
  assert set(record) >= RECORD_KEYS and set(record["per_device"]) == PER_DEVICE_KEYS
  assert record["per_device"]["total_bytes"] > record["hbm_bytes_per_device"]
  assert record["fits_figure"] == "compiler"
  assert record["hbm_checked_bytes_per_device"] == record["per_device"]["total_bytes"]
  assert os.path.exists(tmp_path / "config.gin")


@pytest.mark.parametrize("path", sorted(SMALL_SLICE))
def test_tpu_gin_file_mesh_matches_its_slice(path):
  """The gin file's own mesh takes exactly the devices of the slice it names."""
  exp = _experiment(path)
  topology = _topology_of(path)
  accel = hardware.topology_accelerator(topology)
  devices = hardware.topology_chips(topology) * accel.devices_per_chip
  shape = mesh_lib.resolve_mesh_shape(exp.mesh, devices)
  assert shape["context"] * shape["context_ulysses"] > 1
  assert exp.train.device_memory_gib * GiB <= accel.hbm_bytes_per_device


@pytest.mark.parametrize("kind", ["v5p:2x2x1", "v5e:2x2", "v6e:2x2", "tpu7x:2x2x1"])
def test_hbm_table_is_what_the_compiler_enforces(kind):
  """An oversized program's RESOURCE_EXHAUSTED names the HBM per device; the
  hardware table must hold that figure."""
  devices = tpu_lib.topology_devices(kind)
  sharding = NamedSharding(Mesh(devices[:1], ("x",)), P())
  x = jax.ShapeDtypeStruct((300_000,), jnp.float32, sharding=sharding)
  outer_sorted = jax.jit(lambda x: jnp.sort(x[:, None] * x[None, :], axis=0)[0])
  with pytest.raises(jax.errors.JaxRuntimeError, match="RESOURCE_EXHAUSTED") as err:
    outer_sorted.lower(x).compile()
  needed, available = compile_lib._oom_bytes(str(err.value))  # pylint: disable=protected-access
  assert needed > available
  table = hardware.topology_accelerator(kind).hbm_bytes_per_device
  assert abs(available - table) < 0.01 * GiB, (kind, available / GiB, table / GiB)


def test_the_compilers_hbm_check_is_the_buffer_assignment(tmp_path):
  """Why `fits` reads the buffer assignment's allocation on TPU, not memory_analysis():
  the gradient of two chained `lax.scan`s over `[rows, 4096]` bf16 (v5p, one
  device) allocates 15 rows of HBM (a 13-row heap, the input and its gradient) while
  memory_analysis reports 22 (temporaries 20). At 786,432 rows (6 GiB a row) the
  compiler accepts it with memory_analysis' total at 132 GiB of 95.74 and an
  allocation of 90; at 917,504 rows it refuses it, and the figure of its
  RESOURCE_EXHAUSTED is the allocation of the refused program's own dump. (With a
  single scan the two figures differ by one row, the size of the gradient output,
  which once made memory_analysis look like the figure checked.) A second check
  after code generation adds the program's code overlays: an accepted program
  allocates no more than the HBM, a refused one may allocate less."""
  devices = tpu_lib.topology_devices("v5p:2x2x1")
  sharding = NamedSharding(Mesh(devices[:1], ("x",)), P())

  def two_scans_grad(x, w):
    def loss(x, w):
      layer = lambda c, wi: (jnp.tanh(c @ wi), None)  # noqa: E731
      y, _ = jax.lax.scan(layer, x, w)
      y, _ = jax.lax.scan(layer, y, w)
      return y.astype(jnp.float32).sum()

    return jax.grad(loss, argnums=(0, 1))(x, w)

  def compile_at(rows, dump):
    x = jax.ShapeDtypeStruct((rows, 4096), jnp.bfloat16, sharding=sharding)
    w = jax.ShapeDtypeStruct((2, 4096, 4096), jnp.bfloat16, sharding=sharding)
    options = {"xla_dump_to": str(dump), "xla_dump_hlo_as_text": True}
    return jax.jit(two_scans_grad).lower(x, w).compile(compiler_options=options)

  hbm = hardware.topology_accelerator("v5p:2x2x1").hbm_bytes_per_device
  rows = 786_432
  compiled = compile_at(rows, tmp_path / "accepted")
  allocated = compile_lib._allocated(str(tmp_path / "accepted"), "two_scans_grad")  # pylint: disable=protected-access
  stats = compile_lib._memory(compiled)  # pylint: disable=protected-access
  row = rows * 4096 * 2
  assert stats["total_bytes"] > 1.3 * hbm, stats["total_bytes"] / GiB  # accepted all the same
  assert allocated["hbm_bytes"] < hbm
  assert stats["temp_bytes"] - allocated["temp_bytes"] > 6 * row  # not one buffer: many
  with pytest.raises(jax.errors.JaxRuntimeError, match="RESOURCE_EXHAUSTED") as err:
    compile_at(917_504, tmp_path / "refused")
  needed, available = compile_lib._oom_bytes(str(err.value))  # pylint: disable=protected-access
  refused = compile_lib._allocated(str(tmp_path / "refused"), "two_scans_grad")  # pylint: disable=protected-access
  assert available < needed
  assert abs(needed - refused["hbm_bytes"]) < 0.001 * needed, (needed / GiB, refused)
  # memory_analysis' total, scaled from the accepted program, is far above it.
  assert stats["total_bytes"] * 917_504 / rows > 1.3 * needed
  # After code generation the compiler checks again, counting the program's code
  # overlays besides the allocation: with the HBM capped 1 MiB above a small
  # version's allocation it refuses that program, naming its overlays.
  small = compile_at(65_536, tmp_path / "small")
  assert small.memory_analysis().generated_code_size_in_bytes > 2**20
  cap = compile_lib._allocated(str(tmp_path / "small"), "two_scans_grad")["hbm_bytes"] // 2**20 + 1  # pylint: disable=protected-access
  x = jax.ShapeDtypeStruct((65_536, 4096), jnp.bfloat16, sharding=sharding)
  w = jax.ShapeDtypeStruct((2, 4096, 4096), jnp.bfloat16, sharding=sharding)
  with pytest.raises(jax.errors.JaxRuntimeError, match="CompileTimeHbmOom") as err:
    jax.jit(two_scans_grad).lower(x, w).compile(compiler_options={"xla_tpu_max_hbm_size_mib": cap})
  assert "overlays" in str(err.value)


def test_the_host_allocation_is_read_from_the_buffer_assignment(tmp_path):
  """Pinned host memory as the executable allocates it (memory space 5 of the
  buffer assignment), the figure `fits` checks against the VM's RAM on TPU: the
  gradient of a scan of 8 layers under a policy that offloads each layer's
  `[rows, 512]` bf16 input (v5p, one device) allocates exactly those 8 inputs on
  the host; memory_analysis' host temporaries are at least that."""
  devices = tpu_lib.topology_devices("v5p:2x2x1")
  sharding = NamedSharding(Mesh(devices[:1], ("x",)), P())
  policy = jax.checkpoint_policies.save_and_offload_only_these_names(
    names_which_can_be_saved=[],
    names_which_can_be_offloaded=["layer_input"],
    offload_src="device",
    offload_dst="pinned_host",
  )

  @functools.partial(jax.checkpoint, policy=policy)
  def layer(c, wi):
    c = jax.ad_checkpoint.checkpoint_name(c, "layer_input")
    return jnp.tanh(c @ wi)

  def grad(x, w):
    def loss(x, w):
      step = lambda c, wi: (layer(c, wi), None)  # noqa: E731
      return jax.lax.scan(step, x, w)[0].astype(jnp.float32).sum()

    return jax.grad(loss, argnums=(0, 1))(x, w)

  rows, layers = 16_384, 8
  x = jax.ShapeDtypeStruct((rows, 512), jnp.bfloat16, sharding=sharding)
  w = jax.ShapeDtypeStruct((layers, 512, 512), jnp.bfloat16, sharding=sharding)
  options = {"xla_dump_to": str(tmp_path), "xla_dump_hlo_as_text": True}
  compiled = jax.jit(grad).lower(x, w).compile(compiler_options=options)
  allocated = compile_lib._allocated(str(tmp_path), "grad")  # pylint: disable=protected-access
  assert allocated["host_bytes"] == layers * rows * 512 * 2, allocated
  assert compile_lib._memory(compiled)["host_bytes"] >= allocated["host_bytes"]  # pylint: disable=protected-access


def test_allocated_reads_the_host_space_after_long_hbm_listings(tmp_path):
  """The host memory space follows the HBM slots in the report, 190 KB into the
  Ironwood hybrid's: the whole report is read."""
  rows = "".join(f"   1.00GiB(  1%);    1.00GiB;  {i};  1; bf16[1,2,3]\n" for i in range(5000))
  report = (
    "Memory Space: default (color=0)\nTotal bytes: 1234\n" + rows
    + "Memory Space: cmem (color=5)\nTotal bytes: 5678\n"
  )  # fmt: skip
  assert len(report) > 1 << 17
  (tmp_path / "module_0001.jit_train_step.memory-usage-report.txt").write_text(report)
  allocated = compile_lib._allocated(str(tmp_path))  # pylint: disable=protected-access
  assert (allocated["hbm_bytes"], allocated["host_bytes"]) == (1234, 5678)


def test_fits_is_judged_by_the_allocation_and_says_when_memory_analysis_is_over(
  tmp_path, monkeypatch
):
  """A program whose memory_analysis total is over the HBM but whose allocation
  is within it fits, with a note naming both; without the dump's report, fits
  falls back to memory_analysis and says so."""
  topology, mesh_params = SMALL_SLICE["gin/long_v5p.gin"]
  exp = _experiment("gin/long_v5p.gin", [*TINY, *mesh_params])
  hbm = hardware.topology_accelerator(topology).hbm_bytes_per_device
  real_memory = compile_lib._memory  # pylint: disable=protected-access

  def over(compiled):
    d = real_memory(compiled)
    d["temp_bytes"] += 2 * hbm
    d["total_bytes"] += 2 * hbm
    return d

  monkeypatch.setattr(compile_lib, "_memory", over)
  record = compile_lib.compile_step(exp, topology=topology)
  assert record["fits"] and record["fits_figure"] == "allocation"
  assert record["hbm_checked_bytes_per_device"] == record["allocated_hbm_bytes_per_device"] < hbm
  assert any("out-of-memory checks measure the allocation" in n for n in record["notes"])
  assert "GiB allocated of 95.74 GiB per device" in compile_lib.summary(record)
  monkeypatch.setattr(compile_lib, "_allocated", lambda *a, **k: {})
  record = compile_lib.compile_step(exp, topology=topology)
  assert not record["fits"] and record["fits_figure"] == "memory_analysis"
  assert record["hbm_checked_bytes_per_device"] == record["per_device"]["total_bytes"]
  assert any("no buffer-assignment report" in n for n in record["notes"])
  assert "does not fit: needs" in compile_lib.summary(record)


def test_gpu_nodes_and_tpu_slices_are_named_apart():
  with pytest.raises(ValueError, match="named by its topology"):
    compile_lib.compile_devices("v5p-64")
  with pytest.raises(ValueError, match="not as slices"):
    compile_lib.compile_devices("h100x8", num_slices=2)


def test_oom_figures_are_read_in_their_units():
  read = compile_lib._oom_bytes  # pylint: disable=protected-access
  assert read("temporaries (97.88G) exceeds available HBM (95.74G).") == (
    int(97.88 * GiB),
    int(95.74 * GiB),
  )
  assert read("temporaries (1.57T) exceeds available HBM (15.75G).")[0] == int(1.57 * 2**40)
  assert read("something else") == (None, None)


def test_attention_backend_is_read_from_the_compiled_module():
  assert (
    compile_lib.attention_backend_of('%splash_mha_fwd.1 = custom_call_target="tpu_custom_call"')
    == "splash"
  )
  # The name alone, without a Mosaic call: splash run by the Pallas interpreter.
  assert compile_lib.attention_backend_of("%splash_mha_fwd.1 = f32[] add()") == "splash_interpret"
  assert (
    compile_lib.attention_backend_of(
      'custom_call_target="__cudnn$fmhaSoftmax" custom_call_target="lctx_cpu_attention_fwd"'
    )
    == "cudnn+cpu"
  )
  assert (
    compile_lib.attention_backend_of(
      '%x = f32[] custom-call(), custom_call_target="tpu_custom_call"'
    )
    == "blockwise"
  )
  assert compile_lib.attention_backend_of('custom_call_target="lctx_cpu_attention_fwd"') == "cpu"
  assert compile_lib.attention_backend_of("%add.1 = f32[] add()", "xla") == "xla"


def test_auto_takes_the_tpu_kernel_for_tpu_devices():
  """`auto` decides by the platform the call compiles for, not by this host's
  default backend (CPU here): splash on TPU devices."""
  devices = tpu_lib.topology_devices("v5p:2x2x1")
  sharding = NamedSharding(Mesh(devices[:1], ("x",)), P())
  q = jax.ShapeDtypeStruct((1, 1024, 4, 128), jnp.bfloat16, sharding=sharding)
  kv = jax.ShapeDtypeStruct((1, 1024, 2, 128), jnp.bfloat16, sharding=sharding)

  def loss(q, k, v):
    out = kernels.flash_attention(q, k, v, backend="auto", platform="tpu")
    return out.astype(jnp.float32).sum()

  hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv).compile().as_text()
  assert compile_lib.attention_backend_of(hlo) == "splash"


def test_auto_never_takes_the_cpu_kernel_on_a_tpu_mesh():
  """A float32 model (the fused CPU kernel's dtype) on TPU devices from this CPU
  host: the plan reads the platform from the mesh, and the step compiles for
  TPU with no call into the CPU-only kernel: strategy 'none' takes splash (the
  pipeline's natural order, declared by lctx/parallel/local.py)."""
  exp = _experiment(
    "gin/ring_v5p.gin",
    [
      *TINY,
      "ModelConfig.dtype = 'float32'",
      "MeshConfig.fsdp = 4",
      "MeshConfig.context = 1",
      "TrainConfig.batch_size = 4",
      "TrainConfig.context_parallel_strategy = 'auto'",
      # One layer at 1,024 tokens: the kernel choice does not depend on the size.
      "ModelConfig.num_layers = 1",
      "TrainConfig.seq_len = 1024",
    ],
  )
  mesh = mesh_lib.make_mesh(exp.mesh, devices=tpu_lib.topology_devices("v5p:2x2x1"))
  trainer = Trainer(exp.model, exp.train, mesh)
  assert jax.default_backend() == "cpu" and trainer.plan.platform == "tpu"
  assert trainer.strategy == "none"
  hlo = trainer.lower_train_step().compile().as_text()
  assert "lctx_cpu_attention" not in hlo
  assert compile_lib.attention_backend_of(hlo) == "splash"


def test_auto_strategy_is_sized_with_the_kernel_of_the_mesh(monkeypatch):
  """`auto` sizes its candidates with the buffers of the kernel the mesh runs:
  splash on TPU devices, blockwise on CPU ones (the planner counts the same)."""
  from lctx.parallel import auto  # pylint: disable=g-import-not-at-top
  from lctx.parallel import plan as plan_lib  # pylint: disable=g-import-not-at-top

  seen = []
  choose = auto.choose_strategy
  monkeypatch.setattr(
    auto, "choose_strategy", lambda **kw: seen.append(kw["kernel"]) or choose(**kw)
  )
  dims = plan_lib.AttentionDims(num_heads=8, num_kv_heads=8, head_dim=128, v_head_dim=128)
  cfg = mesh_lib.MeshConfig(context=4)
  for devices in (tpu_lib.topology_devices("v5p:2x2x1"), jax.devices()[:4]):
    plan = plan_lib.make_context_plan(
      mesh_lib.make_mesh(cfg, devices=devices), dims, seq_len=4096, batch_size=1
    )
    assert plan.strategy == "all_gather", plan.reason
  assert seen == ["splash", "blockwise"]


def test_slices_are_data_parallel_over_dcn():
  """Two slices: the data axis crosses them, every other axis stays inside one."""
  exp = _experiment("gin/ring_v5p.gin", ["MeshConfig.fsdp = 1", "MeshConfig.context = 4"])
  devices = tpu_lib.topology_devices("v5p:2x2x1", num_slices=2)
  cfg, note = compile_lib._mesh_config(exp, "v5p:2x2x1", 2)  # pylint: disable=protected-access
  assert cfg.dcn_data == 2 and "dcn_data = 2" in note
  mesh = mesh_lib.make_mesh(cfg, devices=devices)
  assert mesh_lib.mesh_shape(mesh)["data"] == 2
  slices = [{d.slice_index for d in mesh.devices[i].flat} for i in range(2)]
  assert slices == [{0}, {1}] or slices == [{1}, {0}]
  fsdp = dataclasses.replace(exp.mesh, dcn_fsdp=3)
  with pytest.raises(ValueError, match="3 slices, but --compile_topology_num_slices=2"):
    compile_lib._mesh_config(dataclasses.replace(exp, mesh=fsdp), "v5p:2x2x1", 2)  # pylint: disable=protected-access


def test_without_libtpu_it_says_how_to_install_it(monkeypatch):
  real = tpu_lib.importlib.util.find_spec
  monkeypatch.setattr(
    tpu_lib.importlib.util, "find_spec", lambda n: None if n == "libtpu" else real(n)
  )
  with pytest.raises(RuntimeError, match=re.escape("pip install -e '.[tpu]'")):
    tpu_lib.topology_devices("v5p:2x2x1")


def test_without_the_cuda_plugin_it_says_how_to_install_it(monkeypatch):
  from lctx.sizing import gpu as compile_gpu  # pylint: disable=g-import-not-at-top

  real = compile_gpu.importlib.util.find_spec
  monkeypatch.setattr(
    compile_gpu.importlib.util,
    "find_spec",
    lambda n: None if n == "jax_plugins.xla_cuda12" else real(n),
  )
  with pytest.raises(RuntimeError, match=re.escape("pip install -e '.[gpu_compile]'")):
    compile_lib.compile_devices("h100x8")


def test_compile_errors_name_the_problem():
  exp = _experiment("gin/usp_ironwood.gin", [*TINY])
  # 64 devices of v5p cannot take usp_ironwood's 16 x 8 mesh.
  with pytest.raises(ValueError, match=r"v5p:4x4x4 \(64 devices\).*multiply to 128"):
    compile_lib.compile_step(exp, topology="v5p:4x4x4")
  with pytest.raises(ValueError, match="unknown accelerator"):
    compile_lib.compile_step(exp, topology="v9z:2x2")
  with pytest.raises(ValueError, match="--compile_topology"):
    compile_lib.run_compile(exp, "/tmp/unused", topology="")


def test_sliding_layers_move_only_their_halo_under_ring(tmp_path):
  """`--mode=compile` of the ring file (zigzag, 4-way ring on v5p:2x2x1) with two
  sliding-window layers against the same model with two global layers: the
  sliding layers' K/V travel as halos (window 256 of 1,024-token zigzag
  chunks), so the compiled step's collective-permute bytes fall well below the
  ring's. The parameter collectives are the same in both."""
  sliding = {}
  for kind in ("full_attention", "sliding_attention"):
    exp = _experiment(
      "gin/ring_v5p.gin",
      [
        *TINY,
        "MeshConfig.fsdp = 1",
        "MeshConfig.context = 4",
        "TrainConfig.batch_size = 1",
        "TrainConfig.seq_len = 8192",
        f"ModelConfig.layer_types = ['{kind}', '{kind}']",
        "ModelConfig.sliding_window = 256",
      ],
    )
    record = compile_lib.run_compile(exp, str(tmp_path / kind), topology="v5p:2x2x1")
    sliding[kind] = record["collective_bytes_by_kind"]
  permute = {k: v["collective-permute"] for k, v in sliding.items()}
  assert permute["sliding_attention"] * 4 < permute["full_attention"], permute
  for kind in ("all-reduce", "reduce-scatter", "all-gather"):
    assert sliding["sliding_attention"][kind] == sliding["full_attention"][kind], kind

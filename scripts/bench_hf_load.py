"""Loading a Hugging Face checkpoint onto 8 fake CPU devices (fsdp 8): time and peak RSS.

    python scripts/bench_hf_load.py [--param_dtype=float32] [--shard_mb=1024]
        [--json=bench_results/bench_hf_load.json] [--keep_dir=DIR]

Writes a Llama-3.2-1B-shaped checkpoint (random bfloat16 weights, sharded
safetensors + index, tied embeddings, llama3 rope scaling) into a temporary
directory, then loads it in fresh subprocesses, one method each, so their
peaks do not mix:
  lctx      lctx.models.hf.load_pretrained_sharded: every device's slice read on
            its own (safe_open(...).get_slice) into jax.make_array_from_callback;
  baseline  safetensors.numpy.load_file on every file (all tensors in host
            memory), then each param laid out whole and jax.device_put.
Each subprocess reports its wall time (from the first file read to every array
ready) and its peak RSS (VmHWM), both absolute and above its RSS just before the
load (the interpreter, jax and the 8 CPU clients). Targets: peak above that
baseline RSS <= resident params + 2 x largest tensor; wall <= 1.5 x baseline.
The cores are shared: times are a lower bound of what an idle host gives.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# Llama-3.2-1B (meta-llama/Llama-3.2-1B config.json).
LLAMA_3_2_1B = {
  "architectures": ["LlamaForCausalLM"],
  "model_type": "llama",
  "vocab_size": 128256,
  "hidden_size": 2048,
  "intermediate_size": 8192,
  "num_hidden_layers": 16,
  "num_attention_heads": 32,
  "num_key_value_heads": 8,
  "head_dim": 64,
  "hidden_act": "silu",
  "rms_norm_eps": 1e-5,
  "max_position_embeddings": 131072,
  "rope_theta": 500000.0,
  "rope_scaling": {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
  },
  "tie_word_embeddings": True,
  "torch_dtype": "bfloat16",
}


def _rss(field: str) -> int:
  """Bytes of a /proc/self/status field (VmRSS, VmHWM)."""
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1]) * 1024
  raise RuntimeError(f"no {field} in /proc/self/status")


def write_checkpoint(path: str, shard_bytes: int) -> dict:
  """The random checkpoint; returns its sizes."""
  import ml_dtypes
  import numpy as np

  from lctx.models import hf

  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(LLAMA_3_2_1B, f)
  config = hf.load_config(path)
  rng = np.random.default_rng(0)
  params = {}
  for p, shape in hf.param_shapes(config).items():
    node = params
    for key in p[:-1]:
      node = node.setdefault(key, {})
    node[p[-1]] = (0.02 * rng.standard_normal(shape, np.float32)).astype(ml_dtypes.bfloat16)
  files = hf.save_pretrained(path, config, params, "bfloat16", max_shard_bytes=shard_bytes)
  with open(os.path.join(path, "config.json"), "w") as f:  # the original, not the re-export
    json.dump(LLAMA_3_2_1B, f)
  shapes = hf.param_shapes(config)
  # One HF tensor is one layer's slice of a stacked param ('layers' leads with R).
  per_tensor = [int(np.prod(s[1:] if p[0] == "layers" else s)) for p, s in shapes.items()]
  return {
    "files": len(files) - 1,
    "file_bytes": sum(os.path.getsize(f) for f in files if f.endswith(".safetensors")),
    "num_params": sum(int(np.prod(s)) for s in shapes.values()),
    "largest_tensor_params": max(per_tensor),
  }


def load(path: str, method: str, param_dtype: str) -> dict:
  """Runs in the subprocess: one load, its wall time and memory."""
  import dataclasses

  import flax.linen as nn
  import jax
  import numpy as np
  from safetensors.numpy import load_file

  from lctx.models import Transformer, hf
  from lctx.parallel import mesh as mesh_lib

  config = dataclasses.replace(hf.load_config(path), param_dtype=param_dtype)
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(fsdp=8, context=1))
  ids = jax.ShapeDtypeStruct((1, 2), np.int32)
  boxed = jax.eval_shape(lambda i: Transformer(config).init(jax.random.key(0), i, i, i), ids)
  with nn.logical_axis_rules(mesh_lib.LOGICAL_RULES):
    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh)["params"]
  jax.device_put(np.zeros(8), jax.devices()[1]).block_until_ready()  # clients up
  before = _rss("VmRSS")
  start = time.perf_counter()
  if method == "lctx":
    params = hf.load_pretrained_sharded(path, config, shardings)
  else:
    tensors = {}
    for name in sorted(os.listdir(path)):
      if name.endswith(".safetensors"):
        tensors.update(load_file(os.path.join(path, name)))
    reader = hf.open_pretrained(path, config)
    reader.read_hf = lambda name, index: tensors[name][index]  # same layout code, in memory
    flat, treedef = jax.tree_util.tree_flatten_with_path(shardings)
    arrays = [jax.device_put(reader.tensor(tuple(k.key for k in kp))[()], s) for kp, s in flat]
    params = jax.tree_util.tree_unflatten(treedef, arrays)
  jax.block_until_ready(params)
  seconds = time.perf_counter() - start
  resident = sum(x.nbytes for x in jax.tree.leaves(params))
  return {
    "method": method,
    "seconds": seconds,
    "peak_rss_bytes": _rss("VmHWM"),
    "rss_before_load_bytes": before,
    "peak_above_before_bytes": _rss("VmHWM") - before,
    "resident_param_bytes": resident,
  }


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--param_dtype", default="float32", choices=["float32", "bfloat16"])
  p.add_argument("--shard_mb", type=int, default=1024)
  p.add_argument("--json", default="bench_results/bench_hf_load.json")
  p.add_argument("--keep_dir", default=None, help="write (or reuse) the checkpoint here")
  p.add_argument("--_load", nargs=2, help=argparse.SUPPRESS)  # subprocess: path method
  args = p.parse_args()
  if args._load:
    print(json.dumps(load(*args._load, args.param_dtype)))
    return
  tmp = None
  path = args.keep_dir
  if path is None:
    tmp = tempfile.TemporaryDirectory(prefix="bench_hf_load_")
    path = tmp.name
  os.makedirs(path, exist_ok=True)
  start = time.perf_counter()
  sizes_file = os.path.join(path, "bench_sizes.json")
  if os.path.exists(sizes_file):
    with open(sizes_file) as f:
      sizes = json.load(f)
  else:
    sizes = write_checkpoint(path, args.shard_mb << 20)
    with open(sizes_file, "w") as f:
      json.dump(sizes, f)
  write_s = time.perf_counter() - start
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  runs = []
  for method in ("baseline", "lctx"):
    cmd = [sys.executable, __file__, "--_load", path, method, f"--param_dtype={args.param_dtype}"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode:
      sys.exit(f"{method} load failed:\n{out.stderr[-3000:]}")
    runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
  itemsize = 4 if args.param_dtype == "float32" else 2
  largest = sizes["largest_tensor_params"] * itemsize
  base, ours = runs
  result = {
    "machine": "2-core VM shared with other work; 8 fake CPU devices",
    "checkpoint": {**sizes, "write_seconds": write_s, "param_dtype": args.param_dtype},
    "largest_tensor_bytes": largest,
    "runs": runs,
    "wall_ratio_vs_baseline": ours["seconds"] / base["seconds"],
    "target_peak_bytes": ours["resident_param_bytes"] + 2 * largest,
    "peak_target_met": ours["peak_above_before_bytes"]
    <= ours["resident_param_bytes"] + 2 * largest,
    "wall_target_met": ours["seconds"] <= 1.5 * base["seconds"],
  }
  gib = 2**30
  print(
    f"checkpoint: {sizes['num_params'] / 1e9:.3f}B params, {sizes['files']} files, "
    f"{sizes['file_bytes'] / gib:.2f} GiB; params resident as {args.param_dtype}: "
    f"{ours['resident_param_bytes'] / gib:.2f} GiB; largest tensor {largest / gib:.2f} GiB"
  )
  print(f"{'method':<10}{'wall s':>9}{'peak RSS GiB':>14}{'before GiB':>12}{'peak-before':>13}")
  for r in runs:
    print(
      f"{r['method']:<10}{r['seconds']:>9.1f}{r['peak_rss_bytes'] / gib:>14.2f}"
      f"{r['rss_before_load_bytes'] / gib:>12.2f}{r['peak_above_before_bytes'] / gib:>13.2f}"
    )
  print(
    f"wall lctx / baseline = {result['wall_ratio_vs_baseline']:.2f} (target <= 1.5: "
    f"{result['wall_target_met']}); peak above pre-load RSS {ours['peak_above_before_bytes'] / gib:.2f}"
    f" GiB vs target {result['target_peak_bytes'] / gib:.2f} GiB: {result['peak_target_met']}"
  )
  os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
  with open(args.json, "w") as f:
    json.dump(result, f, indent=1)
  if tmp is not None:
    tmp.cleanup()


if __name__ == "__main__":
  main()

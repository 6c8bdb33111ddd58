"""`--mode=compile --compile_step=eval`: the eval step (answers scored inside the
sharded program) compiled by the TPU compiler for a small slice, same compile.json."""

import json
import os
import subprocess
import sys

import helpers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = [*helpers.TINY_GIN, "MeshConfig.fsdp = 2", "MeshConfig.context = 2"]


def _compile(tmp_path, step):
  cmd = [
    sys.executable,
    os.path.join(ROOT, "main.py"),
    "--mode=compile",
    f"--compile_step={step}",
    "--gin_file=gin/ring_v5p.gin",
    "--compile_topology=v5p:2x2x1",
    f"--workdir={tmp_path / step}",
    *[f"--gin_param={p}" for p in TINY],
  ]
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  env.pop("XLA_FLAGS", None)
  proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
  with open(tmp_path / step / "compile.json") as f:
    return json.load(f)


RECORD_KEYS = {  # compile.json's contract (docs/contracts.md), as for the train step
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


def test_the_eval_step_compiles_for_a_slice_and_writes_compile_json(tmp_path):
  ev = _compile(tmp_path, "eval")
  assert set(ev) >= RECORD_KEYS and ev["step"] == "eval"
  assert ev["fits"] is True and ev["strategy"] == "ring"
  assert ev["attention_backend"] == "splash"
  assert ev["tokens_per_step"] == ev["batch_size"] * 4096
  d = ev["per_device"]
  assert d["total_bytes"] == (
    d["argument_bytes"] + d["output_bytes"] - d["alias_bytes"] + d["temp_bytes"]
  )
  # Outputs are the scores only: [B, 64] log-probs and matches, [B, 32] bucket
  # sums, a few KiB with TPU tile padding (this device's share of the logits
  # would be B x T x E x 4 / 4 devices = 6 MiB); nothing is donated.
  assert 0 < d["output_bytes"] < 2**16
  assert d["alias_bytes"] == 0
  assert ev["allocated_temp_bytes_per_device"] is not None  # the eval program's dump was read
  # FLOPs against the forward formula (no backward in an eval step): 2 layers of
  # forward projections and causal attention at 4096 tokens plus the unembedding; the
  # counted total adds whole diagonal blocks and the ring's splash calls, so it
  # sits a little above the formula, never at a train step's ~3x.
  model = 2 * (2 * (128 * 32 * (4 + 2 + 2 + 4) + 3 * 128 * 384) + 2 * 2048 * 4 * 64)
  model = (model + 2 * 128 * 384) * ev["tokens_per_step"] / ev["devices"]
  assert abs(ev["model_flops_per_device"] / model - 1) < 1e-6
  assert 0.9 < ev["recompute_ratio"] < 2.0, ev["recompute_ratio"]

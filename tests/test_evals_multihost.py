"""Evals across processes: `scripts/launch_local.sh 2 ... --mode=eval` writes the
retrieval.json that one process wrote for the same checkpoint (each process
feeds only its rows of every eval batch; process 0 alone writes the files).

Slow (two launches, ~3 minutes on 2 cores): python -m pytest -m slow -n 0 tests/test_evals_multihost.py
"""

import json
import os
import shutil
import subprocess

import helpers
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARAMS = [
  "DataConfig.sources = ('copy',)",
  "DataConfig.weights = ()",
  "DataConfig.copy_max_key_len = 16",
  "ModelConfig.d_model = 32",
  "ModelConfig.num_heads = 4",
  "ModelConfig.num_kv_heads = 2",
  "ModelConfig.head_dim = 8",
  "ModelConfig.mlp_dim = 64",
  "TrainConfig.batch_size = 4",
  "TrainConfig.seq_len = 64",
  "TrainConfig.steps = 1",
  "TrainConfig.log_every = 1",
  "TrainConfig.eval_every = 1",
  "TrainConfig.checkpoint_every = 0",
  "TrainConfig.async_checkpoint = False",
  "TrainConfig.warmup_steps = 1",
  "TrainConfig.attention_options = @AttentionOptions()",
  "AttentionOptions.block_q = 16",
  "AttentionOptions.block_kv = 16",
  "EvalConfig.tasks = ('passkey', 'niah_multikey')",
  "EvalConfig.lengths = (128,)",
  "EvalConfig.depths = (0.0, 1.0)",
  "EvalConfig.samples_per_cell = 2",
  "EvalConfig.batch_size = 4",
  "EvalConfig.length_multiple = 8",
  "EvalConfig.window = 64",
]


def _launch(n, workdir, cache_dir, *more):
  argv, env = helpers.launch_local_args(n, "gin/local_cpu.gin", workdir, cache_dir, PARAMS, *more)
  proc = subprocess.run(
    argv,
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  logs = ""
  for i in range(n):
    with open(os.path.join(workdir, "logs", f"process_{i}.log")) as f:
      logs += f.read()[-3000:]
  assert proc.returncode == 0, (proc.stdout, proc.stderr, logs)
  with open(os.path.join(workdir, "evals", "retrieval.json")) as f:
    return json.load(f)


@pytest.mark.slow
def test_two_processes_write_the_retrieval_json_of_one(tmp_path):
  cache = str(tmp_path / "cache")
  # One process trains a step, checkpoints it and runs the evals; two
  # processes evaluate that checkpoint (--mode=eval) in a copy of the workdir.
  one = _launch(1, str(tmp_path / "one"), cache)
  shutil.copytree(tmp_path / "one" / "checkpoints", tmp_path / "two" / "checkpoints")
  two = _launch(2, str(tmp_path / "two"), cache, "--mode=eval")
  assert len(one) == len(two) > 0
  for a, b in zip(one, two):
    assert a.keys() == b.keys()
    for k, v in a.items():
      if isinstance(v, float):
        np.testing.assert_allclose(b[k], v, rtol=1e-6, atol=1e-6, err_msg=k)
      else:
        assert b[k] == v, k
  # Only process 0 wrote: the metrics line of the evals appears once.
  with open(tmp_path / "two" / "metrics.jsonl") as f:
    lines = [json.loads(x) for x in f]
  assert sum("eval/passkey/acc" in r for r in lines) == 1
  assert sum("eval/loss" in r for r in lines) == 1

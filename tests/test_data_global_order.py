"""One global data order: gin/local_cpu.gin (its text corpus + copy mix) trains
bit-identically as 1 process x 8 devices and 2 x 4 (scripts/launch_local.sh),
and a checkpoint written by 2 processes resumes on 1 with the same stream."""

import json
import os
import shutil
import subprocess

import helpers
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIN_FILE = "gin/local_cpu.gin"
PARAMS = [  # a tiny model and a few steps; the data settings stay local_cpu.gin's
  "experiment.evals = None",
  "DataConfig.copy_max_key_len = 16",
  "ModelConfig.d_model = 32",
  "ModelConfig.num_heads = 4",
  "ModelConfig.num_kv_heads = 2",
  "ModelConfig.head_dim = 8",
  "ModelConfig.mlp_dim = 64",
  "TrainConfig.batch_size = 4",
  "TrainConfig.seq_len = 64",
  "TrainConfig.steps = 4",
  "TrainConfig.log_every = 1",
  "TrainConfig.eval_every = 0",
  "TrainConfig.checkpoint_every = 2",
  "TrainConfig.async_checkpoint = False",
  "TrainConfig.warmup_steps = 2",
  "TrainConfig.attention_options = @AttentionOptions()",
  "AttentionOptions.block_q = 16",
  "AttentionOptions.block_kv = 16",
]


def _launch(n, workdir, cache_dir):
  argv, env = helpers.launch_local_args(n, GIN_FILE, workdir, cache_dir, PARAMS)
  proc = subprocess.run(
    argv,
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  with open(os.path.join(workdir, "logs", "process_0.log")) as f:
    log = f.read()
  assert proc.returncode == 0, (proc.stdout, log[-3000:])
  return log


def _losses(workdir) -> dict[int, float]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  return {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.mark.slow  # three launches: ~4 min on the shared 2-core VM
def test_one_and_two_processes_train_identically_and_resume_across_counts(tmp_path):
  cache = str(tmp_path / "jax_cache")
  one, two = str(tmp_path / "one"), str(tmp_path / "two")
  _launch(1, one, cache)
  _launch(2, two, cache)
  want, got = _losses(one), _losses(two)
  assert sorted(want) == [1, 2, 3, 4]
  assert [got[s] for s in range(1, 5)] == [want[s] for s in range(1, 5)]  # bit-identical
  # The 2-process run's step-2 checkpoint, resumed by 1 process: the same stream.
  shutil.rmtree(os.path.join(two, "checkpoints", "4"))
  log = _launch(1, two, cache)
  assert "Resumed from step 2" in log and "data stream restarts" not in log
  resumed = _losses(two)
  assert [resumed[s] for s in (3, 4)] == [want[s] for s in (3, 4)]


@pytest.fixture(autouse=True)
def _data_dir(tmp_path_factory, monkeypatch):
  # The default corpus cache is shared with the other tests (prepared once).
  if "LCTX_DATA_DIR" not in os.environ:
    monkeypatch.setenv("LCTX_DATA_DIR", os.path.expanduser("~/.cache/lctx/tfds"))

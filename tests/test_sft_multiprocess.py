"""Scale: gin/local_cpu_sft.gin on a conversation file trains to the same losses
(bit-identical) as 1 process x 8 devices and 2 processes x 4 devices
(scripts/launch_local.sh), with the same supervised token counts."""

import json
import os
import subprocess
import sys

import helpers
import pytest

GIN_FILE = "gin/local_cpu_sft.gin"
PARAMS = [  # a tiny model from scratch and a few steps; data, mesh and strategy stay the recipe's
  "TrainConfig.init_params_from = None",
  "ModelConfig.d_model = 32",
  "ModelConfig.num_heads = 4",
  "ModelConfig.num_kv_heads = 2",
  "ModelConfig.head_dim = 8",
  "ModelConfig.mlp_dim = 64",
  "TrainConfig.batch_size = 8",
  "TrainConfig.seq_len = 512",
  "TrainConfig.steps = 4",
  "TrainConfig.log_every = 1",
  "TrainConfig.checkpoint_every = 0",
  "TrainConfig.warmup_steps = 2",
  "TrainConfig.attention_options = @AttentionOptions()",
  "AttentionOptions.block_q = 64",
  "AttentionOptions.block_kv = 64",
  "DataConfig.num_packing_bins = 16",
]


def _launch(n, workdir, cache_dir, params):
  argv, env = helpers.launch_local_args(n, GIN_FILE, workdir, cache_dir, params)
  proc = subprocess.run(
    argv, cwd=helpers.ROOT, env=env, capture_output=True, text=True, timeout=900
  )
  with open(os.path.join(workdir, "logs", "process_0.log")) as f:
    log = f.read()
  assert proc.returncode == 0, (proc.stdout, log[-3000:])
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  return {r["step"]: (r["loss"], r["supervised_tokens"]) for r in records if "loss" in r}


@pytest.mark.slow  # two launches of the recipe on a tiny model: a few minutes on 2 cores
def test_one_and_two_processes_give_the_same_losses(tmp_path):
  data = tmp_path / "sft_data"
  subprocess.run(
    [
      sys.executable,
      os.path.join(helpers.ROOT, "scripts/make_sft_data.py"),
      f"--out={data}",
      "--train=400",
      "--heldout=4",
    ],
    check=True,
    capture_output=True,
  )
  params = PARAMS + [
    f"SFT_TRAIN = '{data / 'train.jsonl'}'",
    f"SFT_TOKENIZER = '{data / 'tokenizer'}'",
    f"DataConfig.data_dir = '{tmp_path / 'cache'}'",
  ]
  cache = str(tmp_path / "jax_cache")
  one = _launch(1, str(tmp_path / "one"), cache, params)
  two = _launch(2, str(tmp_path / "two"), cache, params)
  assert sorted(one) == [1, 2, 3, 4]
  assert [two[s] for s in range(1, 5)] == [one[s] for s in range(1, 5)]  # bit-identical
  assert all(tokens > 0 for _, tokens in one.values())

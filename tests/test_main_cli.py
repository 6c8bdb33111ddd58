"""main.py as a new user meets it: a subprocess per command, stderr read whole.

The environment is the user's, not the test suite's: JAX_PLATFORMS and XLA_FLAGS
(set by conftest.py) are removed, so main.py's own platform choice is what runs.
"""

import json
import os
import re
import subprocess
import sys
import time

import helpers
import numpy as np
import pytest

from lctx import errors, progress

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Plugin noise a CPU run must not print: the CUDA plugin's traceback, libtpu's error.
PLUGIN_NOISE = ("Traceback", "E0000")


def _main(*args):
  env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
  return subprocess.run(
    [sys.executable, os.path.join(ROOT, "main.py"), *args],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )


def test_local_run_prints_no_plugin_errors(tmp_path):
  proc = _main(
    "--gin_file=gin/local_cpu.gin",
    f"--workdir={tmp_path}",
    "--gin_param=TrainConfig.steps = 1",
    "--gin_param=TrainConfig.seq_len = 256",
    "--gin_param=TrainConfig.log_every = 1",
    "--gin_param=TrainConfig.eval_every = 0",
    "--gin_param=TrainConfig.checkpoint_every = 0",
    "--gin_param=experiment.evals = None",
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  for noise in PLUGIN_NOISE:
    assert noise not in proc.stderr, proc.stderr[-3000:]
  assert "on 8 devices (cpu)" in proc.stderr  # LOCAL_DEVICES, on the CPU platform
  with open(tmp_path / "metrics.jsonl") as f:
    assert [json.loads(line)["step"] for line in f if '"loss"' in line] == [1]


@pytest.mark.parametrize(
  "args, cause, fix",
  [
    (
      ["--gin_file=gin/local_cpu.gin", "--gin_param=TrainConfig.seqlen=5"],
      "doesn't have a parameter named 'seqlen'",
      "Did you mean TrainConfig.seq_len?",
    ),
    (
      ["--gin_file=gin/local_cpu_typo.gin"],
      "gin file 'gin/local_cpu_typo.gin' not found",
      "Did you mean gin/local_cpu",
    ),
    (
      ["--mode=compile", "--gin_file=gin/local_cpu.gin"],
      "--mode=compile needs a target",
      "Pass --compile_topology=",
    ),
    (
      [
        "--gin_file=gin/local_cpu.gin",
        "--gin_param=TrainConfig.context_parallel_strategy = 'ulysses'",
        "--gin_param=MeshConfig.data = 1",
        "--gin_param=MeshConfig.context = 8",
      ],
      "[ulysses-heads]",
      "--gin_param",
    ),
    (
      ["--gin_file=gin/local_cpu.gin", "--gin_param=TrainConfig.attention_block_q = 128"],
      "TrainConfig.attention_block_q moved to AttentionOptions.block_q",
      "bind TrainConfig.attention_options = @AttentionOptions()",
    ),
  ],
  ids=["gin-typo", "missing-file", "compile-no-target", "invalid-strategy", "moved-binding"],
)
def test_bad_input_is_one_line(args, cause, fix, tmp_path):
  proc = _main(*args, f"--workdir={tmp_path}")
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
  lines = [line for line in proc.stderr.splitlines() if cause in line]
  assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
  assert fix in lines[0]


def test_wrong_hardware_names_the_target_and_the_command(tmp_path):
  proc = _main("--gin_file=gin/usp_ironwood.gin", f"--workdir={tmp_path}")
  assert proc.returncode == 2, proc.stderr[-3000:]
  (line,) = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
  assert "gin/usp_ironwood.gin is for tpu7x:4x4x4 (128 devices)" in line
  assert re.search(r"this machine has \d+ .+ devices", line), line
  assert "python main.py --mode=compile --gin_file=gin/usp_ironwood.gin" in line
  for noise in PLUGIN_NOISE:
    assert noise not in proc.stderr, proc.stderr[-3000:]


# The gin files' dtypes and strategy, a one-layer model: seconds of compile.
TINY = [
  "ModelConfig.vocab_size = 384",
  "ModelConfig.d_model = 128",
  "ModelConfig.num_layers = 1",
  "ModelConfig.num_heads = 4",
  "ModelConfig.num_kv_heads = 2",
  "ModelConfig.head_dim = 32",
  "ModelConfig.mlp_dim = 384",
  "ModelConfig.mlp_chunk_size = None",
  "TrainConfig.seq_len = 16384",
  "TrainConfig.loss_chunk_size = 1024",
  "TrainConfig.attention_options = @AttentionOptions()",
  "AttentionOptions.block_q = 512",
  "AttentionOptions.block_kv = 512",
]


def test_compile_takes_the_slice_the_file_names(tmp_path):
  """No --compile_topology: ring_v5p.gin's own COMPILE_TOPOLOGY (v5p:4x4x4, 64
  devices) with its own mesh; the heartbeat names the phases."""
  proc = _main(
    "--mode=compile",
    "--gin_file=gin/ring_v5p.gin",
    f"--workdir={tmp_path}",
    *(f"--gin_param={p}" for p in TINY),
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  with open(tmp_path / "compile.json") as f:
    record = json.load(f)
  assert (record["topology"], record["devices"], record["fits"]) == ("v5p:4x4x4", 64, True)
  assert "compile v5p:4x4x4: compiling (lowering took" in proc.stderr
  for noise in PLUGIN_NOISE:
    assert noise not in proc.stderr, proc.stderr[-3000:]


def test_heartbeat_beats_while_the_work_runs(monkeypatch):
  lines = []
  monkeypatch.setattr(progress.logging, "info", lambda fmt, *a: lines.append(fmt % a))
  with progress.Heartbeat("compile x", every=0.02) as beat:
    beat.phase("compiling")
    deadline = time.monotonic() + 30
    while sum("still compiling" in line for line in lines) < 2 and time.monotonic() < deadline:
      time.sleep(0.01)
  assert lines[0] == "compile x: lowering"
  assert lines[1].startswith("compile x: compiling (lowering took")
  assert sum("still compiling" in line for line in lines) >= 2, lines
  count = len(lines)
  time.sleep(0.1)
  assert len(lines) == count  # the thread stopped with the block


def test_only_input_errors_become_one_line():
  """What config_phase turns into a ConfigError, and what it leaves a bug."""
  for user_error in (ValueError("bad value"), FileNotFoundError("no file"), SyntaxError("gin")):
    with pytest.raises(errors.ConfigError), errors.config_phase():
      raise user_error
  with pytest.raises(RuntimeError), errors.config_phase():
    raise RuntimeError("a bug")
  assert issubclass(errors.ConfigError, ValueError)  # callers catching ValueError still do
  line = errors.one_line(errors.ConfigError("two\nlines", fix="Do this."))
  assert line == "error: two lines Do this."


# Run-time bad input: one line, status 2, no traceback, like a config error.
_SHORT_RUN = [
  "--gin_file=gin/local_cpu.gin",
  "--gin_param=TrainConfig.seq_len = 256",
  "--gin_param=TrainConfig.log_every = 1",
  "--gin_param=TrainConfig.eval_every = 0",
  "--gin_param=TrainConfig.checkpoint_every = 0",
]


def _one_error_line(proc, cause):
  assert proc.returncode == errors.EXIT_STATUS, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
  (line,) = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
  assert cause in line, line
  return line


def test_bad_jsonl_row_is_one_line(tmp_path):
  rows = tmp_path / "rows.jsonl"
  good = json.dumps({"text": "a row of text " * 20})
  rows.write_text("\n".join([good, good, "{not json", good]) + "\n")
  source = f"{{'kind': 'jsonl', 'path': '{rows}', 'field': 'text'}}"
  proc = _main(
    *_SHORT_RUN,
    f"--workdir={tmp_path / 'run'}",
    "--gin_param=TrainConfig.steps = 1",
    f"--gin_param=DataConfig.sources = ({source},)",
    "--gin_param=DataConfig.weights = (1.0,)",
    f"--gin_param=DataConfig.data_dir = '{tmp_path / 'cache'}'",
    "--gin_param=experiment.evals = None",
  )
  line = _one_error_line(proc, "rows.jsonl:3: line 3 is not JSON")
  assert "skip_bad_rows" in line


def test_bad_task_file_mid_training_checkpoints_first(tmp_path):
  """The task file is read at the step-1 retrieval eval: the run writes a
  checkpoint at step 1, then stops with the file's line in one error line."""
  task = tmp_path / "qa_bad.jsonl"
  task.write_text(json.dumps({"input": "Q?", "outputs": ["A"]}) + "\n" + '{"input": 3}\n')
  work = tmp_path / "run"
  proc = _main(
    *_SHORT_RUN,
    f"--workdir={work}",
    "--gin_param=TrainConfig.steps = 3",
    "--gin_param=TrainConfig.retrieval_eval_every = 1",
    "--gin_param=EvalConfig.tasks = ()",
    f"--gin_param=EvalConfig.task_files = ('{task}',)",
  )
  line = _one_error_line(proc, "qa_bad.jsonl, line 2: 'input' must be a string")
  assert "stopped at step 1; the checkpoint at step 1" in line
  assert sorted(os.listdir(work / "checkpoints")) == ["1"]


# A chatml template that fails on one row. Conversation rows are rendered as the
# run reads them (lctx/data/conversations.py encode_stored), so unlike a text
# jsonl row (checked when the corpus is prepared) a bad one can be met mid-training.
_POISON_TEMPLATE = (
  "{% for m in messages %}{% if m['content'] == 'poison' %}"
  "{{ raise_exception('the row is poisoned') }}{% endif %}"
  "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
)


def test_bad_chat_row_mid_training_checkpoints_first(tmp_path):
  """A data row met after training began: one error line naming file:line,
  status 2, and first a checkpoint at the step reached. The poisoned row is one
  the run's own pipeline (same data config and seed) reads for batch 6."""
  from lctx.data.pipeline import DataConfig, make_iterator
  from lctx.data.tokenizers import HFTokenizer

  tok = helpers.save_chat_tokenizer(str(tmp_path / "tok"), "chatml")
  rows = [
    [
      {"role": "user", "content": f"what is the key {i}?"},
      {"role": "assistant", "content": f"the answer is {i} " * 12},
    ]
    for i in range(200)
  ]
  path = tmp_path / "conv.jsonl"
  path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
  source = {
    "kind": "chat",
    "path": str(path),
    "field": "messages",
    "train_on": "all",
    "chat_template": _POISON_TEMPLATE,
  }
  data = {"num_packing_bins": 4, "window_shuffle_size": 1}
  it = make_iterator(
    DataConfig(
      sources=(source,),
      weights=(1.0,),
      packing="first_fit",
      tokenizer="hf",
      tokenizer_model_path=tok,
      data_dir=str(tmp_path / "probe_cache"),
      **data,
    ),
    split="train",
    batch_size=8,
    seq_len=256,
    seed=0,
    process_index=0,
    process_count=1,
  )
  batches = [next(it) for _ in range(7)]
  text = HFTokenizer(tok).decode(batches[6]["inputs"].reshape(-1).tolist())
  earlier = HFTokenizer(tok).decode(
    np.concatenate([b["inputs"].reshape(-1) for b in batches[:6]]).tolist()
  )
  late = [i for i in range(200) if f"key {i}?" in text and f"key {i}?" not in earlier]
  assert late, text
  rows[late[0]][1]["content"] = "poison"
  path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
  work = tmp_path / "run"
  proc = _main(
    *_SHORT_RUN,
    f"--workdir={work}",
    "--gin_param=TrainConfig.steps = 20",
    "--gin_param=ModelConfig.vocab_size = 400",
    f"--gin_param=DataConfig.sources = ({source!r},)",
    "--gin_param=DataConfig.weights = (1.0,)",
    *(f"--gin_param=DataConfig.{k} = {v}" for k, v in data.items()),
    "--gin_param=DataConfig.tokenizer = 'hf'",
    f"--gin_param=DataConfig.tokenizer_model_path = '{tok}'",
    f"--gin_param=DataConfig.data_dir = '{tmp_path / 'cache'}'",
    "--gin_param=experiment.evals = None",
  )
  line = _one_error_line(
    proc, f"conv.jsonl:{late[0] + 1}: the chat template failed: the row is poisoned"
  )
  found = re.search(r"stopped at step (\d+); the checkpoint at step \1 ", line)
  assert found and 1 <= int(found.group(1)) <= 6, line
  assert sorted(os.listdir(work / "checkpoints")) == [found.group(1)]

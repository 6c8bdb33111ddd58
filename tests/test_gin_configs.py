"""Every gin file parses and builds; local ones train a step, hardware ones lower.

Hardware configs (TPU slices) cannot run here: their mesh is shrunk to the 8
fake CPU devices (same strategy, same axes used) and one train step is lowered
on abstract inputs, which checks shapes, shardings and strategy validation
without allocating the model.
"""

import glob
import json
import math
import os
import re
import subprocess
import sys

import gin
import pytest

from lctx import configs, gin_utils
from lctx import train as train_lib
from lctx.parallel import mesh as mesh_lib
from lctx.trainer import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPERIMENTS = sorted(
  os.path.relpath(p, ROOT)
  for p in glob.glob(os.path.join(ROOT, "gin", "*.gin"))
  + glob.glob(os.path.join(ROOT, "gin", "bench", "*.gin"))
)
LOCAL = {
  "gin/local_cpu.gin",
  "gin/bench/maxtext_cpu_peer.gin",
  "gin/local_cpu_retrieval.gin",
  "gin/local_cpu_retrieval_windowed.gin",
  "gin/local_cpu_retrieval_hybrid.gin",
  "gin/local_cpu_extension.gin",
  "gin/local_cpu_extension_hybrid.gin",
  "gin/local_cpu_sft.gin",
}
# Local files whose one-step run is under the slow mark: two hybrid compiles (the
# base and the stage) at minutes each on 2 cores, where the hybrid model's step
# (gin/local_cpu_retrieval_hybrid.gin) and the extension stage
# (gin/local_cpu_extension.gin) each run in the default suite and
# tests/test_retrieval_hybrid_gin.py checks that the file is their combination.
SLOW_LOCAL = {"gin/local_cpu_extension_hybrid.gin"}
# Files that import an HF checkpoint (the macro HF_CHECKPOINT): built and run here
# on a tiny Llama with a tiny tokenizer.json.
PRETRAINED = {"gin/local_cpu_pretrained.gin"}
# Stage files and the file whose checkpoint they start from (BASE_WORKDIR).
STAGE_BASES = {
  "gin/local_cpu_extension.gin": "gin/local_cpu_retrieval.gin",
  "gin/local_cpu_extension_hybrid.gin": "gin/local_cpu_retrieval_hybrid.gin",
  "gin/local_cpu_sft.gin": "gin/local_cpu_retrieval.gin",
}
# Mesh shrunk to 8 devices, keeping every axis the strategy uses above 1.
SHRUNK_MESH = {
  "gin/usp_ironwood.gin": [
    "MeshConfig.context = 2",
    "MeshConfig.context_ulysses = 2",
    "MeshConfig.tensor = 2",
  ],
  "gin/long_v5p.gin": [
    "MeshConfig.context = 2",
    "MeshConfig.context_ulysses = 2",
    "MeshConfig.tensor = 2",
  ],
  "gin/long_ironwood.gin": ["MeshConfig.context = 8"],
  "gin/long_h100.gin": ["MeshConfig.context = 8"],  # its own 8-GPU mesh
  # The hybrids: ring with head stages; no tensor axis.
  "gin/long_hybrid_v5p.gin": ["MeshConfig.context = 8"],
  "gin/long_hybrid_ironwood.gin": ["MeshConfig.context = 8"],
  "gin/long_gemma3_v5p.gin": ["MeshConfig.context = 8"],  # ring; sliding layers by halo
  "gin/ring_v5p.gin": ["MeshConfig.fsdp = 2", "MeshConfig.context = 4"],
  "gin/allgather_v5p.gin": ["MeshConfig.fsdp = 2", "MeshConfig.context = 4"],
  "gin/ulysses_v5p.gin": ["MeshConfig.fsdp = 2", "MeshConfig.context = 4"],
  "gin/extend_llama31_8b_v5p.gin": ["MeshConfig.fsdp = 2", "MeshConfig.context = 4"],
  "gin/extend_llama31_8b_v5p_1m.gin": ["MeshConfig.fsdp = 2", "MeshConfig.context = 4"],
  "gin/sft_llama31_8b_v5p.gin": ["MeshConfig.fsdp = 2", "MeshConfig.context = 4"],
}


def tiny_hf_dir(path) -> str:
  """A random tiny Llama and a byte-level BPE tokenizer.json (vocab within the
  model's) in one HF directory."""
  import helpers  # pylint: disable=g-import-not-at-top
  import tokenizers  # pylint: disable=g-import-not-at-top
  from tokenizers import decoders, models, pre_tokenizers, trainers

  if os.path.isfile(os.path.join(path, "tokenizer.json")):
    return str(path)
  helpers.save_tiny_llama(str(path))
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=helpers.TINY_LLAMA["vocab_size"] - 8,
    special_tokens=["<s>", "</s>"],
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
  )
  tok.train_from_iterator(["The grass is green. The sky is blue. The pass key is"] * 20, trainer)
  tok.save(os.path.join(path, "tokenizer.json"))
  with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
    json.dump({"bos_token": "<s>", "eos_token": "</s>"}, f)
  return str(path)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  return tiny_hf_dir(tmp_path_factory.mktemp("tiny_hf"))


def _build(path, params=()):
  gin.clear_config()
  gin_utils.parse([path], list(params), [ROOT])
  exp = configs.experiment()
  gin.clear_config()
  return exp


def test_every_experiment_is_covered():
  assert set(EXPERIMENTS) <= LOCAL | PRETRAINED | set(SHRUNK_MESH), (
    "a new gin file needs a row in LOCAL, PRETRAINED or SHRUNK_MESH"
  )
  for path in EXPERIMENTS:
    with open(os.path.join(ROOT, path)) as f:
      head = f.read(2000)
    assert head.startswith("#"), f"{path} must open with a comment"
    assert "Launch" in head and "Tokens per step" in head, path


_TOKENS_LINE = re.compile(r"# Tokens per step: batch ([\d,]+) x seq ([\d,]+)(?: = ([\d,]+))?")


@pytest.mark.parametrize("path", EXPERIMENTS)
def test_header_tokens_per_step_are_the_configs(path, tmp_path):
  """The header's "batch B x seq S = N" is the file's own TrainConfig (and B x S = N)."""
  with open(os.path.join(ROOT, path)) as f:
    match = _TOKENS_LINE.search(f.read(2000))
  assert match, f"{path}: no '# Tokens per step: batch B x seq S' line"
  batch, seq, total = (int(g.replace(",", "")) if g else None for g in match.groups())
  params = [f"HF_CHECKPOINT = '{tiny_hf_dir(tmp_path)}'"] if path in PRETRAINED else []
  exp = _build(path, params)
  assert (batch, seq) == (exp.train.batch_size, exp.train.seq_len), path
  if total is not None:
    assert total == batch * seq, path


# The collectives each strategy's attention must lower to (present, absent).
STRATEGY_COLLECTIVES = {
  "ring": ({"collective_permute"}, {"all_to_all"}),
  "all_gather": ({"all_gather"}, {"collective_permute", "all_to_all"}),
  "ulysses": ({"all_to_all"}, {"collective_permute"}),
  "usp": ({"collective_permute", "all_to_all"}, set()),
}


# Hardware files whose shrunk lowering is under the slow mark: gin/long_hybrid_v5p.gin
# differs from gin/long_hybrid_ironwood.gin only in its slice, its context size
# (both shrink to the same mesh), its memory budget and a shorter sequence,
# so on 8 CPU devices the two lower the same model, mesh and strategy (the
# ironwood file, at the longer sequence, in the default run).
SLOW_LOWER = {"gin/long_hybrid_v5p.gin"}


@pytest.mark.parametrize(
  "path",
  [pytest.param(p, marks=pytest.mark.slow) if p in SLOW_LOWER else p for p in sorted(SHRUNK_MESH)],
)
def test_hardware_config_lowers_one_step(path):
  """The real model and sequence length, lowered abstractly on the 8 CPU devices;
  tests/test_compile.py compiles each for its own TPU kind."""
  exp = _build(path, SHRUNK_MESH[path])
  mesh = mesh_lib.make_mesh(exp.mesh)
  trainer = Trainer(exp.model, exp.train, mesh)
  text = trainer.lower_train_step().as_text()
  assert trainer.strategy == exp.train.context_parallel_strategy
  # Whole rows of the real length go in; the strategy's communication comes out.
  b, t = exp.train.batch_size, exp.train.seq_len
  assert f"tensor<{b}x{t}xi32>" in text
  present, absent = STRATEGY_COLLECTIVES[trainer.strategy]
  for op in present:
    assert f"stablehlo.{op}" in text, (trainer.strategy, op)
  for op in absent:
    assert f"stablehlo.{op}" not in text, (trainer.strategy, op)


def _train_one_step(path, workdir, params=()):
  exp = _build(
    path,
    [
      "TrainConfig.steps = 1",
      "TrainConfig.log_every = 1",
      "TrainConfig.checkpoint_every = 0",
      "TrainConfig.eval_every = 0",
      "TrainConfig.retrieval_eval_every = 0",
      *params,
    ],
  )
  exp = train_lib.Experiment(
    model=exp.model, data=exp.data, train=exp.train, mesh=exp.mesh, evals=None
  )
  train_lib.run("train", str(workdir), exp)
  return exp


@pytest.fixture(scope="module")
def base_runs(tmp_path_factory):
  """A base file's one-step run, made once per module: its own test and each stage
  that starts from it read the same workdir (the file runs on one worker)."""
  runs = {}

  def run(path):
    if path not in runs:
      workdir = tmp_path_factory.mktemp("base")
      runs[path] = (_train_one_step(path, workdir), workdir)
    return runs[path]

  return run


@pytest.mark.parametrize(
  "path",
  [
    pytest.param(p, marks=pytest.mark.slow) if p in SLOW_LOCAL else p
    for p in sorted(p for p in EXPERIMENTS if p in LOCAL)
  ],
)
def test_local_config_trains_one_step(path, tmp_path, base_runs):
  params = []
  if path in STAGE_BASES:
    # The stage starts from a checkpoint of its base file: their parameters match.
    _, base_dir = base_runs(STAGE_BASES[path])
    params = [f"BASE_WORKDIR = '{base_dir}'"]
    tmp_path = tmp_path / "stage"
  if path == "gin/local_cpu_sft.gin":  # its conversations, written by its own script
    data = tmp_path / "sft_data"
    subprocess.run(
      [
        sys.executable,
        os.path.join(ROOT, "scripts/make_sft_data.py"),
        f"--out={data}",
        "--train=64",
        "--heldout=4",
      ],
      check=True,
      capture_output=True,
    )
    params += [
      f"SFT_TRAIN = '{data / 'train.jsonl'}'",
      f"SFT_TOKENIZER = '{data / 'tokenizer'}'",
      f"DataConfig.data_dir = '{tmp_path / 'cache'}'",
    ]
    tmp_path = tmp_path / "run"
  if path in STAGE_BASES.values():  # the run its stages start from
    exp, tmp_path = base_runs(path)
  else:
    exp = _train_one_step(path, tmp_path, params)
  with open(tmp_path / "metrics.jsonl") as f:
    records = [json.loads(line) for line in f]
  train = [r for r in records if "loss" in r]
  assert [r["step"] for r in train] == [1]
  # One step from initialisation: the loss of a near-uniform prediction over the
  # vocabulary, and a real throughput figure for the strategy the file names.
  assert abs(train[0]["loss"] - math.log(exp.model.vocab_size)) < 1.0, train[0]
  assert math.isfinite(train[0]["grad_norm"]) and train[0]["grad_norm"] > 0
  assert train[0]["tokens_per_sec"] > 0 and train[0]["learning_rate"] >= 0
  assert os.path.isdir(tmp_path / "checkpoints")


@pytest.mark.parametrize("path", sorted(PRETRAINED))
def test_pretrained_config_scores_a_checkpoint_both_ways(path, hf_dir, tmp_path):
  """--mode=eval of the file on a tiny HF checkpoint: its shapes from config.json
  (no model file included), its tokenizer.json, ring with zigzag on 8 devices,
  RULER prompts scored teacher-forced and by greedy decoding, the effective
  length written."""
  exp = _build(
    path,
    [
      f"HF_CHECKPOINT = '{hf_dir}'",
      "TrainConfig.seq_len = 256",
      "EvalConfig.lengths = (512, 640)",
      "EvalConfig.depths = (0.5,)",
      "EvalConfig.samples_per_cell = 1",
      "EvalConfig.generation_tokens = 2",
    ],
  )
  assert exp.model.vocab_size == 288 and exp.model.num_layers == 2  # from config.json
  assert exp.train.context_parallel_strategy == "ring" and exp.mesh.context == 8
  train_lib.run("eval", str(tmp_path), exp)
  with open(tmp_path / "evals" / "retrieval.json") as f:
    records = json.load(f)
  assert {(r["task"], r["length"]) for r in records} == {
    (t, n) for t in exp.evals.tasks for n in (512, 640)
  }
  assert all("accuracy" in r and "generation_score" in r for r in records)
  with open(tmp_path / "evals" / "metrics.json") as f:
    assert json.load(f)["eval/effective_length"] in (0.0, 512.0, 640.0)
  assert "effective length" in (tmp_path / "evals" / "summary.md").read_text()


def test_model_size_files_are_the_published_sizes():
  # gin/models/*.gin are the only place model sizes are written.
  assert round(configs.model_config("llama3_8b").num_params() / 1e9, 2) == 8.03
  assert round(configs.model_config("llama3_70b").num_params() / 1e9, 1) == 70.6
  # Gemma 3 technical report, Table 1: non-embedding parameters of the text decoder.
  for name, millions in (("gemma3_4b", 3209), ("gemma3_12b", 10759)):
    c = configs.model_config(name)
    assert round((c.num_params() - c.vocab_size * c.d_model) / 1e6) == millions, name
  tiny = configs.model_config("tiny", num_layers=3)
  assert (tiny.d_model, tiny.num_layers, tiny.num_heads, tiny.num_kv_heads) == (128, 3, 4, 2)
  with pytest.raises(ValueError, match="no model size 'llama9'"):
    configs.model_config("llama9")

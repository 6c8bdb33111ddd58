"""`--mode=eval` on an imported Hugging Face model: no training, context-parallel
(ring, zigzag), and the retrieval scores equal those of transformers' own forward
of the same checkpoint, scored on the host."""

import json
import os

import helpers
import numpy as np
import pytest

from lctx import data as data_lib
from lctx import init_from
from lctx import train as train_lib
from lctx.data import DataConfig
from lctx.evals import EvalConfig, run_evals
from lctx.kernels import AttentionOptions
from lctx.parallel import mesh as mesh_lib
from lctx.trainer import TrainConfig

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  return helpers.save_tiny_llama(str(tmp_path_factory.mktemp("llama")))


def _transformers_logits_fn(path):
  model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

  def fn(batch):
    with torch.no_grad():
      out = model(
        input_ids=torch.as_tensor(batch["inputs"], dtype=torch.long),
        attention_mask=torch.as_tensor(batch["segment_ids"] > 0, dtype=torch.long),
        position_ids=torch.as_tensor(batch["positions"], dtype=torch.long),
      )
    return out.logits.float().numpy()

  return fn


def test_eval_mode_scores_an_imported_model_as_transformers_does(hf_dir, tmp_path):
  evals = EvalConfig(
    tasks=("passkey", "niah_single"),
    lengths=(128,),
    depths=(0.0, 1.0),
    samples_per_cell=2,
    batch_size=4,
    length_multiple=16,
    window=64,
    held_out_haystack="alt_noise",
    held_out_phrasing=False,
  )
  exp = train_lib.Experiment(
    model=init_from.hf_model_config(hf_dir, {}),
    data=DataConfig(sources=("copy",), copy_max_key_len=16),
    train=TrainConfig(
      batch_size=4,
      seq_len=64,
      steps=1,
      eval_batches=1,
      async_checkpoint=False,
      init_params_from=hf_dir,
      context_parallel_strategy="ring",
      attention_options=AttentionOptions(block_q=16, block_kv=16),
    ),
    mesh=mesh_lib.MeshConfig(data=2, context=4),
    evals=evals,
  )
  workdir = tmp_path / "eval"
  train_lib.run("eval", str(workdir), exp)
  with open(workdir / "evals" / "retrieval.json") as f:
    got = json.load(f)
  with open(workdir / "metrics.jsonl") as f:
    (record,) = [json.loads(line) for line in f]
  assert record["step"] == 0 and "eval/passkey/acc" in record

  documents = data_lib.load_documents(exp.data, split="validation", limit=evals.num_documents)
  run_evals(
    _transformers_logits_fn(hf_dir),
    data_lib.make_tokenizer_for(exp.data),
    config=evals,
    workdir=str(tmp_path / "ref"),
    step=0,
    documents=documents,
    write_files=True,
  )
  with open(tmp_path / "ref" / "evals" / "retrieval.json") as f:
    want = json.load(f)
  assert len(got) == len(want) > 0
  for a, b in zip(got, want):
    assert a.keys() == b.keys()
    for k, v in a.items():
      if isinstance(v, float) and "accuracy" not in k:
        np.testing.assert_allclose(v, b[k], rtol=1e-4, atol=1e-4, err_msg=k)
      else:
        assert v == b[k], k
  assert os.path.exists(workdir / "evals" / "retrieval_passkey.png")

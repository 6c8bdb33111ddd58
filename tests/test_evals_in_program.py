"""The eval step (Trainer.score_fn) against the host-logits path it replaces.

The in-program scores (answer log-probs and greedy matches gathered inside the
sharded program, position-loss sums per bucket) must equal what the host
computes from the full logits of the same forward (`logits_scorer` over
Trainer.logits_fn) on every task, the needle-removed and held-out variants, the
window ablation and the context-use evals, under every context-parallel
strategy, zigzag included. And the compiled step must hold no [B, T, E] buffer.
"""

import dataclasses
import os
import re

import jax
import numpy as np
import pytest

from lctx import models
from lctx.data.tokenizers import ByteTokenizer
from lctx.evals import TASKS, EvalConfig, run_evals
from lctx.evals.scoring import logits_scorer
from lctx.kernels import AttentionOptions
from lctx.parallel import mesh as mesh_lib
from lctx.trainer import TrainConfig, Trainer

TOK = ByteTokenizer()
TINY = models.ModelConfig(
  vocab_size=384, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64
)
MESHES = {
  "all_gather": mesh_lib.MeshConfig(data=2, context=4),
  "ulysses": mesh_lib.MeshConfig(data=4, context=2),
  "ring": mesh_lib.MeshConfig(data=2, context=4),
  "usp": mesh_lib.MeshConfig(data=2, context_ulysses=2, context=2),
}


def _docs(n=3, chars=1200):
  stdlib = os.path.dirname(os.__file__)
  out = []
  for name in ("argparse.py", "inspect.py", "typing.py")[:n]:
    with open(os.path.join(stdlib, name), encoding="utf-8") as f:
      out.append(f.read()[:chars])
  return out


def _trainer(strategy, **train):
  cfg = TrainConfig(
    batch_size=4,
    seq_len=128,
    context_parallel_strategy=strategy,
    attention_options=AttentionOptions(block_q=16, block_kv=16),
    **train,
  )
  return Trainer(TINY, cfg, mesh_lib.make_mesh(MESHES[strategy]))


def _both(trainer, tmp_path, config, docs):
  state = trainer.init_state(0)
  out = {}
  for name, model in (
    ("program", trainer.score_fn(state)),
    ("host", logits_scorer(trainer.logits_fn(state))),
  ):
    metrics = run_evals(
      model,
      TOK,
      config=config,
      workdir=str(tmp_path / name),
      step=1,
      documents=docs,
      write_files=True,
    )
    metrics.pop("eval/seconds")
    out[name] = metrics
  return out["program"], out["host"]


def _records(tmp_path, name):
  import json

  with open(tmp_path / name / "evals" / "retrieval.json") as f:
    return json.load(f)


def _assert_same(tmp_path, program, host):
  assert program.keys() == host.keys()
  for k in program:
    if "seconds" in k:  # wall times
      continue
    np.testing.assert_allclose(program[k], host[k], rtol=1e-5, atol=1e-5, err_msg=k)
  rp, rh = _records(tmp_path, "program"), _records(tmp_path, "host")
  assert len(rp) == len(rh) > 0
  for a, b in zip(rp, rh):
    assert {k: v for k, v in a.items() if not isinstance(v, float)} == {
      k: v for k, v in b.items() if not isinstance(v, float)
    }
    for k, v in a.items():
      if isinstance(v, float) and "seconds" not in k:
        np.testing.assert_allclose(v, b[k], rtol=1e-5, atol=1e-5, err_msg=k)
        if "accuracy" in k:  # greedy matches: exactly equal
          assert v == b[k], k


def test_every_task_and_variant_matches_the_host_logits_path_under_ring_zigzag(tmp_path):
  trainer = _trainer("ring")
  assert trainer.load_balance  # answer positions go through the zigzag order
  config = EvalConfig(
    tasks=TASKS,
    lengths=(128,),
    depths=(0.0, 1.0),
    samples_per_cell=1,
    batch_size=4,
    length_multiple=16,
    window=64,
    context_length=128,
    context_tail=16,
    num_documents=3,
  )
  program, host = _both(trainer, tmp_path, config, _docs())
  assert "eval/context/loss_replaced" in program  # the ablation ran
  assert any(k.endswith("/removed_acc") for k in program)
  assert any(k.endswith("/window_gap") for k in program)
  _assert_same(tmp_path, program, host)


def test_ruler_prompts_and_greedy_decoding_match_the_host_logits_path_under_ring_zigzag(tmp_path):
  """Text prompts of every shape (needles, a chain, cwe's own context) and
  greedy decoding through the eval step's argmax: the same generations and
  scores as decoding from the host's full logits."""
  config = EvalConfig(
    prompts="ruler",
    tasks=("passkey", "niah_multivalue", "variable_tracking"),
    lengths=(512,),
    depths=(0.0, 1.0),
    samples_per_cell=1,
    batch_size=4,
    length_multiple=16,
    window=128,
    held_out_haystack="none",
    held_out_phrasing=False,
    generation_tokens=4,
  )
  trainer = _trainer("ring")
  program, host = _both(trainer, tmp_path, config, None)
  assert "eval/effective_length" in program and "eval/passkey/gen" in program
  rp = _records(tmp_path, "program")
  assert all(len(r["generation"]) > 0 for r in rp)  # it decoded (bytes of a random model)
  _assert_same(tmp_path, program, host)
  # The draft-verified decoding (the default) gives the plain path's tokens
  # through the sharded program too, in no more forwards (a random model's
  # answers and lookups rarely match its argmaxes: the saving shows on real ones).
  plain = dataclasses.replace(config, draft_decoding=False)
  run_evals(
    trainer.score_fn(trainer.init_state(0)),
    TOK,
    config=plain,
    workdir=str(tmp_path / "plain"),
    step=1,
    write_files=True,
  )
  rplain = _records(tmp_path, "plain")
  assert [r["generated_ids"] for r in rp] == [r["generated_ids"] for r in rplain]
  assert rp[0]["length_generation_forwards"] <= rplain[0]["length_generation_forwards"]


# usp (a ring over all-to-all groups) in the default suite; its two parts alone under -m slow.
@pytest.mark.parametrize(
  "strategy",
  [
    pytest.param("all_gather", marks=pytest.mark.slow),
    pytest.param("ulysses", marks=pytest.mark.slow),
    "usp",
  ],
)
def test_other_strategies_match_the_host_logits_path(strategy, tmp_path):
  config = EvalConfig(
    tasks=("passkey",),
    lengths=(128,),
    depths=(0.5,),
    samples_per_cell=2,
    batch_size=4,
    length_multiple=16,
    window=64,
    context_length=128,
    context_tail=16,
    num_documents=2,
    held_out_phrasing=False,
  )
  program, host = _both(_trainer(strategy), tmp_path, config, _docs(2))
  _assert_same(tmp_path, program, host)


def _largest_array_elements(hlo: str) -> int:
  """Elements of the largest array shape written in an HLO module's text."""
  best = 0
  for dims in re.findall(r"\b(?:f32|bf16|f16|s32|pred)\[([\d,]+)\]", hlo):
    best = max(best, int(np.prod([int(d) for d in dims.split(",")])))
  return best


def test_the_compiled_eval_step_holds_no_batch_by_length_by_vocab_buffer():
  # One device, so the product is what a device would hold; a vocab large
  # enough that B x T x E dwarfs every other buffer.
  vocab, b, t = 32768, 2, 512
  cfg = models.ModelConfig(**{**TINY.__dict__, "vocab_size": vocab})
  trainer = Trainer(
    cfg,
    TrainConfig(
      batch_size=b,
      seq_len=t,
      context_parallel_strategy="none",
      loss_chunk_size=64,
      attention_options=AttentionOptions(block_q=64, block_kv=64),
    ),
    mesh_lib.make_mesh(mesh_lib.MeshConfig(data=1), devices=jax.devices()[:1]),
  )
  full = b * t * vocab
  for buckets in (True, False):  # with and without the per-position loss
    compiled = trainer.lower_score_step(width=16, buckets=buckets).compile()
    step_max = _largest_array_elements(compiled.as_text())
    assert step_max <= 64 * vocab < full // 8, buckets  # one chunk of logits at most
    assert compiled.memory_analysis().temp_size_in_bytes < full * 4 // 8, buckets
  # The check can fail: the host-logits forward does hold one.
  state = jax.eval_shape(lambda: trainer.abstract_state)
  trainer.logits_fn(state)  # builds the jitted forward
  arg = jax.ShapeDtypeStruct((b, t), np.int32)
  logits_hlo = trainer._logits_apply.lower(state["params"], arg, arg, arg).compile().as_text()  # pylint: disable=protected-access
  assert _largest_array_elements(logits_hlo) >= full

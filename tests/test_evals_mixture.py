"""Retrieval tasks as data-mixture sources."""

import numpy as np
import pytest

from lctx import data as data_lib
from lctx.evals import mixture
from lctx.evals.tasks import TASKS

mixture.register_retrieval_sources()


@pytest.mark.parametrize("task", ["passkey", "niah_single"])
def test_retrieval_source_rows_carry_loss_only_on_the_answer(task):
  cfg = data_lib.DataConfig(sources=(f"retrieval_{task}",))
  it = data_lib.make_iterator(
    cfg, split="train", batch_size=2, seq_len=512, seed=0, process_index=0, process_count=1
  )
  batch = next(it)
  tok = data_lib.ByteTokenizer()
  checked = 0
  for row in range(2):
    seg = batch["segment_ids"][row]
    for doc in np.unique(seg[seg > 0]):  # short documents pack several to a row
      inputs = batch["inputs"][row][seg == doc]
      mask = batch["loss_mask"][row][seg == doc] > 0
      answer = tok.decode(batch["targets"][row][seg == doc][mask]).strip()
      assert answer.isdigit(), answer
      # The answer appears earlier in its document: retrievable from context.
      assert answer in tok.decode(inputs[: np.argmax(mask)])
      checked += 1
  assert checked >= 2
  again = next(
    data_lib.make_iterator(
      cfg, split="train", batch_size=2, seq_len=512, seed=0, process_index=0, process_count=1
    )
  )
  np.testing.assert_array_equal(again["inputs"], batch["inputs"])


def test_every_task_is_registered_and_names_are_checked():
  assert {f"retrieval_{t}" for t in TASKS} <= set(data_lib.task_source_names())
  with pytest.raises(ValueError, match="unknown data source 'retrieval_nope'"):
    data_lib.DataConfig(sources=("retrieval_nope",))

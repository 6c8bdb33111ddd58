r"""Held-out answer accuracy of the CPU SFT recipe, before or after fine-tuning.

    python scripts/sft_accuracy.py --gin_file=gin/local_cpu_sft.gin \
      --workdir=/tmp/lctx/sft --heldout=/tmp/lctx/sft_data/heldout.jsonl [--before]

A conversation counts as answered when every token of its last assistant turn
(the value and the turn's end, <|im_end|> and newline) is the model's argmax
given the conversation before it: greedy decoding would write exactly that
answer; answer_token_accuracy is the share of those tokens that are, and
by_position the share per token of the answer. --before scores the run's
starting parameters (TrainConfig.init_params_from, else the random
initialisation of TrainConfig.seed); otherwise the workdir's latest checkpoint. Prints one JSON line and writes it to
<workdir>/sft_accuracy_{before,after}.json.
"""

from __future__ import annotations

import json
import os
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

flags.DEFINE_multi_string("gin_file", [], "Gin files (the recipe's).")
flags.DEFINE_multi_string("gin_param", [], "Gin bindings.")
flags.DEFINE_string("workdir", None, "The run directory.", required=True)
flags.DEFINE_string("heldout", None, "Held-out conversations (.jsonl of messages).", required=True)
flags.DEFINE_bool(
  "before", False, "Score the starting parameters instead of the latest checkpoint."
)
FLAGS = flags.FLAGS
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv):
  del argv
  from lctx import gin_utils, platforms  # pylint: disable=g-import-not-at-top

  platforms.set_fake_devices(gin_utils.local_devices_macro(FLAGS.gin_file, [ROOT], FLAGS.gin_param))
  platforms.choose(cpu_only=True)
  import jax  # pylint: disable=g-import-not-at-top

  from lctx import configs, init_from  # pylint: disable=g-import-not-at-top
  from lctx.parallel import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
  from lctx.trainer import Trainer  # pylint: disable=g-import-not-at-top

  gin_utils.parse(FLAGS.gin_file, FLAGS.gin_param, search_paths=[ROOT])
  exp = configs.experiment()
  t0 = time.perf_counter()
  trainer = Trainer(exp.model, exp.train, mesh_lib.make_mesh(exp.mesh))
  source = FLAGS.workdir if not FLAGS.before else exp.train.init_params_from
  if source:
    found = init_from.find_source(source)
    params = init_from.load_params(found, exp.model, trainer.abstract_state["params"])
    state, which = {"params": params}, f"{found.kind}:{found.path}@{found.step}"
  else:
    state, which = trainer.init_state(exp.train.seed), f"random init (seed {exp.train.seed})"
  with open(FLAGS.heldout) as f:
    rows = [json.loads(line)["messages"] for line in f if line.strip()]
  scores = score(rows, exp.data.tokenizer_model_path, trainer.logits_fn(state), exp.train)
  record = {
    "which": "before" if FLAGS.before else "after",
    "params": which,
    "heldout": FLAGS.heldout,
    **scores,
    "seconds": round(time.perf_counter() - t0, 1),
    "devices": jax.device_count(),
  }
  line = json.dumps(record)
  print(line)
  with open(os.path.join(FLAGS.workdir, f"sft_accuracy_{record['which']}.json"), "w") as f:
    f.write(line + "\n")


def score(rows, model_path: str, logits_fn, train) -> dict:
  """Held-out conversations -> conversations, answer_accuracy,
  answer_token_accuracy and by_position (the token accuracy of the answer's
  k-th token: the value's digits, then <|im_end|> and the newline). rows: lists of messages ending in the assistant's
  answer; logits_fn: a batch {inputs, positions, segment_ids} [b, S] -> logits
  [b, S, V] (Trainer.logits_fn); train: its TrainConfig (batch_size, seq_len).
  The logits at position j - 1 predict token j, as in training."""
  import numpy as np  # pylint: disable=g-import-not-at-top

  from lctx.data import chat  # pylint: disable=g-import-not-at-top

  tokenizer = chat.load_chat_model(model_path).tokenizer
  seq, b = train.seq_len, train.batch_size
  correct, total, tokens_right, tokens = 0, 0, 0, 0
  by_position = {}  # answer token k -> [right, seen]
  for start in range(0, len(rows), b):
    group = rows[start : start + b]
    batch = {k: np.zeros((b, seq), np.int32) for k in ("inputs", "positions", "segment_ids")}
    answers = []
    for r, messages in enumerate(group):
      ids, mask = chat.encode_chat(messages, model_path)
      prompt = chat.render_chat(messages[:-1], model_path, add_generation_prompt=True)
      first = len(tokenizer.encode(prompt))
      n = len(ids) - 1
      if n > seq:
        raise ValueError(f"held-out conversation {start + r} has {n} examples > seq_len {seq}.")
      batch["inputs"][r, :n] = ids[:-1]
      batch["positions"][r, :n] = np.arange(n)
      batch["segment_ids"][r, :n] = 1
      targets = [j for j in range(first, len(ids)) if mask[j] > 0]
      answers.append((r, ids, targets))
    predicted = np.asarray(logits_fn(batch)).argmax(-1)  # [b, seq]
    for r, ids, targets in answers:
      right = [bool(predicted[r, j - 1] == ids[j]) for j in targets]
      for k, ok in enumerate(right):
        by_position.setdefault(k, [0, 0])
        by_position[k][0] += ok
        by_position[k][1] += 1
      correct += all(right)
      total += 1
      tokens_right += sum(right)
      tokens += len(right)
  return {
    "conversations": total,
    "answer_accuracy": correct / total,
    "answer_token_accuracy": round(tokens_right / tokens, 4),
    "by_position": [round(r / n, 4) for _, (r, n) in sorted(by_position.items())],
  }


if __name__ == "__main__":
  app.run(main)

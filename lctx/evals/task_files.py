"""Task files in RULER's format: generated jsonl, scored beside the built-in tasks.

RULER (github.com/NVIDIA/RULER, scripts/data/prepare.py) writes one JSON object
per line:

    {"index": 0, "input": "... What is the special magic number for X?",
     "outputs": ["5437923"], "length": 8177,
     "answer_prefix": " The special magic number for X mentioned in the text is"}

`input` and `outputs` (a non-empty list of strings) are required; `length` (the
line's token count under RULER's tokenizer), `index` and `answer_prefix` are used
when present. The prompt is input + answer_prefix.

RULER scores a generated prediction with string_match_all (string_match_part
for its QA tasks: files whose name starts with "qa"). `accuracy`: each output is
scored by teacher-forced greedy exact match right after the prompt
(lctx/evals/scoring.py: one forward gives what greedy decoding would emit), and
the line's score is the fraction of its outputs matched, the same average over
outputs. A prediction that holds the output later, or in another case, counts
for RULER but not here; a match here is one for RULER. With `generate_tokens`,
`generation_score` is RULER's own: its metric on a greedy decoding of the
prompt (lctx/evals/generate.py).

A task's name is its file's name without `.jsonl`; its records have depth None
(RULER lines carry none) and one record per `length`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import numpy as np

from lctx.errors import InputError
from lctx.evals.generate import generation_scores
from lctx.evals.scoring import LogitsFn, Scorer, score_answers

_FIX = "Fix or remove that line, or drop the file from EvalConfig.task_files."


def task_name(path: str) -> str:
  name = os.path.basename(path)
  return name[: -len(".jsonl")] if name.endswith(".jsonl") else os.path.splitext(name)[0]


def read_task_file(path: str) -> list[dict]:
  """The lines of one RULER jsonl file; InputError (a ValueError) naming the
  file and line."""
  try:
    with open(path, encoding="utf-8") as f:
      texts = f.readlines()
  except (OSError, UnicodeDecodeError) as err:
    raise InputError(f"{path}: cannot read the task file ({err}).", _FIX) from None
  lines = []
  for number, text in enumerate(texts, 1):
    if not text.strip():
      continue
    where = f"{path}, line {number}"
    try:
      obj = json.loads(text)
    except json.JSONDecodeError as err:
      raise InputError(f"{where}: not a JSON object ({err.msg}).", _FIX) from None
    if not isinstance(obj, dict):
      raise InputError(f"{where}: expected a JSON object, got {type(obj).__name__}.", _FIX)
    if not isinstance(obj.get("input"), str):
      raise InputError(f"{where}: 'input' must be a string; got {obj.get('input')!r:.80}.", _FIX)
    outputs = obj.get("outputs")
    if (
      not isinstance(outputs, list)
      or not outputs
      or not all(isinstance(o, str) and o for o in outputs)
    ):
      raise InputError(
        f"{where}: 'outputs' must be a non-empty list of non-empty strings; got {outputs!r:.80}.",
        _FIX,
      )
    for key, kind in (("length", int), ("index", int), ("answer_prefix", str)):
      if key in obj and not isinstance(obj[key], kind):
        raise InputError(f"{where}: {key!r} must be {kind.__name__}; got {obj[key]!r:.80}.", _FIX)
    lines.append({**obj, "line": number})
  if not lines:
    raise InputError(f"{path}: no task lines.", _FIX)
  return lines


class _Example:
  def __init__(self, tokens: np.ndarray, answer_start: int, outputs=(), metric="all"):
    self.tokens, self.answer_start = tokens, answer_start
    self.answer_items, self.metric = tuple(outputs), metric


def _examples(line: dict, tokenizer, add_bos: bool, metric: str = "all") -> list[_Example]:
  prompt = line["input"] + line.get("answer_prefix", "")
  head = [tokenizer.bos_id] if add_bos else []
  head += list(tokenizer.encode(prompt))
  out = []
  for answer in line["outputs"]:
    if not (prompt[-1:].isspace() or answer[:1].isspace()):
      answer = " " + answer  # generation continues after "... is"
    ids = np.asarray(head + list(tokenizer.encode(answer)), np.int32)
    out.append(_Example(ids, len(head), line["outputs"], metric))
  return out


def run_task_files(
  model: Scorer | LogitsFn,
  tokenizer,
  paths: Sequence[str],
  *,
  batch_size: int,
  length_multiple: int = 1,
  add_bos: bool = True,
  generate_tokens: int = 0,
  draft_decoding: bool = True,
) -> list[dict]:
  """Scores every file; one record per (file, length) with the keys of the
  grid's records (lctx.evals.grid.run_grid): task, length, depth (None),
  accuracy (mean line score), n (lines), loglik (mean over lines of the summed
  answer log-likelihoods, nats), token_acc, chance 0, needle_removed and
  held_out False, haystack 'file', phrasing 'file', and task_file; with
  `generate_tokens`, generation_score and disagree (as the grid's);
  `draft_decoding` as lctx.evals.generate.generation_scores' `verify`."""
  records = []
  for path in paths:
    lines = read_task_file(path)
    metric = "part" if task_name(path).startswith("qa") else "all"
    examples = [_examples(line, tokenizer, add_bos, metric) for line in lines]
    flat = [ex for exs in examples for ex in exs]
    scores = score_answers(model, flat, batch_size=batch_size, length_multiple=length_multiple)
    gens = [None] * len(lines)
    if generate_tokens > 0:
      gens = generation_scores(
        model,
        [exs[0] for exs in examples],
        tokenizer,
        max_new_tokens=generate_tokens,
        batch_size=batch_size,
        length_multiple=length_multiple,
        verify=draft_decoding,
      )
    per_line, pos = [], 0
    for line, exs, gen in zip(lines, examples, gens):
      sc = scores[pos : pos + len(exs)]
      pos += len(exs)
      per_line.append(
        {
          "length": int(line.get("length", len(exs[0].tokens))),
          "score": float(np.mean([s["exact"] for s in sc])),
          "loglik": float(np.sum([s["loglik"] for s in sc])),
          "token_acc": float(np.mean([s["token_acc"] for s in sc])),
          "gen": None if gen is None else gen["generation_score"],
        }
      )
    for length in sorted({p["length"] for p in per_line}):
      at = [p for p in per_line if p["length"] == length]
      records.append(
        {
          "task": task_name(path),
          "length": length,
          "depth": None,
          "needle_removed": False,
          "held_out": False,
          "haystack": "file",
          "phrasing": "file",
          "chance": 0.0,
          "accuracy": float(np.mean([p["score"] for p in at])),
          "n": len(at),
          "loglik": float(np.mean([p["loglik"] for p in at])),
          "token_acc": float(np.mean([p["token_acc"] for p in at])),
          "task_file": path,
        }
      )
      if generate_tokens > 0:
        records[-1]["generation_score"] = float(np.mean([p["gen"] for p in at]))
        records[-1]["disagree"] = float(
          np.mean([(p["score"] == 1.0) != (p["gen"] == 1.0) for p in at])
        )
  return records

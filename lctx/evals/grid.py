"""The retrieval grid: tasks x lengths x depths x samples, three variants.

Variants per cell (same cell coordinates, reported as separate records):
- main: `haystack` filler (training's format), needle present;
- needle removed: the SAME examples (same seeds) with the queried needles
  replaced by filler, the decisive control: accuracy must fall to `chance`;
- held out (haystack): a haystack training never uses (real text or the
  alternative noise filler), different seeds, needle present, `held_out: true`;
- held out (phrasing): the training haystack with the needle and question
  worded as training never words them (`phrasing: "held_out"`, `held_out:
  true`), different seeds.

For a model whose attention is local in every layer (`attention_windows`, one
size per layer), each cell is also classed by where its depth-placed needle
lies as seen from the first answer-predicting position a = answer_start - 1
(a layer of window w sees (p - w, p]):
- "window": the whole needle within a - (w_min - 1), so one layer reads it
  directly;
- "beyond": even the needle's last token is farther than the receptive field
  sum(w_l - 1) of the stack: no path carries it to the answer, so accuracy must
  be at chance;
- "relay": in between, reachable only by passing information up through layers.

With `window` < length, each main example is also scored with its context cut to
the last `window` tokens (positions restarting at 0): `window_accuracy` and
`window_loglik` show how much the answer depends on context beyond the window.

Two scores per cell: `accuracy`, teacher-forced exact match of the answer right
after the prompt (one forward), and, with `generate_tokens` > 0,
`generation_score`, RULER's string match on a greedy decoding of the prompt
(lctx/evals/generate.py), with `disagree`, the fraction of examples where one
says solved (exact match; a generation score of 1) and the other does not.
Tasks without a needle (cwe, fwe) have one cell per length (depth None) and no
needle-removed control.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np

from lctx.evals import ruler
from lctx.evals.generate import generation_scores
from lctx.evals.scoring import LogitsFn, round_up, score_answers
from lctx.evals.tasks import build_example, eval_seed

_log = logging.getLogger(__name__)


class _Window:
  """The last `window` tokens of an example; the answer keeps its offset from
  the end, so it is scored exactly as in the full example."""

  def __init__(self, ex, window: int):
    self.tokens = ex.tokens[-window:]
    self.answer_start = ex.answer_start - (len(ex.tokens) - window)


def run_grid(
  logits_fn: LogitsFn,
  tokenizer,
  *,
  tasks: Sequence[str],
  lengths: Sequence[int],
  depths: Sequence[float],
  samples_per_cell: int,
  seed: int,
  haystack,
  held_out_haystack,
  needle_removed_control: bool,
  window: int | None,
  batch_size: int,
  length_multiple: int,
  add_bos: bool = True,
  held_out_phrasing: bool = False,
  attention_windows: Sequence[int | None] | None = None,
  builder=build_example,
  generate_tokens: int = 0,
  draft_decoding: bool = True,
) -> list[dict]:
  """Builds and scores the grid; returns one record per (variant, task, length,
  depth) with keys task, length, depth, accuracy, n, needle_removed, held_out,
  haystack, phrasing, loglik (mean answer log-likelihood, nats), token_acc,
  chance, distance (mean tokens from the depth-placed needle's start to the
  end), for main cells with window < length window_accuracy and window_loglik,
  and with bounded `attention_windows` receptive_field and reach_class; with
  `generate_tokens`, generation_score, disagree, generation (the first
  example's decoded text), generations and generated_ids (every example's text
  and token ids), generated_tokens, and the length's wall times and decoding
  forwards (length_tf_seconds, length_generation_seconds,
  length_generation_forwards); `draft_decoding`: generation_scores' `verify`.
  `builder` makes the examples: build_example (spliced ids) or lctx.evals.prompts.build_text_example (RULER text, partially applied).
  Cells too short for a task are skipped with a warning. Examples are built
  one length at a time so memory stays bounded at long lengths."""
  records = []
  for length in lengths:
    cells = []  # (record template, [examples])
    for task in tasks:
      depthless = builder is not build_example and task in ruler.DEPTHLESS
      for di, depth in enumerate([None] if depthless else depths):
        variants = [(haystack, False, False, "main", "train")]
        if needle_removed_control and not depthless:
          variants.append((haystack, True, False, "main", "train"))
        if held_out_haystack is not None:
          variants.append((held_out_haystack, False, True, "held_out", "train"))
        if held_out_phrasing:
          variants.append((haystack, False, True, "held_out_phrasing", "held_out"))
        try:
          for hs, removed, held_out, tag, phrasing in variants:
            exs = [
              builder(
                task,
                length,
                depth,
                eval_seed(seed, tag, task, length, di, s),
                tokenizer,
                hs,
                needle_removed=removed,
                add_bos=add_bos,
                phrasing=phrasing,
              )
              for s in range(samples_per_cell)
            ]
            template = {
              "task": task,
              "length": int(length),
              "depth": None if depth is None else float(depth),
              "needle_removed": removed,
              "held_out": held_out,
              "haystack": hs.kind,
              "phrasing": phrasing,
              "chance": exs[0].chance,
            }
            template.update(reach_class(exs, attention_windows))
            cells.append((template, exs))
        except ValueError as e:
          _log.warning("skipping %s at length %d: %s", task, length, e)
          cells = [c for c in cells if not (c[0]["task"] == task and c[0]["depth"] == depth)]
    flat = [ex for _, exs in cells for ex in exs]
    if not flat:
      continue
    t0 = time.perf_counter()
    scores = score_answers(logits_fn, flat, batch_size=batch_size, length_multiple=length_multiple)
    tf_seconds = time.perf_counter() - t0
    main_idx = [i for i, ex in enumerate(flat) if not ex.needle_removed]
    use_window = window is not None and 0 < window < length
    # The window must hold the question tail and the whole answer (+1 token).
    if use_window and any(len(flat[i].tokens) - flat[i].answer_start >= window for i in main_idx):
      _log.warning(
        "window %s too short for the answers at length %d; skipping window scoring", window, length
      )
      use_window = False
    win_scores = {}
    if use_window:
      ws = score_answers(
        logits_fn,
        [_Window(flat[i], window) for i in main_idx],
        batch_size=batch_size,
        length_multiple=length_multiple,
      )
      win_scores = dict(zip(main_idx, ws))
    gen, gen_seconds, gen_stats = [], 0.0, {}
    if generate_tokens > 0:
      t0 = time.perf_counter()
      gen = generation_scores(
        logits_fn,
        flat,
        tokenizer,
        max_new_tokens=generate_tokens,
        batch_size=batch_size,
        length_multiple=length_multiple,
        width=round_up(length, max(1, length_multiple)),
        verify=draft_decoding,
        teacher_forced=scores,
        stats=gen_stats,
      )
      gen_seconds = time.perf_counter() - t0
    pos = 0
    for template, exs in cells:
      sc = scores[pos : pos + len(exs)]
      rec = dict(template)
      rec.update(
        accuracy=float(np.mean([s["exact"] for s in sc])),
        n=len(exs),
        loglik=float(np.mean([s["loglik"] for s in sc])),
        token_acc=float(np.mean([s["token_acc"] for s in sc])),
        # tokens from the depth-placed needle's start to the answer
        distance=float(np.mean([len(e.tokens) - e.depth_offset for e in exs])),
      )
      if gen:
        g = gen[pos : pos + len(exs)]
        rec.update(
          generation_score=float(np.mean([x["generation_score"] for x in g])),
          disagree=float(
            np.mean([(s["exact"] == 1.0) != (x["generation_score"] == 1.0) for s, x in zip(sc, g)])
          ),
          generation=g[0]["generation"][:200],
          generations=[x["generation"][:200] for x in g],
          generated_ids=[x["ids"] for x in g],
          # this length's wall time: all its cells' teacher-forced scoring, and decoding
          length_tf_seconds=tf_seconds,
          length_generation_seconds=gen_seconds,
          generated_tokens=int(sum(x["tokens"] for x in g)),
          # this length's decoding calls (forwards of batch_size rows), all cells
          length_generation_forwards=int(gen_stats.get("forwards", 0)),
        )
      if use_window and pos in win_scores:
        wsc = [win_scores[pos + k] for k in range(len(exs))]
        rec.update(
          window=int(window),
          window_accuracy=float(np.mean([s["exact"] for s in wsc])),
          window_loglik=float(np.mean([s["loglik"] for s in wsc])),
          # the cut drops the whole depth-placed needle in every example
          needle_cut=bool(exs[0].needle_spans)
          and all(_depth_needle_end(e) <= len(e.tokens) - window for e in exs),
        )
      records.append(rec)
      pos += len(exs)
  return records


def _depth_needle_end(ex) -> int:
  """End (exclusive) of the depth-placed needle (always a queried needle)."""
  return next(e for s, e in ex.needle_spans if s == ex.depth_offset)


def reach_class(examples, attention_windows: Sequence[int | None] | None) -> dict:
  """{receptive_field, reach_class} of a cell (see the module docstring), or {}
  when some layer attends globally (or no windows are given)."""
  if not attention_windows or any(w is None for w in attention_windows):
    return {}
  if not all(ex.needle_spans for ex in examples):
    return {}
  direct = min(attention_windows) - 1
  field = int(sum(w - 1 for w in attention_windows))
  near, far = [], []
  for ex in examples:
    end = _depth_needle_end(ex)
    first = ex.answer_start - 1
    near.append(first - ex.depth_offset)  # to the needle's first token
    far.append(first - (end - 1))  # to its last token
  if max(near) <= direct:
    cls = "window"
  elif min(far) > field:
    cls = "beyond"
  else:
    cls = "relay"
  return {"receptive_field": field, "reach_class": cls}


def grid_metrics(records: Sequence[dict], prefix: str = "eval") -> dict[str, float]:
  """Flat scalars per task: acc (main, all cells), token_acc (teacher-forced
  per-token answer accuracy), acc_len{L} and
  min_acc_len{L} (mean / worst depth at length L), removed_acc, needle_gain
  (answer log-likelihood with minus without the needle),
  held_out_acc (held-out haystack) and held_out_phrasing_acc (each also per
  length, _len{L}), loglik, window_gap
  (mean answer log-likelihood lost when the context is cut to the window: > 0
  means distant context is used), window_gap_cut (the same over the cells where
  the cut drops the whole needle: large for a model that retrieves from there,
  ~0 for one that cannot see that far) and, for local-attention models,
  acc_{window,relay,beyond} (main cells by reach class)."""
  out: dict[str, float] = {}
  for task in dict.fromkeys(r["task"] for r in records):
    rs = [r for r in records if r["task"] == task]
    main = [r for r in rs if not r["needle_removed"] and not r["held_out"]]
    removed = [r for r in rs if r["needle_removed"]]
    held = [r for r in rs if r["held_out"] and r.get("phrasing") != "held_out"]
    phrased = [r for r in rs if r["held_out"] and r.get("phrasing") == "held_out"]
    mean = lambda xs, k: float(np.mean([x[k] for x in xs]))
    p = f"{prefix}/{task}"
    if main:
      out[f"{p}/acc"] = mean(main, "accuracy")
      out[f"{p}/loglik"] = mean(main, "loglik")
      # Partial credit: shows learning before whole answers come out right.
      out[f"{p}/token_acc"] = mean(main, "token_acc")
      for length in sorted({r["length"] for r in main}):
        at = [r for r in main if r["length"] == length]
        out[f"{p}/acc_len{length}"] = mean(at, "accuracy")
        out[f"{p}/min_acc_len{length}"] = float(min(r["accuracy"] for r in at))
      for cls in ("window", "relay", "beyond"):
        at = [r for r in main if r.get("reach_class") == cls]
        if at:
          out[f"{p}/acc_{cls}"] = mean(at, "accuracy")
      win = [r for r in main if "window_loglik" in r]
      if win:
        out[f"{p}/window_acc"] = mean(win, "window_accuracy")
        out[f"{p}/window_gap"] = mean(win, "loglik") - mean(win, "window_loglik")
        cut = [r for r in win if r.get("needle_cut")]
        if cut:
          out[f"{p}/window_gap_cut"] = mean(cut, "loglik") - mean(cut, "window_loglik")
    if removed:
      out[f"{p}/removed_acc"] = mean(removed, "accuracy")
      if main:  # answer nats the needle is worth: > 0 long before exact match
        out[f"{p}/needle_gain"] = mean(main, "loglik") - mean(removed, "loglik")
    gen = [r for r in main if "generation_score" in r]
    if gen:
      out[f"{p}/gen"] = mean(gen, "generation_score")
      for length in sorted({r["length"] for r in gen}):
        out[f"{p}/gen_len{length}"] = mean(
          [r for r in gen if r["length"] == length], "generation_score"
        )
    if any("generation_score" in r for r in removed):
      out[f"{p}/removed_gen"] = mean(
        [r for r in removed if "generation_score" in r], "generation_score"
      )
    for name, group in (("held_out_acc", held), ("held_out_phrasing_acc", phrased)):
      if group:
        out[f"{p}/{name}"] = mean(group, "accuracy")
        for length in sorted({r["length"] for r in group}):
          out[f"{p}/{name}_len{length}"] = mean(
            [r for r in group if r["length"] == length], "accuracy"
          )
  scored = [r for r in records if "disagree" in r]
  if scored:  # weighted by examples
    n = sum(r["n"] for r in scored)
    out[f"{prefix}/generation/disagree"] = sum(r["disagree"] * r["n"] for r in scored) / n
  timed = {r["length"]: r for r in records if "length_generation_seconds" in r}
  if timed:  # what decoding cost against the one-forward teacher-forced score
    out[f"{prefix}/generation/seconds"] = sum(
      r["length_generation_seconds"] for r in timed.values()
    )
    out[f"{prefix}/generation/tf_seconds"] = sum(r["length_tf_seconds"] for r in timed.values())
  eff, by_length = effective_length(records)
  if by_length:
    out[f"{prefix}/effective_length"] = float(eff)
    for length, score in by_length.items():
      out[f"{prefix}/ruler_score_len{length}"] = score
  return out


RULER_THRESHOLD = 85.6  # RULER's effective-length threshold (Llama-2-7B at 4K), percent


def effective_length(
  records: Sequence[dict], threshold: float = RULER_THRESHOLD
) -> tuple[int, dict[int, float]]:
  """RULER's effective length: the longest length whose task-average
  generation score (percent; main cells: no control, not held out; each task
  averaged over its depths first) is >= threshold, 0 if none; and that
  average per length."""
  main = [
    r for r in records if "generation_score" in r and not r["needle_removed"] and not r["held_out"]
  ]
  by_length = {}
  for length in sorted({r["length"] for r in main}):
    at = [r for r in main if r["length"] == length]
    tasks = dict.fromkeys(r["task"] for r in at)
    per_task = [np.mean([r["generation_score"] for r in at if r["task"] == t]) for t in tasks]
    by_length[int(length)] = float(100.0 * np.mean(per_task))
  passing = [n for n, v in by_length.items() if v >= threshold]
  return (max(passing) if passing else 0), by_length

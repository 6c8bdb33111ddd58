"""`run_evals`: the one entry point the train loop and `--mode=eval` call.

Writes under `<workdir>/evals/` (only on the writing process):

    retrieval.json            list of records, one per (variant, task, length, depth)
    retrieval_<task>.png      length x depth heatmaps: with needle / removed / held out
    effective_length.png      task x length generation scores (with generation)
    context_use.json          loss per position bucket + context ablation (if documents)
    position_loss.png         the per-position loss curve (if documents)
    summary.md                short markdown report
    metrics.json              the flat scalars returned
    step_<step:08d>/...       a step-stamped copy of all of the above

The top-level files are always the latest step's.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import shutil
import time
from collections.abc import Sequence

import numpy as np

from lctx.evals import plots
from lctx.evals.context_use import context_use, context_use_metrics
from lctx.evals.grid import grid_metrics, run_grid
from lctx.evals.haystack import HAYSTACK_KINDS, make_haystack
from lctx.evals.prompts import TEXT_HAYSTACK_KINDS, build_text_example, make_text_haystack
from lctx.evals.ruler import NEEDLE_KINDS, TEXT_TASKS, TOKENS_TO_GENERATE
from lctx.evals.scoring import LogitsFn, Scorer
from lctx.evals.task_files import run_task_files, task_name
from lctx.evals.tasks import TASKS, build_example

PROMPTS = ("ruler", "spliced")

_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """What `run_evals` runs. Cost: len(tasks) x len(lengths) x len(depths) x
  samples_per_cell examples per variant (main, needle removed, held out), one
  forward each, plus a short window forward per main example."""

  tasks: tuple[str, ...] = TASKS
  """Subset of lctx.evals.TASKS ('spliced' prompts) or lctx.evals.ruler.TEXT_TASKS
  ('ruler' prompts: also niah_multiquery, cwe, fwe)."""
  prompts: str = "spliced"
  """'ruler': each example is RULER's template as one string, tokenized once
  (lctx/evals/prompts.py); 'spliced': needle, filler and question ids placed at
  exact token offsets (lctx/evals/tasks.py: the retrieval training mixture's
  format, what gin/local_cpu_retrieval*.gin train and are scored on)."""
  generation_tokens: int = 0
  """Greedy decoding budget for the generation score (RULER's string match);
  each task decodes at most its RULER tokens_to_generate. 0 = off. Costs up to
  this many forwards per example on the plain path, usually 1 or 2 with
  draft_decoding (lctx/evals/generate.py); runs in --mode=eval and at the end
  of training, not in the evals during training."""
  draft_decoding: bool = True
  """Greedy decoding verifies a draft (the example's answer tokens, then
  prompt-lookup guesses) in each forward: the same tokens as one forward per
  token (the model is causal), in fewer forwards. False: the plain path."""
  needle_kinds: tuple[str, str] = ("words", "numbers")
  """'ruler' niah needles: (key kind, value kind), each in ruler.NEEDLE_KINDS."""
  chat: bool = False
  """'ruler' prompts in the tokenizer's chat template (lctx.data.chat.render_chat);
  without a template it is a ConfigError."""
  lengths: tuple[int, ...] = (256, 512)
  """Total example lengths in tokens (prompt + answer)."""
  depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
  """Needle depths as fractions of the body (see lctx.evals.tasks)."""
  samples_per_cell: int = 4
  """Examples per (task, length, depth); accuracy resolution is 1/this."""
  seed: int = 0
  """Base eval seed; example seeds derive from it inside the reserved range."""
  haystack: str = "noise"
  """Filler of the main grid: 'noise' (training's filler), 'alt_noise' or 'text';
  with 'ruler' prompts also 'needle' (distractor needles)."""
  held_out_haystack: str = "auto"
  """'auto' (= 'text' when documents are given, else 'alt_noise'), 'text',
  'alt_noise' or 'none'. Reported separately (held_out: true)."""
  needle_removed_control: bool = True
  """Also score every main example with its queried needles removed."""
  held_out_phrasing: bool = True
  """Also score the needles and question in the wording training never uses
  (lctx.evals.tasks.PHRASINGS), on the main haystack."""
  add_bos: bool = True
  """Start every example with BOS (match the training data)."""
  batch_size: int = 8
  """Rows per logits_fn call (short batches are padded with all-pad rows)."""
  length_multiple: int = 1
  """Rows are right-padded to a multiple of this (e.g. 2 x context degree)."""
  window: int = 128
  """Short context W for the ablations (grid answers and documents); 0 = off."""
  context_length: int = 0
  """Document length for the context-use evals; 0 = max(lengths)."""
  context_tail: int = 32
  """Last tokens of each document scored in the ablation."""
  num_documents: int = 16
  """Held-out documents to read (the caller's load limit): the 'text' haystack
  and, those at least context_length long, the context-use evals."""
  key_threshold: float = 2.0
  """LongPPL key-token threshold in nats."""
  task_files: tuple[str, ...] = ()
  """RULER-format jsonl files (lctx/evals/task_files.py), scored beside the
  built-in tasks; each is a task named after its file."""

  def __post_init__(self):
    if self.prompts not in PROMPTS:
      raise ValueError(f"EvalConfig.prompts {self.prompts!r} not in {PROMPTS}.")
    known = TEXT_TASKS if self.prompts == "ruler" else TASKS
    bad = [t for t in self.tasks if t not in known]
    if bad or not (self.tasks or self.task_files):
      raise ValueError(
        f"EvalConfig.tasks {self.tasks} must be a subset of {known} (prompts "
        f"{self.prompts!r}), non-empty unless task_files are given."
      )
    if self.generation_tokens < 0:
      raise ValueError(f"EvalConfig.generation_tokens must be >= 0, got {self.generation_tokens}.")
    if len(self.needle_kinds) != 2 or any(k not in NEEDLE_KINDS for k in self.needle_kinds):
      raise ValueError(
        f"EvalConfig.needle_kinds {self.needle_kinds} must be (key kind, value kind) in "
        f"{NEEDLE_KINDS}."
      )
    names = [task_name(p) for p in self.task_files]
    clash = sorted({n for n in names if n in self.tasks or names.count(n) > 1})
    if clash:
      raise ValueError(
        f"EvalConfig.task_files {self.task_files}: task names {clash} (from the file names) "
        "repeat a built-in task or another file."
      )
    if not self.lengths or min(self.lengths) < 2:
      raise ValueError(f"EvalConfig.lengths must be positive, got {self.lengths}.")
    if not self.depths or any(not 0.0 <= d <= 1.0 for d in self.depths):
      raise ValueError(f"EvalConfig.depths must be in [0, 1], got {self.depths}.")
    kinds = TEXT_HAYSTACK_KINDS if self.prompts == "ruler" else HAYSTACK_KINDS
    if self.haystack not in kinds:
      raise ValueError(f"EvalConfig.haystack {self.haystack!r} not in {kinds}.")
    if self.held_out_haystack not in kinds + ("auto", "none"):
      raise ValueError(
        f"EvalConfig.held_out_haystack {self.held_out_haystack!r} not in {kinds + ('auto', 'none')}."
      )
    for name in ("samples_per_cell", "batch_size", "length_multiple", "num_documents"):
      if getattr(self, name) < 1:
        raise ValueError(f"EvalConfig.{name} must be >= 1, got {getattr(self, name)}.")


def _documents_as_ids(documents, tokenizer, limit: int) -> list[np.ndarray]:
  out = []
  for doc in documents:
    ids = tokenizer.encode(doc) if isinstance(doc, str) else doc
    out.append(np.asarray(ids, np.int32).reshape(-1))
    if len(out) >= limit:
      break
  return out


def _write_json(path: str, obj) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=1)
  os.replace(tmp, path)  # readers never see a half-written file


def run_evals(
  logits_fn: Scorer | LogitsFn,
  tokenizer,
  *,
  config: EvalConfig,
  workdir: str,
  step: int,
  documents: Sequence[str | np.ndarray] | None = None,
  write_files: bool | None = None,
  attention_windows: Sequence[int | None] | None = None,
  generate: bool = True,
) -> dict[str, float]:
  """Runs the retrieval grid (+ controls) and, with `documents`, the context-use
  evals; writes the files listed in the module docstring; returns flat scalars
  such as `eval/passkey/acc`, `eval/passkey/removed_acc`,
  `eval/context/gap_truncated` for metrics.jsonl / TensorBoard.

  logits_fn: the model: a Scorer (lctx/evals/scoring.py; the trainer's
    in-program eval step, Trainer.score_fn) or a plain logits function, batch
    {inputs, positions, segment_ids: int32 [B, T]} in natural order -> float32
    logits [B, T, E] (scored on the host). B = config.batch_size and T a
    multiple of config.length_multiple (rows are right-padded with pad 0 /
    segment 0). Every process must call run_evals (the forward is collective).
  documents: held-out texts (str) or token-id arrays: the 'text' haystack and
    the context-use evals. Only the first config.num_documents are read.
  write_files: None = only jax.process_index() == 0 writes.
  attention_windows: the model's per-layer attention window (None = global);
    when every layer is local, cells are classed window / relay / beyond by
    the needle's distance (lctx.evals.grid).
  generate: False skips the generation score (the evals during training).
  """
  t0 = time.time()
  if write_files is None:
    import jax  # local: the evals themselves never need jax

    write_files = jax.process_index() == 0
  docs = None
  if documents is not None:
    docs = _documents_as_ids(documents, tokenizer, config.num_documents)
  held_kind = config.held_out_haystack
  if held_kind == "auto":
    held_kind = "text" if docs else "alt_noise"
  if "text" in (config.haystack, held_kind) and not docs:
    raise ValueError("a 'text' haystack needs documents.")
  gen_tokens = config.generation_tokens if generate else 0
  if config.prompts == "ruler":
    make = functools.partial(make_text_haystack, documents=docs, tokenizer=tokenizer)
    builder = functools.partial(
      build_text_example,
      kinds=tuple(config.needle_kinds),
      reserve=min(gen_tokens, max(TOKENS_TO_GENERATE.values())),
      chat=config.chat,
    )
  else:
    make = functools.partial(make_haystack, tokenizer=tokenizer, documents=docs)
    builder = build_example
  haystack = make(config.haystack)
  held = None if held_kind == "none" else make(held_kind)

  records = run_grid(
    logits_fn,
    tokenizer,
    tasks=config.tasks,
    lengths=config.lengths,
    depths=config.depths,
    samples_per_cell=config.samples_per_cell,
    seed=config.seed,
    haystack=haystack,
    held_out_haystack=held,
    needle_removed_control=config.needle_removed_control,
    window=config.window or None,
    batch_size=config.batch_size,
    length_multiple=config.length_multiple,
    add_bos=config.add_bos,
    held_out_phrasing=config.held_out_phrasing,
    attention_windows=attention_windows,
    builder=builder,
    generate_tokens=gen_tokens,
    draft_decoding=config.draft_decoding,
  )
  if config.task_files:
    records += run_task_files(
      logits_fn,
      tokenizer,
      config.task_files,
      batch_size=config.batch_size,
      length_multiple=config.length_multiple,
      add_bos=config.add_bos,
      generate_tokens=gen_tokens,
      draft_decoding=config.draft_decoding,
    )
  metrics = grid_metrics(records)
  main = [metrics[f"eval/{t}/acc"] for t in config.tasks if f"eval/{t}/acc" in metrics]
  if main:
    metrics["eval/retrieval/acc"] = float(np.mean(main))

  context = None
  if docs:
    length = config.context_length or max(config.lengths)
    long_docs = [d for d in docs if d.size >= length]
    window = config.window or length // 4
    if long_docs and config.context_tail < window < length:
      context = context_use(
        logits_fn,
        long_docs,
        length=length,
        window=window,
        tail=config.context_tail,
        batch_size=config.batch_size,
        length_multiple=config.length_multiple,
        key_threshold=config.key_threshold,
      )
      metrics.update(context_use_metrics(context))
    else:
      _log.warning(
        "context-use evals skipped: %d documents >= %d tokens, window %d, tail %d",
        len(long_docs),
        length,
        window,
        config.context_tail,
      )
  metrics["eval/seconds"] = time.time() - t0

  if write_files:
    _write_outputs(records, context, metrics, config, workdir, step)
  _log.info(
    "evals at step %d took %.1fs: %s",
    step,
    metrics["eval/seconds"],
    {k: round(v, 3) for k, v in metrics.items() if k.endswith("acc")},
  )
  return metrics


def _write_outputs(records, context, metrics, config, workdir, step) -> None:
  top = os.path.join(workdir, "evals")
  stamped = os.path.join(top, f"step_{step:08d}")
  os.makedirs(stamped, exist_ok=True)
  _write_json(os.path.join(stamped, "retrieval.json"), records)
  _write_json(
    os.path.join(stamped, "metrics.json"),
    {"step": step, **metrics, "config": dataclasses.asdict(config)},
  )
  for task in dict.fromkeys(r["task"] for r in records):
    plots.heatmap(records, task, os.path.join(stamped, f"retrieval_{task}.png"), step=step)
  if any("generation_score" in r for r in records):
    plots.effective_length_heatmap(
      records, metrics, os.path.join(stamped, "effective_length.png"), step=step
    )
  if context is not None:
    _write_json(os.path.join(stamped, "context_use.json"), context)
    plots.position_loss_plot(context, os.path.join(stamped, "position_loss.png"), step=step)
  with open(os.path.join(stamped, "summary.md"), "w") as f:
    f.write(plots.summary_markdown(records, context, metrics, step=step))
  latest = set(os.listdir(stamped))
  for name in latest:  # the latest copies at the fixed names
    tmp = os.path.join(top, name + ".tmp")
    shutil.copyfile(os.path.join(stamped, name), tmp)
    os.replace(tmp, os.path.join(top, name))
  for name in os.listdir(top):  # drop outputs an earlier step wrote but this one did not
    path = os.path.join(top, name)
    if os.path.isfile(path) and name not in latest and name.endswith((".json", ".png", ".md")):
      os.remove(path)

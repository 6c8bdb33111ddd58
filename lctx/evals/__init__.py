"""Long-range retrieval evals: does the model use distant context?

Entry point for the train loop and `--mode=eval`:

    metrics = lctx.evals.run_evals(logits_fn, tokenizer, config=EvalConfig(...),
                                   workdir=workdir, step=step, documents=docs)

Pieces: `tasks` (synthetic examples, exact depth, seeds, training rows),
`ruler` and `prompts` (RULER's tasks, templates and metrics; prompts as text),
`generate` (greedy decoding, the generation score),
`haystack` (fillers), `scoring` (teacher-forced exact match == greedy),
`grid` (tasks x lengths x depths, controls), `context_use` (loss by position,
context ablation, key tokens), `plots` (PNGs, markdown), `runner`.
"""

from lctx.evals.context_use import context_use
from lctx.evals.grid import effective_length, grid_metrics, run_grid
from lctx.evals.haystack import HAYSTACK_KINDS, Haystack, make_haystack
from lctx.evals.runner import EvalConfig, run_evals
from lctx.evals.scoring import make_batch, score_answers, token_scores
from lctx.evals.tasks import (
  EVAL_SEED_BASE,
  TASKS,
  RetrievalExample,
  build_example,
  depth_offset,
  draw_training_seed,
  eval_seed,
  make_training_example,
  training_example_at,
)

__all__ = [
  "EVAL_SEED_BASE",
  "EvalConfig",
  "HAYSTACK_KINDS",
  "Haystack",
  "RetrievalExample",
  "TASKS",
  "build_example",
  "context_use",
  "depth_offset",
  "draw_training_seed",
  "effective_length",
  "eval_seed",
  "grid_metrics",
  "make_batch",
  "make_haystack",
  "make_training_example",
  "run_evals",
  "run_grid",
  "score_answers",
  "token_scores",
  "training_example_at",
]

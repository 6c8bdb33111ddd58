"""Does the model use distant context? Evals on held-out long documents.

Each document is cut to its first `length` tokens, x = doc[:length].

- Loss per position (Sun et al. 2021, arXiv 2109.09115): the next-token loss of
  x[t] given x[:t], averaged in log2-spaced position buckets [1,2), [2,4), ...
  A model that uses long context keeps improving in the late buckets.
- Context ablation on the last `tail` tokens of each document:
    full      : x scored as is;
    truncated : only x[-window:] is fed (positions restart at 0);
    replaced  : x[:-window] is swapped for the start of ANOTHER document (same
                length, same positions), x[-window:] kept.
  gap = mean loss(ablated) - mean loss(full), nats/token; > 0 means the distant
  context (beyond the last `window` tokens) lowers the loss.
- Key tokens (LongPPL, arXiv 2410.23771): fraction of tail tokens whose loss drops
  by more than `key_threshold` nats (2 in the paper) with full context instead of
  the window. Here the short context of a tail token is the truncated run above
  (window - tail .. window - 1 tokens), not a per-token sliding window.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from lctx.evals.scoring import NUM_BUCKETS, LogitsFn, Scorer, score_rows, token_scores


def position_buckets(length: int) -> list[tuple[int, int]]:
  """[start, end) buckets over target positions 1..length-1: [1,2), [2,4), ..."""
  out, start = [], 1
  while start < length:
    out.append((start, min(2 * start, length)))
    start *= 2
  return out


def context_use(
  logits_fn: Scorer | LogitsFn,
  documents: Sequence[np.ndarray],
  *,
  length: int,
  window: int,
  tail: int,
  batch_size: int,
  length_multiple: int = 1,
  key_threshold: float = 2.0,
) -> dict:
  """Runs the three evals above. `documents` are int32 token arrays; those
  shorter than `length` are dropped (ValueError if none is left or if not
  1 <= tail < window < length). Returns a JSON-ready dict with `position_loss`
  (list of {start, end, loss, n}) and `ablation` (loss_full, loss_truncated,
  loss_replaced, gap_truncated, gap_replaced, key_token_frac, n_tokens ...).
  `loss_replaced` is None when fewer than two documents are given."""
  if not 1 <= tail < window < length:
    raise ValueError(
      f"need 1 <= tail < window < length, got tail={tail}, window={window}, length={length}."
    )
  docs = [np.asarray(d, np.int32)[:length] for d in documents if len(d) >= length]
  if not docs:
    raise ValueError(f"no document has at least {length} tokens.")

  # Full documents: per-bucket loss sums and the tail's per-token scores only.
  spans = position_buckets(length)
  if len(spans) > NUM_BUCKETS:
    raise ValueError(f"length {length} has {len(spans)} position buckets > {NUM_BUCKETS}.")
  bucket_of = np.full(length, -1, np.int32)
  for k, (start, end) in enumerate(spans):
    bucket_of[start:end] = k
  tail_mask_l = np.zeros(length, bool)
  tail_mask_l[-tail:] = True
  full = score_rows(
    logits_fn,
    docs,
    [tail_mask_l] * len(docs),
    batch_size=batch_size,
    length_multiple=length_multiple,
    buckets=[bucket_of] * len(docs),
  )
  sums = np.stack([b for _, _, b in full]).sum(axis=0)  # [NUM_BUCKETS]
  buckets = []
  for k, (start, end) in enumerate(spans):
    n = (end - start) * len(docs)
    buckets.append({"start": start, "end": end, "loss": float(sums[k] / n), "n": int(n)})

  tail_mask_w = np.zeros(window, bool)
  tail_mask_w[-tail:] = True
  trunc = token_scores(
    logits_fn,
    [d[-window:] for d in docs],
    [tail_mask_w] * len(docs),
    batch_size=batch_size,
    length_multiple=length_multiple,
  )
  loss_full = -np.stack([lp for lp, _, _ in full])  # [num_docs, tail]
  loss_trunc = -np.stack([lp for lp, _ in trunc])  # [num_docs, tail]
  ablation = {
    "window": int(window),
    "tail": int(tail),
    "num_docs": len(docs),
    "n_tokens": int(loss_full.size),
    "loss_full": float(loss_full.mean()),
    "loss_truncated": float(loss_trunc.mean()),
    "gap_truncated": float((loss_trunc - loss_full).mean()),
    "key_token_frac": float(((loss_trunc - loss_full) > key_threshold).mean()),
    "key_threshold": float(key_threshold),
    "loss_replaced": None,
    "gap_replaced": None,
  }
  if len(docs) >= 2:
    swapped = [
      np.concatenate([docs[(i + 1) % len(docs)][: length - window], d[-window:]])
      for i, d in enumerate(docs)
    ]
    repl = token_scores(
      logits_fn,
      swapped,
      [tail_mask_l] * len(docs),
      batch_size=batch_size,
      length_multiple=length_multiple,
    )
    loss_repl = -np.stack([lp for lp, _ in repl])
    ablation["loss_replaced"] = float(loss_repl.mean())
    ablation["gap_replaced"] = float((loss_repl - loss_full).mean())
  return {
    "length": int(length),
    "num_docs": len(docs),
    "position_loss": buckets,
    "ablation": ablation,
  }


def context_use_metrics(result: dict, prefix: str = "eval/context") -> dict[str, float]:
  """Flat scalars from `context_use`'s result (None entries are omitted)."""
  out = {
    f"{prefix}/{k}": float(v)
    for k, v in result["ablation"].items()
    if k
    in (
      "loss_full",
      "loss_truncated",
      "loss_replaced",
      "gap_truncated",
      "gap_replaced",
      "key_token_frac",
    )
    and v is not None
  }
  if result["position_loss"]:
    out[f"{prefix}/loss_last_bucket"] = result["position_loss"][-1]["loss"]
  return out

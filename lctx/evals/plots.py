"""PNG figures and the markdown summary (matplotlib, Agg backend, no display)."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402
import numpy as np  # noqa: E402

_VARIANTS = (
  ("main", "with needle"),
  ("removed", "needle removed (control)"),
  ("held_out", "held-out haystack"),
  ("held_out_phrasing", "held-out needle phrasing"),
)


def _variant(rec: dict) -> str:
  if rec.get("held_out"):
    return "held_out_phrasing" if rec.get("phrasing") == "held_out" else "held_out"
  return "removed" if rec["needle_removed"] else "main"


def _depth_label(d) -> str:
  return "all" if d is None else f"{d:g}"  # task files carry no depth


def _table(records: Sequence[dict], key: str = "accuracy"):
  """(lengths, depths, values [len(lengths), len(depths)]) with NaN for gaps."""
  lengths = sorted({r["length"] for r in records})
  depths = sorted({r["depth"] for r in records}, key=lambda d: -1.0 if d is None else d)
  vals = np.full((len(lengths), len(depths)), np.nan)
  for r in records:
    if r.get(key) is not None:
      vals[lengths.index(r["length"]), depths.index(r["depth"])] = r[key]
  return lengths, depths, vals


def heatmap(records: Sequence[dict], task: str, path: str, *, step: int) -> None:
  """One figure per task: a length x depth accuracy heatmap per variant."""
  rs = [r for r in records if r["task"] == task]
  panels = [(v, title, "accuracy") for v, title in _VARIANTS if any(_variant(r) == v for r in rs)]
  if any(_variant(r) == "main" and "generation_score" in r for r in rs):
    panels.insert(1, ("main", "generation (RULER string match)", "generation_score"))
  windowed = [r for r in rs if _variant(r) == "main" and "window_accuracy" in r]
  if windowed:  # same examples, context cut to the last W tokens
    panels.append(
      ("main", f"context cut to last {windowed[0]['window']} tokens", "window_accuracy")
    )
  fig, axes = plt.subplots(
    1, len(panels), figsize=(3.6 * len(panels) + 1.2, 3.4), squeeze=False, layout="constrained"
  )
  image = None
  for ax, (v, title, key) in zip(axes[0], panels):
    sub = [r for r in rs if _variant(r) == v and key in r]
    lengths, depths, vals = _table(sub, key)
    image = ax.imshow(vals, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto", origin="lower")
    for i in range(len(lengths)):
      for j in range(len(depths)):
        if not np.isnan(vals[i, j]):
          ax.text(j, i, f"{vals[i, j]:.2f}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(depths)), [_depth_label(d) for d in depths])
    ax.set_yticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_xlabel("needle depth (fraction)")
    if ax is axes[0][0]:
      ax.set_ylabel("context length (tokens)")
    chance = max(r["chance"] for r in sub)
    ax.set_title(f"{title}\nmean {np.nanmean(vals):.2f}, chance {chance:.1g}", fontsize=9)
  fig.suptitle(f"{task} exact match, step {step}", fontsize=11)
  fig.colorbar(image, ax=axes[0].tolist(), label="accuracy")
  fig.savefig(path, dpi=110)
  plt.close(fig)


def effective_length_heatmap(records: Sequence[dict], metrics: dict, path: str, *, step: int):
  """Task x length generation scores (main cells, mean over depths) with the
  task average per length and RULER's effective length."""
  main = [r for r in records if _variant(r) == "main" and "generation_score" in r]
  tasks = list(dict.fromkeys(r["task"] for r in main))
  lengths = sorted({r["length"] for r in main})
  vals = np.full((len(tasks) + 1, len(lengths)), np.nan)
  for i, t in enumerate(tasks):
    for j, n in enumerate(lengths):
      at = [r["generation_score"] for r in main if r["task"] == t and r["length"] == n]
      if at:
        vals[i, j] = float(np.mean(at))
  vals[-1] = [metrics.get(f"eval/ruler_score_len{n}", np.nan) / 100.0 for n in lengths]
  fig, ax = plt.subplots(figsize=(1.2 * len(lengths) + 3.0, 0.45 * len(tasks) + 2.0))
  image = ax.imshow(vals, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
  for i in range(vals.shape[0]):
    for j in range(vals.shape[1]):
      if not np.isnan(vals[i, j]):
        ax.text(j, i, f"{100 * vals[i, j]:.0f}", ha="center", va="center", fontsize=8)
  ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
  ax.set_yticks(range(len(tasks) + 1), tasks + ["average"])
  ax.set_xlabel("context length (tokens)")
  eff = int(metrics.get("eval/effective_length", 0))
  ax.set_title(f"generation score (%), step {step}; effective length {eff} (>= 85.6)", fontsize=9)
  fig.colorbar(image, ax=ax)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def position_loss_plot(result: dict, path: str, *, step: int) -> None:
  """Loss per position bucket (log x axis), with the ablation figures as text."""
  b = result["position_loss"]
  mids = [np.sqrt(x["start"] * max(x["end"] - 1, x["start"])) for x in b]
  fig, ax = plt.subplots(figsize=(6.4, 4.0))
  ax.plot(mids, [x["loss"] for x in b], marker="o")
  ax.set_xscale("log", base=2)
  ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
  ax.set_xlabel("token position (bucket centre)")
  ax.set_ylabel("next-token loss (nats)")
  ab = result["ablation"]
  note = (
    f"last {ab['tail']} tokens: full {ab['loss_full']:.3f}, "
    f"last-{ab['window']} {ab['loss_truncated']:.3f}"
  )
  if ab["loss_replaced"] is not None:
    note += f", replaced {ab['loss_replaced']:.3f}"
  note += f"\nkey-token fraction {ab['key_token_frac']:.3f}"
  ax.set_title(
    f"loss by position, {result['num_docs']} docs x {result['length']} tokens, step {step}\n{note}",
    fontsize=9,
  )
  ax.grid(True, alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def summary_markdown(
  records: Sequence[dict], context: dict | None, metrics: dict[str, float], *, step: int
) -> str:
  """A short human-readable report of the grid and the context evals."""
  lines = [f"# Retrieval evals, step {step}", ""]
  ruler = sorted(
    (int(k.rsplit("_len", 1)[1]), v)
    for k, v in metrics.items()
    if k.startswith("eval/ruler_score_len")
  )
  if ruler:
    lines += [
      "## Generation (RULER's string match on greedy decoding)",
      "",
      f"- effective length: {int(metrics.get('eval/effective_length', 0))} (the longest length "
      "whose task-average score is >= 85.6%)",
      "- task-average score by length: " + ", ".join(f"{n}: {v:.1f}%" for n, v in ruler),
      f"- teacher-forced exact match and generation disagree on "
      f"{100 * metrics.get('eval/generation/disagree', 0.0):.1f}% of examples",
      "",
    ]
  for task in dict.fromkeys(r["task"] for r in records):
    rs = [r for r in records if r["task"] == task]
    lines += [f"## {task}", ""]
    main = [r for r in rs if _variant(r) == "main"]
    lengths, depths, vals = _table(main)
    lines.append("| length \\ depth | " + " | ".join(_depth_label(d) for d in depths) + " | mean |")
    lines.append("|---" * (len(depths) + 2) + "|")
    for i, n in enumerate(lengths):
      cells = " | ".join("-" if np.isnan(v) else f"{v:.2f}" for v in vals[i])
      lines.append(f"| {n} | {cells} | {np.nanmean(vals[i]):.2f} |")
    lines.append("")
    for key, label in (
      ("gen", "generation score (RULER string match)"),
      ("removed_gen", "generation score, needle removed (control)"),
      ("removed_acc", "needle removed (control)"),
      ("held_out_acc", "held-out haystack"),
      ("held_out_phrasing_acc", "held-out needle phrasing"),
      ("needle_gain", "answer log-lik gained from the needle (nats)"),
      ("window_acc", "context cut to the window"),
      ("window_gap", "answer log-lik lost without distant context"),
      ("window_gap_cut", "answer log-lik lost where the cut drops the whole needle"),
    ):
      k = f"eval/{task}/{key}"
      if k in metrics:
        per_length = sorted(
          (int(m.rsplit("_len", 1)[1]), v) for m, v in metrics.items() if m.startswith(k + "_len")
        )
        detail = ", ".join(f"{n}: {v:.2f}" for n, v in per_length)
        lines.append(
          f"- {label}: {metrics[k]:.3f}" + (f" (by length {detail})" if len(per_length) > 1 else "")
        )
    field = next((r["receptive_field"] for r in rs if "receptive_field" in r), None)
    if field is not None:
      by_class = ", ".join(
        f"{cls} {metrics[f'eval/{task}/acc_{cls}']:.2f}"
        for cls in ("window", "relay", "beyond")
        if f"eval/{task}/acc_{cls}" in metrics
      )
      lines.append(
        f"- local attention, receptive field {field} tokens; "
        f"accuracy by where the needle lies: {by_class}"
      )
    lines.append(
      f"- chance: {max(r['chance'] for r in rs):.1g}; "
      f"{main[0]['n'] if main else 0} samples per cell"
    )
    lines.append("")
  if context is not None:
    ab = context["ablation"]
    lines += [
      "## Distant context on held-out documents",
      "",
      f"{context['num_docs']} documents x {context['length']} tokens; "
      f"last {ab['tail']} tokens, window {ab['window']}.",
      "",
      f"- loss full {ab['loss_full']:.3f}, truncated "
      f"{ab['loss_truncated']:.3f} (gap {ab['gap_truncated']:+.3f})",
    ]
    if ab["loss_replaced"] is not None:
      lines.append(
        f"- distant context replaced {ab['loss_replaced']:.3f} (gap {ab['gap_replaced']:+.3f})"
      )
    lines.append(
      f"- key-token fraction (> {ab['key_threshold']:g} nats): {ab['key_token_frac']:.3f}"
    )
    lines.append("")
  return "\n".join(lines)

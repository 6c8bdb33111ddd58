"""Data pipeline throughput and fill ratio on the default config.

    python scripts/bench_data.py [--seq_lens=1024,4096] [--batch_size=8]
        [--num_batches=200] [--packing=first_fit] [--sources=text,copy --weights=0.8,0.2]
        [--json=bench_results/bench_data.json]

For each seq_len: tokens/s the pipeline produces (after a warm-up batch; the
local corpus is prepared beforehand and not timed), fill ratio (non-pad tokens
over all tokens) and loss-mask ratio. Prints a table and writes JSON. The
cores are shared: figures are a lower bound of what an idle host gives.
"""

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


from lctx.data import sources  # noqa: E402
from lctx.data.pipeline import DataConfig, make_iterator, packing_bins  # noqa: E402


def bench(config: DataConfig, *, batch_size: int, seq_len: int, num_batches: int) -> dict:
  start = time.perf_counter()
  it = make_iterator(
    config, batch_size=batch_size, seq_len=seq_len, seed=0, process_index=0, process_count=1
  )
  next(it)  # warm-up: threads start, first packing bins filled
  first_batch_s = time.perf_counter() - start
  real = total = masked = 0
  start = time.perf_counter()
  for _ in range(num_batches):
    b = next(it)
    real += int((b["segment_ids"] > 0).sum())
    masked += float(b["loss_mask"].sum())
    total += b["segment_ids"].size
  seconds = time.perf_counter() - start
  return dict(
    seq_len=seq_len,
    batch_size=batch_size,
    num_batches=num_batches,
    packing=config.packing,
    num_packing_bins=packing_bins(config, seq_len),
    window_shuffle_size=config.window_shuffle_size,
    tokens_per_s=total / seconds,
    real_tokens_per_s=real / seconds,
    fill_ratio=real / total,
    loss_mask_ratio=masked / total,
    seconds=seconds,
    first_batch_s=first_batch_s,
  )


def main(argv=None):
  p = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  p.add_argument("--seq_lens", default="1024,4096")
  p.add_argument("--batch_size", type=int, default=8)
  p.add_argument("--num_batches", type=int, default=200)
  p.add_argument("--packing", default="first_fit")
  p.add_argument("--num_packing_bins", type=int, default=None)
  p.add_argument("--window_shuffle_size", type=int, default=None)
  p.add_argument("--sources", default="text", help="e.g. text,copy")
  p.add_argument("--weights", default="", help="e.g. 0.8,0.2 (default equal)")
  p.add_argument("--json", default="bench_results/bench_data.json")
  args = p.parse_args(argv)

  weights = tuple(float(w) for w in args.weights.split(",")) if args.weights else ()
  config = DataConfig(sources=tuple(args.sources.split(",")), weights=weights, packing=args.packing)
  overrides = {
    k: getattr(args, k)
    for k in ("num_packing_bins", "window_shuffle_size")
    if getattr(args, k) is not None
  }
  config = dataclasses.replace(config, **overrides)
  t = time.perf_counter()
  sources.prepare_text_corpus(config.text_glob, data_dir=config.data_dir)
  prepare_s = time.perf_counter() - t
  rows = [
    bench(config, batch_size=args.batch_size, seq_len=int(s), num_batches=args.num_batches)
    for s in args.seq_lens.split(",")
  ]
  print(
    f"corpus check/prepare {prepare_s:.1f} s (cached after the first run); "
    f"cpu count {os.cpu_count()}, load avg {os.getloadavg()[0]:.2f}"
  )
  print(
    f"{'seq_len':>8} {'batch':>6} {'packing':>12} {'bins':>5} {'Mtok/s':>8} "
    f"{'fill':>7} {'loss_mask':>9} {'1st_batch_s':>11}"
  )
  for r in rows:
    print(
      f"{r['seq_len']:>8} {r['batch_size']:>6} {r['packing']:>12} "
      f"{r['num_packing_bins']:>5} {r['tokens_per_s'] / 1e6:>8.2f} "
      f"{r['fill_ratio']:>7.4f} {r['loss_mask_ratio']:>9.4f} {r['first_batch_s']:>11.2f}"
    )
  os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
  with open(args.json, "w") as f:
    json.dump(
      dict(
        config=dataclasses.asdict(config),
        prepare_s=prepare_s,
        load_avg=os.getloadavg()[0],
        results=rows,
      ),
      f,
      indent=2,
    )
  print(f"wrote {args.json}")


if __name__ == "__main__":
  main()

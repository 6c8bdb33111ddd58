"""Data pipeline throughput and fill ratio on the default config, per source
kind against reading the raw files, the cost of the global order, and the
train step's consumption to compare with.

    python scripts/bench_data.py [--seq_lens=1024,4096] [--batch_size=8]
        [--num_batches=200] [--packing=first_fit] [--sources=text,copy --weights=0.8,0.2]
        [--mix_dir=/tmp/lctx_mix] [--kinds=text,jsonl,parquet,copy] [--processes=1,2,4]
        [--train_steps=12] [--json=bench_results/bench_data.json]

1. For each seq_len: tokens/s the pipeline produces (timed after the batches
   that the packer's first buffer of rows serves; the local corpus is prepared
   beforehand and not timed), fill ratio (non-pad tokens over all tokens) and
   loss-mask ratio.
2. Per source kind (scripts/make_mix_corpus.py's files under --mix_dir, written
   if missing): packed tokens/s of a one-source pipeline at the first seq_len,
   and the tokens/s of reading the same raw files alone (open, decompress,
   parse, byte-tokenize; no packing), in the same run.
3. The global order: every process builds the whole global batch and keeps its
   rows, so documents read per process do not fall with the process count. For
   each --processes count, process 0's documents read (prefetch included) for
   --num_batches batches of its own rows, the corpus documents that begin in
   those rows, and the tokens/s of its own rows.
4. --train_steps > 0: gin/local_cpu.gin trained that many steps in a temporary
   workdir; the tokens/s of its last logged window is what the train step
   consumes, and the pipeline's ratio to it is printed.
Prints tables and writes JSON. The cores are shared: figures are a lower bound
of what an idle host gives.
"""

import argparse
import dataclasses
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


from lctx.data import sources, streams  # noqa: E402
from lctx.data.pipeline import DataConfig, make_iterator, packing_bins  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# One source per reader kind over make_mix_corpus.py's files.
KIND_SPECS = {
  "text": lambda d: {"kind": "text", "path": f"{d}/books"},
  "jsonl": lambda d: {"kind": "jsonl", "path": f"{d}/code", "field": "content"},
  "parquet": lambda d: {"kind": "parquet", "path": f"{d}/arxiv", "field": "text"},
  "copy": lambda d: "copy",
}


def bench(config: DataConfig, *, batch_size: int, seq_len: int, num_batches: int) -> dict:
  start = time.perf_counter()
  it = make_iterator(
    config, batch_size=batch_size, seq_len=seq_len, seed=0, process_index=0, process_count=1
  )
  next(it)  # warm-up: threads start, first packing bins filled
  first_batch_s = time.perf_counter() - start
  # The packer holds `bins` rows at once: batches served from that buffer would
  # not be timed honestly, so they are read before the clock starts.
  for _ in range(-(-packing_bins(config, seq_len) // batch_size)):
    next(it)
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


def raw_read_tokens_per_s(spec: dict) -> float:
  """Tokens/s of reading a kind's raw files alone: open, decompress, parse,
  byte-tokenize (bytes + BOS + EOS per document), no pipeline."""
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top

  from lctx.data import corpus  # pylint: disable=g-import-not-at-top

  start, tokens = time.perf_counter(), 0
  for path in corpus.expand_glob(spec["path"]):
    if spec["kind"] == "text":
      with open(path, "rb") as f:
        tokens += len(f.read()) + 2
    elif spec["kind"] == "jsonl":
      with (gzip.open if path.endswith(".gz") else open)(path, "rb") as f:
        for line in f:
          tokens += len(json.loads(line)[spec["field"]].encode()) + 2
    else:
      for text in pq.read_table(path, columns=[spec["field"]]).column(0).to_pylist():
        tokens += len(text.encode()) + 2
  return tokens / (time.perf_counter() - start)


def bench_kinds(args, seq_len: int) -> list[dict]:
  if not os.path.isdir(args.mix_dir):
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import make_mix_corpus  # pylint: disable=g-import-not-at-top

    make_mix_corpus.write(args.mix_dir)
  rows = []
  for kind in args.kinds.split(","):
    spec = KIND_SPECS[kind](args.mix_dir)
    config = DataConfig(sources=(spec,), packing=args.packing)
    make_iterator(config, batch_size=1, seq_len=seq_len, seed=0, process_index=0, process_count=1)
    r = bench(config, batch_size=args.batch_size, seq_len=seq_len, num_batches=args.num_batches)
    r["kind"] = kind
    r["raw_read_tokens_per_s"] = raw_read_tokens_per_s(spec) if isinstance(spec, dict) else None
    rows.append(r)
  return rows


class _CountingSource:
  """A document source that counts the documents read through it."""

  def __init__(self, source):
    self._source, self.reads = source, 0

  def __len__(self):
    return len(self._source)

  def __getitem__(self, index):
    self.reads += 1
    return self._source[index]

  def __repr__(self):
    return repr(self._source)


def bench_global_order(config: DataConfig, args, seq_len: int) -> list[dict]:
  """Process 0's documents read and own-row tokens/s, per process count."""
  open_source = streams.document_source
  corpus_ids = [i + 1 for i, spec in enumerate(config.source_specs()) if spec.is_corpus]
  rows = []
  for count in (int(p) for p in args.processes.split(",")):
    counters = []

    def counting(*a, counters=counters, **k):
      counters.append(_CountingSource(open_source(*a, **k)))
      return counters[-1]

    streams.document_source = counting
    try:
      it = make_iterator(
        config,
        batch_size=args.batch_size,
        seq_len=seq_len,
        seed=0,
        process_index=0,
        process_count=count,
        with_sources=True,
      )
      start, real, own_docs = time.perf_counter(), 0, 0
      for _ in range(args.num_batches):
        batch = next(it)
        real += int((batch["segment_ids"] > 0).sum())
        corpus = np.isin(batch["source_ids"], corpus_ids)
        own_docs += int(batch["document_starts"][corpus].sum())
      seconds = time.perf_counter() - start
    finally:
      streams.document_source = open_source
    rows.append(
      dict(
        processes=count,
        global_batch=args.batch_size * count,
        documents_read=sum(c.reads for c in counters),
        documents_in_own_rows=own_docs,
        own_real_tokens_per_s=real / seconds,
      )
    )
  return rows


def train_tokens_per_s(steps: int) -> float:
  """Non-pad tokens/s of gin/local_cpu.gin's train step (its last log window)."""
  with tempfile.TemporaryDirectory() as workdir:
    params = [
      f"TrainConfig.steps = {steps}",
      f"TrainConfig.log_every = {max(1, steps // 2)}",
      "TrainConfig.eval_every = 0",
      "TrainConfig.checkpoint_every = 0",
      "experiment.evals = None",
    ]
    cmd = [sys.executable, os.path.join(ROOT, "main.py"), "--gin_file=gin/local_cpu.gin"]
    cmd += [f"--workdir={workdir}"] + [f"--gin_param={p}" for p in params]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      records = [json.loads(line) for line in f if "tokens_per_sec" in line]
    return float(records[-1]["tokens_per_sec"])


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
  p.add_argument("--mix_dir", default="/tmp/lctx_mix")
  p.add_argument("--kinds", default="text,jsonl,parquet,copy", help="'' = skip part 2")
  p.add_argument("--processes", default="1,2,4", help="'' = skip part 3")
  p.add_argument("--train_steps", type=int, default=12, help="0 = skip part 4")
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
  seq_len = int(args.seq_lens.split(",")[0])
  kinds = bench_kinds(args, seq_len) if args.kinds else []
  if kinds:
    print(f"\nper source kind, seq_len {seq_len} (raw = reading the files alone)")
    print(f"{'kind':>8} {'packed Mtok/s':>13} {'raw Mtok/s':>10} {'fill':>7}")
    for r in kinds:
      raw = r["raw_read_tokens_per_s"]
      raw_text = f"{raw / 1e6:>10.2f}" if raw else f"{'-':>10}"
      print(f"{r['kind']:>8} {r['tokens_per_s'] / 1e6:>13.2f} {raw_text} {r['fill_ratio']:>7.4f}")
  order = bench_global_order(config, args, seq_len) if args.processes else []
  if order:
    print(f"\nglobal order, {args.num_batches} batches of {args.batch_size} rows per process")
    print(
      f"{'processes':>9} {'global_batch':>12} {'docs_read/proc':>14} {'docs_in_own_rows':>16} "
      f"{'own Mtok/s':>10}"
    )
    for r in order:
      print(
        f"{r['processes']:>9} {r['global_batch']:>12} {r['documents_read']:>14} "
        f"{r['documents_in_own_rows']:>16} {r['own_real_tokens_per_s'] / 1e6:>10.3f}"
      )
  train_tps = train_tokens_per_s(args.train_steps) if args.train_steps else None
  if train_tps:
    pipeline_tps = rows[0]["real_tokens_per_s"]
    print(
      f"\ngin/local_cpu.gin train step consumes {train_tps:,.0f} tokens/s; the pipeline "
      f"({config.sources}, seq_len {rows[0]['seq_len']}) delivers {pipeline_tps:,.0f} real "
      f"tokens/s = {pipeline_tps / train_tps:,.0f}x"
    )
  os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
  with open(args.json, "w") as f:
    json.dump(
      dict(
        config=dataclasses.asdict(config),
        prepare_s=prepare_s,
        load_avg=os.getloadavg()[0],
        results=rows,
        kinds=kinds,
        global_order=order,
        train_tokens_per_s=train_tps,
      ),
      f,
      indent=2,
    )
  print(f"wrote {args.json}")


if __name__ == "__main__":
  main()

r"""Collective bytes of sliding-window layers against global layers, compiled.

  python scripts/bench_sliding_bytes.py
  python scripts/bench_sliding_bytes.py --topology=v5p:2x2x1 --seq_len=8192 --window=256

Compiles (`--mode=compile`'s `run_compile`, compile-only TPU devices, no TPU
needed) one train step of the same model twice: every layer `full_attention`,
then every layer `sliding_attention` with the window; same gin file (default
the ring file), same mesh. The sliding layers run window-aware
(lctx/parallel/halo.py): K/V travel as halos, not ring hops. Prints the bytes
per device by collective kind and writes JSON.
"""

import json
import os
import sys

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

flags.DEFINE_string("gin_file", "gin/ring_v5p.gin", "The experiment (its strategy).")
flags.DEFINE_string("topology", "v5p:2x2x1", "Compile-only TPU slice.")
flags.DEFINE_integer("context", 4, "MeshConfig.context (fsdp = 1, batch 1).")
flags.DEFINE_integer("seq_len", 8192, "Tokens per row.")
flags.DEFINE_integer("window", 256, "sliding_window of the sliding model.")
flags.DEFINE_string("out", "bench_results/bench_sliding_bytes.json", "JSON output.")
FLAGS = flags.FLAGS

# The tiny model of the compile tests (tests/helpers.py TINY_GIN), 2 layers.
TINY = [
  "ModelConfig.vocab_size = 384",
  "ModelConfig.d_model = 128",
  "ModelConfig.num_layers = 2",
  "ModelConfig.num_heads = 4",
  "ModelConfig.num_kv_heads = 2",
  "ModelConfig.head_dim = 32",
  "ModelConfig.mlp_dim = 384",
  "ModelConfig.mlp_chunk_size = None",
  "TrainConfig.loss_chunk_size = 1024",
]


def main(_):
  from lctx.sizing import devices as devices_lib  # pylint: disable=g-import-not-at-top

  devices_lib.compile_only_env()
  import gin  # pylint: disable=g-import-not-at-top

  from lctx import configs, gin_utils  # pylint: disable=g-import-not-at-top
  from lctx.sizing import compile as compile_lib  # pylint: disable=g-import-not-at-top

  rows = {}
  for kind in ("full_attention", "sliding_attention"):
    params = [
      *TINY,
      "MeshConfig.fsdp = 1",
      f"MeshConfig.context = {FLAGS.context}",
      "TrainConfig.batch_size = 1",
      f"TrainConfig.seq_len = {FLAGS.seq_len}",
      f"ModelConfig.layer_types = ['{kind}', '{kind}']",
      f"ModelConfig.sliding_window = {FLAGS.window}",
    ]
    gin.clear_config()
    gin_utils.parse([os.path.join(ROOT, FLAGS.gin_file)], params, [ROOT])
    exp = configs.experiment()
    gin.clear_config()
    workdir = os.path.join(os.path.dirname(FLAGS.out) or ".", f"sliding_bytes_{kind}")
    record = compile_lib.run_compile(exp, workdir, topology=FLAGS.topology)
    rows[kind] = {
      "collective_bytes_per_device": record["collective_bytes_per_device"],
      "by_kind": record["collective_bytes_by_kind"],
      "attention_flops_per_device": record.get("attention_flops_per_device"),
    }
  print(f"\n{FLAGS.gin_file} on {FLAGS.topology}, context {FLAGS.context}, "
        f"{FLAGS.seq_len} tokens, window {FLAGS.window}: bytes per device per step")  # fmt: skip
  kinds = list(rows["full_attention"]["by_kind"])
  print(f"{'layers':<20}{'total':>14}" + "".join(f"{k:>20}" for k in kinds))
  for kind, row in rows.items():
    cells = "".join(f"{row['by_kind'][k]:>20,.0f}" for k in kinds)
    print(f"{kind:<20}{row['collective_bytes_per_device']:>14,.0f}{cells}")
  os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
  with open(FLAGS.out, "w") as f:
    json.dump({"flags": {k: FLAGS[k].value for k in ("gin_file", "topology", "context",
                                                     "seq_len", "window")},  # fmt: skip
               "rows": rows}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
  app.run(main)

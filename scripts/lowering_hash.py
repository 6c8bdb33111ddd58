r"""The train step's StableHLO, lowered (not compiled), as one hash per gin file.

  python scripts/lowering_hash.py gin/ring_v5p.gin --gin_param='TrainConfig.seq_len=65536'

A refactor that must not change what runs: hash before and after (each tree
with its own gin files) and compare. Files with a COMPILE_TOPOLOGY lower for
that topology's compile-only devices (libtpu / the CUDA plugin); the others for
their LOCAL_DEVICES fake CPU devices. Lowering traces the program on abstract
shapes, so it needs no device memory. Prints `<sha256[:16]> <gin file>` and,
with --dump_dir, writes each text for a diff.

The text is printed without debug locations, but Pallas kernels (splash) embed
their serialized Mosaic body, whose locations name the calling file and line;
those are dropped here (lowered as if no user frame were known), so a line that
moved is not a change.
"""

import argparse
import hashlib
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("gin_file")
  parser.add_argument("--gin_param", action="append", default=[])
  parser.add_argument("--dump_dir", default=None)
  args = parser.parse_args()

  import bench_setup  # pylint: disable=g-import-not-at-top  (scripts/)

  bench_setup.fake_devices([args.gin_file], args.gin_param)
  from jax._src.interpreters import mlir  # pylint: disable=g-import-not-at-top

  with_frames = mlir.source_info_to_location
  mlir.source_info_to_location = lambda ctx, prim, names, tb: with_frames(ctx, prim, names, None)
  from lctx import configs, gin_utils  # pylint: disable=g-import-not-at-top
  from lctx.parallel import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
  from lctx.sizing import compile as compile_lib  # pylint: disable=g-import-not-at-top
  from lctx.trainer import Trainer  # pylint: disable=g-import-not-at-top

  gin_utils.parse([args.gin_file], args.gin_param, [ROOT])
  exp, topology = configs.experiment(), configs.target()
  devices = compile_lib.compile_devices(topology)[0] if topology else None
  mesh = mesh_lib.make_mesh(exp.mesh, devices=devices)
  text = Trainer(exp.model, exp.train, mesh).lower_train_step().as_text()
  digest = hashlib.sha256(text.encode()).hexdigest()[:16]
  if args.dump_dir:
    os.makedirs(args.dump_dir, exist_ok=True)
    name = os.path.splitext(os.path.basename(args.gin_file))[0]
    with open(os.path.join(args.dump_dir, f"{name}.mlir"), "w") as f:
      f.write(text)
  print(f"{digest} {args.gin_file} {' '.join(args.gin_param)}", flush=True)


if __name__ == "__main__":
  main()

r"""Recount a kept `--mode=compile` program: FLOPs, bytes and step-time estimate.

  LCTX_COMPILE_DUMP_DIR=/tmp/dump python main.py --mode=compile --gin_file=G ...
  python scripts/recount_compile.py --gin_file=G --compile_topology=v5p:4x4x4 \
      --dump_dir=/tmp/dump --compile_json=<workdir>/compile.json

Reads the optimised HLO the compile left in the dump directory and rewrites the
counting keys of compile.json (lctx.sizing.compile.step_figures) with the current
lctx/sizing/hlo_flops.py, without compiling again (a full-size compile takes minutes).
"""

import glob
import json
import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

flags.DEFINE_multi_string("gin_file", [], "Gin files.")
flags.DEFINE_multi_string("gin_param", [], "Gin bindings.")
flags.DEFINE_string("compile_topology", "", "As --mode=compile.")
flags.DEFINE_integer("compile_topology_num_slices", 1, "As --mode=compile.")
flags.DEFINE_string("dump_dir", "", "LCTX_COMPILE_DUMP_DIR of the compile.")
flags.DEFINE_string("compile_json", "", "compile.json to update (printed if empty).")
FLAGS = flags.FLAGS
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(_):
  from lctx import configs, gin_utils  # pylint: disable=g-import-not-at-top
  from lctx.parallel import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
  from lctx.sizing import compile as compile_lib  # pylint: disable=g-import-not-at-top
  from lctx.sizing import hlo_flops  # pylint: disable=g-import-not-at-top

  paths = glob.glob(os.path.join(FLAGS.dump_dir, "*train_step*.after_optimizations.txt"))
  if len(paths) != 1:
    raise ValueError(f"--dump_dir={FLAGS.dump_dir}: expected one optimised train step, got {paths}")
  gin_utils.parse(FLAGS.gin_file, FLAGS.gin_param, [ROOT])
  exp = configs.experiment()
  topology, slices = FLAGS.compile_topology, FLAGS.compile_topology_num_slices
  devices, accel, _, _ = compile_lib.compile_devices(topology, slices)
  mesh_cfg, _ = compile_lib._mesh_config(exp, topology, slices)  # noqa: SLF001
  mesh = mesh_lib.make_mesh(mesh_cfg, devices=devices)
  with open(paths[0]) as f:
    count = hlo_flops.matmul_flops(f.read())
  record = {}
  if FLAGS.compile_json:
    with open(FLAGS.compile_json) as f:
      record = json.load(f)
  record.update(
    matmul_flops_per_device=count["dot_flops"],
    matmul_flops_per_device_min=count["dot_flops_min"],
    kernel_custom_calls=count["custom_calls"],
    kernel_custom_calls_by_kernel=count["custom_calls_by_kernel"],
    unknown_trip_count_loops=count["unknown_trip_count_loops"],
  )
  record.update(
    compile_lib.step_figures(count, mesh=mesh, accel=accel, model=exp.model, train=exp.train)
  )
  if FLAGS.compile_json:
    with open(FLAGS.compile_json, "w") as f:
      json.dump(record, f, indent=2)
    print(compile_lib.summary(record))
  else:
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
  app.run(main)

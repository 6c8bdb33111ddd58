r"""lctx entry point: gin files + absl flags -> lctx.train.run.

python main.py --gin_file=gin/local_cpu.gin --workdir=/tmp/lctx
python main.py --gin_file=gin/usp_ironwood.gin --gin_param="TrainConfig.steps=10"
python main.py --mode=inspect_data --gin_file=gin/local_cpu.gin
python main.py --mode=compile --gin_file=gin/ring_v5p.gin --compile_topology=v5p:4x4x4
python main.py --mode=plan --gin_file=gin/ring_v5p.gin --plan_hardware=v5p-64
"""

import os
import sys

from absl import app, flags, logging

flags.DEFINE_multi_string("gin_file", [], "Gin files to bind (repeatable).")
flags.DEFINE_multi_string("gin_param", [], "Gin bindings (repeatable).")
flags.DEFINE_multi_string(
  "gin_search_path", [], "Extra gin include paths (the repo root is always one)."
)
flags.DEFINE_string("workdir", None, "Run directory (checkpoints, metrics).")
flags.DEFINE_enum(
  "mode",
  "train",
  ["train", "eval", "train_and_eval", "inspect_data", "compile", "plan"],
  "What to run.",
)
flags.DEFINE_string(
  "plan_hardware",
  None,
  "--mode=plan: the hardware to plan for: '<tpu>-<chips>' (v5p-64, tpu7x-64), "
  "'<gpu>x<count>' (h100x8) or a topology (v5p:4x4x4); see lctx/hardware.py.",
)
flags.DEFINE_bool(
  "plan_then_compile",
  False,
  "--mode=plan: also compile the smallest fitting setup for the TPU slice (as --mode=compile).",
)
flags.DEFINE_string(
  "compile_topology",
  None,
  "--mode=compile: the TPU slice to compile the train step for, e.g. 'v5p:4x4x4', "
  "'tpu7x:4x4x4' (compile-only devices from libtpu; no TPU needed).",
)
flags.DEFINE_enum(
  "compile_step",
  "train",
  ["train", "eval"],
  "--mode=compile: the step to compile: the train step, or the eval step that scores "
  "answers inside the sharded program (the retrieval evals).",
)
flags.DEFINE_integer(
  "compile_topology_num_slices", 1, "--mode=compile: how many such slices (multi-slice, DCN)."
)
flags.DEFINE_integer(
  "fake_devices",
  None,
  "CPU only: force this many host devices (default: the "
  "gin file's LOCAL_DEVICES macro, else none).",
)
flags.DEFINE_bool(
  "jax_distributed",
  False,
  "Multi-host: call jax.distributed.initialize (arguments "
  "auto-detected on TPU VMs; else the three flags below).",
)
flags.DEFINE_string("coordinator_address", None, "host:port of process 0.")
flags.DEFINE_integer("num_processes", None, "Number of processes.")
flags.DEFINE_integer("process_id", None, "This process's index.")
FLAGS = flags.FLAGS
REPO_ROOT = os.path.dirname(os.path.abspath(__file__))


def _set_fake_devices(n):
  if n and "jax" not in sys.modules:
    os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}"
    )


class _QuietLibraries:
  """absl filter: INFO chatter of orbax/grain stays out of the run's log."""

  _NOISY = ("/orbax/", "/grain/", "/tensorflow_datasets/")

  def filter(self, record):
    return record.levelno >= 30 or not any(n in record.pathname for n in self._NOISY)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  logging.get_absl_handler().addFilter(_QuietLibraries())
  if FLAGS.mode == "compile" or FLAGS.plan_then_compile:
    # libtpu compiles for TPU devices it only describes; other processes may
    # hold it too, and there is no TPU metadata server to ask.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    # GPU nodes (--compile_topology=h100x8) compile on the CUDA plugin's
    # compile-only devices: its CUDA library check would fail without a GPU.
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
  import gin  # pylint: disable=g-import-not-at-top

  from lctx import gin_utils  # pylint: disable=g-import-not-at-top

  _set_fake_devices(
    FLAGS.fake_devices
    or gin_utils.local_devices_macro(
      FLAGS.gin_file, [REPO_ROOT, *FLAGS.gin_search_path], FLAGS.gin_param
    )
  )
  if FLAGS.jax_distributed:
    import jax  # pylint: disable=g-import-not-at-top

    # CPU processes (scripts/launch_local.sh) need gloo for cross-process
    # collectives; the option only concerns the CPU client.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
  from lctx import configs, train  # pylint: disable=g-import-not-at-top

  gin_utils.parse(FLAGS.gin_file, FLAGS.gin_param, search_paths=[REPO_ROOT, *FLAGS.gin_search_path])
  experiment = configs.experiment()
  workdir = FLAGS.workdir or os.path.join(
    "/tmp/lctx", os.path.splitext(os.path.basename((FLAGS.gin_file or ["run"])[-1]))[0]
  )
  os.makedirs(workdir, exist_ok=True)
  operative = gin.operative_config_str()
  logging.info("Operative config:\n%s", operative)
  with open(os.path.join(workdir, "config.gin"), "w") as f:
    f.write(operative)
  if FLAGS.mode == "compile":
    record = train.run(
      "compile",
      workdir,
      experiment,
      compile_topology=FLAGS.compile_topology,
      compile_topology_num_slices=FLAGS.compile_topology_num_slices,
      compile_step=FLAGS.compile_step,
    )
    return 0 if record["fits"] else 1
  if FLAGS.mode == "plan":
    record = train.run(
      "plan",
      workdir,
      experiment,
      plan_hardware=FLAGS.plan_hardware,
      plan_then_compile=FLAGS.plan_then_compile,
      plan_gin_files=tuple(FLAGS.gin_file),
    )
    return 0 if record["configured"]["fits"] else 1
  train.run(FLAGS.mode, workdir, experiment)


if __name__ == "__main__":
  app.run(main)

r"""lctx entry point: gin files + absl flags -> one handler per --mode (MODES).

python main.py --gin_file=gin/local_cpu.gin --workdir=/tmp/lctx
python main.py --gin_file=gin/usp_ironwood.gin --gin_param="TrainConfig.steps=10"
python main.py --mode=inspect_data --gin_file=gin/local_cpu.gin
python main.py --mode=compile --gin_file=gin/ring_v5p.gin  # for its COMPILE_TOPOLOGY
python main.py --mode=plan --gin_file=gin/ring_v5p.gin --plan_hardware=v5p-64
python main.py --mode=export_hf --gin_file=gin/local_cpu.gin --workdir=/tmp/lctx --export_dir=/tmp/hf
"""

import os

from absl import app, flags, logging

from lctx import errors, gin_utils

flags.DEFINE_multi_string("gin_file", [], "Gin files to bind (repeatable).")
flags.DEFINE_multi_string("gin_param", [], "Gin bindings (repeatable).")
flags.DEFINE_multi_string(
  "gin_search_path", [], "Extra gin include paths (the repo root is always one)."
)
flags.DEFINE_string("workdir", None, "Run directory (checkpoints, metrics).")
flags.DEFINE_enum(
  "mode",
  "train",
  ["train", "eval", "train_and_eval", "inspect_data", "compile", "plan", "export_hf"],
  "What to run (one handler each in MODES below).",
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
  "--mode=compile: the TPU slice ('v5p:4x4x4', 'tpu7x:4x4x4') or GPU node ('h100x8') "
  "to compile the train step for, on compile-only devices (no TPU/GPU needed); "
  "default: the gin file's COMPILE_TOPOLOGY.",
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
flags.DEFINE_string("export_dir", None, "--mode=export_hf: the Hugging Face directory to write.")
flags.DEFINE_integer("export_step", None, "--mode=export_hf: the checkpoint step (default latest).")
flags.DEFINE_enum(
  "export_dtype", "bfloat16", ["bfloat16", "float32"], "--mode=export_hf: tensor dtype."
)
flags.DEFINE_bool(
  "verbose_errors",
  False,
  "Configuration errors keep their traceback (also: LCTX_VERBOSE_ERRORS=1); "
  "without it they print as one line and exit with status 2.",
)
FLAGS = flags.FLAGS
REPO_ROOT = os.path.dirname(os.path.abspath(__file__))
# Modes whose jax devices are the host CPU (compile-only TPU/GPU devices, or none).
CPU_MODES = ("compile", "plan")


class _QuietLibraries:
  """absl filter: INFO chatter of orbax/grain stays out of the run's log."""

  _NOISY = ("/orbax/", "/grain/", "/tensorflow_datasets/")

  def filter(self, record):
    return record.levelno >= 30 or not any(n in record.pathname for n in self._NOISY)


def _search_paths():
  return [REPO_ROOT, *FLAGS.gin_search_path]


def _start_jax(fake):
  """Fake devices and platform before any jax backend starts (lctx/platforms.py)."""
  from lctx import platforms  # pylint: disable=g-import-not-at-top

  platforms.set_fake_devices(fake)
  platforms.choose(cpu_only=bool(fake) or FLAGS.mode in CPU_MODES)
  if FLAGS.jax_distributed:
    import jax  # pylint: disable=g-import-not-at-top

    # CPU processes (scripts/launch_local.sh) need gloo for cross-process
    # collectives; the option only concerns the CPU client.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)


def _read_config():
  """Parses the gin files and bindings: (experiment, target, workdir)."""
  import gin  # pylint: disable=g-import-not-at-top

  from lctx import configs  # pylint: disable=g-import-not-at-top

  gin_utils.parse(FLAGS.gin_file, FLAGS.gin_param, search_paths=_search_paths())
  experiment, target = configs.experiment(), configs.target()
  workdir = FLAGS.workdir or os.path.join(
    "/tmp/lctx", os.path.splitext(os.path.basename((FLAGS.gin_file or ["run"])[-1]))[0]
  )
  os.makedirs(workdir, exist_ok=True)
  operative = gin.operative_config_str()
  logging.info("Operative config:\n%s", operative)
  with open(os.path.join(workdir, "config.gin"), "w") as f:
    f.write(operative)
  return experiment, target, workdir


# ----------------------------------------------------------------------------
# One handler per --mode: (experiment, target, workdir) -> exit status.
# ----------------------------------------------------------------------------
def _run(experiment, target, workdir):
  from lctx import platforms, train  # pylint: disable=g-import-not-at-top

  platforms.check_target(experiment.mesh, target, FLAGS.gin_file, FLAGS.gin_param)
  train.run(FLAGS.mode, workdir, experiment)
  return 0


def _compile(experiment, target, workdir):
  from lctx.sizing import compile as compile_lib  # pylint: disable=g-import-not-at-top

  topology = FLAGS.compile_topology or target
  if not topology:
    raise errors.ConfigError(
      f"--mode=compile needs a target, and {' '.join(FLAGS.gin_file) or 'the config'} "
      "names none (no COMPILE_TOPOLOGY).",
      fix="Pass --compile_topology=v5p:4x4x4 (a TPU slice) or =h100x8 (a GPU node), "
      "or set COMPILE_TOPOLOGY = '...' in the gin file.",
    )
  record = compile_lib.run_compile(
    experiment,
    workdir,
    topology=topology,
    num_slices=FLAGS.compile_topology_num_slices,
    step=FLAGS.compile_step,
  )
  return 0 if record["fits"] else 1


def _plan(experiment, target, workdir):
  from lctx.sizing import planner  # pylint: disable=g-import-not-at-top

  record = planner.run_plan(
    experiment,
    workdir,
    hardware=FLAGS.plan_hardware,
    plan_then_compile=FLAGS.plan_then_compile,
    gin_files=tuple(FLAGS.gin_file),
  )
  return 0 if record["configured"]["fits"] else 1


def _export_hf(experiment, target, workdir):
  del target
  from lctx import export  # pylint: disable=g-import-not-at-top

  export.run_export_hf(
    experiment,
    workdir,
    export_dir=FLAGS.export_dir,
    step=FLAGS.export_step,
    dtype=FLAGS.export_dtype,
  )
  return 0


MODES = {
  "train": _run,
  "eval": _run,
  "train_and_eval": _run,
  "inspect_data": _run,
  "compile": _compile,
  "plan": _plan,
  "export_hf": _export_hf,
}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  logging.get_absl_handler().addFilter(_QuietLibraries())
  try:
    with errors.config_phase():
      fake = FLAGS.fake_devices or gin_utils.local_devices_macro(
        FLAGS.gin_file, _search_paths(), FLAGS.gin_param
      )
    _start_jax(fake)
    with errors.config_phase():
      experiment, target, workdir = _read_config()
    return MODES[FLAGS.mode](experiment, target, workdir)
  except errors.ConfigError as err:
    if errors.verbose(FLAGS.verbose_errors):
      raise
    errors.report(err)


if __name__ == "__main__":
  app.run(main)

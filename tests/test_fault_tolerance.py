"""Scale-out and fault tolerance: multi-process runs, preemption, non-finite steps,
corrupt checkpoints, the profiler window and the launch scripts.

One tiny configuration (gin/local_cpu.gin with the overrides below) serves every
test; the compiled train step is shared through a persistent compilation cache
in a temporary directory, so each run after the first skips the compile.
"""

import dataclasses
import glob
import json
import logging
import os
import shutil
import signal
import subprocess
import time
from unittest import mock

import gin
import helpers
import jax
import numpy as np
import pytest

from lctx import checkpoint as ckpt_lib
from lctx import configs, gin_utils  # noqa: F401  (configs registers the gin names)
from lctx import train as train_lib
from lctx.parallel import mesh as mesh_lib
from lctx.trainer import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIN_FILE = "gin/local_cpu.gin"
PARAMS = [
  "experiment.evals = None",
  "DataConfig.sources = ('copy',)",
  "DataConfig.weights = ()",
  "DataConfig.copy_max_key_len = 16",
  "ModelConfig.d_model = 32",
  "ModelConfig.num_heads = 4",
  "ModelConfig.num_kv_heads = 2",
  "ModelConfig.head_dim = 8",
  "ModelConfig.mlp_dim = 64",
  "TrainConfig.batch_size = 4",
  "TrainConfig.seq_len = 64",
  "TrainConfig.steps = 6",
  "TrainConfig.log_every = 1",
  "TrainConfig.eval_every = 0",
  "TrainConfig.checkpoint_every = 3",
  "TrainConfig.async_checkpoint = False",
  "TrainConfig.warmup_steps = 2",
  "TrainConfig.attention_options = @AttentionOptions()",
  "AttentionOptions.block_q = 16",
  "AttentionOptions.block_kv = 16",
]
PROFILE = (2, 4)
MAKE_DATA_ITERATOR = train_lib.make_data_iterator


def _experiment(**train_overrides) -> train_lib.Experiment:
  gin.clear_config()
  try:
    gin_utils.parse([GIN_FILE], PARAMS, search_paths=[ROOT])
    exp = configs.experiment()
  finally:
    gin.clear_config()
  return dataclasses.replace(exp, train=dataclasses.replace(exp.train, **train_overrides))


def _metrics(workdir) -> list[dict]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def _losses(workdir) -> dict[int, float]:
  return {r["step"]: r["loss"] for r in _metrics(workdir) if "loss" in r}


def _steps(workdir) -> list[int]:
  return sorted(int(d) for d in os.listdir(os.path.join(workdir, "checkpoints")) if d.isdigit())


# ----------------------------------------------------------------------------
# Data as two hosts would read it, on one process; batches that poison or signal.
# ----------------------------------------------------------------------------
class _Hosts:
  """Stands in for `jax` inside make_data_iterator: process i of n."""

  def __init__(self, index: int, count: int):
    self._index, self._count = index, count

  def process_index(self):
    return self._index

  def process_count(self):
    return self._count

  def __getattr__(self, name):
    return getattr(jax, name)


class _Wrapped:
  """The global batch of several per-host iterators; `hook(n, batch)` edits batch n."""

  def __init__(self, shards, hook=None):
    self._shards, self._hook, self._served = shards, hook, 0

  def __iter__(self):
    return self

  def __next__(self):
    parts = [next(s) for s in self._shards]
    batch = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    self._served += 1
    return self._hook(self._served, batch) if self._hook else batch

  def get_state(self):
    return {"served": self._served, "shards": [s.get_state() for s in self._shards]}

  def set_state(self, state):
    self._served = state["served"]
    for s, st in zip(self._shards, state["shards"]):
      s.set_state(st)


def _two_host_data(monkeypatch, hook=None):
  """make_data_iterator on one process returns what two processes read together."""
  make = MAKE_DATA_ITERATOR

  def two_hosts(exp, trainer, split, seed):
    shards = []
    for i in range(2):
      with mock.patch.object(train_lib, "jax", _Hosts(i, 2)):
        shards.append(make(exp, trainer, split, seed))
    return _Wrapped(shards, hook)

  monkeypatch.setattr(train_lib, "make_data_iterator", two_hosts)


def _poison(steps):
  def hook(n, batch):
    if n in steps:
      batch = dict(batch, loss_mask=np.full_like(batch["loss_mask"], np.nan))
    return batch

  return hook


def _sigterm_at(step):
  def hook(n, batch):
    if n == step:  # a real SIGTERM while this step's batch is being prepared
      os.kill(os.getpid(), signal.SIGTERM)
    return batch

  return hook


# ----------------------------------------------------------------------------
# Fixtures: a shared compilation cache and the uninterrupted reference run.
# ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
  from jax._src import compilation_cache  # pylint: disable=g-import-not-at-top

  path = str(tmp_path_factory.mktemp("jax_cache"))
  before = jax.config.jax_compilation_cache_dir
  jax.config.update("jax_compilation_cache_dir", path)
  compilation_cache.reset_cache()
  yield path
  jax.config.update("jax_compilation_cache_dir", before)
  compilation_cache.reset_cache()


@pytest.fixture(scope="module")
def reference(cache_dir, tmp_path_factory):
  """1 process x 8 devices, 6 steps, the data two hosts would read; profiled."""
  workdir = str(tmp_path_factory.mktemp("reference"))
  with pytest.MonkeyPatch.context() as mp:
    _two_host_data(mp)
    train_lib.run("train", workdir, _experiment(profile_steps=PROFILE))
  return workdir


# ----------------------------------------------------------------------------
# Multi-process (scripts/launch_local.sh) and preemption
# ----------------------------------------------------------------------------
def _launch(n, workdir, cache_dir):
  argv, env = helpers.launch_local_args(n, GIN_FILE, workdir, cache_dir, PARAMS)
  return subprocess.Popen(
    argv,
    cwd=ROOT,
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
  )


def _logs(workdir):
  out = []
  for path in sorted(glob.glob(os.path.join(workdir, "logs", "*.log"))):
    with open(path) as f:
      out.append(f.read())
  return out


def test_two_processes_match_one_process_across_a_preemption(reference, cache_dir, tmp_path):
  workdir = str(tmp_path / "two")
  # Run 1: SIGTERM to the launcher once step 1 is logged; both processes stop
  # at one agreed step, checkpoint it and exit 0.
  proc = _launch(2, workdir, cache_dir)
  metrics = os.path.join(workdir, "metrics.jsonl")
  deadline = time.time() + 240
  while not (os.path.exists(metrics) and os.path.getsize(metrics)) and proc.poll() is None:
    assert time.time() < deadline, "the first run did not log a step in time"
    time.sleep(0.05)
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=240)
  logs = _logs(workdir)
  assert proc.returncode == 0, (out, logs[0][-3000:])
  stopped = max(_losses(workdir))
  assert stopped < 6, "the run finished before the preemption notice landed"
  assert _steps(workdir)[-1] == stopped  # (and step 3's periodic one when reached)
  assert len(logs) == 2
  for log in logs:
    assert f"Preempted: stopped at step {stopped} of 6" in log
  # Run 2: the same command resumes and finishes.
  proc = _launch(2, workdir, cache_dir)
  out, _ = proc.communicate(timeout=300)
  assert proc.returncode == 0, (out, _logs(workdir)[0][-3000:])
  assert f"Resumed from step {stopped}" in _logs(workdir)[0]
  losses, expected = _losses(workdir), _losses(reference)
  assert sorted(losses) == [1, 2, 3, 4, 5, 6]
  np.testing.assert_allclose(
    [losses[s] for s in range(1, 7)], [expected[s] for s in range(1, 7)], rtol=0, atol=1e-5
  )
  assert 6 in _steps(workdir)


def test_sigterm_checkpoints_at_the_step_reached_and_resumes_exactly(
  reference, monkeypatch, tmp_path
):
  workdir = str(tmp_path)
  _two_host_data(monkeypatch, hook=_sigterm_at(4))
  train_lib.run("train", workdir, _experiment(checkpoint_every=0))  # returns: no exception
  assert sorted(_losses(workdir)) == [1, 2, 3, 4]
  assert _steps(workdir) == [4]
  assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is removed
  _two_host_data(monkeypatch)
  train_lib.run("train", workdir, _experiment(checkpoint_every=0))
  losses, expected = _losses(workdir), _losses(reference)
  assert [losses[s] for s in range(1, 7)] == [expected[s] for s in range(1, 7)]


# ----------------------------------------------------------------------------
# Non-finite steps
# ----------------------------------------------------------------------------
def test_a_non_finite_step_leaves_params_and_optimizer_state_unchanged(cache_dir):
  exp = _experiment()
  trainer = Trainer(exp.model, exp.train, mesh_lib.make_mesh(exp.mesh))
  state = trainer.init_state(0)
  batch = next(train_lib.make_data_iterator(exp, trainer, "train", seed=0))
  good = trainer.device_batch(batch)
  bad = trainer.device_batch(dict(batch, loss_mask=np.full_like(batch["loss_mask"], np.nan)))
  state, metrics = trainer.train_step(state, good)
  assert int(metrics["skipped"]) == 0
  before = jax.device_get(state)
  state, metrics = trainer.train_step(state, bad)
  after = jax.device_get(state)
  assert int(metrics["skipped"]) == 1 and not np.isfinite(float(metrics["loss"]))
  for key in ("params", "opt_state"):
    for a, b in zip(jax.tree.leaves(before[key]), jax.tree.leaves(after[key]), strict=True):
      np.testing.assert_array_equal(a, b)
  assert int(after["step"]) == int(before["step"]) + 1  # the batch is consumed
  # And the next finite step updates again.
  state, metrics = trainer.train_step(state, good)
  assert int(metrics["skipped"]) == 0
  changed = jax.device_get(state["params"])
  assert any(
    not np.array_equal(a, b)
    for a, b in zip(jax.tree.leaves(after["params"]), jax.tree.leaves(changed))
  )


def test_too_many_non_finite_steps_stop_with_the_last_good_checkpoint(
  cache_dir, monkeypatch, tmp_path
):
  workdir = str(tmp_path)
  # Step 2 alone is skipped and the run goes on; steps 5 and 6 in a row stop it.
  _two_host_data(monkeypatch, hook=_poison({2, 5, 6}))
  exp = _experiment(max_skipped_steps=2)
  with pytest.raises(
    train_lib.NonFiniteStepsError,
    match=r"2 consecutive steps \(5\.\.6\) had a non-finite loss or gradient norm "
    r"\(TrainConfig.max_skipped_steps=2\); stopping\. The last checkpoint, step 3 in .*"
    r"is intact",
  ):
    train_lib.run("train", workdir, exp)
  skipped = {r["step"]: r["skipped_steps"] for r in _metrics(workdir)}
  assert skipped == {1: 0, 2: 1, 3: 1, 4: 1, 5: 2}  # step 6 raised before logging
  assert _steps(workdir) == [3]
  checkpointer = ckpt_lib.Checkpointer(workdir, save_every=3, keep=3, async_save=False)
  trainer = Trainer(exp.model, exp.train, mesh_lib.make_mesh(exp.mesh))
  step, state, _ = checkpointer.restore_latest(
    trainer.abstract_state, ckpt_lib.experiment_meta(exp)
  )
  checkpointer.close()
  assert step == 3
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(jax.device_get(state["params"])))


def test_max_skipped_steps_must_be_positive(tmp_path):
  checkpointer = ckpt_lib.Checkpointer(str(tmp_path), save_every=0, keep=1, async_save=False)
  with pytest.raises(ValueError, match="TrainConfig.max_skipped_steps must be >= 1; got 0"):
    train_lib._SkippedSteps(0, checkpointer)
  checkpointer.close()


# ----------------------------------------------------------------------------
# Corrupt checkpoints
# ----------------------------------------------------------------------------
def test_a_truncated_latest_checkpoint_is_skipped_with_a_warning(
  reference, monkeypatch, tmp_path, caplog
):
  workdir = str(tmp_path)
  shutil.copytree(os.path.join(reference, "checkpoints"), os.path.join(workdir, "checkpoints"))
  # Truncate every array-data file of step 6's state to half (which file is the
  # largest, or is read at all, varies between machines: OCDBT keeps several).
  files = [
    p
    for p in glob.glob(os.path.join(workdir, "checkpoints", "6", "state", "**"), recursive=True)
    if os.path.isfile(p) and os.path.basename(os.path.dirname(p)) == "d"
  ]
  assert files
  for path in files:
    with open(path, "r+b") as f:
      f.truncate(os.path.getsize(path) // 2)
  _two_host_data(monkeypatch)
  with caplog.at_level(logging.WARNING):
    train_lib.run("train", workdir, _experiment())
  assert any(
    "Checkpoint step 6" in r.getMessage() and "is corrupt" in r.getMessage() for r in caplog.records
  ), [r.getMessage() for r in caplog.records]
  # Resumed from step 3: steps 4..6 retrained, exactly as the reference.
  losses, expected = _losses(workdir), _losses(reference)
  assert sorted(losses) == [4, 5, 6]
  assert [losses[s] for s in (4, 5, 6)] == [expected[s] for s in (4, 5, 6)]
  assert _steps(workdir) == [3, 6]
  assert len(os.listdir(os.path.join(workdir, "checkpoints.corrupt"))) == 1


@pytest.mark.slow
def test_two_processes_agree_to_skip_a_corrupt_checkpoint(reference, cache_dir, tmp_path):
  workdir = str(tmp_path / "two")
  proc = _launch(2, workdir, cache_dir)
  out, _ = proc.communicate(timeout=300)
  assert proc.returncode == 0, (out, _logs(workdir)[0][-3000:])
  assert _steps(workdir) == [3, 6]
  # Damage only what process 1 wrote of step 6.
  files = glob.glob(os.path.join(workdir, "checkpoints", "6", "state", "ocdbt.process_1", "d", "*"))
  largest = max(files, key=os.path.getsize)
  with open(largest, "r+b") as f:
    f.truncate(os.path.getsize(largest) // 2)
  os.remove(os.path.join(workdir, "metrics.jsonl"))
  proc = _launch(2, workdir, cache_dir)
  out, _ = proc.communicate(timeout=300)
  logs = _logs(workdir)
  assert proc.returncode == 0, (out, logs[0][-3000:])
  for log in logs:
    assert "Checkpoint step 6 in" in log and "is corrupt" in log
    assert "Resumed from step 3" in log
  losses, expected = _losses(workdir), _losses(reference)
  np.testing.assert_allclose(
    [losses[s] for s in (4, 5, 6)], [expected[s] for s in (4, 5, 6)], rtol=0, atol=1e-5
  )


def test_a_missing_state_directory_is_corrupt_too(reference, tmp_path):
  workdir = str(tmp_path)
  shutil.copytree(os.path.join(reference, "checkpoints"), os.path.join(workdir, "checkpoints"))
  shutil.rmtree(os.path.join(workdir, "checkpoints", "6", "state"))
  exp = _experiment()
  trainer = Trainer(exp.model, exp.train, mesh_lib.make_mesh(exp.mesh))
  checkpointer = ckpt_lib.Checkpointer(workdir, save_every=3, keep=3, async_save=False)
  step, _, data_state = checkpointer.restore_latest(
    trainer.abstract_state, ckpt_lib.experiment_meta(exp)
  )
  checkpointer.close()
  assert step == 3 and data_state["served"] == 3


# ----------------------------------------------------------------------------
# Profiler window and launch scripts
# ----------------------------------------------------------------------------
def test_profile_steps_write_a_trace(reference):
  traces = glob.glob(os.path.join(reference, "profile", "**", "*.xplane.pb"), recursive=True)
  assert traces and all(os.path.getsize(t) > 0 for t in traces)


@pytest.mark.parametrize("window", [(3, 3), (-1, 2), (1, 2, 3)])
def test_bad_profile_steps_are_an_error(window):
  from lctx import metrics as metrics_lib  # pylint: disable=g-import-not-at-top

  with pytest.raises(ValueError, match="profile_steps must be None or \\(start, stop\\)"):
    metrics_lib.Profiler(window, "/tmp/unused")


@pytest.mark.parametrize(
  "script", ["launch_local.sh", "tpu_vm_launch.sh", "slurm_gpu.sbatch", "gpu_launch.sh"]
)
def test_launch_scripts_parse(script):
  subprocess.run(["bash", "-n", os.path.join(ROOT, "scripts", script)], check=True)

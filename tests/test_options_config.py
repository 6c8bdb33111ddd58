"""TrainConfig's two options objects in gin: AttentionOptions and ContextOptions.

`TrainConfig.attention_options = @AttentionOptions()` carries the kernel settings,
`TrainConfig.context_options = @ContextOptions()` the context-parallel ones; the
flat names they replaced fail with one line naming the new binding.
"""

import glob
import os

import gin
import pytest

from lctx import configs, errors, gin_utils  # noqa: F401  (configs registers the gin names)
from lctx.kernels import AttentionOptions
from lctx.parallel import ContextOptions
from lctx.parallel import mesh as mesh_lib
from lctx.trainer import TrainConfig, Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = [
  "ModelConfig.vocab_size = 384",
  "ModelConfig.d_model = 64",
  "ModelConfig.num_layers = 1",
  "ModelConfig.num_heads = 4",
  "ModelConfig.num_kv_heads = 2",
  "ModelConfig.head_dim = 16",
  "ModelConfig.mlp_dim = 128",
  "TrainConfig.batch_size = 4",
  "TrainConfig.seq_len = 64",
  "MeshConfig.data = 4",
  "MeshConfig.context = 2",
]


def _experiment(params):
  gin.clear_config()
  try:
    with errors.config_phase():
      gin_utils.parse(["gin/local_cpu.gin"], [*SMALL, *params], [ROOT])
      return configs.experiment()
  finally:
    gin.clear_config()


def test_gin_options_reach_the_plan():
  exp = _experiment(
    [
      "TrainConfig.context_parallel_strategy = 'ulysses'",
      "AttentionOptions.block_q = 32",
      "AttentionOptions.backend = 'blockwise'",
      "TrainConfig.context_options = @ContextOptions()",
      "ContextOptions.head_chunks = 2",
      "ContextOptions.load_balance = False",
    ]
  )
  assert exp.train.attention_options == AttentionOptions(
    block_q=32, block_kv=256, backend="blockwise"
  )
  assert exp.train.context() == ContextOptions(
    strategy="ulysses", head_chunks=2, load_balance=False
  )
  plan = Trainer(exp.model, exp.train, mesh_lib.make_mesh(exp.mesh)).plan
  assert (plan.strategy, plan.load_balance, plan.head_chunks) == ("ulysses", False, 2)
  assert plan.context.token_order == 0  # natural order: the plan sets it
  assert (plan.attention.block_q, plan.attention.backend, plan.attention.platform) == (
    32,
    "blockwise",
    "cpu",
  )


@pytest.mark.parametrize(
  "old, new",
  [
    ("TrainConfig.attention_block_q = 128", "AttentionOptions.block_q"),
    ("TrainConfig.attention_backend = 'blockwise'", "AttentionOptions.backend"),
    ("TrainConfig.attention_fused_bwd = False", "AttentionOptions.fused_bwd"),
    ("TrainConfig.load_balance = True", "ContextOptions.load_balance"),
    ("TrainConfig.ulysses_head_chunks = 2", "ContextOptions.head_chunks"),
  ],
)
def test_old_flat_names_name_the_new_binding(old, new):
  with pytest.raises(errors.ConfigError) as info:
    _experiment([old])
  line = errors.one_line(info.value)
  field = "attention_options" if new.startswith("Attention") else "context_options"
  kind = new.split(".")[0]
  assert f"moved to {new}: bind TrainConfig.{field} = @{kind}()" in line, line


@pytest.mark.parametrize(
  "params, message",
  [
    (["ContextOptions.head_chunks = 2"], r"TrainConfig.context_options does not reference"),
    (["AttentionOptions.causal = False"], r"AttentionOptions.causal is the model's"),
    (["AttentionOptions.platform = 'tpu'"], r"AttentionOptions.platform is the mesh's"),
    (
      ["TrainConfig.context_options = @ContextOptions()", "ContextOptions.strategy = 'ring'"],
      r"TrainConfig.context_parallel_strategy",
    ),
    (["AttentionOptions.block_q = 0"], r"block_q must be a positive int"),
    (["AttentionOptions.backend = 'fast'"], r"backend must be one of"),
    (
      ["TrainConfig.context_options = @ContextOptions()", "ContextOptions.head_chunks = 0"],
      r"head_chunks must be None or an int >= 1",
    ),
  ],
)
def test_misplaced_option_bindings_are_config_errors(params, message):
  with pytest.raises(errors.ConfigError, match=message):
    _experiment(params)


def test_python_configs_take_the_objects():
  cfg = TrainConfig(
    attention_options=AttentionOptions(block_q=64), context_options=ContextOptions(head_chunks=2)
  )
  assert (cfg.attention_options.block_q, cfg.context_options.head_chunks) == (64, 2)
  assert cfg.context_options.load_balance is None
  # The flat names are gone, not kept as views: one place to read each setting.
  flat = ("attention_backend", "attention_block_q", "attention_block_kv", "attention_fused_bwd")
  for old in (*flat, "load_balance", "ulysses_head_chunks"):
    assert not hasattr(cfg, old), old
  with pytest.raises(TypeError):
    TrainConfig(attention_block_q=64)  # pylint: disable=unexpected-keyword-arg


def test_no_gin_file_binds_a_moved_name():
  files = glob.glob(os.path.join(ROOT, "gin", "**", "*.gin"), recursive=True)
  assert files
  for path in files:
    with open(path) as f:
      text = f.read()
    for old in errors.MOVED_BINDINGS:
      assert f"\n{old} " not in f"\n{text}" and f"\n{old}=" not in f"\n{text}", (path, old)


def test_the_keyword_form_exists_only_at_the_two_edges():
  """Only lctx.kernels.flash_attention and lctx.parallel.context_attention take
  attention settings as keywords beside `options` (and call options_from); every
  other function of lctx takes the object."""
  import ast  # pylint: disable=g-import-not-at-top
  import dataclasses  # pylint: disable=g-import-not-at-top

  fields = {f.name for f in dataclasses.fields(AttentionOptions)} - {"platform"}
  fields |= {"kernel_backend"}
  twins, callers = set(), set()
  for path in glob.glob(os.path.join(ROOT, "lctx", "**", "*.py"), recursive=True):
    with open(path) as f:
      tree = ast.parse(f.read())
    for node in ast.walk(tree):
      if isinstance(node, ast.FunctionDef):
        names = {a.arg for a in node.args.args + node.args.kwonlyargs}
        if "options" in names and names & fields:
          twins.add(node.name)
        for call in ast.walk(node):
          if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "options_from":
            callers.add(node.name)
  assert twins == {"flash_attention", "context_attention"}, twins
  assert callers == {"flash_attention", "context_attention"}, callers

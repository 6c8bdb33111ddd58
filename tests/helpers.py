"""Helpers shared by several test files (imported as `helpers`: pytest puts tests/ on sys.path)."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A tiny Llama (transformers.LlamaConfig fields) whose vocabulary holds the byte
# tokenizer's 259 ids.
TINY_LLAMA = dict(
  vocab_size=288,
  hidden_size=32,
  intermediate_size=64,
  num_hidden_layers=2,
  num_attention_heads=4,
  num_key_value_heads=2,
  max_position_embeddings=256,
  rms_norm_eps=1e-5,
)


def save_tiny_llama(path: str, *, random_norms: bool = False, **save_kwargs) -> str:
  """A random TINY_LLAMA (torch seed 0) saved by transformers under `path`.

  random_norms: norm scales drawn around 1 instead of all ones, so a mixed-up
  norm shows. save_kwargs go to save_pretrained (e.g. max_shard_size)."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top

  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**TINY_LLAMA))
  if random_norms:
    with torch.no_grad():
      for name, p in model.named_parameters():
        if "norm" in name:
          p.copy_(1.0 + 0.3 * torch.randn_like(p))
  model.save_pretrained(path, **save_kwargs)
  return path


def launch_local_args(n: int, gin_file: str, workdir: str, cache_dir: str, params, *flags):
  """(argv, env) that run scripts/launch_local.sh: n local processes of main.py on
  gin_file with --gin_param=p for each of params, then flags; a shared compilation
  cache, and no XLA_FLAGS (each process sets its own device count)."""
  env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=cache_dir, PYTHON=sys.executable)
  env.pop("XLA_FLAGS", None)
  argv = [
    "bash",
    os.path.join(ROOT, "scripts/launch_local.sh"),
    str(n),
    gin_file,
    workdir,
    *(f"--gin_param={p}" for p in params),
    *flags,
  ]
  return argv, env

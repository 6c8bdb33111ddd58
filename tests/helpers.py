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


# The tiny linear-attention layers (lctx ModelConfig fields, d_model 32) that
# tests/test_linear_attention.py checks against transformers and
# tests/test_linear_chunked.py runs over sequence chunks.
TINY_LINEAR = {
  "gdn": dict(
    d_model=32,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=12,
    norm_eps=1e-6,
  ),
  "kda": dict(
    d_model=32,
    num_heads=4,
    linear_attention="kda",
    linear_num_key_heads=4,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    norm_eps=1e-5,
  ),
}


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


# Device meshes the attention tests run on (8 fake CPU devices): name -> (shape, axis names).
MESHES = {
  "c8": ((8,), ("context",)),
  "d2c4": ((2, 4), ("data", "context")),
  "t2c4": ((2, 4), ("tensor", "context")),
  "usp2x4": ((2, 4), ("context", "context_ulysses")),
  "usp4x2": ((4, 2), ("context", "context_ulysses")),
}

# Attention head layouts: name -> (q heads N, kv heads K, q/k head dim H, value dim V).
# The *16 and mla24 rows have head dims the fused CPU and splash kernels take.
HEADS = {
  "mha": (8, 8, 8, 8),
  "gqa": (8, 4, 8, 8),
  "mqa": (8, 1, 8, 8),
  "mla": (4, 4, 12, 8),  # value dim != q/k dim
  "mha16": (8, 8, 16, 16),
  "gqa16": (8, 4, 16, 16),
  "mqa16": (8, 1, 16, 16),
  "mla16": (4, 4, 32, 16),
  "mla24": (4, 4, 24, 16),
}


def mesh(name: str, axis_type=None):
  """The MESHES[name] mesh over the fake CPU devices, every axis of `axis_type`
  (default Auto)."""
  import jax  # pylint: disable=g-import-not-at-top

  shape, names = MESHES[name]
  axis_type = jax.sharding.AxisType.Auto if axis_type is None else axis_type
  return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape))


def strategy_attention_fn(
  mesh,
  strategy: str,
  *,
  load_balance=None,
  head_chunks=None,
  sub_chunks=None,
  window_aware=False,
  **options,
):
  """make_attention_fn of one resolved strategy, with the token order a plan would
  give it (load_balance None: unknown) and AttentionOptions(**options)."""
  from lctx.kernels import AttentionOptions  # pylint: disable=g-import-not-at-top
  from lctx.parallel import ContextOptions, make_attention_fn  # pylint: disable=g-import-not-at-top
  from lctx.parallel.validation import zigzag_ring_size  # pylint: disable=g-import-not-at-top

  shape = dict(zip(mesh.axis_names, mesh.devices.shape))
  order = None if load_balance is None else (zigzag_ring_size(shape) if load_balance else 0)
  context = ContextOptions(
    strategy=strategy,
    load_balance=load_balance,
    head_chunks=head_chunks,
    sub_chunks=sub_chunks,
    token_order=order,
  )
  return make_attention_fn(mesh, context, AttentionOptions(**options), window_aware=window_aware)


def packed_segments(b: int, t: int, packed: bool = True):
  """(segment ids, positions) as numpy int32 [b, t], laid out as the data pipeline
  packs rows: row 0 holds two documents then trailing padding (segment 0), the last
  row two documents; positions restart at every document and are 0 on padding.
  packed=False: one document filling every row."""
  import numpy as np  # pylint: disable=g-import-not-at-top

  seg = np.ones((b, t), np.int32)
  if packed:
    seg[0, t // 3 : t - t // 5] = 2
    seg[0, t - t // 5 :] = 0
    seg[-1, t // 2 :] = 2
  pos = np.zeros((b, t), np.int32)
  for r in range(b):
    for i in range(1, t):
      pos[r, i] = pos[r, i - 1] + 1 if seg[r, i] == seg[r, i - 1] else 0
  return seg, np.where(seg > 0, pos, 0).astype(np.int32)


# gin bindings that shrink a flagship gin file to a model the TPU compiler builds in
# seconds (2 layers, 4096 tokens), for compile tests on small slices.
TINY_GIN = [
  "ModelConfig.vocab_size = 384",
  "ModelConfig.d_model = 128",
  "ModelConfig.num_layers = 2",
  "ModelConfig.num_heads = 4",
  "ModelConfig.num_kv_heads = 2",
  "ModelConfig.head_dim = 32",
  "ModelConfig.mlp_dim = 384",
  "ModelConfig.mlp_chunk_size = None",
  "TrainConfig.seq_len = 4096",
  "TrainConfig.loss_chunk_size = 1024",
  "TrainConfig.attention_options = @AttentionOptions()",
  "AttentionOptions.block_q = 512",
  "AttentionOptions.block_kv = 512",
]


# Chat templates as their models publish them (tests/fixtures/chat_templates), and
# ChatML with and without `{% generation %}` markers.
CHAT_TEMPLATE_DIR = os.path.join(ROOT, "tests", "fixtures", "chat_templates")
CHATML = (
  "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
  "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
  "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CHATML_GENERATION = (
  "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n'}}"
  "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}"
  "{% endgeneration %}{% else %}{{ message['content'] }}{% endif %}"
  "{{ '<|im_end|>' + '\\n' }}{% endfor %}"
  "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Each family's special tokens, BOS, EOS and template.
CHAT_FAMILIES = {
  "llama31": dict(
    specials=[
      "<|begin_of_text|>",
      "<|end_of_text|>",
      "<|start_header_id|>",
      "<|end_header_id|>",
      "<|eot_id|>",
      "<|eom_id|>",
      "<|python_tag|>",
    ],
    bos="<|begin_of_text|>",
    eos="<|eot_id|>",
    template="llama31_instruct.jinja",
  ),
  "qwen3": dict(
    specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    added=["<think>", "</think>"],  # added, not special, as in Qwen3's tokenizer
    bos=None,
    eos="<|im_end|>",
    pad="<|endoftext|>",
    template="qwen3.jinja",
  ),
  "chatml": dict(
    specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    bos=None,
    eos="<|im_end|>",
    template=CHATML,
  ),
  "chatml_generation": dict(
    specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    bos=None,
    eos="<|im_end|>",
    template=CHATML_GENERATION,
  ),
}


def save_chat_tokenizer(path: str, family: str, vocab_size: int = 400) -> str:
  """A byte-level BPE (trained here with the tokenizers library) with the special
  tokens and chat template of CHAT_FAMILIES[family], saved by transformers under
  `path` (tokenizer.json, tokenizer_config.json, chat_template.jinja)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tokenizers  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  from tokenizers import decoders, models, pre_tokenizers, trainers  # pylint: disable=g-import-not-at-top

  spec = CHAT_FAMILIES[family]
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  rng = np.random.default_rng(0)
  words = ["alpha", "beta", "gamma", "the", "answer", "is", "key", "what", "document", "über"]
  corpus = [" ".join(rng.choice(words, 12)) for _ in range(300)]
  trainer = trainers.BpeTrainer(
    vocab_size=vocab_size,
    special_tokens=spec["specials"],
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
  )
  tok.train_from_iterator(corpus, trainer)
  if spec.get("added"):
    tok.add_tokens([tokenizers.AddedToken(t, special=False) for t in spec["added"]])
  template = spec["template"]
  if template.endswith(".jinja"):
    with open(os.path.join(CHAT_TEMPLATE_DIR, template), encoding="utf-8") as f:
      template = f.read()
  transformers.PreTrainedTokenizerFast(
    tokenizer_object=tok,
    bos_token=spec["bos"],
    eos_token=spec["eos"],
    pad_token=spec.get("pad"),
    chat_template=template,
  ).save_pretrained(path)
  return path

"""The tensor layout shared by lctx.models.hf (reading) and hf_export (writing):
which Hugging Face tensors make each lctx param, and how.

HF stores each layer's tensors under `model.layers.{l}.` with torch Linear
weights as [out, in]; lctx stacks the layers of one attention-pattern position on a
leading axis (params['layers']['layer_{i}'][r] is HF layer r * len(pattern) + i)
and splits heads: wq [D, N, H] = q_proj.weight.T reshaped. HF's q/k rows are
already in the rotate-half order lctx's RoPE uses, so no permutation is needed.

Shapes legend (docs/contracts.md): N q heads, K kv heads, H head dim, D d_model,
F MLP hidden, E vocab, R scan repeats.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import ml_dtypes
import numpy as np

from lctx.models import hf_hybrid
from lctx.models.config import ModelConfig
from lctx.models.hf_hybrid import Part  # noqa: F401  (re-exported: Entry.part)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# safetensors dtype names lctx reads as weights (converted to the param dtype).
FLOAT_DTYPES = {"F32": np.float32, "BF16": ml_dtypes.bfloat16, "F16": np.float16}
NUMPY_TO_ST = {np.dtype(v).name: k for k, v in FLOAT_DTYPES.items()}
# HF tensors a checkpoint may hold that lctx does not need.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)

# lctx param (inside a decoder layer, or at the top) -> (HF name, transposed,
# number of lctx dims that form the first axis of the (transposed) HF tensor).
_LAYER_RULES = {
  ("attn_norm", "scale"): ("input_layernorm.weight", False, 1),
  ("mlp_norm", "scale"): ("post_attention_layernorm.weight", False, 1),
  ("attention", "wq"): ("self_attn.q_proj.weight", True, 1),  # [D, N, H] <- [N*H, D]
  ("attention", "wk"): ("self_attn.k_proj.weight", True, 1),
  ("attention", "wv"): ("self_attn.v_proj.weight", True, 1),
  ("attention", "wo"): ("self_attn.o_proj.weight", True, 2),  # [N, H, D] <- [D, N*H]
  ("attention", "bq"): ("self_attn.q_proj.bias", False, 2),  # [N, H] <- [N*H]
  ("attention", "bk"): ("self_attn.k_proj.bias", False, 2),
  ("attention", "bv"): ("self_attn.v_proj.bias", False, 2),
  ("attention", "q_norm", "scale"): ("self_attn.q_norm.weight", False, 1),
  ("attention", "k_norm", "scale"): ("self_attn.k_norm.weight", False, 1),
  ("mlp", "wi_gate"): ("mlp.gate_proj.weight", True, 1),  # [D, F] <- [F, D]
  ("mlp", "wi_up"): ("mlp.up_proj.weight", True, 1),
  ("mlp", "wo"): ("mlp.down_proj.weight", True, 1),  # [F, D] <- [D, F]
}
# Gemma 2/3 (ModelConfig.post_sublayer_norms): four norms per layer, and
# post_attention_layernorm is the norm AFTER attention, not the MLP's input norm.
_SANDWICH_RULES = {
  ("mlp_norm", "scale"): ("pre_feedforward_layernorm.weight", False, 1),
  ("post_attn_norm", "scale"): ("post_attention_layernorm.weight", False, 1),
  ("post_mlp_norm", "scale"): ("post_feedforward_layernorm.weight", False, 1),
}
_TOP_RULES = {
  ("embedding",): ("model.embed_tokens.weight", False, 1),
  ("final_norm", "scale"): ("model.norm.weight", False, 1),
  ("unembed", "kernel"): ("lm_head.weight", True, 1),  # [D, E] <- [E, D]
}


@dataclasses.dataclass(frozen=True)
class Entry:
  """How one lctx param is made of HF tensors."""

  path: tuple[str, ...]
  shape: tuple[int, ...]  # lctx shape (with the leading R axis when stacked)
  hf_names: tuple[str, ...]  # one per repeat when stacked, else one
  stacked: bool
  transposed: bool
  split: int  # lctx dims (after R) forming the first axis of the transposed HF tensor
  offset: float = 0.0  # lctx = HF + offset (a (1 + weight) norm read as lctx's scale)
  part: Part | None = None  # a piece of a fused HF tensor

  @property
  def inner(self) -> tuple[int, ...]:
    return self.shape[1:] if self.stacked else self.shape

  @property
  def hf_shape(self) -> tuple[int, ...]:
    if self.part is not None:
      return self.part.hf_shape
    dims = (math.prod(self.inner[: self.split]), math.prod(self.inner[self.split :]))
    dims = dims[:1] if self.split == len(self.inner) else dims
    return dims[::-1] if self.transposed else dims


def param_shapes(config: ModelConfig) -> dict[tuple[str, ...], tuple[int, ...]]:
  """Flat {path: shape} of the params Transformer(config).init creates (no memory)."""
  # Imported here: the model pulls in the kernels, which config-only users do not need.
  import flax.linen as nn  # pylint: disable=g-import-not-at-top

  from lctx.models.transformer import Transformer  # pylint: disable=g-import-not-at-top

  ids = jax.ShapeDtypeStruct((1, 2), np.int32)
  model = Transformer(dataclasses.replace(config, remat_policy="none", remat_custom=()))
  with nn.logical_axis_rules(()):
    tree = jax.eval_shape(lambda i: model.init(jax.random.key(0), i, i, i)["params"], ids)
  flat = jax.tree_util.tree_flatten_with_path(nn.unbox(tree))[0]
  return {tuple(k.key for k in kp): tuple(v.shape) for kp, v in flat}


def layout(
  config: ModelConfig, architecture: str | None = None, text_prefix: str = "model."
) -> dict[tuple[str, ...], Entry]:
  """{lctx path: Entry} for every param of `config` (ValueError if one has no HF name).

  architecture: the HF family whose tensor names and fusions to use; None: the
  one `config` exports to (the hybrid families differ from Llama's layout).
  text_prefix: where the decoder's tensors live ('model.' in a causal LM;
  'language_model.model.' or 'model.language_model.' in Gemma 3's multimodal
  checkpoints, whose text weights are all lctx reads)."""
  arch = architecture or hf_hybrid.default_architecture(config)
  top_rules = {**_TOP_RULES, **hf_hybrid.top_rules(arch)}
  period = len(config.attention_pattern)
  layer_rules = {**_LAYER_RULES, **hf_hybrid.layer_rules(config, arch)}
  if config.post_sublayer_norms:
    layer_rules.update(_SANDWICH_RULES)
  entries = {}
  for path, shape in param_shapes(config).items():
    if path in top_rules:
      name, transposed, split, *extra = top_rules[path]
      name = text_prefix + name[len("model.") :] if name.startswith("model.") else name
      entries[path] = Entry(path, shape, (name,), False, transposed, split, *extra)
      continue
    # ('layers', 'layer_{i}', ...) stacked over R, or ('layers_{r}', 'layer_{i}', ...).
    rule = layer_rules.get(path[2:])
    if rule is None or not path[1].startswith("layer_"):
      raise ValueError(f"lctx param {'/'.join(path)} has no Hugging Face counterpart")
    name, transposed, split, *extra = rule
    i = int(path[1][len("layer_") :])
    if path[0] == "layers":
      layers = [r * period + i for r in range(shape[0])]
    else:
      layers = [int(path[0][len("layers_") :]) * period + i]
    names = tuple(f"{text_prefix}layers.{l}.{name}" for l in layers)
    entries[path] = Entry(path, shape, names, path[0] == "layers", transposed, split, *extra)
  return entries


def part_from_hf(entry: Entry, hf: np.ndarray) -> np.ndarray:
  """The lctx (per-layer) value of a Part entry from its whole HF tensor."""
  p = entry.part
  full = hf.reshape(p.hf_shape[0], -1).T if entry.transposed else hf
  return full.reshape(p.view)[..., p.lo : p.hi].reshape(entry.inner)


def parts_to_hf(entries_values: list[tuple[Entry, np.ndarray]]) -> np.ndarray:
  """One fused HF tensor (as stored) from the (Entry, per-layer value) of its parts."""
  first = entries_values[0][0]
  p = first.part
  full = np.zeros(p.view, entries_values[0][1].dtype)
  covered = 0
  for e, value in entries_values:
    full[..., e.part.lo : e.part.hi] = value.reshape(p.view[:-1] + (e.part.hi - e.part.lo,))
    covered += e.part.hi - e.part.lo
  if covered != p.view[-1]:
    raise ValueError(f"{first.hf_names}: its parts cover {covered} of {p.view[-1]} columns")
  if first.transposed:
    return np.ascontiguousarray(full.reshape(-1, p.hf_shape[0]).T.reshape(p.hf_shape))
  return full.reshape(p.hf_shape)


def unit_slices(index, shape) -> tuple[slice, ...]:
  """A basic index (tuple of slices/ints, may be short) as full unit-step slices."""
  index = index if isinstance(index, tuple) else (index,)
  index = tuple(s for s in index if s is not Ellipsis)
  out = []
  for s, n in zip(index + (slice(None),) * (len(shape) - len(index)), shape):
    if isinstance(s, (int, np.integer)):
      s = slice(int(s) % n, int(s) % n + 1)
    start, stop, step = s.indices(n)
    if step != 1:
      raise ValueError(f"index {index}: only unit-step slices are supported")
    out.append(slice(start, max(start, stop)))
  return tuple(out)

"""Hugging Face checkpoints in and out: config.json + safetensors <-> lctx params.

Public API:
  load_config(path) -> ModelConfig          config.json (lctx.models.hf_config)
  open_pretrained(path, config=None)        a lazy reader: per lctx param, its
                                            shape/dtype and any slice, read from disk
  load_pretrained(path) -> (config, params) the whole tree as numpy arrays
  load_pretrained_sharded(path, config, shardings)
                                            jax arrays; each process reads only
                                            the slices its devices hold
  save_pretrained(path, config, params, dtype=..., max_shard_bytes=...)

Layout. HF stores each layer's tensors under `model.layers.{l}.` with torch Linear
weights as [out, in]; lctx stacks the layers of one attention-pattern position on a
leading axis (params['layers']['layer_{i}'][r] is HF layer r * len(pattern) + i)
and splits heads: wq [D, N, H] = q_proj.weight.T reshaped. HF's q/k rows are
already in the rotate-half order lctx's RoPE uses, so no permutation is needed.

Shapes legend (docs/contracts.md): N q heads, K kv heads, H head dim, D d_model,
F MLP hidden, E vocab, R scan repeats.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from typing import Any

import jax
import ml_dtypes
import numpy as np
from safetensors import safe_open

from lctx.models.config import ModelConfig
from lctx.models.hf_config import (  # noqa: F401  (re-exported)
  SHAPE_FIELDS,
  check_shape_fields,
  config_from_hf,
  config_to_hf,
  load_config,
  read_config_json,
)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# safetensors dtype names lctx reads as weights (converted to the param dtype).
_FLOAT_DTYPES = {"F32": np.float32, "BF16": ml_dtypes.bfloat16, "F16": np.float16}
_NUMPY_TO_ST = {np.dtype(v).name: k for k, v in _FLOAT_DTYPES.items()}
# HF tensors a checkpoint may hold that lctx does not need.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)

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
_TOP_RULES = {
  ("embedding",): ("model.embed_tokens.weight", False, 1),
  ("final_norm", "scale"): ("model.norm.weight", False, 1),
  ("unembed", "kernel"): ("lm_head.weight", True, 1),  # [D, E] <- [E, D]
}


@dataclasses.dataclass(frozen=True)
class _Entry:
  """How one lctx param is made of HF tensors."""

  path: tuple[str, ...]
  shape: tuple[int, ...]  # lctx shape (with the leading R axis when stacked)
  hf_names: tuple[str, ...]  # one per repeat when stacked, else one
  stacked: bool
  transposed: bool
  split: int  # lctx dims (after R) forming the first axis of the transposed HF tensor

  @property
  def inner(self) -> tuple[int, ...]:
    return self.shape[1:] if self.stacked else self.shape

  @property
  def hf_shape(self) -> tuple[int, ...]:
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


def layout(config: ModelConfig) -> dict[tuple[str, ...], _Entry]:
  """{lctx path: _Entry} for every param of `config` (ValueError if one has no HF name)."""
  period = len(config.attention_pattern)
  entries = {}
  for path, shape in param_shapes(config).items():
    if path in _TOP_RULES:
      name, transposed, split = _TOP_RULES[path]
      entries[path] = _Entry(path, shape, (name,), False, transposed, split)
      continue
    # ('layers', 'layer_{i}', ...) stacked over R, or ('layers_{r}', 'layer_{i}', ...).
    rule = _LAYER_RULES.get(path[2:])
    if rule is None or not path[1].startswith("layer_"):
      raise ValueError(f"lctx param {'/'.join(path)} has no Hugging Face counterpart")
    name, transposed, split = rule
    i = int(path[1][len("layer_") :])
    if path[0] == "layers":
      layers = [r * period + i for r in range(shape[0])]
    else:
      layers = [int(path[0][len("layers_") :]) * period + i]
    names = tuple(f"model.layers.{l}.{name}" for l in layers)
    entries[path] = _Entry(path, shape, names, path[0] == "layers", transposed, split)
  return entries


def _slices(index, shape) -> tuple[slice, ...]:
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


class LazyTensor:
  """One lctx param read on demand: `.shape`, `.dtype`, and `t[index]` -> numpy
  (index: a tuple of unit-step slices over the lctx shape, as
  jax.make_array_from_callback passes). Only the HF rows/columns that the index
  covers are read (whole heads when only part of a head's dims is asked for)."""

  def __init__(self, reader: PretrainedReader, entry: _Entry):
    self._reader, self._entry = reader, entry
    self.shape, self.dtype = entry.shape, np.dtype(reader.config.param_dtype)

  def __getitem__(self, index) -> np.ndarray:
    e = self._entry
    index = _slices(index, self.shape)
    names = e.hf_names
    if e.stacked:
      names, index = names[index[0]], index[1:]
    parts = [self._read_one(name, index) for name in names]
    out = np.stack(parts) if e.stacked else parts[0]
    return out.astype(self.dtype, copy=False)

  def _read_one(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
    e = self._entry
    inner = e.inner
    groups = [(0, e.split), (e.split, len(inner))][: 1 if e.split == len(inner) else 2]
    hf_index, block_shape, within = [], [], []
    for lo, hi in groups:  # one (transposed) HF axis per group of lctx dims
      first, rest = index[lo], inner[lo + 1 : hi]
      row = math.prod(rest)
      hf_index.append(slice(first.start * row, first.stop * row))
      block_shape += [first.stop - first.start, *rest]
      within += [slice(None), *index[lo + 1 : hi]]
    if e.transposed:
      hf_index = hf_index[::-1]
    block = self._reader.read_hf(name, tuple(hf_index))
    if e.transposed:
      block = block.T
    return block.reshape(block_shape)[tuple(within)]


class PretrainedReader:
  """What `open_pretrained` returns: the config, the layout and the files' headers.

  Files are opened per read and closed after it, so pages of the memory-mapped
  files do not stay in this process's resident memory.
  """

  def __init__(self, path: str, config: ModelConfig | None = None):
    self.path = path
    self.hf_config = read_config_json(path)
    file_config = config_from_hf(self.hf_config, os.path.join(path, "config.json"))
    if config is None:
      config = file_config
    else:
      check_shape_fields(file_config, config, path)
    self.config = config
    self.entries = layout(config)
    self._file_of, headers = _scan_files(path)
    self._check(headers)

  def _check(self, headers: dict[str, tuple[str, tuple[int, ...]]]) -> None:
    """Every needed tensor present with its shape and a float dtype; nothing unknown."""
    needed = {}
    for e in self.entries.values():
      for name in e.hf_names:
        needed[name] = e.hf_shape
    missing = sorted(set(needed) - set(headers))
    if missing:
      more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
      raise ValueError(f"{self.path}: missing tensor(s) {', '.join(missing[:5])}{more}")
    for name, shape in needed.items():
      dtype, found = headers[name]
      where = f"{self.path}: tensor {name} in {os.path.basename(self._file_of[name])}"
      if found != shape:
        raise ValueError(f"{where} has shape {list(found)}, the config needs {list(shape)}")
      if dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{where} has dtype {dtype}; lctx reads {sorted(_FLOAT_DTYPES)}")
    tied_head = {"lm_head.weight"} if self.config.tie_embeddings else set()
    unknown = sorted(
      n for n in set(headers) - set(needed) - tied_head if not n.endswith(_IGNORED_SUFFIXES)
    )
    if unknown:
      raise ValueError(
        f"{self.path}: tensor(s) {', '.join(unknown[:5])} have no place in "
        f"{self.config_architecture()} as lctx builds it (an unsupported feature?)"
      )

  def config_architecture(self) -> str:
    return (self.hf_config.get("architectures") or ["?"])[0]

  def tensor(self, path) -> LazyTensor:
    """The lazy tensor of an lctx param path (tuple of keys or 'a/b/c')."""
    path = tuple(path.split("/")) if isinstance(path, str) else tuple(path)
    if path not in self.entries:
      raise KeyError(f"no lctx param {'/'.join(path)} in this model")
    return LazyTensor(self, self.entries[path])

  def tree(self) -> dict[str, Any]:
    """The params tree (nested dicts) with LazyTensor leaves."""
    tree: dict[str, Any] = {}
    for path in self.entries:
      node = tree
      for key in path[:-1]:
        node = node.setdefault(key, {})
      node[path[-1]] = self.tensor(path)
    return tree

  def read_hf(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
    """A slice of one HF tensor as stored (numpy, its file dtype)."""
    file = self._file_of[name]
    with safe_open(file, "numpy") as f:
      return f.get_slice(name)[index]


def _scan_files(path: str):
  """({HF name: file}, {HF name: (dtype, shape)}) from the index (if any) and every
  file's header; ValueError naming the file if one is missing or truncated."""
  index_file, single = os.path.join(path, INDEX_FILE), os.path.join(path, SINGLE_FILE)
  if os.path.exists(index_file):
    with open(index_file) as f:
      try:
        weight_map = json.load(f)["weight_map"]
      except (json.JSONDecodeError, KeyError) as e:
        raise ValueError(f"{index_file}: not a safetensors index ({e})") from e
    files = sorted(set(weight_map.values()))
  elif os.path.exists(single):
    weight_map, files = None, [SINGLE_FILE]
  else:
    raise ValueError(f"{path}: neither {SINGLE_FILE} nor {INDEX_FILE}")
  file_of, headers = {}, {}
  for name in files:
    file = os.path.join(path, name)
    if not os.path.exists(file):
      raise ValueError(f"{file}: listed in {INDEX_FILE} but missing")
    try:
      with safe_open(file, "numpy") as f:
        for key in f.keys():
          sl = f.get_slice(key)
          headers[key] = (sl.get_dtype(), tuple(sl.get_shape()))
          file_of[key] = file
    except Exception as e:  # safetensors raises its own error type for bad files
      raise ValueError(f"{file}: unreadable safetensors file (truncated?): {e}") from e
  if weight_map is not None:
    for key, name in weight_map.items():
      if file_of.get(key) != os.path.join(path, name):
        raise ValueError(f"{index_file}: tensor {key} is not in {name}")
  return file_of, headers


def open_pretrained(path: str, config: ModelConfig | None = None) -> PretrainedReader:
  """Opens an HF directory: checks config.json, the index and every tensor's header
  (names, shapes, dtypes) before any data is read. `config`: the ModelConfig to
  read into (its SHAPE_FIELDS must match config.json; its param_dtype is the
  dtype reads return); default load_config(path)."""
  return PretrainedReader(path, config)


def _unflatten(flat: Mapping[tuple[str, ...], Any]) -> dict[str, Any]:
  tree: dict[str, Any] = {}
  for path, value in flat.items():
    node = tree
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = value
  return tree


def load_pretrained(path: str, config: ModelConfig | None = None):
  """(ModelConfig, params) of an HF directory; params are numpy arrays on this host."""
  reader = open_pretrained(path, config)
  return reader.config, _unflatten({p: reader.tensor(p)[()] for p in reader.entries})


def load_pretrained_sharded(path: str, config: ModelConfig, shardings: Any):
  """Params as global jax arrays with the given shardings (a pytree matching the
  params tree, e.g. the trainer's NamedShardings). Each process reads, for each of
  its devices, only that device's slice of each tensor, so the whole model is
  never on one host: peak host memory is about what the devices hold plus one
  slice in flight."""
  reader = open_pretrained(path, config)
  flat, treedef = jax.tree_util.tree_flatten_with_path(shardings)
  paths = [tuple(getattr(k, "key", getattr(k, "name", k)) for k in kp) for kp, _ in flat]
  if set(paths) != set(reader.entries):
    extra, lacking = set(paths) - set(reader.entries), set(reader.entries) - set(paths)
    raise ValueError(
      f"shardings do not match the params of {path}: extra {sorted(extra)[:3]}, "
      f"missing {sorted(lacking)[:3]}"
    )
  arrays = []
  for p, (_, sharding) in zip(paths, flat):
    t = reader.tensor(p)
    arrays.append(jax.make_array_from_callback(t.shape, sharding, lambda idx, t=t: t[idx]))
  return jax.tree_util.tree_unflatten(treedef, arrays)


# ----------------------------------------------------------------------------
# Export
# ----------------------------------------------------------------------------
def _hf_tensor(entry: _Entry, value: np.ndarray) -> np.ndarray:
  """One HF tensor (as torch stores it) from one lctx (per-layer) array."""
  hf = value.reshape(entry.hf_shape[::-1] if entry.transposed else entry.hf_shape)
  return np.ascontiguousarray(hf.T if entry.transposed else hf)


def _fetch(value, r: int | None) -> np.ndarray:
  """value[r] (or value) as a host numpy array; for a jax array that spans
  processes every process must call this (it gathers)."""
  if isinstance(value, jax.Array):
    if r is not None:
      value = _take(value, r)
    if not value.is_fully_addressable:
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

      return np.asarray(multihost_utils.process_allgather(value, tiled=True))
    return np.asarray(jax.device_get(value))
  value = np.asarray(value)
  return value if r is None else value[r]


@jax.jit
def _take(a, r):
  return jax.lax.dynamic_index_in_dim(a, r, keepdims=False)


def save_pretrained(
  path: str,
  config: ModelConfig,
  params: Any,
  dtype: str = "bfloat16",
  max_shard_bytes: int = 5 * 2**30,
  max_position_embeddings: int | None = None,
) -> list[str]:
  """Writes an HF directory transformers' AutoModelForCausalLM.from_pretrained loads:
  config.json and `model.safetensors`, or shards of at most max_shard_bytes with
  model.safetensors.index.json. params: the lctx tree (numpy or jax arrays, which
  may span processes: every process calls this, process 0 writes). Tensors are
  gathered, converted and written one at a time (each shard's header is known
  from the shapes beforehand). Returns the files written."""
  if dtype not in ("bfloat16", "float32"):
    raise ValueError(f"dtype={dtype!r}: export as 'bfloat16' or 'float32'")
  import flax.linen as nn  # pylint: disable=g-import-not-at-top

  hf_config = config_to_hf(config, dtype, max_position_embeddings)
  entries = layout(config)
  params = nn.unbox(params)
  params = params.get("params", params) if isinstance(params, Mapping) else params
  values = {}
  for p in entries:
    node = params
    for key in p:
      if key not in node:
        raise ValueError(f"params have no {'/'.join(p)} (needed by {config})")
      node = node[key]
    values[p] = node
  np_dtype = np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32)
  # (HF name, entry, repeat or None) in HF order, then shards by size.
  order = [(n, e, (r if e.stacked else None)) for e in entries.values()
           for r, n in enumerate(e.hf_names)]  # fmt: skip
  order.sort(key=lambda t: _hf_sort_key(t[0]))
  shards, size = [[]], 0
  for item in order:
    nbytes = math.prod(item[1].hf_shape) * np_dtype.itemsize
    if shards[-1] and size + nbytes > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append(item)
    size += nbytes
  names = (
    [SINGLE_FILE]
    if len(shards) == 1
    else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
  )
  writer = jax.process_index() == 0
  if writer:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
      json.dump(hf_config, f, indent=2, sort_keys=True)
  for name, shard in zip(names, shards):
    header = {n: (_NUMPY_TO_ST[np_dtype.name], e.hf_shape) for n, e, _ in shard}
    out = _SafetensorsWriter(os.path.join(path, name), header) if writer else None
    for n, e, r in shard:
      tensor = _hf_tensor(e, _fetch(values[e.path], r)).astype(np_dtype)
      if out is not None:
        out.write(n, tensor)
    if out is not None:
      out.close()
  if writer and len(shards) > 1:
    total = sum(math.prod(e.hf_shape) * np_dtype.itemsize for _, e, _ in order)
    index = {
      "metadata": {"total_size": total},
      "weight_map": {n: name for name, shard in zip(names, shards) for n, _, _ in shard},
    }
    with open(os.path.join(path, INDEX_FILE), "w") as f:
      json.dump(index, f, indent=2, sort_keys=True)
  return [os.path.join(path, n) for n in ["config.json", *names]]


def _hf_sort_key(name: str):
  """model.embed_tokens, model.layers.0..L-1 (numerically), model.norm, lm_head."""
  parts = name.split(".")
  if parts[:2] == ["model", "layers"]:
    return (1, int(parts[2]), name)
  return (0 if "embed_tokens" in name else 2, 0, name)


class _SafetensorsWriter:
  """Streams one safetensors file: the header (names, dtypes, shapes, offsets) is
  written first, then each tensor's bytes in header order as it arrives."""

  def __init__(self, file: str, header: Mapping[str, tuple[str, tuple[int, ...]]]):
    meta, offset = {"__metadata__": {"format": "pt"}}, 0
    itemsize = {"F32": 4, "BF16": 2}
    self._order = list(header)
    for name, (dtype, shape) in header.items():
      n = math.prod(shape) * itemsize[dtype]
      meta[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
      offset += n
    blob = json.dumps(meta, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned
    self._file = open(file, "wb")
    self._file.write(len(blob).to_bytes(8, "little") + blob)
    self._next = 0

  def write(self, name: str, tensor: np.ndarray) -> None:
    if self._order[self._next] != name:
      raise ValueError(f"safetensors writer: expected {self._order[self._next]}, got {name}")
    np.ascontiguousarray(tensor).tofile(self._file)
    self._next += 1

  def close(self) -> None:
    self._file.close()

"""Writing Hugging Face checkpoints: lctx params -> config.json + safetensors shards.

`save_pretrained` (re-exported by lctx.models.hf) gathers one HF tensor at a
time (one layer's slice of a stacked param), converts it and streams it into its
shard, whose header was written first from the shapes alone; process 0 writes.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Mapping
from typing import Any

import jax
import ml_dtypes
import numpy as np

from lctx.models.config import ModelConfig
from lctx.models.hf_config import config_to_hf
from lctx.models.hf_layout import (
  INDEX_FILE,
  NUMPY_TO_ST,
  SINGLE_FILE,
  Entry,
  layout,
  parts_to_hf,
  unit_slices,
)


def _hf_tensor(entry: Entry, value: np.ndarray) -> np.ndarray:
  """One HF tensor (as torch stores it) from one lctx (per-layer) array."""
  hf = value.reshape(entry.hf_shape[::-1] if entry.transposed else entry.hf_shape)
  return np.ascontiguousarray(hf.T if entry.transposed else hf)


def _hf_from_sources(srcs, values) -> np.ndarray:
  """One HF tensor from its lctx sources [(entry, repeat or None)]: one entry
  (less its norm offset), or the parts of a fused tensor."""
  fetched = [(e, _fetch(values[e.path], r)) for e, r in srcs]
  fetched = [
    (e, v.astype(np.float32) - np.float32(e.offset) if e.offset else v) for e, v in fetched
  ]
  if srcs[0][0].part is not None:
    return parts_to_hf(fetched)
  return _hf_tensor(*fetched[0])


def _fetch(value, r: int | None) -> np.ndarray:
  """value[r] (or value) as a host numpy array, read from the shards that hold it
  (no whole stacked param is gathered). A jax array that spans processes is
  gathered with a collective, so every process must call this."""
  if not isinstance(value, jax.Array):
    value = np.asarray(value)
    return value if r is None else value[r]
  if not value.is_fully_addressable:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

    part = value if r is None else _take(value, r)
    return np.asarray(multihost_utils.process_allgather(part, tiled=True))
  out = np.empty(value.shape if r is None else value.shape[1:], value.dtype)
  seen = set()
  for shard in value.addressable_shards:
    index = unit_slices(shard.index, value.shape)
    if str(index) in seen or (r is not None and not index[0].start <= r < index[0].stop):
      continue  # a replica, or a shard of other layers
    seen.add(str(index))
    data = np.asarray(shard.data)
    if r is None:
      out[index] = data
    else:
      out[index[1:]] = data[r - index[0].start]
  return out


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
  architecture: str | None = None,
) -> list[str]:
  """Writes an HF directory transformers' AutoModelForCausalLM.from_pretrained loads:
  config.json and `model.safetensors`, or shards of at most max_shard_bytes with
  model.safetensors.index.json. params: the lctx tree (numpy or jax arrays, which
  may span processes: every process calls this, process 0 writes). Tensors are
  gathered, converted and written one at a time (each shard's header is known
  from the shapes beforehand). architecture: the HF family to write where more
  than one expresses `config` (Qwen3NextForCausalLM for a GDN hybrid; default
  the first, lctx.models.hf_config.architecture_for). Returns the files written."""
  if dtype not in ("bfloat16", "float32"):
    raise ValueError(f"dtype={dtype!r}: export as 'bfloat16' or 'float32'")
  import flax.linen as nn  # pylint: disable=g-import-not-at-top

  hf_config = config_to_hf(config, dtype, max_position_embeddings, architecture)
  entries = layout(config, hf_config["architectures"][0])
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
  # (HF name, its [(entry, repeat or None)] (several: the parts of a fused
  # tensor)) in HF order, then shards by size.
  by_name: dict[str, list] = {}
  for e in entries.values():
    for r, n in enumerate(e.hf_names):
      by_name.setdefault(n, []).append((e, r if e.stacked else None))
  order = sorted(((n, srcs[0][0], srcs) for n, srcs in by_name.items()),
                 key=lambda t: _hf_sort_key(t[0]))  # fmt: skip
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
    file = os.path.join(path, name)
    with open(file, "wb") if writer else contextlib.nullcontext() as out:
      if out is not None:
        out.write(_safetensors_header({n: (np_dtype, e.hf_shape) for n, e, _ in shard}))
      for _, _, srcs in shard:  # every process gathers; process 0 writes, in header order
        tensor = _hf_from_sources(srcs, values).astype(np_dtype)
        if out is not None:
          tensor.tofile(out)
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


def _safetensors_header(tensors: Mapping[str, tuple[np.dtype, tuple[int, ...]]]) -> bytes:
  """The leading bytes of a safetensors file holding `tensors` in this order: the
  header length, then the JSON header (offsets known from the shapes alone), so
  the tensors' bytes can follow one at a time."""
  meta, offset = {"__metadata__": {"format": "pt"}}, 0
  for name, (dtype, shape) in tensors.items():
    n = math.prod(shape) * dtype.itemsize
    meta[name] = {
      "dtype": NUMPY_TO_ST[dtype.name],
      "shape": list(shape),
      "data_offsets": [offset, offset + n],
    }
    offset += n
  blob = json.dumps(meta, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned
  return len(blob).to_bytes(8, "little") + blob

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
                                            (lctx.models.hf_export)
The layout (which HF tensors make each lctx param) is lctx.models.hf_layout.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from safetensors import safe_open

from lctx.models import hf_hybrid
from lctx.models.config import ModelConfig
from lctx.models.hf_config import (  # noqa: F401  (re-exported)
  SHAPE_FIELDS,
  architecture_for,
  architecture_of,
  check_shape_fields,
  config_from_hf,
  config_to_hf,
  load_config,
  read_config_json,
)
from lctx.models.hf_export import save_pretrained  # noqa: F401  (re-exported)
from lctx.models.hf_gemma import ignored_prefixes, text_prefix
from lctx.models.hf_layout import (  # noqa: F401  (re-exported)
  FLOAT_DTYPES,
  IGNORED_SUFFIXES,
  INDEX_FILE,
  SINGLE_FILE,
  Entry,
  layout,
  param_shapes,
  part_from_hf,
  unit_slices,
)


class LazyTensor:
  """One lctx param read on demand: `.shape`, `.dtype`, and `t[index]` -> numpy
  (index: a tuple of unit-step slices over the lctx shape, as
  jax.make_array_from_callback passes). Only the HF rows/columns that the index
  covers are read (whole heads when only part of a head's dims is asked for)."""

  def __init__(self, reader: PretrainedReader, entry: Entry):
    self._reader, self._entry = reader, entry
    self.shape, self.dtype = entry.shape, np.dtype(reader.config.param_dtype)

  def __getitem__(self, index) -> np.ndarray:
    e = self._entry
    index = unit_slices(index, self.shape)
    names = e.hf_names
    if e.stacked:
      names, index = names[index[0]], index[1:]
    if e.part is None:
      parts = [self._read_one(name, index) for name in names]
    else:  # a piece of a fused tensor: read the whole (one layer's) tensor
      whole = tuple(slice(None) for _ in e.hf_shape)
      parts = [part_from_hf(e, self._reader.read_hf(n, whole))[index] for n in names]
    out = np.stack(parts) if e.stacked else parts[0]
    if e.offset:
      out = out.astype(np.float32) + np.float32(e.offset)
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
    self._file_of, headers = _scan_files(path)
    arch = architecture_of(self.hf_config, path)
    self.entries = layout(config, arch, text_prefix(self.hf_config, headers))
    # Canonical (layout) name -> stored name, where a family stores some tensors
    # under another name (lctx.models.hf_hybrid.stored_name).
    self._stored = {}
    for e in self.entries.values():
      for name in e.hf_names:
        stored = hf_hybrid.stored_name(arch, name, headers)
        if stored != name:
          self._stored[name] = stored
          headers[name] = headers.pop(stored)
          self._file_of[name] = self._file_of[stored]
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
      if dtype not in FLOAT_DTYPES:
        raise ValueError(f"{where} has dtype {dtype}; lctx reads {sorted(FLOAT_DTYPES)}")
    tied_head = {"lm_head.weight"} if self.config.tie_embeddings else set()
    skipped = ignored_prefixes(self.hf_config)
    unknown = sorted(
      n
      for n in set(headers) - set(needed) - tied_head
      if not n.endswith(IGNORED_SUFFIXES) and not n.startswith(skipped)
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
      return f.get_slice(self._stored.get(name, name))[index]


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
        for key in f.keys():  # noqa: SIM118  (safe_open is not a dict)
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

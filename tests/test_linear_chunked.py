"""A linear layer run over sequence chunks (ModelConfig.linear_chunk_size,
lctx.parallel.linear_context.chunked_layer) gives the values and gradients (input
and every parameter) of the same layer run whole on one device: GDN and KDA, packed
rows whose document boundaries fall inside chunks, on chunk edges and on device
pieces' edges, on one device and under context parallelism (zigzag and natural)."""

import dataclasses

import flax.linen as nn
import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lctx.errors import ConfigError
from lctx.models import ModelConfig, reference_attention_fn
from lctx.models.linear_attention import GatedDeltaNet, KimiDeltaAttention
from lctx.parallel.linear_context import chunk_tokens, make_linear_fns
from lctx.parallel.mesh import LOGICAL_RULES, MeshConfig, make_mesh, mesh_shape
from lctx.parallel.mixer import SequenceMixer
from lctx.parallel.validation import zigzag_ring_size
from lctx.parallel.zigzag import zigzag_inverse, zigzag_reorder

D, T = 32, 256
GDN = ModelConfig(**helpers.TINY_LINEAR["gdn"])
KDA = ModelConfig(**helpers.TINY_LINEAR["kda"])
assert GDN.d_model == KDA.d_model == D
KINDS = {"gdn": GDN, "kda": KDA}


def _inputs():
  """Row 0: documents of 16 (ending on a chunk edge and, under 8-way zigzag, on a
  piece edge), 84, 31 and 119 tokens, then 6 of padding; row 1: one document of 200
  tokens, then padding."""
  rng = np.random.default_rng(0)
  x = rng.standard_normal((2, T, D)).astype(np.float32)
  cot = rng.standard_normal((2, T, D)).astype(np.float32)
  seg = np.zeros((2, T), np.int32)
  for lo, hi, s in [(0, 16, 1), (16, 100, 2), (100, 131, 3), (131, 250, 4)]:
    seg[0, lo:hi] = s
  seg[1, :200] = 1
  return x, seg, cot


def _module(cfg, mixer):
  cls = GatedDeltaNet if cfg.linear_attention == "gated_deltanet" else KimiDeltaAttention
  return cls(cfg, mixer)


def _out_and_grads(cfg, mixer, params, x, seg, cot):
  module = _module(cfg, mixer)

  def loss(p, x):
    out = module.apply({"params": p}, x, seg, seg)
    return jnp.sum(out * cot), out

  (_, out), (gp, gx) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
  return out, gx, gp


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)


def _want(cfg):
  x, seg, cot = _inputs()
  params = nn.unbox(_module(cfg, reference_attention_fn).init(jax.random.key(0), x, seg, seg))
  params = params["params"]
  return params, _out_and_grads(cfg, reference_attention_fn, params, x, seg, cot)


def _check(got, want, unorder=np.asarray):
  out, gx, gp = got
  assert _rel(unorder(out), want[0]) < 2e-5
  assert _rel(unorder(gx), want[1]) < 2e-5
  for name in want[2]:
    assert _rel(gp[name], want[2][name]) < 2e-5, name


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_one_device_chunks_equal_whole(kind):
  cfg = KINDS[kind]
  params, want = _want(cfg)
  x, seg, cot = _inputs()
  # Chunks of 2 (shorter than the conv's W-1 = 3; every document edge but 131 on a
  # chunk edge) and of 64 (edges inside chunks).
  for chunk in (2, 64):
    got = _out_and_grads(
      dataclasses.replace(cfg, linear_chunk_size=chunk), reference_attention_fn, params, x, seg,
      cot,
    )  # fmt: skip
    _check(got, want)
  np.testing.assert_array_equal(np.asarray(got[0][0, 250:]), 0.0)  # padding
  # A row shorter than the conv's W-1 (the scanned blocks' params are created on 2
  # tokens), in one chunk of the whole row (a chunk size above the length).
  cfg2 = dataclasses.replace(cfg, linear_chunk_size=4096)
  short = _out_and_grads(cfg2, reference_attention_fn, params, x[:, :2], seg[:, :2], cot[:, :2])
  want2 = _out_and_grads(cfg, reference_attention_fn, params, x[:, :2], seg[:, :2], cot[:, :2])
  _check(short, want2)


SLOW = pytest.mark.slow
MESHES = [
  ("gdn", dict(context=8), True),
  pytest.param("kda", dict(context=2, context_ulysses=4), False, marks=SLOW),
  pytest.param("gdn", dict(tensor=2, context=4), True, marks=SLOW),
  pytest.param("kda", dict(fsdp=2, context=4), True, marks=SLOW),
  pytest.param("gdn", dict(data=2, context=2, context_ulysses=2), True, marks=SLOW),
]


@pytest.mark.parametrize("kind,mesh_kw,zigzag", MESHES)
def test_context_parallel_chunks_equal_one_device(kind, mesh_kw, zigzag):
  cfg = KINDS[kind]
  params, want = _want(cfg)
  x, seg, cot = _inputs()
  mesh = make_mesh(MeshConfig(**mesh_kw))
  ring = zigzag_ring_size(mesh_shape(mesh))
  order = (lambda a: zigzag_reorder(a, ring, axis=1)) if zigzag else (lambda a: a)  # noqa: E731
  unorder = (lambda a: zigzag_inverse(np.asarray(a), ring, axis=1)) if zigzag else np.asarray  # noqa: E731
  mixer = SequenceMixer(reference_attention_fn, linear=make_linear_fns(mesh, load_balance=zigzag))
  chunked = dataclasses.replace(cfg, linear_chunk_size=8)  # 2 or 4 chunks per piece
  with jax.set_mesh(mesh), nn.logical_axis_rules(LOGICAL_RULES):
    got = _out_and_grads(chunked, mixer, params, order(x), order(seg), order(cot))
  _check(got, want, unorder)


def test_refusals():
  with pytest.raises(ConfigError, match=r"\[linear-chunk\].*\(24\).*32 tokens"):
    chunk_tokens(32, 24)
  assert chunk_tokens(32, 64) == 32 and chunk_tokens(32, None) == 32
  assert chunk_tokens(32, 8) == 8
  with pytest.raises(ValueError, match="linear_chunk_size must be None or an int >= 1"):
    ModelConfig(layer_types=("linear_attention",), num_layers=1, linear_chunk_size=0)
  # A layout the chunk does not divide fails at trace time, naming the field.
  x, seg, _ = _inputs()
  cfg = dataclasses.replace(GDN, linear_chunk_size=96)
  with pytest.raises(ConfigError, match="linear_chunk_size"):
    _module(cfg, reference_attention_fn).init(jax.random.key(0), x, seg, seg)

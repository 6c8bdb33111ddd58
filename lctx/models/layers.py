"""Building blocks: logically partitioned params, RMSNorm, RoPE, SwiGLU MLP.

Shapes legend (docs/contracts.md): B batch, T length, N q heads, K kv heads,
H head dim, D d_model, F MLP hidden, E vocab.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from lctx.models.config import ModelConfig
from lctx.models.rope import apply_rope  # noqa: F401  (re-exported: RoPE lives in rope.py)


def fan_in_init(in_axes: Sequence[int], out_axes: Sequence[int]):
  """Lecun-normal over the contracted axes of a multi-axis kernel (e.g. [N, H, D])."""
  return nn.initializers.variance_scaling(
    1.0, "fan_in", "truncated_normal", in_axis=tuple(in_axes), out_axis=tuple(out_axes)
  )


def param(module: nn.Module, name: str, init, shape, names: tuple[str, ...], dtype):
  """A parameter annotated with logical axis names; returned unboxed."""
  if len(names) != len(shape):
    raise ValueError(f"param {name}: {len(shape)} dims but logical names {names}")
  return module.param(name, nn.with_logical_partitioning(init, names), shape, dtype)


def constrain(x, names: tuple[str, ...]):
  """Activation sharding hint in logical names (no-op without a mesh/rules)."""
  return nn.with_logical_constraint(x, names)


class RMSNorm(nn.Module):
  """x / rms(x) * scale over the last axis, computed in float32; with plus_one,
  x / rms(x) * (1 + scale) (Gemma's zero-centred scale, initialised to 0)."""

  eps: float = 1e-5
  dtype: str = "float32"
  param_dtype: str = "float32"
  axis_name: str = "embed"
  plus_one: bool = False

  @nn.compact
  def __call__(self, x, *, as_function: bool = False):
    """The normalised x, or with as_function the norm as a pure per-token
    function (closed over the scale), for a consumer that applies it to one
    sequence chunk at a time (chunked MLP, chunked loss): its float32 values
    and cotangents then exist for one chunk, not for all T tokens."""
    init = nn.initializers.zeros if self.plus_one else nn.initializers.ones
    scale = param(self, "scale", init, (x.shape[-1],), (self.axis_name,), self.param_dtype)
    fn = RMSNormFn(scale, self.eps, jnp.dtype(self.dtype).name, 1.0 if self.plus_one else 0.0)
    return fn if as_function else fn(x)


@functools.partial(
  jax.tree_util.register_dataclass, data_fields=["scale"], meta_fields=["eps", "dtype", "offset"]
)
@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity: scale may be a tracer
class RMSNormFn:
  """An RMSNorm with its scale: a pure per-token function and a pytree (its leaf
  is the scale), so it can be passed into a shard_map or a custom VJP."""

  scale: jax.Array
  eps: float
  dtype: str
  offset: float = 0.0  # 1.0: the norm multiplies by (1 + scale), in float32

  def __call__(self, x):
    scale = self.scale.astype(jnp.float32)
    if self.offset:
      scale = scale + self.offset
    return rms_norm(x, scale, self.eps, self.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def rms_norm(x, scale, eps, out_dtype=None):
  """x `[..., D]` / rms over D, times scale `[D]`, computed in float32 (x may be
  bf16; the result is float32 and dx comes back in x's dtype).

  The same math as `x * rsqrt(mean(x^2) + eps) * scale` under autodiff, with
  every sum written as a matmul against a ones vector: XLA CPU runs the
  reductions of the autodiff version (mean over D, and the scale gradient's
  sum over tokens) several times slower than the whole norm takes this way
  (docs/benchmarks.md, "Figures moved from code comments"). The matmuls
  run at HIGHEST precision: TPU and GPU would otherwise round f32 to bf16/TF32.
  The backward keeps x in its own dtype and 1/rms, not the float32 normalised
  x: at Llama-8B with 524,288 tokens per device that is a 4 GiB bf16 value
  that is live anyway (the residual stream) instead of a new 8 GiB f32 one
  per norm; xn is recomputed exactly as the forward made it.

  out_dtype: the result rounded to this dtype inside the custom VJP, so the
  cotangent arrives in it too. Rounded outside, the cast's transpose hands the
  backward a float32 cotangent and XLA folds that conversion into the matmul
  that makes it: a float32 `[T, D]` value (at 720,896 tokens per device and
  d_model 4096, 11 GiB against 5.5 in bf16).
  """
  return _rms_norm_fwd(x, scale, eps, out_dtype)[0]


def _normalise(x, eps):
  """(x / rms(x) in float32, 1 / rms `[..., 1]`)."""
  x = x.astype(jnp.float32)
  d = x.shape[-1]
  inv_d = jnp.full((d,), 1.0 / d, x.dtype)
  r = jax.lax.rsqrt(_dot(x * x, inv_d) + eps)[..., None]
  return x * r, r


def _rms_norm_fwd(x, scale, eps, out_dtype=None):
  xn, r = _normalise(x, eps)
  y = xn * scale
  return (y if out_dtype is None else y.astype(out_dtype)), (x, r, scale)


def _rms_norm_bwd(eps, out_dtype, res, g):
  del eps, out_dtype
  x, r, scale = res
  # The barrier makes this float32 x a value of the backward's own: else XLA
  # shares the forward's conversion (the remat recompute and the backward sit in
  # one computation) and keeps it float32 in between (Qwen3.5's q/k norms at
  # 720,896 tokens per device: two [T, 1024] f32 values, 5.5 GiB). x alone: tied
  # to g as well, it undid remat_group_inner_inputs='offload' on a small Llama
  # (tests/test_remat.py::test_tpu_group_inner_inputs_go_to_host).
  x = jax.lax.optimization_barrier(x)
  g = g.astype(jnp.float32)
  xn = x.astype(jnp.float32) * r
  d = xn.shape[-1]
  gs = g * scale
  # d/dx of xn = x r: r (gs - xn mean(gs xn)); d/dscale: sum over tokens of g xn.
  dx = r * (gs - xn * _dot(gs * xn, jnp.full((d,), 1.0 / d, xn.dtype))[..., None])
  dscale = _dot(jnp.ones((xn.size // d,), xn.dtype), (g * xn).reshape(-1, d))
  return dx.astype(x.dtype), dscale


rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)
_dot = functools.partial(jnp.matmul, precision=jax.lax.Precision.HIGHEST)


_ACTIVATIONS = {
  "silu": nn.silu,
  # transformers' gelu_pytorch_tanh (Gemma's hidden_activation)
  "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}


def norm_of(c: ModelConfig, name: str, axis_name: str = "embed") -> RMSNorm:
  """The model's RMSNorm (eps, dtypes and (1 + scale) form from the config)."""
  return RMSNorm(c.norm_eps, c.dtype, c.param_dtype, axis_name, c.norm_plus_one, name=name)


class MLP(nn.Module):
  """Gated MLP: (act(x Wg) * (x Wu)) Wo (act: ModelConfig.mlp_activation, SwiGLU by
  default), optionally over sequence chunks."""

  config: ModelConfig

  @nn.compact
  def __call__(self, x, pre=None, post=None):
    """x `[B, T, D]` (compute dtype) -> `[B, T, D]`; pre: an optional per-token
    function applied to x first, inside the chunks (the layer's RMSNorm); post:
    one applied to the output, inside the chunks (a post-MLP norm)."""
    c = self.config
    d, f = c.d_model, c.mlp_dim
    w_gate = param(self, "wi_gate", fan_in_init([0], [1]), (d, f), ("embed", "mlp"), c.param_dtype)
    w_up = param(self, "wi_up", fan_in_init([0], [1]), (d, f), ("embed", "mlp"), c.param_dtype)
    w_out = param(self, "wo", fan_in_init([0], [1]), (f, d), ("mlp", "embed"), c.param_dtype)
    w_gate, w_up, w_out = (w.astype(c.dtype) for w in (w_gate, w_up, w_out))

    def mlp(xc):  # [B, c, D] -> [B, c, D]; pure in xc, so it can be chunked.
      if pre is not None:
        xc = pre(xc)
      # [B, T, D] einsums, not token-major [B*T, D] matmuls: when a device holds
      # several rows of a sequence-sharded batch, its tokens are not one block of
      # the flattened B*T axis, and XLA replicated the flattened tokens over the
      # sequence axes (local_cpu.gin: each device computed the MLP of 4x its
      # tokens). Remat tags (lctx.models.config.REMAT_TAGS) as before.
      gate = checkpoint_name(jnp.einsum("BTD,DF->BTF", xc, w_gate), "mlp_gate")
      up = checkpoint_name(jnp.einsum("BTD,DF->BTF", xc, w_up), "mlp_up")
      act = _ACTIVATIONS[c.mlp_activation]
      hidden = constrain(act(gate) * up, ("act_batch", "act_seq", "act_mlp"))
      hidden = checkpoint_name(hidden, "mlp_hidden")
      out = checkpoint_name(jnp.einsum("BTF,FD->BTD", hidden, w_out), "mlp_out")
      return out if post is None else post(out)

    if c.mlp_chunk_size is None or c.mlp_chunk_size >= x.shape[1]:
      return mlp(x)
    # Imported lazily: models may run without the kernels package's extras.
    from lctx.kernels import chunked_mlp

    return chunked_mlp(mlp, x, c.mlp_chunk_size)

"""Rotary position embedding: frequency schedules and exact angles at any position.

One module for RoPE. Frequency schedules follow Hugging Face's `rope_scaling` dicts
(`config.json`), computed as transformers' `modeling_rope_utils` computes them:

  default  inv_freq[i] = theta^(-2i / H)
  linear   inv_freq / factor                               (position interpolation)
  llama3   Llama 3.1: long wavelengths divided by factor, short ones kept, a smooth
           ramp between (low_freq_factor, high_freq_factor, original_max_position_embeddings)
  yarn     YaRN: a ramp between interpolation and extrapolation over the dimensions
           (beta_fast, beta_slow), and an attention factor (0.1 ln(factor) + 1 unless
           given) that multiplies cos and sin

Angles. float32(position) x inv_freq loses the position above 2^24 and rounds the
product to ulp(position x inv_freq): 0.06 rad at 1M tokens, radians at 2^25. Here the
angle is computed in turns (fractions of a full rotation), exactly reduced:
position = sum_j d_j 256^j with 8-bit digits d_j, and for every frequency g (turns per
position) the float64 constants frac(256^j g) are split into a 16-bit fixed-point
part G_hi and a float32 remainder G_lo < 2^-16. Each d_j x G_hi is an exact float32
(8 + 16 bits), so its fractional part and the sum of the four are exact; the
remainders contribute d_j x G_lo < 2^-8 with errors near 2^-32. The angle's error is
that of one float32 in [0, 1) turn, ~4e-7 rad, at every int32 position, for every
schedule; the cost is a few elementwise ops on `[B, T, H/2]` per call.

Shapes legend (docs/contracts.md): B batch, T length, N heads, H rotary dim (even).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# Keys each rope_type requires, and the ones it may carry (transformers' names).
_REQUIRED = {
  "default": (),
  "linear": ("factor",),
  "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
  "yarn": ("factor", "original_max_position_embeddings"),
}
_OPTIONAL = {
  "default": (),
  "linear": (),
  "llama3": (),
  "yarn": ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "truncate"),
}
# Keys transformers writes into every rope dict that carry no schedule information here.
_IGNORED = ("rope_type", "type", "rope_theta", "partial_rotary_factor")
_DIGIT_BITS = 8
_DIGITS = 4  # 4 x 8 bits cover every non-negative int32 position


def rope_type(scaling: Mapping[str, Any] | None) -> str:
  """The schedule's name ('default' for None or an empty dict)."""
  if not scaling:
    return "default"
  return str(scaling.get("rope_type", scaling.get("type", "default")))


def validate_scaling(scaling: Mapping[str, Any] | None) -> None:
  """Raises one ValueError naming an unknown rope_type, a missing or unknown key."""
  kind = rope_type(scaling)
  if kind not in SUPPORTED_ROPE_TYPES:
    raise ValueError(
      f"rope_scaling: rope_type {kind!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}"
    )
  scaling = dict(scaling or {})
  missing = [k for k in _REQUIRED[kind] if scaling.get(k) is None and k != "factor"]
  if kind != "default" and scaling.get("factor") is None:
    missing.insert(0, "factor")
  if missing:
    raise ValueError(f"rope_scaling: rope_type {kind!r} needs {missing}; got {sorted(scaling)}")
  known = set(_REQUIRED[kind]) | set(_OPTIONAL[kind]) | set(_IGNORED)
  unknown = sorted(set(scaling) - known)
  if unknown:
    raise ValueError(f"rope_scaling: unknown keys {unknown} for rope_type {kind!r}")
  if kind != "default" and float(scaling["factor"]) <= 0:
    raise ValueError(f"rope_scaling: factor must be > 0; got {scaling['factor']}")
  if kind == "llama3" and float(scaling["high_freq_factor"]) <= float(scaling["low_freq_factor"]):
    raise ValueError(
      "rope_scaling: llama3 needs high_freq_factor > low_freq_factor; got "
      f"{scaling['high_freq_factor']} and {scaling['low_freq_factor']}"
    )


def inv_frequencies(dim: int, theta: float, scaling: Mapping[str, Any] | None = None) -> np.ndarray:
  """float64 `[dim/2]` inverse frequencies (radians per position) of a schedule."""
  if dim < 2 or dim % 2:
    raise ValueError(f"RoPE dim must be even and >= 2; got {dim}")
  validate_scaling(scaling)
  kind, s = rope_type(scaling), dict(scaling or {})
  inv_freq = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
  if kind == "default":
    return inv_freq
  factor = float(s["factor"])
  if kind == "linear":
    return inv_freq / factor
  if kind == "llama3":
    return _llama3(inv_freq, factor, s)
  return _yarn(dim, theta, factor, s)


def _llama3(inv_freq, factor, s):
  low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
  old_len = float(s["original_max_position_embeddings"])
  wavelen = 2 * math.pi / inv_freq
  scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
  smooth = (old_len / wavelen - low) / (high - low)
  smoothed = (1 - smooth) * scaled / factor + smooth * scaled
  medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
  return np.where(medium, smoothed, scaled)


def _yarn(dim, theta, factor, s):
  beta_fast = float(s.get("beta_fast") or 32)
  beta_slow = float(s.get("beta_slow") or 1)
  old_len = float(s["original_max_position_embeddings"])
  truncate = s.get("truncate", True)

  def correction_dim(rotations):  # the dimension that turns `rotations` times in old_len
    return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

  lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
  if truncate:
    lo, hi = math.floor(lo), math.ceil(hi)
  lo, hi = max(lo, 0), min(hi, dim - 1)
  if lo == hi:
    hi += 0.001  # transformers' guard against a zero-width ramp
  ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - lo) / (hi - lo), 0, 1)
  pos_freqs = theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
  extrapolation = 1 - ramp  # 1: keep the frequency, 0: interpolate it
  return (1 / (factor * pos_freqs)) * (1 - extrapolation) + (1 / pos_freqs) * extrapolation


def attention_factor(scaling: Mapping[str, Any] | None) -> float:
  """The factor yarn applies to cos and sin (so q.k scales by its square); 1 otherwise."""
  validate_scaling(scaling)
  if rope_type(scaling) != "yarn":
    return 1.0
  s = dict(scaling)
  if s.get("attention_factor") is not None:
    return float(s["attention_factor"])
  factor = float(s["factor"])

  def mscale(scale, m=1.0):
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

  if s.get("mscale") and s.get("mscale_all_dim"):
    return mscale(factor, float(s["mscale"])) / mscale(factor, float(s["mscale_all_dim"]))
  return mscale(factor)


@functools.lru_cache(maxsize=64)
def _turn_constants(dim: int, theta: float, scaling: tuple) -> tuple[np.ndarray, np.ndarray]:
  """(G_hi, G_lo), each float32 `[DIGITS, dim/2]`: frac(256^j x turns per position),
  G_hi a multiple of 2^-16 (so d x G_hi is exact for 8-bit d), G_lo the rest."""
  turns = inv_frequencies(dim, theta, dict(scaling)) / (2 * math.pi)  # [dim/2]
  scale = np.float64(1 << _DIGIT_BITS) ** np.arange(_DIGITS)[:, None]
  g = np.mod(scale * turns, 1.0)  # [DIGITS, dim/2]; exact: a power-of-two multiple
  g_hi = np.floor(g * 65536.0) / 65536.0
  return g_hi.astype(np.float32), (g - g_hi).astype(np.float32)


def rope_angles(positions, dim: int, theta: float, scaling: Mapping[str, Any] | None = None):
  """Angles in radians, float32 `[..., dim/2]` in [0, 2 pi), for int positions `[...]`
  (0 <= position < 2^31), reduced modulo 2 pi exactly (see the module docstring)."""
  g_hi, g_lo = _turn_constants(dim, float(theta), _key(scaling))
  p = jnp.asarray(positions).astype(jnp.int32)[..., None]
  hi = jnp.zeros(p.shape[:-1] + (dim // 2,), jnp.float32)
  lo = jnp.zeros_like(hi)
  mask = (1 << _DIGIT_BITS) - 1
  for j in range(_DIGITS):
    d = ((p >> (_DIGIT_BITS * j)) & mask).astype(jnp.float32)
    prod = d * g_hi[j]  # exact
    hi = hi + (prod - jnp.floor(prod))  # exact: multiples of 2^-16 below 4
    lo = lo + d * g_lo[j]
  turns = hi - jnp.floor(hi) + lo
  turns = turns - jnp.floor(turns)
  return turns * np.float32(2 * math.pi)


def apply_rope(x, positions, theta: float, scaling: Mapping[str, Any] | None = None):
  """Rotary embedding, half-split convention (rotate_half), driven by positions.

  Args:
    x: `[B, T, N, H]` (H even; N may be 1 for MLA's shared key part).
    positions: int32 `[B, T]`: the true token positions (may be permuted, restart
      per packed document), so RoPE never depends on array order.
    theta: the RoPE base.
    scaling: an HF `rope_scaling` dict (or (key, value) pairs), None for the default.
  Returns: `[B, T, N, H]` in x.dtype, rotated in float32 (times yarn's attention factor).
  """
  h = x.shape[-1]
  angles = rope_angles(positions, h, theta, scaling)[:, :, None, :]  # [B, T, 1, H/2]
  mult = attention_factor(_as_dict(scaling))
  sin, cos = jnp.sin(angles), jnp.cos(angles)
  if mult != 1.0:
    sin, cos = sin * mult, cos * mult
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def _as_dict(scaling) -> dict[str, Any] | None:
  if not scaling:
    return None
  return dict(scaling)


def _key(scaling) -> tuple:
  """A hashable, order-free form of a rope_scaling dict or pairs."""
  return tuple(sorted((_as_dict(scaling) or {}).items()))


def scaling_pairs(scaling: Mapping[str, Any] | tuple | None) -> tuple[tuple[str, Any], ...]:
  """rope_scaling as sorted (key, value) pairs (what ModelConfig stores); gin lists of
  pairs and dicts both accepted."""
  if not scaling:
    return ()
  if isinstance(scaling, Mapping):
    items = scaling.items()
  else:
    items = [tuple(p) for p in scaling]
    if not all(len(p) == 2 for p in items):
      raise ValueError(f"rope_scaling must be a dict or (key, value) pairs; got {scaling!r}")
  return tuple(sorted((str(k), v) for k, v in items))

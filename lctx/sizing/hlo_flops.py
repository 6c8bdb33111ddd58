r"""The matmul and attention FLOPs, collective and host bytes one device moves in a
compiled step, read from its HLO.

`compiled.cost_analysis()["flops"]` counts every computation once: a while
loop's body (the layer scan, remat groups, chunked MLP/loss scans, ring hops)
adds its FLOPs once however many times it runs, and Mosaic (Pallas) kernels
such as splash attention add nothing. For lctx's train steps that figure is
one to two orders of magnitude below the work done.

`matmul_flops(compiled.as_text())` reads the optimised HLO module instead:

- every `dot` counts 2 x prod(output shape) x prod(lhs contracting dims), and
  every `convolution` (the TPU compiler rewrites dots as convolutions, with
  heads or chunks as spatial dimensions) 2 x (output batch x output features)
  x input features per group x the kernel taps that land inside the padded
  input, summed over output positions (as XLA's HloCostAnalysis counts them);
- a computation's count is multiplied through the call graph: a `while` body by
  the loop's trip count (`known_trip_count` in its backend config when
  present; the TPU compiler of jax 0.10 / libtpu 0.0.42 writes none, so the
  trip count is read from the loop itself: an induction variable that starts at
  a constant, steps by a constant and is compared with a constant); fusions,
  calls and async ops by the times their caller runs them; a `conditional` by
  its most expensive branch (`dot_flops`: an upper bound) and its cheapest
  (`dot_flops_min`: a lower bound);
- attention: the kernels say at trace time what their own block maps make
  them compute, in name scopes XLA keeps in each op's `op_name` metadata
  (lctx/kernels/flop_tags.py). A kernel custom call (splash's forward, dkv and
  dq Mosaic calls, cuDNN's fmha calls, the CPU kernel's FFI calls) tagged
  `lctx_flops=N` adds N per execution; a `while` whose trip count is known only
  at run time (the blockwise kernel's live-block loops) and is tagged
  `lctx_trips=X` runs X times; dots and convolutions inside `lctx_attention`
  count as attention, the rest as dense. So attention multiplies through the
  layer scan, ring loops and rematerialised forwards like every matmul. Pure
  XLA attention (backends 'xla', 'reference') stays in the dense figure where
  XLA's fusions drop the op names;
- untagged Mosaic/Pallas and Triton custom calls are counted (with
  multiplicity) in `custom_calls`, by kernel name in `custom_calls_by_kernel`:
  their FLOPs are not visible in HLO and are not estimated here;
- collectives: bytes one device sends, as ring algorithms move them, with the
  replica groups as written (`collective`); an all-reduce of one slice placed
  in zeros is the TPU compiler's all-gather and counts as one;
- host transfers: ops that move arrays between HBM and pinned host memory
  (memory space S(5)), by direction.

A loop whose trip count cannot be read (and is not tagged) counts once and is
reported in `unknown_trip_count_loops`. Elementwise work and reductions are not
counted: this is the matmul figure, which dominates a transformer step.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any

import numpy as np

from lctx.kernels.flop_tags import (
  ATTENTION_SCOPE,
  BWD_FLOPS_TAG,
  FLOPS_TAG,
  LINEAR_SCOPE,
  TRIPS_TAG,
)

# Custom-call targets that run a user kernel whose FLOPs HLO cannot see.
KERNEL_TARGETS = frozenset(
  {"tpu_custom_call", "mosaic_gpu", "mosaic_gpu_v2", "__gpu$xla.gpu.triton"}
)
_INSTR = re.compile(r"^\s+(ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([^\s(]+)\s*\(.*\{\s*$")
# A computation ends with "}" (or "}, execution_thread=..." for SparseCore ones).
_END = re.compile(r"^\}(\s*$|,\s*execution_thread=)")
_ARRAY = re.compile(r"^[a-z]\w*\[([^\]]*)\]")
_NAME = r"%?([^\s,}]+)"
_CALLS = re.compile(r"\bcalls=" + _NAME)
_TO_APPLY = re.compile(r"\bto_apply=" + _NAME)  # a `call`'s callee (elsewhere: reducers)
_BODY = re.compile(r"\bbody=" + _NAME)
_COND = re.compile(r"\bcondition=" + _NAME)
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_TRUE = re.compile(r"\btrue_computation=" + _NAME)
_FALSE = re.compile(r"\bfalse_computation=" + _NAME)
_CALLED = re.compile(r"\bcalled_computations=\{([^}]*)\}")
_KNOWN_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_DIM_LABELS = re.compile(r"\bdim_labels=(\w+)_(\w+)->(\w+)")
_WINDOW = re.compile(r"\bwindow=\{([^}]*)\}")
_LHS_CONTRACTING = re.compile(r"\blhs_contracting_dims=\{([^}]*)\}")
_DIRECTION = re.compile(r"\bdirection=(\w+)")
_INDEX = re.compile(r"\bindex=(\d+)")
_OP_NAME = re.compile(r'\bop_name="([^"]*)"')
# Ops that pass a scalar through unchanged, for following an induction variable.
_PASS_THROUGH = {"copy", "bitcast", "convert", "reshape", "copy-done"}


@dataclasses.dataclass
class Instr:
  name: str
  shape: str
  opcode: str
  operands: list[tuple[str, str | None]]  # (name, inline shape or None)
  attrs: str
  operand_text: str


@dataclasses.dataclass
class Computation:
  name: str
  instrs: dict[str, Instr]
  root: Instr | None = None
  params: dict[int, Instr] = dataclasses.field(default_factory=dict)


# ----------------------------------------------------------------------------
# Parsing
# ----------------------------------------------------------------------------
def _balanced(text: str, start: int) -> int:
  """Index just past the bracket group opening at text[start]."""
  depth = 0
  for i in range(start, len(text)):
    c = text[i]
    if c in "([{":
      depth += 1
    elif c in ")]}":
      depth -= 1
      if depth == 0:
        return i + 1
  raise ValueError(f"unbalanced brackets in HLO: {text[start : start + 200]!r}")


def _split_top(text: str) -> list[str]:
  """Splits on commas outside brackets."""
  parts, depth, cur = [], 0, []
  for c in text:
    if c in "([{":
      depth += 1
    elif c in ")]}":
      depth -= 1
    if c == "," and depth == 0:
      parts.append("".join(cur))
      cur = []
    else:
      cur.append(c)
  if "".join(cur).strip():
    parts.append("".join(cur))
  return parts


def _parse_instr(name: str, rest: str) -> Instr:
  if rest.startswith("("):
    end = _balanced(rest, 0)
  else:
    end = rest.index(" ")
  shape, rest = rest[:end], rest[end:].lstrip()
  m = re.match(r"([\w\-]+)\(", rest)
  if not m:
    raise ValueError(f"cannot parse HLO instruction {name!r}: {rest[:200]!r}")
  close = _balanced(rest, m.end() - 1)
  operand_text = rest[m.end() : close - 1]
  operands = []
  for op in _split_top(re.sub(r"/\*.*?\*/", "", operand_text)):
    tokens = op.split()
    if not tokens:
      continue
    operands.append((tokens[-1].lstrip("%"), tokens[0] if len(tokens) > 1 else None))
  return Instr(name, shape, m.group(1), operands, rest[close:], operand_text)


def parse(hlo_text: str) -> tuple[dict[str, Computation], str]:
  """(computations by name, the entry computation's name) of an HLO module's text."""
  comps: dict[str, Computation] = {}
  entry, comp, lines = None, None, []

  def flush():
    if comp is not None and lines:
      root, name, rest = lines[0]
      instr = _parse_instr(name, " ".join([rest, *lines[1:]]))
      comp.instrs[name] = instr
      if root:
        comp.root = instr
      if instr.opcode == "parameter":
        comp.params[int(instr.operand_text.strip())] = instr
    lines.clear()

  for line in hlo_text.splitlines():
    if comp is None:
      m = _HEADER.match(line)
      if m and not line.startswith("HloModule"):
        comp = Computation(m.group(2), {})
        if m.group(1):
          entry = comp.name
      continue
    if _END.match(line):
      flush()
      comps[comp.name] = comp
      comp = None
      continue
    m = _INSTR.match(line)
    if m and re.match(r"[\w(]", m.group(3)):
      flush()
      lines.append((bool(m.group(1)), m.group(2), m.group(3)))
    elif lines:
      lines.append(line.strip())  # a continuation (multi-line frontend attributes)
  if entry is None:
    raise ValueError("no ENTRY computation in the HLO text (pass compiled.as_text()).")
  return comps, entry


def dims(shape: str) -> list[int]:
  """The dimensions of an array shape ('bf16[8,16]{1,0}' -> [8, 16])."""
  m = _ARRAY.match(shape.strip())
  if not m:
    raise ValueError(f"not an array shape: {shape!r}")
  return [int(d.replace("<=", "")) for d in m.group(1).split(",") if d.strip()]


# ----------------------------------------------------------------------------
# FLOPs of one instruction
# ----------------------------------------------------------------------------
def _operand_shape(comp: Computation, instr: Instr, i: int) -> str:
  name, inline = instr.operands[i]
  if inline is not None:
    return inline
  if name not in comp.instrs:
    raise ValueError(f"{comp.name}/{instr.name}: operand {name!r} is not defined there")
  return comp.instrs[name].shape


def _safe_operand_shape(comp: Computation, instr: Instr, i: int) -> str:
  """An operand's shape, '' for a literal or an undefined name."""
  name, inline = instr.operands[i]
  if inline is not None:
    return inline
  return comp.instrs[name].shape if name in comp.instrs else ""


def dot_flops(comp: Computation, instr: Instr) -> float:
  """2 x prod(output) x prod(lhs contracting dims)."""
  lhs = dims(_operand_shape(comp, instr, 0))
  m = _LHS_CONTRACTING.search(instr.attrs)
  contracting = [int(d) for d in m.group(1).split(",") if d.strip()] if m else []
  return 2.0 * math.prod(dims(instr.shape)) * math.prod(lhs[d] for d in contracting)


def _window(attrs: str, n: int) -> list[dict[str, Any]]:
  """Per spatial dimension: size, stride, pad (low, high), lhs_dilate, rhs_dilate."""
  win = [
    {"size": 1, "stride": 1, "pad": (0, 0), "lhs_dilate": 1, "rhs_dilate": 1} for _ in range(n)
  ]
  m = _WINDOW.search(attrs)
  if not m:
    return win
  for field in m.group(1).split():
    key, _, value = field.partition("=")
    if key not in ("size", "stride", "pad", "lhs_dilate", "rhs_dilate"):
      continue  # rhs_reversal: mirrors the kernel, same taps
    for d, v in enumerate(value.split("x")):
      if key == "pad":
        lo, hi = v.split("_")
        win[d]["pad"] = (int(lo), int(hi))
      else:
        win[d][key] = int(v)
  return win


def _valid_taps(in_size: int, out_size: int, w: dict[str, Any]) -> int:
  """Kernel taps inside the (dilated) input, summed over the output positions."""
  k, s, lo, ld, rd = w["size"], w["stride"], w["pad"][0], w["lhs_dilate"], w["rhs_dilate"]
  extent = (in_size - 1) * ld + 1
  total = 0
  for t in range(k):
    off = t * rd - lo  # input position = o * s + off
    if ld == 1:
      o_min = max(0, math.ceil(-off / s))
      o_max = min(out_size - 1, math.floor((extent - 1 - off) / s))
      total += max(0, o_max - o_min + 1)
    else:
      total += sum(
        1 for o in range(out_size) if 0 <= o * s + off < extent and (o * s + off) % ld == 0
      )
  return total


def conv_flops(comp: Computation, instr: Instr) -> float:
  """As XLA's HloCostAnalysis: 2 x multiply-adds over the taps inside the input."""
  m = _DIM_LABELS.search(instr.attrs)
  if not m:
    raise ValueError(f"{comp.name}/{instr.name}: convolution without dim_labels")
  lhs_l, rhs_l, out_l = m.groups()
  lhs = dims(_operand_shape(comp, instr, 0))
  rhs = dims(_operand_shape(comp, instr, 1))
  out = dims(instr.shape)
  spatial = sorted(c for c in rhs_l if c.isdigit())
  win = _window(instr.attrs, len(spatial))
  taps = math.prod(
    _valid_taps(lhs[lhs_l.index(c)], out[out_l.index(c)], win[int(c)]) for c in spatial
  )
  batch_features = out[out_l.index("b")] * out[out_l.index("f")]
  return 2.0 * batch_features * rhs[rhs_l.index("i")] * taps


# ----------------------------------------------------------------------------
# Trip counts
# ----------------------------------------------------------------------------
def _source(comp: Computation, name: str) -> Instr | None:
  """The instruction `name` is, through copies and bitcasts."""
  instr = comp.instrs.get(name)
  while instr is not None and instr.opcode in _PASS_THROUGH and instr.operands:
    instr = comp.instrs.get(instr.operands[0][0])
  return instr


def _constant(instr: Instr | None) -> int | None:
  if instr is None or instr.opcode != "constant":
    return None
  try:
    return int(float(instr.operand_text.strip()))
  except ValueError:
    return None


def _tuple_index(instr: Instr | None, comp: Computation) -> int | None:
  """k where `instr` is get-tuple-element(comp's parameter 0), index=k."""
  if instr is None or instr.opcode != "get-tuple-element":
    return None
  src = _source(comp, instr.operands[0][0])
  if src is None or src.opcode != "parameter":
    return None
  m = _INDEX.search(instr.attrs)
  return int(m.group(1)) if m else None


def trip_count(comps: dict[str, Computation], caller: Computation, loop: Instr) -> int | None:
  """The trip count of a `while`, or None where it cannot be read."""
  m = _KNOWN_TRIP.search(loop.attrs)
  if m:
    return int(m.group(1))
  cond, body = comps[_COND.search(loop.attrs).group(1)], comps[_BODY.search(loop.attrs).group(1)]
  root = cond.root
  if root is None or root.opcode != "compare" or len(root.operands) != 2:
    return None
  direction = _DIRECTION.search(root.attrs).group(1)
  a, b = (_source(cond, n) for n, _ in root.operands)
  k, limit = _tuple_index(a, cond), _constant(b)
  if k is None:  # constant on the left: flip the comparison
    k, limit = _tuple_index(b, cond), _constant(a)
    direction = {"LT": "GT", "GT": "LT", "LE": "GE", "GE": "LE"}.get(direction, direction)
  if k is None or limit is None:
    return None
  init = _source(caller, loop.operands[0][0])
  if init is None or init.opcode != "tuple" or k >= len(init.operands):
    return None
  start = _constant(_source(caller, init.operands[k][0]))
  if start is None or body.root is None or body.root.opcode != "tuple":
    return None
  update = _source(body, body.root.operands[k][0])
  if update is None or update.opcode not in ("add", "subtract"):
    return None
  x, y = (_source(body, n) for n, _ in update.operands)
  if _tuple_index(x, body) == k and _constant(y) is not None:
    step = _constant(y)
  elif update.opcode == "add" and _tuple_index(y, body) == k and _constant(x) is not None:
    step = _constant(x)
  else:
    return None
  step = -step if update.opcode == "subtract" else step
  if step == 0:
    return None
  if direction in ("LT", "LE") and step > 0:
    return max(0, -(-(limit - start + (direction == "LE")) // step))
  if direction in ("GT", "GE") and step < 0:
    return max(0, -(-(start - limit + (direction == "GE")) // -step))
  if direction == "NE" and (limit - start) % step == 0 and (limit - start) // step >= 0:
    return (limit - start) // step
  return None


# ----------------------------------------------------------------------------
# Attention tags, collectives and host transfers of one instruction
# ----------------------------------------------------------------------------
def op_name(instr: Instr) -> str:
  m = _OP_NAME.search(instr.attrs)
  return m.group(1) if m else ""


def _tag(name: str, tag: str) -> float | None:
  """The value of the innermost `tag` in an op_name (lctx/kernels/flop_tags.py)."""
  found = re.findall(re.escape(tag) + r"([0-9.eE+\-]+)", name)
  return float(found[-1]) if found else None


def kernel_call_flops(instr: Instr) -> float | None:
  """FLOPs a tagged kernel custom call computes (None when untagged)."""
  name = op_name(instr)
  target = _TARGET.search(instr.attrs)
  if target and "backward" in target.group(1).lower():
    bwd = _tag(name, BWD_FLOPS_TAG)
    if bwd is not None:
      return bwd
  return _tag(name, FLOPS_TAG)


_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4}
_BYTES |= {"u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_BYTES |= {"f8e4m3fn": 1, "f8e5m2": 1, "s4": 0.5, "u4": 0.5}
_LEAF = re.compile(r"([a-z]\w*)\[([^\]]*)\](\{[^}]*\})?")
HOST_SPACE = "S(5)"  # the TPU compiler's memory space of pinned host buffers


def array_leaves(shape: str) -> list[tuple[float, bool]]:
  """(bytes, in host memory) of each array in a (tuple) shape."""
  out = []
  for dtype, ds, layout in _LEAF.findall(shape):
    if dtype not in _BYTES:
      continue
    n = math.prod(int(d.replace("<=", "")) for d in ds.split(",") if d.strip())
    out.append((n * _BYTES[dtype], HOST_SPACE in (layout or "")))
  return out


_REPLICA_GROUPS = re.compile(
  r"\breplica_groups=(\{\{[^=]*?\}\}|\{\}|mesh\[[^\]]*\]\s*\{[^}]*\}"
  r"|\[[^\s,]*(?:,\d+)*\]<=\[[\d,]*\](?:T\([\d,]*\))?)"
)
_PAIRS = re.compile(r"\bsource_target_pairs=(\{\{[^=]*?\}\})")
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")


def expand_groups(text: str, num_devices: int) -> list[list[int]]:
  """replica_groups (explicit '{{0,1},{2,3}}', iota '[2,2]<=[4]' or
  '[2,2]<=[2,2]T(1,0)', empty '{}' = every device) or source_target_pairs as
  lists of device (partition) ids."""
  if text in ("", "{}"):
    return [list(range(num_devices))]
  if text.startswith("mesh["):  # mesh['a'=2,'b'=4] {'b'}: groups along the listed axes
    axes = [(a, int(n)) for a, n in re.findall(r"'([^']+)'=(\d+)", text)]
    along = re.findall(r"'([^']+)'", text[text.index("]") :])
    ids = np.arange(math.prod(n for _, n in axes)).reshape([n for _, n in axes] or [1])
    names = [a for a, _ in axes]
    order = [names.index(a) for a in names if a not in along] + [names.index(a) for a in along]
    size = math.prod(n for a, n in axes if a in along)
    return ids.transpose(order).reshape(-1, size).tolist()
  if text.startswith("{"):
    return [
      [int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([\d,\s]*)\}", text)
    ]
  m = re.fullmatch(r"\[([\d,]*)\]<=\[([\d,]*)\](?:T\(([\d,]*)\))?", text)
  shape = [int(x) for x in m.group(1).split(",")]
  dims = [int(x) for x in m.group(2).split(",")]
  ids = np.arange(math.prod(dims)).reshape(dims)
  if m.group(3):
    ids = ids.transpose([int(x) for x in m.group(3).split(",")])
  return ids.reshape(shape).tolist()


def collective(comp: Computation, instr: Instr) -> tuple[str, str, float] | None:
  """(kind, its replica groups or pairs as written, bytes one device sends) of a
  collective, None for other ops. Bytes as the ring algorithms move them, with n
  the group size and X the operand bytes: all-gather (n-1) X, reduce-scatter and
  all-to-all (n-1)/n X, all-reduce 2 (n-1)/n X, collective-permute X."""
  op = instr.opcode.removesuffix("-start")
  if op not in COLLECTIVES or instr.opcode.endswith("-done"):
    return None
  x = sum(
    b
    for i in range(len(instr.operands))
    for b, _ in array_leaves(_safe_operand_shape(comp, instr, i))
  )
  if op == "collective-permute":
    m = _PAIRS.search(instr.attrs)
    return op, m.group(1) if m else "", float(x)
  if op == "all-reduce" and _into_zeros(comp, instr):
    op = "all-gather"  # written as an all-reduce of one slice placed into zeros
  m = _REPLICA_GROUPS.search(instr.attrs)
  groups = m.group(1) if m else "{}"
  n = len(expand_groups(groups, 1 << 20)[0]) if groups != "{}" else 0
  if n == 0:  # every device: the caller knows how many
    n_frac = 1.0
  else:
    n_frac = (n - 1) / n
  gathered = x / n if instr.opcode.startswith("all-reduce") and n else x
  moved = {
    "all-gather": gathered * (n - 1) if n else x,
    "reduce-scatter": x * n_frac,
    "all-to-all": x * n_frac,
    "all-reduce": 2 * x * n_frac,
  }[op]
  return op, groups, float(moved)


def _into_zeros(comp: Computation, instr: Instr) -> bool:
  """Whether an all-reduce's operand is a dynamic-update-slice (possibly fused):
  the TPU compiler's all-gather written as an all-reduce of one device's slice
  in a zero buffer."""
  src = comp.instrs.get(instr.operands[0][0]) if instr.operands else None
  return src is not None and (
    src.opcode == "dynamic-update-slice" or "dynamic-update-slice" in src.name
  )


def _source_op_name(comp: Computation, instr: Instr, steps: int = 8) -> str:
  """The op_name of the value a collective moves, for a collective that has none
  of its own. The TPU compiler writes a large all-gather as an all-reduce of a
  zero buffer holding the device's slice and drops the metadata (the full-size
  hybrid compiles: every linear layer's summary gather); the slice's producer,
  a few copies upstream, keeps it. Follows operand 0 (a dynamic-update-slice's
  update, operand 1) through ops without one; "" when none is found."""
  cur = instr
  for _ in range(steps):
    if not cur.operands:
      return ""
    i = 1 if cur.opcode == "dynamic-update-slice" and len(cur.operands) > 1 else 0
    cur = comp.instrs.get(cur.operands[i][0])
    if cur is None:
      return ""
    name = op_name(cur)
    if name:
      return name
  return ""


def host_transfer(comp: Computation, instr: Instr) -> tuple[str, float] | None:
  """('to_host' | 'to_device', bytes) of an op that moves data between HBM and
  pinned host memory (HOST_SPACE), None otherwise: the device-side bytes."""
  if instr.opcode in (
    "parameter",
    "constant",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "copy-done",
  ):
    return None
  shapes = [_safe_operand_shape(comp, instr, i) for i in range(len(instr.operands))]
  if HOST_SPACE not in instr.shape and not any(HOST_SPACE in x for x in shapes):
    return None
  out = array_leaves(instr.shape)
  if instr.opcode == "copy-start" and out:
    out = out[:1]  # (destination, source, context)
  ins = [leaf for x in shapes for leaf in array_leaves(x)]
  out_host = [b for b, h in out if h]
  if out_host and any(b > 8 for b, h in ins if not h):
    return "to_host", float(sum(b for b, h in ins if not h and b > 8))
  if out and not out_host and any(h for _, h in ins):
    return "to_device", float(sum(b for b, h in out))
  return None


# ----------------------------------------------------------------------------
# The whole module
# ----------------------------------------------------------------------------
def _kernel_name(instr: Instr) -> str:
  return re.sub(r"(\.\d+)+$", "", instr.name)


@dataclasses.dataclass
class _Tally:
  """What one run of a computation does (dicts: by key, with multiplicity)."""

  hi: float = 0.0  # dot + convolution FLOPs, conditionals at their costliest branch
  lo: float = 0.0  # ... at their cheapest
  attention_dots: float = 0.0  # the part of hi inside attention calls
  linear_dots: float = 0.0  # the part of hi inside linear-attention sequence work
  linear_collectives: dict = dataclasses.field(default_factory=dict)  # kind -> bytes
  kernel_flops: float = 0.0  # tagged kernel custom calls
  kernel_calls: float = 0.0  # ... how many
  untagged: dict = dataclasses.field(default_factory=dict)  # kernel calls by name
  collectives: dict = dataclasses.field(default_factory=dict)  # (kind, groups) -> bytes
  host: dict = dataclasses.field(default_factory=dict)  # direction -> bytes

  def add(self, other: _Tally, times: float = 1.0) -> None:
    self.hi += times * other.hi
    self.lo += times * other.lo
    self.attention_dots += times * other.attention_dots
    self.linear_dots += times * other.linear_dots
    self.kernel_flops += times * other.kernel_flops
    self.kernel_calls += times * other.kernel_calls
    for mine, theirs in (
      (self.untagged, other.untagged),
      (self.collectives, other.collectives),
      (self.host, other.host),
      (self.linear_collectives, other.linear_collectives),
    ):
      for k, v in theirs.items():
        mine[k] = mine.get(k, 0) + v * times


def matmul_flops(hlo_text: str) -> dict[str, Any]:
  """Matmul FLOPs (and attention, collectives, host transfers) one device
  executes in an optimised HLO module (`compiled.as_text()`).

  Returns `dot_flops` (conditionals at their most expensive branch: an upper
  bound), `dot_flops_min` (at their cheapest), `attention_dot_flops` (the part
  of dot_flops inside attention calls: the pure-JAX kernels),
  `attention_kernel_flops` (tagged kernel custom calls: splash, cuDNN, the CPU
  kernel), `attention_flops` (their sum), `dense_flops` (dot_flops less the
  attention dots), `linear_dot_flops` (the part of dense_flops inside
  linear-attention sequence work: LINEAR_SCOPE), `linear_collective_bytes` (the
  collectives inside it, by kind: the state exchange and conv halos),
  `custom_calls` (untagged Mosaic/Pallas/Triton kernel
  launches, with multiplicity, whose FLOPs are not counted),
  `custom_calls_by_kernel`, `kernel_calls_counted`, `collectives` (rows of kind,
  groups, bytes per step), `host_transfer_bytes` ({'to_host', 'to_device'}),
  `unknown_trip_count_loops` (while loops counted once as their trip count was
  not readable), `estimated_trip_count_loops` (run-time bounded loops at the
  mean trip count their kernel tagged), `loops` (each while: its trip count,
  None when unknown) and `conditionals`.
  """
  comps, entry = parse(hlo_text)
  memo: dict[tuple[str, bool, bool], _Tally] = {}
  loops: dict[str, float | None] = {}
  tagged_loops = [0]
  conditionals = [0]

  def cost(
    name: str, stack: tuple[str, ...] = (), in_attention: bool = False, in_linear: bool = False
  ) -> _Tally:
    # in_attention / in_linear: the caller's op is an attention (linear-attention)
    # op (ops that XLA made, such as the dots of a fusion, may carry no op_name of
    # their own).
    if (name, in_attention, in_linear) in memo:
      return memo[name, in_attention, in_linear]
    if name in stack:
      raise ValueError(f"recursive HLO call graph at {name!r}")
    comp = comps[name]
    t = _Tally()
    for instr in comp.instrs.values():
      op, attrs = instr.opcode, instr.attrs
      here = op_name(instr)
      attn = ATTENTION_SCOPE in here if here else in_attention
      lin = LINEAR_SCOPE in here if here else in_linear
      sub = (*stack, name), attn, lin
      if op in ("dot", "convolution"):
        f = dot_flops(comp, instr) if op == "dot" else conv_flops(comp, instr)
        t.hi, t.lo = t.hi + f, t.lo + f
        if attn:
          t.attention_dots += f
        elif lin:
          t.linear_dots += f
      elif op == "custom-call":
        f = kernel_call_flops(instr)
        target = _TARGET.search(attrs)
        if f is not None:
          t.kernel_flops += f
          t.kernel_calls += 1
        elif target and target.group(1) in KERNEL_TARGETS:
          t.untagged[_kernel_name(instr)] = t.untagged.get(_kernel_name(instr), 0) + 1
      found = collective(comp, instr)
      if found:
        key = found[:2]
        t.collectives[key] = t.collectives.get(key, 0.0) + found[2]
        source = here or _source_op_name(comp, instr)
        c_attn = ATTENTION_SCOPE in source if source else in_attention
        c_lin = LINEAR_SCOPE in source if source else in_linear
        if c_lin and not c_attn:
          t.linear_collectives[found[0]] = t.linear_collectives.get(found[0], 0.0) + found[2]
      moved = host_transfer(comp, instr)
      if moved:
        t.host[moved[0]] = t.host.get(moved[0], 0.0) + moved[1]
      if op == "while":
        n = trip_count(comps, comp, instr)
        if n is None:
          n = _tag(op_name(instr), TRIPS_TAG)
          tagged_loops[0] += n is not None
        loops[f"{name}/{instr.name}"] = n
        t.add(cost(_BODY.search(attrs).group(1), *sub), 1 if n is None else n)
        t.add(cost(_COND.search(attrs).group(1), *sub), (1 if n is None else n) + 1)
      elif op == "conditional":
        conditionals[0] += 1
        m = _BRANCHES.search(attrs)
        if m:
          branches = [b.strip().lstrip("%") for b in m.group(1).split(",") if b.strip()]
        else:
          branches = [_TRUE.search(attrs).group(1), _FALSE.search(attrs).group(1)]
        costs = [cost(b, *sub) for b in branches]
        most = max(costs, key=lambda c: (c.hi + c.kernel_flops, sum(c.untagged.values())))
        lo = min(c.lo for c in costs)
        t.add(most)
        t.lo += lo - most.lo
      elif op not in ("async-done", "async-update"):
        callees = []
        m = _CALLS.search(attrs) or (_TO_APPLY.search(attrs) if op == "call" else None)
        if m:
          callees.append(m.group(1))
        m = _CALLED.search(attrs)
        if m:
          callees += [c.strip().lstrip("%") for c in m.group(1).split(",") if c.strip()]
        for callee in dict.fromkeys(callees):
          t.add(cost(callee, *sub))
    memo[name, in_attention] = t
    return t

  t = cost(entry)
  attention = t.attention_dots + t.kernel_flops
  return {
    "dot_flops": t.hi,
    "dot_flops_min": t.lo,
    "dense_flops": t.hi - t.attention_dots,
    "attention_dot_flops": t.attention_dots,
    "attention_kernel_flops": t.kernel_flops,
    "attention_flops": attention,
    "linear_dot_flops": t.linear_dots,
    "linear_collective_bytes": {k: t.linear_collectives.get(k, 0.0) for k in COLLECTIVES},
    "kernel_calls_counted": round(t.kernel_calls),
    "custom_calls": round(sum(t.untagged.values())),
    "custom_calls_by_kernel": {k: round(v) for k, v in sorted(t.untagged.items())},
    "collectives": [
      {"kind": kind, "groups": groups, "bytes": b}
      for (kind, groups), b in sorted(t.collectives.items())
    ],
    "host_transfer_bytes": {k: t.host.get(k, 0.0) for k in ("to_host", "to_device")},
    "unknown_trip_count_loops": sum(n is None for n in loops.values()),
    "estimated_trip_count_loops": tagged_loops[0],
    "loops": loops,
    "conditionals": conditionals[0],
  }


def _main(argv: list[str]) -> None:
  """python -m lctx.sizing.hlo_flops MODULE.txt: the counts of a dumped HLO module."""
  with open(argv[1]) as f:
    print(json.dumps(matmul_flops(f.read()), indent=2))


if __name__ == "__main__":
  import sys  # pylint: disable=g-import-not-at-top

  _main(sys.argv)

"""One GPU session's measurements: matmul baseline, attention kernels, Gated DeltaNet, a train step.

    python scripts/bench_gpu.py --out=/tmp/bench_gpu.json            # one GPU, about 5-6 min
    python scripts/bench_gpu.py --quick --out=/tmp/bench_gpu_quick.json   # tiny shapes on CPU

Four sections, each in its own try/except (an error is recorded as a string in
its place); the JSON (--out) is rewritten after every row, so a run cut short
keeps what it measured. Every row runs only if its cost, extrapolated from the
same backend's previous (shorter) row, fits before the section's deadline
(--budget-s split over the sections; time a section leaves goes to the next);
a skipped row says why.

1. matmul: bf16 8192^3 on device 0, best of 5 after a warm-up: the same-run
   yardstick every rate below is divided by (`*_vs_matmul`).
2. attention, bf16, Llama-3.1-8B heads (32 q, 8 kv, head dim 128), batch 1,
   masks `causal` and `packed` (8 equal documents, causal inside each, by
   segment ids); backends: lctx `flash_attention` with backend 'cudnn' and
   'blockwise', and jax.nn.dot_product_attention 'cudnn' (causal: the very
   call lctx_cudnn makes, so timed at --check-t only; packed: a dense boolean
   mask, T <= --dense-mask-max-t) and 'xla' (dense logits, T <= --xla-max-t). Seconds are the median of --repeats calls after a compile
   and warm-up call. FLOP convention: visible (unmasked) query-key pairs P only,
   forward 4*P*N*D (two matmuls; N q heads, D head dim), forward+backward
   3.5x that (flash-style backward with recompute: 7 matmuls) for every
   backend alike, so fwd+bwd TFLOP/s compare work done per second, not what
   each backend executes. fwd+bwd = grad of sum(out) w.r.t. q, k, v.
   Correctness at --check-t: output and gradients against lctx's dense
   reference (reference.py) computed in float32 from the same bf16 inputs;
   error = max |got - want| / max |want|, tolerance --tol.
3. Gated DeltaNet: lctx.kernels.delta_rule (chunked, chunk 64), Qwen3.5 heads
   (16 q/k heads of 128, 32 value heads of 128), q/k L2-normalised bf16 (q
   scaled by 128^-1/2), v bf16, g and beta float32 (as the model passes
   them); fwd and fwd+bwd (grad of sum(out) w.r.t. q, k, v, g, beta) seconds
   beside the same length's causal attention row; correctness at
   --gdn-check-t against delta_rule_reference (token by token, float32).
4. One training step (forward, backward, AdamW) of a small model built without
   gin (ModelConfig + Transformer + optax): full attention vs the 3:1 Gated
   DeltaNet hybrid of the same width, bf16 compute, float32 params, remat
   'full', chunked cross-entropy; batch 1, one document (the attention layers
   get no segment ids so 'auto' may pick cuDNN). Step seconds (median), tokens/s
   and model TFLOP/s (ModelConfig.flops_per_token).

--quick: tiny shapes on the default backend (CPU here); cuDNN rows are skipped
with a note where the platform is not 'gpu'.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from lctx.kernels import flash_attention, reference_attention  # noqa: E402
from lctx.kernels.chunked import chunked_cross_entropy  # noqa: E402
from lctx.kernels.delta_rule import delta_rule, delta_rule_reference  # noqa: E402
from lctx.kernels.flash import choose_backend  # noqa: E402

FWD_BWD_FACTOR = 3.5  # flash-style: forward 2 matmuls, backward 5 (recompute)


# bench_attention.py's mask helpers, not imported: that script imports
# lctx.metrics, which needs tensorboardX (not on every GPU image).
def _segments(t, mode):
  """None (causal) or 8 equal documents `[1, T]` (packed)."""
  if mode == "causal":
    return None
  return np.repeat(np.arange(1, 9, dtype=np.int32), t // 8)[None, :]


def _visible_pairs(t, mode):
  if mode == "causal":
    return t * (t + 1) // 2
  d = t // 8
  return 8 * d * (d + 1) // 2


# ---------------------------------------------------------------- bookkeeping


class Run:
  """The results, the deadlines and the JSON file."""

  def __init__(self, args):
    self.args, self.t0 = args, time.perf_counter()
    self.result = dict(
      argv=sys.argv,
      jax_version=jax.__version__,
      backend=jax.default_backend(),
      device_kind=jax.devices()[0].device_kind,
      device_count=jax.device_count(),
      machine=f"{platform.node()} {platform.machine()}, {os.cpu_count()} cpus",
      date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
      quick=args.quick,
      budget_s=args.budget_s,
      section_deadlines_s={k: v * args.budget_s for k, v in DEADLINES.items()},
      sections={},
    )
    self.matmul_flops = None

  def elapsed(self) -> float:
    return time.perf_counter() - self.t0

  def left(self, deadline: float) -> float:
    return deadline - self.elapsed()

  def save(self) -> None:
    self.result["elapsed_s"] = round(self.elapsed(), 1)
    os.makedirs(os.path.dirname(self.args.out) or ".", exist_ok=True)
    tmp = self.args.out + ".tmp"
    with open(tmp, "w") as f:
      json.dump(self.result, f, indent=1, default=str)
    os.replace(tmp, self.args.out)


def _err(e: BaseException) -> str:
  return f"{type(e).__name__}: {str(e)[:2000]}"


def _timed_calls(fn, args, repeats: int, deadline_left) -> dict:
  """First call (compile + warm-up), then up to `repeats` timed calls (fewer if
  the next would pass the deadline). Returns first_s, times, median_s."""
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  first = time.perf_counter() - t0
  times = []
  for _ in range(repeats):
    if times and deadline_left() < times[-1]:
      break
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return dict(
    first_s=round(first, 3), times=[round(t, 5) for t in times], median_s=float(np.median(times))
  )


# A row with nothing to extrapolate from (the first of its kind) still needs
# this much time left to start: its compile alone takes seconds on a GPU.
FIRST_ROW_MIN_S = 10.0


def _estimate(prev: dict | None, t: int, repeats: int, power: float) -> float:
  """Seconds a row at length t should take, from a row at a shorter length
  (its first call, which holds the compile, plus its median scaled by
  (t / t_prev) ** power per call); FIRST_ROW_MIN_S without one."""
  if not prev:
    return FIRST_ROW_MIN_S
  grow = (t / prev["T"]) ** power
  return prev["first_s"] + prev["median_s"] * grow * (1 + repeats)


def _rel_err(got, want) -> float:
  got, want = jnp.asarray(got, jnp.float32), jnp.asarray(want, jnp.float32)
  return float(jnp.max(jnp.abs(got - want)) / jnp.maximum(jnp.max(jnp.abs(want)), 1e-30))


# ---------------------------------------------------------------- 1. matmul


def section_matmul(run: Run, deadline: float) -> dict:
  del deadline
  n = run.args.matmul_n
  a = jnp.ones((n, n), jnp.bfloat16) * jnp.bfloat16(0.01)
  f = jax.jit(lambda x, y: x @ y)
  timing = _timed_calls(f, (a, a), 5, lambda: 1e9)
  best = min(timing["times"])
  run.matmul_flops = 2 * n**3 / best
  return dict(
    n=n,
    dtype="bfloat16",
    best_s=best,
    tflops=run.matmul_flops / 1e12,
    **timing,
    how="jit(x @ y), block_until_ready, best of 5 after a warm-up call",
  )


# ---------------------------------------------------------------- 2. attention


def _attention_backends(seg, t, args, on_gpu: bool) -> dict:
  """name -> fn(q, k, v) -> out, or a string: why the backend has no row here."""
  packed = seg is not None
  out = {}
  if on_gpu:
    out["lctx_cudnn"] = functools.partial(flash_attention, segment_ids=seg, backend="cudnn")
  else:
    out["lctx_cudnn"] = f"skipped: platform {jax.default_backend()!r} (cuDNN needs 'gpu')"
  out["lctx_blockwise"] = functools.partial(
    flash_attention,
    segment_ids=seg,
    backend="blockwise",
    block_q=args.block_q,
    block_kv=args.block_kv,
  )
  mask = None
  if packed:
    s = jnp.asarray(seg)
    mask = (s[:, None, :, None] == s[:, None, None, :]) if t <= args.dense_mask_max_t else None
  for impl in ("cudnn", "xla"):
    name = f"jax_nn_{impl}"
    if impl == "cudnn" and not on_gpu:
      out[name] = f"skipped: platform {jax.default_backend()!r} (cuDNN needs 'gpu')"
    elif impl == "cudnn" and not packed and t != args.check_t:
      out[name] = (
        "skipped: the same jax.nn call as lctx_cudnn (lctx/kernels/jax_nn.py); "
        f"timed beside it at T={args.check_t} only"
      )
    elif impl == "xla" and t > args.xla_max_t:
      out[name] = f"skipped: dense logits at T={t} > --xla-max-t {args.xla_max_t}"
    elif packed and mask is None:
      out[name] = f"skipped: dense [T, T] mask at T={t} > --dense-mask-max-t"
    else:
      out[name] = functools.partial(
        jax.nn.dot_product_attention, mask=mask, is_causal=True, implementation=impl
      )
  return out


def _sum_grad(fn, argnums):
  def loss(*xs):
    return jnp.sum(fn(*xs).astype(jnp.float32))

  return jax.jit(jax.grad(loss, argnums=argnums))


def _reference_attention(q, k, v, seg):
  """Out and grads of the dense reference in float32 from the same inputs."""
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]

  def fn(q, k, v):
    return reference_attention(q, k, v, segment_ids=seg)

  out = jax.jit(fn)(*f32)
  grads = _sum_grad(fn, (0, 1, 2))(*f32)
  return out, grads


def section_attention(run: Run, deadline: float) -> dict:
  args = run.args
  on_gpu = jax.default_backend() == "gpu"
  b, n, kh, d = 1, args.q_heads, args.kv_heads, args.head_dim
  sec = dict(
    shape=dict(batch=b, q_heads=n, kv_heads=kh, head_dim=d, dtype="bfloat16"),
    flops=(
      "visible query-key pairs P only: fwd 4*P*q_heads*head_dim; fwd+bwd "
      f"{FWD_BWD_FACTOR}x fwd for every backend (flash-style with recompute)"
    ),
    correctness=(
      f"at T={args.check_t}: max|got-want|/max|want| of out and of d(sum out)/d(q,k,v) "
      f"against reference_attention in float32 from the same bf16 inputs; tol {args.tol}"
    ),
    rows=[],
  )
  run.result["sections"]["attention"] = sec
  last = {}  # (backend, kind) -> the previous row's timing, for the estimate
  for t in args.lengths:
    ks = jax.random.split(jax.random.PRNGKey(t), 3)
    q = jax.random.normal(ks[0], (b, t, n, d), jnp.bfloat16)
    k = jax.random.normal(ks[1], (b, t, kh, d), jnp.bfloat16)
    v = jax.random.normal(ks[2], (b, t, kh, d), jnp.bfloat16)
    for mode in args.modes:
      seg = _segments(t, mode)
      seg = None if seg is None else jnp.asarray(seg)
      pairs = _visible_pairs(t, mode)
      fwd_flops = 4 * pairs * n * d
      ref = None
      if t == args.check_t:
        try:
          ref = _reference_attention(q, k, v, seg)
        except Exception as e:  # noqa: BLE001
          sec.setdefault("reference_errors", {})[f"{t}/{mode}"] = _err(e)
      for name, fn in _attention_backends(seg, t, args, on_gpu).items():
        row = dict(T=t, mode=mode, backend=name, visible_pairs=pairs, fwd_gflop=fwd_flops / 1e9)
        sec["rows"].append(row)
        if isinstance(fn, str):
          row["note"] = fn
          continue
        for kind, f in (("fwd", jax.jit(fn)), ("fwdbwd", _sum_grad(fn, (0, 1, 2)))):
          est = _estimate(last.get((name, kind)), t, args.repeats, 2.0)
          if est > run.left(deadline):
            row[f"{kind}_note"] = (
              f"skipped: estimated {est:.0f} s > {run.left(deadline):.0f} s left"
            )
            continue
          try:
            timing = _timed_calls(f, (q, k, v), args.repeats, lambda: run.left(deadline))
          except Exception as e:  # noqa: BLE001  (an unsupported call is a row, not a crash)
            row[f"{kind}_error"] = _err(e)
            continue
          last[(name, kind)] = dict(T=t, **timing)
          flops = fwd_flops * (1 if kind == "fwd" else FWD_BWD_FACTOR)
          row[f"{kind}_s"] = timing["median_s"]
          row[f"{kind}_times"] = timing["times"]
          row[f"{kind}_first_s"] = timing["first_s"]
          row[f"{kind}_tflops"] = flops / timing["median_s"] / 1e12
          if run.matmul_flops:
            row[f"{kind}_vs_matmul"] = flops / timing["median_s"] / run.matmul_flops
          if ref is not None:
            try:
              got = f(q, k, v)
              if kind == "fwd":
                row["out_err"] = _rel_err(got, ref[0])
              else:
                row["grad_err"] = {x: _rel_err(g, r) for x, g, r in zip("qkv", got, ref[1])}
            except Exception as e:  # noqa: BLE001
              row[f"{kind}_check_error"] = _err(e)
        errs = [row.get("out_err")] + list(row.get("grad_err", {}).values())
        if any(e is not None for e in errs):
          row["check_pass"] = all(e is not None and e <= args.tol for e in errs)
        print(_attention_line(row), flush=True)
        run.save()
      del ref
  return sec


def _fmt(x, spec="8.4f"):
  return "-" if x is None else format(x, spec)


def _attention_line(r) -> str:
  err = r.get("grad_err", {})
  return (
    f"  T={r['T']:>7} {r['mode']:>6} {r['backend']:>15}: fwd {_fmt(r.get('fwd_s'))} s "
    f"({_fmt(r.get('fwd_tflops'), '6.1f')} TF/s) fwd+bwd {_fmt(r.get('fwdbwd_s'))} s "
    f"({_fmt(r.get('fwdbwd_tflops'), '6.1f')} TF/s, {_fmt(r.get('fwdbwd_vs_matmul'), '.2f')} of mm)"
    f" err out {_fmt(r.get('out_err'), '.1e')} grad {_fmt(max(err.values()) if err else None, '.1e')}"
    + "".join(f" [{k}: {str(v)[:120]}]" for k, v in r.items() if k.endswith(("note", "error")))
  )


# ---------------------------------------------------------------- 3. Gated DeltaNet


def _gdn_inputs(t, args, key):
  b, nq, nv, h = 1, args.gdn_qk_heads, args.gdn_v_heads, args.gdn_head_dim
  ks = jax.random.split(key, 5)

  def l2(x, scale=1.0):
    return (x * scale * jax.lax.rsqrt(jnp.sum(x * x, -1, keepdims=True) + 1e-6)).astype(
      jnp.bfloat16
    )

  q = l2(jax.random.normal(ks[0], (b, t, nq, h)), h**-0.5)
  k = l2(jax.random.normal(ks[1], (b, t, nq, h)))
  v = jax.random.normal(ks[2], (b, t, nv, h), jnp.bfloat16)
  g = jax.nn.log_sigmoid(jax.random.normal(ks[3], (b, t, nv)) + 4.0)  # decays near 1
  beta = jax.nn.sigmoid(jax.random.normal(ks[4], (b, t, nv)))
  return q, k, v, g, beta


def _gdn_fn(q, k, v, g, beta):
  return delta_rule(q, k, v, g, beta, chunk_size=64)[0]


def _gdn_ref_fn(q, k, v, g, beta):
  return delta_rule_reference(q, k, v, g, beta)[0]


def section_gdn(run: Run, deadline: float) -> dict:
  args = run.args
  sec = dict(
    shape=dict(
      batch=1,
      qk_heads=args.gdn_qk_heads,
      v_heads=args.gdn_v_heads,
      head_dim=args.gdn_head_dim,
      chunk=64,
      dtypes="q, k, v bfloat16; g, beta float32",
    ),
    fwdbwd="grad of sum(out) w.r.t. q, k, v, g, beta",
    rows=[],
  )
  run.result["sections"]["gdn"] = sec
  t = args.gdn_check_t
  try:
    if run.left(deadline) < FIRST_ROW_MIN_S:
      raise TimeoutError(f"skipped: {run.left(deadline):.0f} s left < {FIRST_ROW_MIN_S} s")
    xs = _gdn_inputs(t, args, jax.random.PRNGKey(7))
    f32 = [x.astype(jnp.float32) for x in xs]
    got = jax.jit(_gdn_fn)(*xs)
    want = jax.jit(_gdn_ref_fn)(*f32)
    gg = _sum_grad(_gdn_fn, (0, 1, 2, 3, 4))(*xs)
    gw = _sum_grad(_gdn_ref_fn, (0, 1, 2, 3, 4))(*f32)
    sec["check"] = dict(
      T=t,
      how="max|got-want|/max|want|; want: delta_rule_reference on float32 casts of the inputs",
      out_err=_rel_err(got, want),
      grad_err={n: _rel_err(a, r) for n, a, r in zip(("q", "k", "v", "g", "beta"), gg, gw)},
      tol=args.tol,
    )
    errs = [sec["check"]["out_err"], *sec["check"]["grad_err"].values()]
    sec["check"]["pass"] = all(e <= args.tol for e in errs)
    print(f"  GDN check T={t}: {sec['check']}", flush=True)
  except Exception as e:  # noqa: BLE001
    sec["check_error"] = _err(e)
    print(f"  GDN check failed: {_err(e)}", flush=True)
  run.save()
  attn = {
    (r["T"], r["backend"]): r
    for r in run.result["sections"].get("attention", {}).get("rows", [])
    if r.get("mode") == "causal"
  }
  last = {}
  for t in args.lengths:
    row = dict(T=t)
    sec["rows"].append(row)
    xs = _gdn_inputs(t, args, jax.random.PRNGKey(t))
    for kind, f in (("fwd", jax.jit(_gdn_fn)), ("fwdbwd", _sum_grad(_gdn_fn, (0, 1, 2, 3, 4)))):
      est = _estimate(last.get(kind), t, args.repeats, 1.0)
      if est > run.left(deadline):
        row[f"{kind}_note"] = f"skipped: estimated {est:.0f} s > {run.left(deadline):.0f} s left"
        continue
      try:
        timing = _timed_calls(f, xs, args.repeats, lambda: run.left(deadline))
      except Exception as e:  # noqa: BLE001
        row[f"{kind}_error"] = _err(e)
        continue
      last[kind] = dict(T=t, **timing)
      row[f"{kind}_s"] = timing["median_s"]
      row[f"{kind}_times"] = timing["times"]
      row[f"{kind}_first_s"] = timing["first_s"]
      row[f"{kind}_tokens_per_s"] = t / timing["median_s"]
      for backend in ("lctx_cudnn", "lctx_blockwise"):
        a = attn.get((t, backend), {}).get(f"{kind}_s")
        if a is not None:
          row[f"attention_{backend}_{kind}_s"] = a
    print(
      f"  GDN T={t:>7}: fwd {_fmt(row.get('fwd_s'))} s fwd+bwd {_fmt(row.get('fwdbwd_s'))} s; "
      f"attention (lctx cudnn / blockwise, causal) fwd+bwd "
      f"{_fmt(row.get('attention_lctx_cudnn_fwdbwd_s'))} / "
      f"{_fmt(row.get('attention_lctx_blockwise_fwdbwd_s'))} s"
      + "".join(f" [{k}: {str(v)[:120]}]" for k, v in row.items() if k.endswith(("note", "error"))),
      flush=True,
    )
    run.save()
  return sec


# ---------------------------------------------------------------- 4. train step


def _model_configs(args):
  from lctx.models import ModelConfig  # pylint: disable=g-import-not-at-top

  layers = args.train_layers
  hybrid = tuple("full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers))
  common = dict(
    vocab_size=args.train_vocab,
    d_model=args.train_d_model,
    num_layers=layers,
    num_heads=args.train_heads,
    num_kv_heads=args.train_kv_heads,
    head_dim=args.train_d_model // args.train_heads,
    mlp_dim=4 * args.train_d_model,
    linear_attention="gated_deltanet",
    linear_num_key_heads=args.train_heads // 2,
    linear_num_value_heads=args.train_heads,
    linear_key_head_dim=args.train_d_model // args.train_heads,
    linear_value_head_dim=args.train_d_model // args.train_heads,
    linear_conv_kernel_dim=4,
    dtype="bfloat16",
    param_dtype="float32",
    remat_policy="full",
    rope_theta=500000.0,
  )
  return {
    "full": ModelConfig(layer_types=("full_attention",) * layers, **common),
    "hybrid": ModelConfig(layer_types=hybrid, **common),
  }


def _attention_plugin(
  q, k, v, *, segment_ids, positions, causal=True, window_size=None, softmax_scale=None
):
  """The model's attention call: one document per row, so no segment ids (cuDNN
  may take the call on GPU); positions count up from 0 (in order)."""
  del segment_ids
  return flash_attention(
    q,
    k,
    v,
    q_positions=positions,
    kv_positions=positions,
    positions_in_order=True,
    causal=causal,
    window_size=window_size,
    softmax_scale=softmax_scale,
  )


def _train_step_fn(cfg, args):
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top

  from lctx.models import Transformer, unembed_matrix  # pylint: disable=g-import-not-at-top

  model = Transformer(cfg, _attention_plugin)
  tx = optax.adamw(1e-4, weight_decay=0.1)

  def init(key):
    ids = jnp.zeros((1, 128), jnp.int32)
    params = nn.unbox(model.init(key, ids, ids, ids + 1)["params"])
    return params, tx.init(params)

  def loss_fn(params, tokens):
    t = tokens.shape[1]
    positions = jnp.arange(t, dtype=jnp.int32)[None]
    seg = jnp.ones_like(tokens)
    hidden, norm = model.apply({"params": params}, tokens, positions, seg, return_hidden="pre_norm")
    targets = jnp.roll(tokens, -1, axis=1)
    s_loss, _, s_w = chunked_cross_entropy(
      hidden,
      unembed_matrix(params, cfg),
      targets,
      jnp.ones(tokens.shape, jnp.float32),
      chunk_size=args.train_loss_chunk,
      prologue=norm,
    )
    return s_loss / s_w

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, opt_state, tokens):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return init, step


def section_train(run: Run, deadline: float) -> dict:
  args = run.args
  cfgs = _model_configs(args)
  sec = dict(
    models={
      name: dict(
        layer_types=list(c.layer_types),
        params=c.num_params(),
        d_model=c.d_model,
        num_heads=c.num_heads,
        num_kv_heads=c.num_kv_heads,
        vocab=c.vocab_size,
      )
      for name, c in cfgs.items()
    },
    how=(
      "jit(value_and_grad + optax.adamw update), donated state; batch 1, one document; "
      "bf16 compute, f32 params, remat 'full', chunked cross-entropy; median of timed steps "
      "after a compile + warm-up step; model TFLOP/s from ModelConfig.flops_per_token"
    ),
    rows=[],
  )
  run.result["sections"]["train"] = sec
  last = {}
  for t in args.train_lengths:
    for name, cfg in cfgs.items():
      row = dict(T=t, model=name)
      sec["rows"].append(row)
      probe = jnp.zeros((1, t, cfg.num_heads, cfg.head_dim), jnp.bfloat16)
      kv = jnp.zeros((1, t, cfg.num_kv_heads, cfg.head_dim), jnp.bfloat16)
      row["attention_backend"] = choose_backend(probe, kv, kv, positions_given=False)
      est = _estimate(last.get(name), t, args.train_repeats, 1.6)
      if est > run.left(deadline):
        row["note"] = f"skipped: estimated {est:.0f} s > {run.left(deadline):.0f} s left"
        print(f"  train {name} T={t}: {row['note']}", flush=True)
        run.save()
        continue
      try:
        init, step = _train_step_fn(cfg, args)
        params, opt_state = jax.jit(init)(jax.random.PRNGKey(0))
        tokens = jax.random.randint(jax.random.PRNGKey(1), (1, t), 0, cfg.vocab_size, jnp.int32)
        t0 = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, tokens)
        jax.block_until_ready(loss)
        first = time.perf_counter() - t0
        times, losses = [], [float(loss)]
        for _ in range(args.train_repeats):
          if times and run.left(deadline) < times[-1]:
            break
          t0 = time.perf_counter()
          params, opt_state, loss = step(params, opt_state, tokens)
          jax.block_until_ready(loss)
          times.append(time.perf_counter() - t0)
          losses.append(float(loss))
        med = float(np.median(times))
        last[name] = dict(T=t, first_s=first, median_s=med)
        flops = cfg.flops_per_token(t) * t
        row.update(
          first_step_s=round(first, 3),
          step_times=[round(x, 4) for x in times],
          step_s=med,
          tokens_per_s=t / med,
          model_tflops=flops / med / 1e12,
          losses=losses,
        )
        if run.matmul_flops:
          row["model_flops_vs_matmul"] = flops / med / run.matmul_flops
        del params, opt_state
      except Exception as e:  # noqa: BLE001
        row["error"] = _err(e)
      print(
        f"  train {name:>6} T={t:>7}: step {_fmt(row.get('step_s'))} s, "
        f"{_fmt(row.get('tokens_per_s'), '.0f')} tok/s, {_fmt(row.get('model_tflops'), '.1f')} "
        f"TF/s (attention: {row['attention_backend']})"
        + (f" [error: {row['error'][:300]}]" if "error" in row else ""),
        flush=True,
      )
      run.save()
  return sec


# ---------------------------------------------------------------- main


def _print_summary(run: Run) -> None:
  secs = run.result["sections"]
  print(
    f"\n{run.result['device_kind']} ({run.result['backend']}), jax {run.result['jax_version']}, "
    f"{run.result['elapsed_s']} s"
  )
  mm = secs.get("matmul", {})
  if "tflops" in mm:
    print(f"matmul bf16 {mm['n']}^3: {mm['tflops']:.1f} TFLOP/s (best of 5)")
  rows = secs.get("attention", {}).get("rows", [])
  if rows:
    print(
      f"{'T':>7} {'mode':>6} {'backend':>15} {'fwd s':>9} {'fwd TF/s':>9} {'f+b s':>9} "
      f"{'f+b TF/s':>9} {'f+b/mm':>7} {'out err':>8} {'grad err':>8}"
    )
    for r in rows:
      ge = r.get("grad_err", {})
      print(
        f"{r['T']:>7} {r['mode']:>6} {r['backend']:>15} {_fmt(r.get('fwd_s'), '9.4f'):>9} "
        f"{_fmt(r.get('fwd_tflops'), '9.1f'):>9} {_fmt(r.get('fwdbwd_s'), '9.4f'):>9} "
        f"{_fmt(r.get('fwdbwd_tflops'), '9.1f'):>9} {_fmt(r.get('fwdbwd_vs_matmul'), '7.2f'):>7} "
        f"{_fmt(r.get('out_err'), '8.1e'):>8} {_fmt(max(ge.values()) if ge else None, '8.1e'):>8}"
      )
  gdn = secs.get("gdn", {})
  if gdn.get("rows"):
    print(
      f"{'T':>7} {'GDN fwd s':>10} {'GDN f+b s':>10} {'attn cudnn f+b':>15} {'attn blockw f+b':>16}"
    )
    for r in gdn["rows"]:
      print(
        f"{r['T']:>7} {_fmt(r.get('fwd_s'), '10.4f'):>10} {_fmt(r.get('fwdbwd_s'), '10.4f'):>10} "
        f"{_fmt(r.get('attention_lctx_cudnn_fwdbwd_s'), '15.4f'):>15} "
        f"{_fmt(r.get('attention_lctx_blockwise_fwdbwd_s'), '16.4f'):>16}"
      )
  train = secs.get("train", {})
  if train.get("rows"):
    print(f"{'T':>7} {'model':>7} {'step s':>9} {'tok/s':>10} {'TF/s':>7}")
    for r in train["rows"]:
      print(
        f"{r['T']:>7} {r['model']:>7} {_fmt(r.get('step_s'), '9.3f'):>9} "
        f"{_fmt(r.get('tokens_per_s'), '10.0f'):>10} {_fmt(r.get('model_tflops'), '7.1f'):>7}"
      )
  for name, s in secs.items():
    if isinstance(s, dict) and "error" in s:
      print(f"section {name} failed: {s['error'][:300]}")


def _ints(s):
  return [int(x) for x in s.split(",")]


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", default="bench_results/bench_gpu.json")
  p.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run)")
  p.add_argument("--budget-s", type=float, default=300.0, help="all sections, from start-up")
  p.add_argument("--sections", default="matmul,attention,gdn,train")
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--matmul-n", type=int, default=8192)
  p.add_argument("--lengths", type=_ints, default=[8192, 32768, 131072])
  p.add_argument("--modes", type=lambda s: s.split(","), default=["causal", "packed"])
  p.add_argument("--q-heads", type=int, default=32)
  p.add_argument("--kv-heads", type=int, default=8)
  p.add_argument("--head-dim", type=int, default=128)
  p.add_argument("--block-q", type=int, default=512)
  p.add_argument("--block-kv", type=int, default=512)
  p.add_argument("--check-t", type=int, default=8192)
  p.add_argument("--tol", type=float, default=2e-2)
  p.add_argument("--xla-max-t", type=int, default=8192)
  p.add_argument("--dense-mask-max-t", type=int, default=32768)
  p.add_argument("--gdn-qk-heads", type=int, default=16)
  p.add_argument("--gdn-v-heads", type=int, default=32)
  p.add_argument("--gdn-head-dim", type=int, default=128)
  p.add_argument("--gdn-check-t", type=int, default=4096)
  p.add_argument("--train-lengths", type=_ints, default=[32768, 131072])
  p.add_argument("--train-d-model", type=int, default=1024)
  p.add_argument("--train-layers", type=int, default=8)
  p.add_argument("--train-heads", type=int, default=16)
  p.add_argument("--train-kv-heads", type=int, default=8)
  p.add_argument("--train-vocab", type=int, default=32768)
  p.add_argument("--train-loss-chunk", type=int, default=8192)
  p.add_argument("--train-repeats", type=int, default=3)
  args = p.parse_args(argv)
  if args.quick:
    args.matmul_n, args.lengths, args.check_t = 512, [256, 512], 256
    args.q_heads, args.kv_heads, args.head_dim = 4, 2, 32
    args.block_q = args.block_kv = 128
    args.xla_max_t = args.dense_mask_max_t = 512
    args.gdn_qk_heads, args.gdn_v_heads, args.gdn_head_dim, args.gdn_check_t = 2, 4, 32, 128
    args.train_lengths, args.train_d_model, args.train_layers = [256], 64, 4
    args.train_heads, args.train_kv_heads, args.train_vocab = 4, 2, 256
    args.train_loss_chunk, args.train_repeats = 128, 2
  return args


# Share of --budget-s by which each section should end (what one leaves passes on).
DEADLINES = {"matmul": 0.05, "attention": 0.50, "gdn": 0.68, "train": 1.0}


def main(argv=None):
  args = parse_args(argv)
  run = Run(args)
  print(
    f"{run.result['device_kind']} ({run.result['backend']}, {jax.device_count()} devices), "
    f"jax {jax.__version__}; writing {args.out}",
    flush=True,
  )
  sections = dict(
    matmul=section_matmul, attention=section_attention, gdn=section_gdn, train=section_train
  )
  for name in args.sections.split(","):
    deadline = DEADLINES[name] * args.budget_s
    print(f"== {name} (until {deadline:.0f} s; now {run.elapsed():.0f} s)", flush=True)
    t0 = time.perf_counter()
    try:
      out = sections[name](run, deadline)
      run.result["sections"][name] = out
    except Exception as e:  # noqa: BLE001  (one section's failure keeps the others)
      got = run.result["sections"].setdefault(name, {})
      got["error"] = _err(e)
      got["traceback"] = traceback.format_exc()[-4000:]
      print(f"section {name} failed: {_err(e)}", flush=True)
    run.result["sections"][name]["section_s"] = round(time.perf_counter() - t0, 1)
    run.save()
  _print_summary(run)
  run.save()
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()

#!/usr/bin/env bash
# Time a few training steps of each flagship config on ONE TPU VM and print MFU.
#
#   scripts/tpu_smoke.sh                      # the four flagships
#   scripts/tpu_smoke.sh gin/ring_v5p.gin     # some of them
#
# Run it on the TPU VM itself (one host: a v5p VM has 4 chips = 4 devices, a
# TPU7x VM 4 chips = 8 devices), from a checkout installed as in README.md.
# The flagships are sized for 64-chip slices; here each keeps its model, dtype,
# remat, kernels, strategy and the tokens per device of its gin file, on a mesh
# of this VM's devices:
#   ring_v5p       ring over all D devices, zigzag    seq 65,536 x D, batch 1
#   allgather_v5p  all_gather over all D devices       seq 32,768 x D, batch 1
#   ulysses_v5p    ulysses over all D devices          seq 65,536 x D, batch 1
#   usp_ironwood   ring 2 x ulysses D/2 (<= 8)         seq 65,536 x D, batch 1
# (parameters and optimizer state are sharded over the context axes too). The
# sequences are D/64 of the flagships' (fewer ring hops, less attention per
# token), so this is the first measured MFU on real chips, not the full slice's.
# Data: the local text corpus (built on first use, no bucket needed), byte
# tokenizer, rows packed without padding (concat_split).
#
# Environment:
#   STEPS       steps per config (default 5; the first includes compilation, so
#               the MFU printed is the median over the steps after the second)
#   SMOKE_DIR   where runs go (default /dev/shm/lctx_smoke: host RAM; each run's
#               final checkpoint, ~100 GB for the 8B model, is deleted after it)
#   PYTHON      the interpreter (default: python)
#   EXTRA       more --gin_param bindings, separated by ';' (e.g.
#               "AttentionOptions.backend='blockwise'" to compare kernels)
# Output: one line per config (step time, tokens/s, MFU, any logged reason the
# TPU attention kernel was passed over) and
# the per-step records in $SMOKE_DIR/<config>.metrics.jsonl.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
STEPS="${STEPS:-5}"
SMOKE_DIR="${SMOKE_DIR:-/dev/shm/lctx_smoke}"
mkdir -p "$SMOKE_DIR"

if [ "$#" -gt 0 ]; then
  CONFIGS=("$@")
else
  CONFIGS=(gin/ring_v5p.gin gin/allgather_v5p.gin gin/ulysses_v5p.gin gin/usp_ironwood.gin)
fi
if [ "$STEPS" -lt 3 ]; then
  echo "STEPS must be at least 3 (the first two steps include compilation)" >&2
  exit 2
fi

read -r NDEV KIND < <("$PYTHON" -c 'import jax; print(jax.device_count(), jax.devices()[0].device_kind.replace(" ", "_"))')
if [ "$NDEV" -lt 2 ]; then
  echo "found $NDEV $KIND device(s); the strategies need at least 2" >&2
  exit 2
fi
echo "devices: $NDEV x $KIND; $STEPS steps per config; runs in $SMOKE_DIR"

mesh_params() {  # the mesh, batch and length of config $1 on NDEV devices
  local name ctx=$NDEV uly=1 per_device=65536
  name="$(basename "$1" .gin)"
  case "$name" in
    allgather_v5p) per_device=32768 ;;
    ring_v5p | ulysses_v5p) ;;
    usp_ironwood)
      uly=$((NDEV / 2))
      if [ "$uly" -gt 8 ]; then uly=8; fi
      ctx=$((NDEV / uly))
      ;;
    *) echo "unknown flagship $1" >&2; return 1 ;;
  esac
  printf '%s\n' \
    "MeshConfig.data = 1" "MeshConfig.fsdp = 1" "MeshConfig.tensor = 1" \
    "MeshConfig.context = $ctx" "MeshConfig.context_ulysses = $uly" \
    "TrainConfig.batch_size = 1" "TrainConfig.seq_len = $((per_device * NDEV))"
}

run_one() {
  local gin="$1" name workdir
  name="$(basename "$gin" .gin)"
  workdir="$SMOKE_DIR/$name"
  rm -rf "$workdir"
  local params=()
  while IFS= read -r p; do params+=(--gin_param="$p"); done < <(mesh_params "$gin")
  for p in \
    "DataConfig.sources = ('text',)" \
    "DataConfig.weights = ()" \
    "DataConfig.tokenizer = 'byte'" \
    "DataConfig.packing = 'concat_split'" \
    "TrainConfig.steps = $STEPS" \
    "TrainConfig.log_every = 1" \
    "TrainConfig.eval_every = 0" \
    "TrainConfig.retrieval_eval_every = 0" \
    "TrainConfig.checkpoint_every = 0" \
    "TrainConfig.warmup_steps = 1"; do
    params+=(--gin_param="$p")
  done
  if [ -n "${EXTRA:-}" ]; then
    IFS=';' read -r -a extra <<<"$EXTRA"
    for p in "${extra[@]}"; do params+=(--gin_param="$p"); done
  fi
  echo "== $name: ${params[*]}"
  local status=0
  "$PYTHON" main.py --mode=train --gin_file="$gin" --workdir="$workdir" "${params[@]}" \
    >"$SMOKE_DIR/$name.log" 2>&1 || status=$?
  if [ -f "$workdir/metrics.jsonl" ]; then
    cp "$workdir/metrics.jsonl" "$SMOKE_DIR/$name.metrics.jsonl"
  fi
  rm -rf "$workdir"  # the final checkpoint: ~100 GB for the 8B model
  if [ "$status" -ne 0 ]; then
    echo "$name: FAILED (exit $status); last lines of $SMOKE_DIR/$name.log:"
    tail -n 20 "$SMOKE_DIR/$name.log"
    return 0
  fi
  "$PYTHON" - "$name" "$SMOKE_DIR/$name.metrics.jsonl" "$SMOKE_DIR/$name.log" <<'EOF'
import json, re, statistics, sys

name, metrics_path, log_path = sys.argv[1:4]
records = []
with open(metrics_path) as f:
  for line in f:
    r = json.loads(line)
    if "mfu" in r:
      records.append(r)
steady = records[2:]  # steps 1-2 include compilation and warm-up
if not steady:
  print(f"{name}: only {len(records)} timed steps in {metrics_path}")
  sys.exit(0)
med = lambda key: statistics.median(r[key] for r in steady)  # noqa: E731
with open(log_path, errors="replace") as f:
  log = f.read()
# lctx.kernels.flash logs once why 'auto' passed over the TPU kernel, if it did.
fallbacks = sorted(set(re.findall(r"attention 'auto': not splash \((.*)\); blockwise", log)))
print(
  f"{name}: step {med('step_time_s'):.2f} s | {med('tokens_per_sec'):,.0f} tok/s | "
  f"{med('tflops_per_device'):.1f} TFLOP/s/device | MFU {100 * med('mfu'):.1f}% "
  f"(median of {len(steady)} steps) | splash fallbacks logged: {fallbacks or 'none'}"
)
EOF
}

for gin in "${CONFIGS[@]}"; do
  run_one "$gin"
done

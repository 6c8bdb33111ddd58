#!/usr/bin/env bash
# Run one lctx experiment on a Cloud TPU VM slice (or several slices), end to end.
#
#   scripts/tpu_vm_launch.sh create                          # queue the slice(s), wait until ACTIVE
#   scripts/tpu_vm_launch.sh install                         # this repo's commit on every worker
#   scripts/tpu_vm_launch.sh run GIN_FILE WORKDIR [flags]    # main.py on every worker
#   scripts/tpu_vm_launch.sh delete                          # release the slice(s)
#   scripts/tpu_vm_launch.sh all GIN_FILE WORKDIR [flags]    # create, install, run, delete
#   scripts/tpu_vm_launch.sh GIN_FILE WORKDIR [flags]        # = run (existing slice)
#
# Environment:
#   TPU_NAME          node name; with NUM_SLICES > 1 the node prefix (nodes
#                     TPU_NAME-0 .. TPU_NAME-<NUM_SLICES-1>)            (required)
#   ZONE              e.g. us-east5-a                                    (required)
#   PROJECT           GCP project (default: gcloud's)
#   ACCELERATOR_TYPE  e.g. v5p-128 (create)          RUNTIME_VERSION  e.g. v2-alpha-tpuv5 (create)
#   NUM_SLICES        slices in the queued resource (default 1)
#   SPOT=1            request Spot capacity (preemptible; the run checkpoints on SIGTERM)
#   QR_ID             queued-resource id (default: TPU_NAME-qr)
#   LCTX_REPO_URL / LCTX_REF   what `install` checks out (default: origin, this HEAD)
#   LOG_DIR           where per-worker logs land here (default: logs/tpu/TPU_NAME)
#
# Every worker runs `main.py --jax_distributed` (hosts find each other through
# the TPU metadata; with several slices each worker also gets MEGASCALE_NUM_SLICES,
# its MEGASCALE_SLICE_ID and slice 0's first worker as MEGASCALE_COORDINATOR_ADDRESS,
# port MEGASCALE_PORT, default 8080). No training settings live here: the gin file
# holds them all, multi-slice runs included (MeshConfig.dcn_data / dcn_fsdp = NUM_SLICES).
# WORKDIR must be a path every worker shares (e.g. a Filestore or gcsfuse mount
# at the same path on all workers): each host writes its checkpoint shards there.
set -euo pipefail
: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}"
NUM_SLICES="${NUM_SLICES:-1}"
QR_ID="${QR_ID:-$TPU_NAME-qr}"
MEGASCALE_PORT="${MEGASCALE_PORT:-8080}"
LOG_DIR="${LOG_DIR:-logs/tpu/$TPU_NAME}"
GCLOUD=(gcloud --quiet)
ZONE_ARGS=(--zone="$ZONE")
if [ -n "${PROJECT:-}" ]; then ZONE_ARGS+=(--project="$PROJECT"); fi

nodes() {
  if [ "$NUM_SLICES" -eq 1 ]; then
    echo "$TPU_NAME"
  else
    for ((s = 0; s < NUM_SLICES; s++)); do echo "$TPU_NAME-$s"; done
  fi
}

workers() {  # number of hosts (workers) of node $1
  "${GCLOUD[@]}" compute tpus tpu-vm describe "$1" "${ZONE_ARGS[@]}" \
    --format='value(networkEndpoints.len())'
}

create() {
  : "${ACCELERATOR_TYPE:?set ACCELERATOR_TYPE (e.g. v5p-128)}"
  : "${RUNTIME_VERSION:?set RUNTIME_VERSION (e.g. v2-alpha-tpuv5)}"
  local args=(--accelerator-type="$ACCELERATOR_TYPE" --runtime-version="$RUNTIME_VERSION")
  if [ "$NUM_SLICES" -eq 1 ]; then
    args+=(--node-id="$TPU_NAME")
  else
    args+=(--node-count="$NUM_SLICES" --node-prefix="$TPU_NAME")
  fi
  if [ "${SPOT:-0}" = 1 ]; then args+=(--spot); fi
  "${GCLOUD[@]}" compute tpus queued-resources create "$QR_ID" "${ZONE_ARGS[@]}" "${args[@]}"
  local state=""
  while [ "$state" != ACTIVE ]; do
    sleep "${POLL_S:-30}"
    state="$("${GCLOUD[@]}" compute tpus queued-resources describe "$QR_ID" "${ZONE_ARGS[@]}" \
      --format='value(state.state)')"
    echo "queued resource $QR_ID: $state" >&2
    case "$state" in
      FAILED | SUSPENDED) echo "queued resource $QR_ID is $state" >&2; return 1 ;;
    esac
  done
}

on_all_workers() {  # COMMAND: run on every worker of every node (@SLICE@: the node's index)
  local command="$1" pids=() node w n s=0
  mkdir -p "$LOG_DIR"
  for node in $(nodes); do
    n="$(workers "$node")"
    for ((w = 0; w < n; w++)); do
      "${GCLOUD[@]}" compute tpus tpu-vm ssh "$node" "${ZONE_ARGS[@]}" --worker="$w" \
        --command="${command//@SLICE@/$s}" >"$LOG_DIR/$node-worker$w.log" 2>&1 &
      pids+=($!)
    done
    s=$((s + 1))
  done
  echo "started on ${#pids[@]} workers; logs in $LOG_DIR/" >&2
  local rc=0 pid
  for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
  return "$rc"
}

install() {
  local url ref
  url="${LCTX_REPO_URL:-$(git config --get remote.origin.url || true)}"
  ref="${LCTX_REF:-$(git rev-parse HEAD)}"
  if [ -z "$url" ]; then
    echo "install: this checkout has no remote 'origin'; set LCTX_REPO_URL" >&2
    return 2
  fi
  on_all_workers "set -e
    if [ ! -d ~/lctx ]; then git clone -q $(printf %q "$url") ~/lctx; fi
    cd ~/lctx && git fetch -q origin && git checkout -q $(printf %q "$ref")
    python3 -m venv ~/lctx-venv && . ~/lctx-venv/bin/activate
    pip install -q -e '.[tpu]'"
}

run() {
  if [ "$#" -lt 2 ]; then
    echo "usage: $0 run GIN_FILE WORKDIR [more main.py flags]" >&2
    return 2
  fi
  local flags env=""
  flags="$(printf ' %q' --jax_distributed --gin_file="$1" --workdir="$2" "${@:3}")"
  if [ "$NUM_SLICES" -gt 1 ]; then
    # Multi-slice: slices talk over DCN through the coordinator on slice 0, worker 0.
    local coordinator
    coordinator="$("${GCLOUD[@]}" compute tpus tpu-vm describe "$TPU_NAME-0" "${ZONE_ARGS[@]}" \
      --format='value(networkEndpoints[0].ipAddress)')"
    env="export MEGASCALE_COORDINATOR_ADDRESS=$coordinator:$MEGASCALE_PORT"
    env+=" MEGASCALE_PORT=$MEGASCALE_PORT MEGASCALE_NUM_SLICES=$NUM_SLICES"
    env+=" MEGASCALE_SLICE_ID=@SLICE@ && "
  fi
  on_all_workers "${env}cd ~/lctx && . ~/lctx-venv/bin/activate && exec python main.py$flags"
}

delete() {
  "${GCLOUD[@]}" compute tpus queued-resources delete "$QR_ID" "${ZONE_ARGS[@]}" --force
}

case "${1:-}" in
  create | install | delete) "$1" ;;
  run) shift; run "$@" ;;
  all)
    shift
    create
    trap delete EXIT  # release the slices even when install or run fails
    install
    run "$@"
    ;;
  *.gin) run "$@" ;;
  *)
    sed -n '2,9p' "$0" >&2
    exit 2
    ;;
esac

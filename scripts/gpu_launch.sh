#!/usr/bin/env bash
# Run one lctx experiment on this GPU host (all local GPUs, one process).
# For several hosts, run this on each with COORDINATOR=host:port, NUM_HOSTS and
# HOST_ID set; jax.distributed connects them.
#
#   scripts/gpu_launch.sh GIN_FILE WORKDIR [extra main.py flags...]
set -euo pipefail
GIN_FILE="$1"; WORKDIR="$2"; shift 2
DIST=()
if [ -n "${COORDINATOR:-}" ]; then
  DIST=(--jax_distributed --coordinator_address="$COORDINATOR"
        --num_processes="${NUM_HOSTS:?}" --process_id="${HOST_ID:?}")
fi
exec python main.py "${DIST[@]}" --gin_file="$GIN_FILE" --workdir="$WORKDIR" "$@"

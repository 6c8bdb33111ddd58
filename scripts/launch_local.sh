#!/usr/bin/env bash
# Run one lctx experiment as N processes on this machine, as on an N-host pod.
#
#   scripts/launch_local.sh N GIN_FILE WORKDIR [more main.py flags, e.g. --gin_param=...]
#
# Each process gets 8/N fake CPU devices (--fake_devices) and joins the others
# through jax.distributed (coordinator on a free local port; gloo collectives
# on CPU, set in main.py). As on a real pod, every process reads its own shard
# of the data, all of them write their shards of each orbax checkpoint, and
# process 0 alone writes WORKDIR/metrics.jsonl. Process i logs to
# WORKDIR/logs/process_<i>.log.
#
# SIGTERM/SIGINT to this script are forwarded to every process: they agree on
# a step, checkpoint it and exit 0 (preemption); rerunning the same command
# resumes. If one process fails, the others are stopped. The exit code is the
# first non-zero exit code of a process, else 0.
set -euo pipefail
if [ "$#" -lt 3 ]; then
  echo "usage: $0 N GIN_FILE WORKDIR [more main.py flags]" >&2
  exit 2
fi
N="$1"; GIN_FILE="$2"; WORKDIR="$3"; shift 3
if ! [[ "$N" =~ ^[1-8]$ ]] || [ $((8 % N)) -ne 0 ]; then
  echo "$0: N=$N must divide 8 (1, 2, 4 or 8 processes of 8/N fake devices)." >&2
  exit 2
fi
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python}"
PORT="${LCTX_COORDINATOR_PORT:-$("$PYTHON" -c 'import socket
s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}"
mkdir -p "$WORKDIR/logs"

pids=()
for ((i = 0; i < N; i++)); do
  JAX_PLATFORMS=cpu "$PYTHON" "$REPO/main.py" \
    --jax_distributed --coordinator_address="127.0.0.1:$PORT" \
    --num_processes="$N" --process_id="$i" --fake_devices=$((8 / N)) \
    --gin_file="$GIN_FILE" --workdir="$WORKDIR" "$@" \
    >"$WORKDIR/logs/process_$i.log" 2>&1 &
  pids+=($!)
done
echo "launch_local: $N processes (${pids[*]}) on 127.0.0.1:$PORT; logs in $WORKDIR/logs/" >&2

forwarded=0
forward() {
  forwarded=1
  kill -TERM "${pids[@]}" 2>/dev/null || true
}
trap forward TERM INT

rc=0
remaining=("${pids[@]}")
while [ "${#remaining[@]}" -gt 0 ]; do
  status=0
  unset done_pid
  wait -n -p done_pid "${remaining[@]}" || status=$?
  if [ -z "${done_pid:-}" ]; then
    continue  # wait was interrupted by a forwarded signal
  fi
  left=()
  for p in "${remaining[@]}"; do [ "$p" != "$done_pid" ] && left+=("$p"); done
  remaining=("${left[@]+"${left[@]}"}")
  if [ "$status" -ne 0 ]; then
    [ "$rc" -eq 0 ] && rc=$status
    if [ "$forwarded" -eq 0 ] && [ "${#remaining[@]}" -gt 0 ]; then
      # The others would wait for the failed process in every collective.
      echo "launch_local: a process exited with $status; stopping the others" >&2
      kill -KILL "${remaining[@]}" 2>/dev/null || true
    fi
  fi
done
exit "$rc"

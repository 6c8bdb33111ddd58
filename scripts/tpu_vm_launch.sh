#!/usr/bin/env bash
# Run one lctx experiment on every host of a TPU VM slice.
#
#   scripts/tpu_vm_launch.sh GIN_FILE WORKDIR [extra main.py flags...]
#
# Needs TPU_NAME and ZONE (and optionally PROJECT) in the environment. Installs
# the repo on every host, then starts main.py on all hosts at once; hosts find
# each other through jax.distributed (auto-detected on TPU VMs). No training
# settings live here: everything is in the gin file.
set -euo pipefail
GIN_FILE="$1"; WORKDIR="$2"; shift 2
: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}"
PROJECT_FLAG=${PROJECT:+--project=$PROJECT}
REPO_URL="${LCTX_REPO_URL:-$(git config --get remote.origin.url)}"
REF="${LCTX_REF:-$(git rev-parse HEAD)}"
REMOTE="set -e
if [ ! -d ~/lctx ]; then git clone $REPO_URL ~/lctx; fi
cd ~/lctx && git fetch -q origin && git checkout -q $REF
python3 -m venv ~/lctx-venv && . ~/lctx-venv/bin/activate
pip install -q -e '.[tpu]'
python main.py --jax_distributed --gin_file=$GIN_FILE --workdir=$WORKDIR $*"
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" $PROJECT_FLAG \
  --worker=all --command="$REMOTE"

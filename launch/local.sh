#!/usr/bin/env bash
# N processes on this machine, one jax.distributed job (localhost coordinator).
#
#   launch/local.sh NPROC CONFIG [--config.x=y ...]
#
# GPUs: process i gets GPU i (--config.dist.local_device_ids=i); one process seeing all GPUs
# (`python main.py --config=...`) is equivalent and simpler, this is for testing the multi-process
# path or for one-process-per-GPU setups. CPU: SPAN_LM_CPU_DEVICES=4 gives each process 4 fake
# CPU devices (what tests/train/test_distributed.py does).
set -euo pipefail
if [[ $# -lt 2 ]]; then
  echo "usage: $0 NPROC CONFIG [--config.x=y ...]" >&2
  exit 2
fi
nproc=$1; config=$2; shift 2
cd "$(dirname "$0")/.."
port=${SPAN_LM_PORT:-$((20000 + RANDOM % 20000))}
pids=()
cleanup() { for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done; }
trap cleanup INT TERM
for ((i = 0; i < nproc; i++)); do
  extra=()
  if [[ -n "${SPAN_LM_CPU_DEVICES:-}" ]]; then
    env_flags=(JAX_PLATFORMS=cpu XLA_FLAGS="--xla_force_host_platform_device_count=${SPAN_LM_CPU_DEVICES}")
  else
    env_flags=()
    extra=(--config.dist.local_device_ids="$i")
  fi
  env "${env_flags[@]}" python main.py --config="$config" \
    --config.dist.coordinator="localhost:${port}" --config.dist.num_processes="$nproc" \
    --config.dist.process_id="$i" "${extra[@]}" "$@" &
  pids+=($!)
done
status=0
for p in "${pids[@]}"; do wait "$p" || status=$?; done
exit $status

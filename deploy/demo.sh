#!/usr/bin/env bash
# The README's main command: set up, start two local worker daemons, train the paper's
# network on Fashion-MNIST distributed over them, stop them, and print the report.
# Extra arguments go to `hetconv train` (e.g. deploy/demo.sh --epochs 1).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${HETCONV_VENV:-.venv}
deploy/setup-env.sh "$venv" ""
if [ -z "${HETCONV_DATA_DIR:-}" ] && [ ! -e /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ]; then
  echo "hetconv: error: Fashion-MNIST is missing; run: sudo apt-get install dataset-fashion-mnist" >&2
  exit 2
fi
hetconv="$venv/bin/hetconv"
port=${HETCONV_DEMO_PORT:-5555}
run_dir=${HETCONV_RUN_DIR:-runs/demo-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$run_dir"
pids=()
cleanup() { for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT INT TERM
# One BLAS thread per worker: on one machine the two daemons share its cores.
for name in worker-a worker-b; do
  "$hetconv" worker --master "tcp://127.0.0.1:$port" --threads 1 --name "$name" \
    >"$run_dir/$name.log" 2>&1 &
  pids+=($!)
done
echo "== started worker daemons worker-a, worker-b (logs in $run_dir/)"
# --no-local: the master trains the dense part only, so the two workers own the two cores.
"$hetconv" train --listen "tcp://127.0.0.1:$port" --min-workers 2 --wait 60 --no-local \
  --data fashion-mnist --arch 32:64 --epochs 4 --batch 128 --threads 1 \
  --run-dir "$run_dir" "$@"
cleanup; pids=()
echo "== workload-balance report"
"$hetconv" report "$run_dir"

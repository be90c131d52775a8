#!/usr/bin/env bash
# The README's main command: set up, then train on Fashion-MNIST and print the results.
# Extra arguments go to `hetconv train` (e.g. deploy/demo.sh --epochs 1).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${HETCONV_VENV:-.venv}
deploy/setup-env.sh "$venv" ""
if [ ! -e /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ] && [ -z "${HETCONV_DATA_DIR:-}" ]; then
  echo "hetconv: error: Fashion-MNIST is missing; run: sudo apt-get install dataset-fashion-mnist" >&2
  exit 2
fi
run_dir=${HETCONV_RUN_DIR:-runs/demo-$(date +%Y%m%d-%H%M%S)}
exec "$venv/bin/hetconv" train --local --data fashion-mnist --arch 32:64 --epochs 3 \
  --batch 128 --run-dir "$run_dir" "$@"

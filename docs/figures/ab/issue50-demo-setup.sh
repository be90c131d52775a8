#!/bin/bash
# Issue 50 on the demo: set-up's prediction against the first steps, and `hetconv plan`'s
# estimate against the run's median, on the demo's own command (deploy/demo.sh: two local
# workers, --no-local, 32:64 on Fashion-MNIST), one epoch on 6400 images, RUNS times.
# Run from the repository root: docs/figures/ab/issue50-demo-setup.sh > docs/figures/ab/issue50-demo-setup.log
# (HETCONV: the hetconv to run, default .venv-test/bin/hetconv; needs dataset-fashion-mnist.)
set -euo pipefail
hetconv=${HETCONV:-.venv-test/bin/hetconv}
python=$(dirname "$hetconv")/python
runs=${RUNS:-3}
port=${PORT:-5621}
work=$(mktemp -d /tmp/issue50-demo.XXXXXX)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT
echo "# $0, $(date -u +%FT%TZ), $(git rev-parse --short HEAD), load $(cut -d' ' -f1-3 /proc/loadavg)"
for i in $(seq "$runs"); do
  d=$work/run$i; mkdir -p "$d"
  for n in worker-a worker-b; do
    "$hetconv" worker --master "tcp://127.0.0.1:$port" --threads 1 --name "$n" > "$d/$n.log" 2>&1 &
  done
  "$hetconv" train --listen "tcp://127.0.0.1:$port" --min-workers 2 --wait 60 --no-local \
    --data fashion-mnist --arch 32:64 --epochs 1 --batch 128 --threads 1 --limit 6400 \
    --no-progress --run-dir "$d/run" > "$d/train.log" 2>&1
  kill $(jobs -p) 2>/dev/null || true; wait 2>/dev/null || true
  grep -h "^hetconv: split by \(samples\|kernels\) (\|rehearsed the plan" "$d/train.log" | cut -c1-200
done
"$python" - "$work" "$runs" <<'PY'
import json, sys
from pathlib import Path
from hetconv.bench.scale_setup import setup_figures
work, runs = Path(sys.argv[1]), int(sys.argv[2])
ms = lambda v: "-" if v is None else f"{v * 1e3:.1f}"
print("| run | set-up ms | first steps ms | set-up error | fitted ms | hetconv plan ms | run's median / plan |")
print("|---|---|---|---|---|---|---|")
for i in range(1, runs + 1):
    d = work / f"run{i}" / "run"
    f = setup_figures([json.loads(l) for l in open(d / "metrics.jsonl")], d)
    error = "-" if f.setup_error is None else f"{f.setup_error:+.1%}"
    ratio = "-" if f.plan_ratio is None else f"{f.plan_ratio:.2f}"
    print(f"| {i} | {ms(f.setup_s)} | {ms(f.first_steps_s)} | {error} | {ms(f.fitted_s)} | {ms(f.plan_s)} | {ratio} |")
PY

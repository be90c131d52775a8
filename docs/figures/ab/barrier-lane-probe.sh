#!/usr/bin/env bash
# The barrier-lane probe (docs/sample-split.md, "Tried and not kept"): ZeroMQ and a plain
# TCP lane alternated, for W = 3 and 8 ms of compute a round; writes barrier-lane-probe.log.
# Root (cgroup v1 CPU quotas); run on a quiet machine.
set -euo pipefail
cd "$(dirname "$0")"
python=${PYTHON:-../../../.venv-test/bin/python}
{
  echo "# barrier-lane-probe.py {zmq,tcp} 4 0.45, W=3 then W=8, alternated; $(date -u +%FT%TZ);$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2), $(nproc) cores"
  for w in 3 8; do
    for kind in zmq tcp zmq tcp; do
      W=$w "$python" barrier-lane-probe.py "$kind" 4 0.45 | sed "s/^/W=$w /"
    done
  done
} > barrier-lane-probe.log 2>&1
cat barrier-lane-probe.log

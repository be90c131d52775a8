#!/usr/bin/env bash
# Is the barriers' delivery the kernel's CFS bandwidth slice (docs/sample-split.md, "Tried
# and not kept")? The barrier-lane probe's ZeroMQ lane under sched_cfs_bandwidth_slice_us
# 5000 (the kernel's default), 1000 and 500, alternated, W = 3 and 8 ms of compute a round;
# restores the default; writes cfs-slice-probe.log. Root; run on a quiet machine.
set -euo pipefail
cd "$(dirname "$0")"
python=${PYTHON:-../../../.venv-test/bin/python}
knob=/proc/sys/kernel/sched_cfs_bandwidth_slice_us
before=$(cat "$knob")
trap 'echo "$before" > "$knob"' EXIT
{
  echo "# barrier-lane-probe.py zmq 4 0.45 under sched_cfs_bandwidth_slice_us 5000/1000/5000/1000/500; $(date -u +%FT%TZ);$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2), $(nproc) cores"
  for w in 3 8; do
    for slice in 5000 1000 5000 1000 500; do
      echo "$slice" > "$knob"
      W=$w "$python" barrier-lane-probe.py zmq 4 0.45 | sed "s/^/slice=$slice W=$w /"
    done
  done
} > cfs-slice-probe.log 2>&1
cat cfs-slice-probe.log

#!/bin/bash
# The kernel's CFS bandwidth slice in the whole step (docs/sample-split.md, "Tried and not
# kept"): `hetconv bench scale` of 32:64 on four 0.45-core machines beside DDP, one repeat
# per invocation, under sched_cfs_bandwidth_slice_us 5000 (the default) and 1000,
# alternated three times; restores the setting. Root, quiet machine, about 10 minutes.
# Prints one line per invocation (cfs-slice-bench.log beside this script); the figure
# files and work directories go to $OUT (default /tmp/cfs-slice-bench).
set -u
mkdir -p "${OUT:-/tmp/cfs-slice-bench}"
cd "$(dirname "$0")/../../.."
knob=/proc/sys/kernel/sched_cfs_bandwidth_slice_us
before=$(cat $knob)
trap 'echo "$before" > "$knob"' EXIT
for round in 1 2 3; do
  for slice in 5000 1000; do
    echo $slice > $knob
    .venv-test/bin/python -m hetconv bench scale --machines 0.45,0.45,0.45,0.45 --rate 1gbit --arch 32:64 --limit 3840 --batch 128 --epochs 3 --repeats 1 --split model --split-by auto --peer ddp --cfs-period-ms 10 --work-dir ${OUT:-/tmp/cfs-slice-bench}/w$slice-$round --markdown ${OUT:-/tmp/cfs-slice-bench}/s$slice-$round.md > ${OUT:-/tmp/cfs-slice-bench}/s$slice-$round.log 2>&1
    echo "slice=$slice round=$round rc=$? $(grep -m1 '^| 4x\[0.45,0.45,0.45,0.45\] auto | 1gbit | [0-9.]* (' ${OUT:-/tmp/cfs-slice-bench}/s$slice-$round.md) barriers: $(grep 'per participant and step' ${OUT:-/tmp/cfs-slice-bench}/s$slice-$round.md)"
  done
done

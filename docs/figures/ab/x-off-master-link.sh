#!/bin/bash
# The A/B of docs/sample-split.md, "Tried and not kept": the x slices off the master's
# link. Run as root (the lab) from a throw-away checkout of hetconv at 16b389b with
#   git apply docs/figures/ab/x-off-master-link.patch
# applied (never commit it: it breaks the run's arithmetic on purpose). A: as shipped;
# B: HETCONV_HACK_NOX=1, from step 21 on every worker runs on its own cached earlier
# x slice while the master's link carries a 1x1 crop of it. Alternates A B A B and
# prints the summary rows of each invocation (x-off-master-link.log is its output).
set -u
python=${PYTHON:-python}
for i in 1 2; do
 for mode in A B; do
  if [ "$mode" = B ]; then export HETCONV_HACK_NOX=1; else unset HETCONV_HACK_NOX; fi
  echo "== $mode $i $(date +%T)"
  "$python" -m hetconv bench scale --machines 0.45,0.45,0.45,0.45 --rate 100mbit --arch 32:64 \
    --epochs 2 --batch 128 --limit 3840 --repeats 2 --split model --split-by auto \
    --cfs-period-ms 10 --markdown "/tmp/x-off-master-link-$mode-$i.md" 2>&1 \
    | grep -E "^\| 4x|error|Error" | head -5
 done
done

#!/bin/bash
# A/B of the master-alone check's trigger (master/samples/fall_back.py): the code before it (OLD)
# and this checkout, alternated, 2 x 0.45 core, 32:64, one repeat each (root: the lab).
# Results: alone-trigger-ab.log beside this file.
NEW=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
OLD=${OLD:-e7ec5a6}  # the code before the trigger change, checked out at /tmp/ab-old:
#   git worktree add /tmp/ab-old $OLD
for i in 1 2 3 4; do
  for side in old new; do
    if [ $side = old ]; then dir=/tmp/ab-old; else dir=$NEW; fi
    cd $dir && $NEW/.venv-test/bin/python -m hetconv bench scale --machines 0.45,0.45 --rate 1gbit --arch 32:64 --epochs 3 --batch 128 --limit 3840 --repeats 1 --split model --split-by auto --cfs-period-ms 10 --work-dir /tmp/ab-$side-$i > /tmp/ab-$side-$i.out 2>&1
    echo "$side $i: $(grep -E '^\| 2x' /tmp/ab-$side-$i.out | head -1 | cut -d'|' -f4,7) trials: $(grep -h 'alone' /tmp/ab-$side-$i/2x*/repeat0.log | sed 's/hetconv: //' | cut -c1-60 | tr '\n' ';')"
  done
done

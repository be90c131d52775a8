#!/bin/bash
# The fused block's batch norm folded into one scale and one shift per channel
# (block-fold.patch beside this file, applied to this checkout; not kept) against the code
# without it (checked out at /tmp/block-old: git worktree add /tmp/block-old 2e2ae55),
# alternated, three rounds,
# the VGG-style network's two layers without a pool and two with one, at its four-machine
# slice (32 samples). Results: block-probe.log beside this file.
NEW=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
for i in 1 2 3; do
  for repo in /tmp/block-old "$NEW"; do
    for shape in "32 32 64 14 none" "32 1 32 28 none" "32 64 64 14 max" "32 32 32 28 max"; do
      "$NEW/.venv-test/bin/python" "$NEW/docs/figures/ab/block-probe.py" $shape --repo "$repo"
    done
  done
done

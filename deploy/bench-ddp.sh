#!/usr/bin/env bash
# hetconv against PyTorch DDP on the emulated LAN, every row of issue 22's target table in
# one go: hetconv with the defaults a user gets (--split-by auto, the whole batch's
# batch-norm statistics, --dense-part auto, --wire-dtype auto) beside PyTorch DDP (gloo,
# even and by-speed batch splits) and PyTorch alone, interleaved repeats, medians.
#
#   deploy/bench-ddp.sh [--dry-run] [OUT_DIR]   (default docs/figures; as root: namespaces,
#                                               tc, cgroups; --dry-run prints the commands)
#
#   HETCONV_BENCH_VENV=DIR     its environment (default .venv-bench, with the bench extra)
#   HETCONV_BENCH_REPEATS=N    interleaved repeats per configuration (default 3)
#
# One `hetconv bench scale` per network and link rate, each writing
# OUT_DIR/scale-targets-*.md with its exact command line, date and machine. About an
# hour on two cores; run it on a quiet machine (nothing else: the emulated machines
# share the host's cores).
set -euo pipefail
cd "$(dirname "$0")/.."
dry_run=0
if [ "${1:-}" = --dry-run ]; then dry_run=1; shift; fi
case "${1:-}" in -*) echo "hetconv: error: unknown option '$1' (usage: deploy/bench-ddp.sh [--dry-run] [OUT_DIR])" >&2; exit 2;; esac
out=${1:-docs/figures}
venv=${HETCONV_BENCH_VENV:-.venv-bench}
repeats=${HETCONV_BENCH_REPEATS:-3}
if [ "$dry_run" = 0 ] && [ "$(id -u)" != 0 ]; then
  echo "hetconv: error: deploy/bench-ddp.sh needs root (network namespaces, tc, cgroup quotas)" >&2
  exit 2
fi
case "$repeats" in ''|*[!0-9]*|0) echo "hetconv: error: HETCONV_BENCH_REPEATS must be a positive integer, not '$repeats'" >&2; exit 2;; esac
if [ "$dry_run" = 0 ]; then
  mkdir -p "$out"
  HETCONV_SYSTEM_EXTRAS="iproute2" deploy/setup-env.sh "$venv" bench
fi
vgg=c32k3p1,c32k3p1,pool,c64k3p1,c64k3p1,pool,fc256,drop0.5
common=(--batch 128 --epochs 2 --repeats "$repeats" --split model --split-by auto --peer ddp)

bench() {  # bench NAME FLAGS...: one invocation, its figure file OUT/scale-targets-NAME.md
  local name=$1
  shift
  local command=("$venv/bin/python" -m hetconv bench scale "$@" "${common[@]}"
                 --markdown "$out/scale-targets-$name.md")
  if [ "$dry_run" = 1 ]; then
    printf '%q ' "${command[@]}"
    echo
    return
  fi
  echo "== $name"
  "${command[@]}"
}

bench 32-64 --machines 0.45,0.45,0.45,0.45 --machines 0.45,0.45 --machines 0.6,0.4,0.2,0.2 \
  --rate 1gbit --arch 32:64 --limit 3840
bench 64-256 --machines 0.45,0.45,0.45,0.45 --machines 0.45,0.45 --machines 0.6,0.4,0.2,0.2 \
  --rate 1gbit --arch 64:256 --limit 1920
bench 100mbit --machines 0.45,0.45,0.45,0.45 --rate 100mbit --arch 32:64 --limit 3840
bench vgg --machines 0.45,0.45,0.45,0.45 --machines 0.45,0.45 --rate 1gbit --arch "$vgg" --limit 1920
bench resnet20 --machines 0.45,0.45,0.45,0.45 --machines 0.45,0.45 --machines 0.6,0.4,0.2,0.2 \
  --rate 1gbit --arch resnet20 --limit 1280
[ "$dry_run" = 1 ] || echo "== written: $out/scale-targets-{32-64,64-256,100mbit,vgg,resnet20}.md"

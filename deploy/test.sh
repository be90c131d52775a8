#!/usr/bin/env bash
# The README's test command: its own environment, the quality gates, then the whole pytest suite.
# Extra arguments go to pytest (e.g. deploy/test.sh tests/unit -q).
#
#   HETCONV_TEST_VENV=DIR    the environment (default .venv-test)
#   HETCONV_REQUIRE_TORCH=1  fail when the PyTorch test oracle (torch==2.13.0) cannot be
#                            installed, instead of skipping its tests (CI sets this)
#   HETCONV_TORCH_INDEX=URL  an extra index to look for the CPU build of torch in first
#                            (default: none; pip install torch==2.13.0 as configured)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${HETCONV_TEST_VENV:-.venv-test}
torch_pin="torch==2.13.0"
require_torch=${HETCONV_REQUIRE_TORCH:-0}
torch_index=${HETCONV_TORCH_INDEX:-}
HETCONV_SYSTEM_EXTRAS="${HETCONV_SYSTEM_EXTRAS:-chromium debootstrap iproute2 iptables podman runc slurm-wlm systemd}" deploy/setup-env.sh "$venv" test,export,metrics

# ---- PyTorch: only a test oracle, but never allowed to vanish silently.
torch_ok() {
  "$venv/bin/python" -c 'import sys, torch; sys.exit(torch.__version__.split("+")[0] != sys.argv[1])' \
    "${torch_pin#torch==}" 2>/dev/null
}
if ! torch_ok; then
  torch_log="$venv/torch-install.log"
  echo "== installing the PyTorch test oracle $torch_pin (log: $torch_log)"
  : >"$torch_log"
  if [ -n "$torch_index" ]; then  # the CPU build (no CUDA libraries) when that index answers
    "$venv/bin/python" -m pip install -q --timeout 60 --retries 2 "$torch_pin" \
      --extra-index-url "$torch_index" >>"$torch_log" 2>&1 || true
  fi
  torch_ok || "$venv/bin/python" -m pip install -q "$torch_pin" >>"$torch_log" 2>&1 || true
  if ! torch_ok; then
    oracle_tests=$(grep -rnE --include='test_*.py' 'importorskip\(["'\'']torch["'\'']' tests \
      | cut -d: -f1,2 | sort | sed 's/^/#     /' || true)
    {
      echo "################################################################################"
      echo "# PyTorch test oracle MISSING: $torch_pin could not be installed into $venv"
      echo "# (or does not import there). $("$venv/bin/python" --version 2>&1) on $(uname -sm)."
      echo "# Last lines of $torch_log:"
      if [ -s "$torch_log" ]; then tail -n 5 "$torch_log" | sed 's/^/#     /'; else echo "#     (empty)"; fi
      echo "# The tests that compare hetconv with PyTorch will SKIP (fail with"
      echo "# HETCONV_REQUIRE_TORCH=1); they call importorskip(\"torch\") at:"
      echo "${oracle_tests:-#     (none found)}"
      echo "# To fix: $venv/bin/python -m pip install '$torch_pin' \\"
      echo "#           --extra-index-url https://download.pytorch.org/whl/cpu"
      echo "#   (needs network access and a Python that torch 2.13 has wheels for), then rerun."
      echo "################################################################################"
    } >&2
    if [ "$require_torch" = 1 ]; then
      echo "hetconv: error: HETCONV_REQUIRE_TORCH=1 and $torch_pin is not installed; see the banner above" >&2
      exit 1
    fi
  fi
fi

# ---- Quality gates: every finding fails the command. ruff (a second) before any test;
# mypy --strict (half a minute of one core, cold) alongside the first part of the tests,
# and its findings fail the command before the second part starts.
echo "== gate: ruff check ."
if ! "$venv/bin/python" -m ruff check .; then
  echo "hetconv: error: quality gate failed: 'ruff check .' (findings above; '$venv/bin/ruff check . --fix' fixes some)" >&2
  exit 1
fi
mypy_log=$(mktemp)
echo "== gate: mypy --strict (hetconv, with protocol/, master/, worker/ through its symlinks), in the background"
"$venv/bin/python" -m mypy --strict >"$mypy_log" 2>&1 &
mypy_pid=$!
mypy_gate() {  # wait for mypy, show what it said; non-zero when it found anything
  local rc=0
  wait "$mypy_pid" || rc=$?
  echo "== gate: mypy --strict said:"
  cat "$mypy_log"
  rm -f "$mypy_log"
  if [ "$rc" -ne 0 ]; then
    echo "hetconv: error: quality gate failed: 'mypy --strict' (findings above; files = [\"hetconv\"] in pyproject.toml)" >&2
  fi
  return "$rc"
}

# ---- The tests. Extra arguments: one pytest run with them, as given (after mypy). Without:
# first the tests not marked `serial` on pytest-xdist workers, two more than the cores (at most 4:
# these tests spend part of their time waiting on sleeps and liveness deadlines; an idle
# worker steals queued tests from a busy one), then the `serial` ones alone, since they time
# themselves or give emulated machines CPU quotas that add up to the host's cores. Both
# parts always run; the command fails if either does.
# pytest keeps the assertion-rewritten test modules only where Python may write bytecode;
# under PYTHONDONTWRITEBYTECODE (set here and in many containers) every pytest process
# (each xdist worker, then part 2) rewrote all ~190 test modules again: about 7 s of CPU
# each (collection 11.5 s cold, 4.1 s with the caches). The caches go to tests/__pycache__.
unset PYTHONDONTWRITEBYTECODE
if [ "$#" -gt 0 ]; then
  mypy_gate || exit 1
  exec "$venv/bin/python" -m pytest "$@"
fi
cores=$(nproc 2>/dev/null || echo 1)
workers=$(( cores + 2 > 4 ? 4 : cores + 2 ))
parallel_rc=0
if [ "$cores" -gt 1 ]; then
  echo "== pytest, part 1 of 2: the tests not marked serial, $workers at a time"
  "$venv/bin/python" -m pytest -m "not serial" -n "$workers" --dist worksteal || parallel_rc=$?
else
  echo "== pytest, part 1 of 2: the tests not marked serial (one core: one at a time)"
  "$venv/bin/python" -m pytest -m "not serial" || parallel_rc=$?
fi
mypy_gate || exit 1  # before part 2: nothing else may run beside the serial tests
echo "== pytest, part 2 of 2: the tests marked serial, alone"
serial_rc=0
"$venv/bin/python" -m pytest -m serial || serial_rc=$?
if [ "$parallel_rc" -ne 0 ] || [ "$serial_rc" -ne 0 ]; then
  echo "hetconv: error: tests failed (part 1 exit $parallel_rc, part 2 exit $serial_rc; failures above)" >&2
  exit 1
fi

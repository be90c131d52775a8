#!/usr/bin/env bash
# The README's test command: its own environment, then the whole pytest suite.
# Extra arguments go to pytest (e.g. deploy/test.sh tests/unit -q).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${HETCONV_TEST_VENV:-.venv-test}
HETCONV_SYSTEM_EXTRAS="${HETCONV_SYSTEM_EXTRAS:-chromium iproute2}" deploy/setup-env.sh "$venv" test
# PyTorch is only a test oracle: install the pinned CPU build when it is at hand, else those tests skip.
if ! "$venv/bin/python" -c 'import torch' 2>/dev/null; then
  "$venv/bin/python" -m pip install -q "torch==2.13.0" >/dev/null 2>&1 \
    || echo "note: torch==2.13.0 not installable here; PyTorch oracle tests will skip" >&2
fi
exec "$venv/bin/python" -m pytest "$@"

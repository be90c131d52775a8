#!/usr/bin/env bash
# Create (or reuse) a virtual environment and install hetconv into it.
# usage: deploy/setup-env.sh VENV_DIR EXTRAS   (EXTRAS like "test" or "" )
# Also installs the Debian packages hetconv uses when run as root with apt-get:
# dataset-fashion-mnist (the demo's dataset) and, with HETCONV_SYSTEM_EXTRAS, more.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:?usage: deploy/setup-env.sh VENV_DIR [EXTRAS]}
extras=${2:-}
python=${PYTHON:-python3}
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
  echo "hetconv: error: needs Python 3.10 or newer as '$python' (set PYTHON=...)" >&2
  exit 2
fi
if [ ! -x "$venv/bin/python" ]; then
  echo "== creating virtual environment $venv"
  "$python" -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q --upgrade pip >/dev/null
spec="."
[ -n "$extras" ] && spec=".[${extras}]"
echo "== installing hetconv ${spec} into $venv"
"$venv/bin/python" -m pip install -q -e "$spec"
# The editable install leaves hetconv's own modules uncompiled; where Python may not
# write bytecode (PYTHONDONTWRITEBYTECODE, as in many containers) every hetconv process
# would compile them again at each start (0.2 s of CPU each: the test suite starts
# hundreds). compileall writes the caches once; Python reads them either way.
"$venv/bin/python" -m compileall -q hetconv master worker protocol >/dev/null \
  || echo "note: could not write hetconv's bytecode caches; every start compiles them" >&2

apt_packages="dataset-fashion-mnist ${HETCONV_SYSTEM_EXTRAS:-}"
missing=""
for pkg in $apt_packages; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing="$missing $pkg"
done
if [ -n "$missing" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "== installing Debian packages:$missing"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q $missing >/dev/null 2>&1 || {
      apt-get update -q >/dev/null 2>&1 || true
      apt-get install -y -q $missing >/dev/null 2>&1 || echo "warning: could not install:$missing" >&2
    }
  else
    echo "note: Debian packages missing:$missing; run: sudo apt-get install$missing" >&2
  fi
fi

#!/usr/bin/env bash
# run_installed.sh PYTHON PACKAGE_SOURCE WORK_DIR SUITE...
# The Python package as a user gets it: a fresh venv of PYTHON (with the
# system's site-packages: Debian's grpcio, protobuf, torch, pytest), the
# package pip-installed into it offline (no index, no build isolation, no
# dependency resolution), then the pytest SUITEs run by that venv's python
# from WORK_DIR with no PYTHONPATH, so `import canzona` is the installed
# copy (conftest.py checks it through CANZONA_TEST_INSTALLED).
set -euo pipefail
python=$1
source=$2
work=$3
shift 3
rm -rf "$work"
mkdir -p "$work"
"$python" -m venv --system-site-packages "$work/venv"
# pip builds in the folder it is given (build/, canzona.egg-info): build a
# copy, so the source tree stays clean and concurrent runs do not collide.
cp -r "$source" "$work/src"
rm -rf "$work/src/build" "$work/src"/*.egg-info
find "$work/src" -name __pycache__ -prune -exec rm -rf {} +
"$work/venv/bin/python" -m pip install --no-build-isolation --no-deps \
  --no-index --disable-pip-version-check --quiet "$work/src"
unset PYTHONPATH
export CANZONA_TEST_INSTALLED="$work/venv"
cd "$work"
exec "$work/venv/bin/python" -m pytest -q -p no:cacheprovider "$@"

#!/usr/bin/env bash
# End-to-end suite: real edge-bin, node-bin and bench mock-provider processes on
# loopback, driven by the official Python SDKs and raw HTTP.
#
# Creates (or reuses) a virtualenv with the pinned SDKs, builds the binaries
# and runs pytest over tests/e2e. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

venv="${IOP_VENV:-.venv}"
req=tests/e2e/requirements.txt
stamp="$venv/.requirements.sha"
want=$(sha256sum "$req" | cut -d' ' -f1)
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "e2e: creating virtualenv $venv with $(tr '\n' ' ' < "$req" | sed 's/#[^ ]*//g')"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$req"
  echo "$want" > "$stamp"
fi

# The status page's browser test (tests/e2e/test_ui_browser.py) drives
# Debian's chromium through chromium-driver; install them where we may.
if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "e2e: installing chromium and chromium-driver for the browser test"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        chromium chromium-driver >/dev/null; } || echo "e2e: warning: could not install chromium" >&2
  else
    echo "e2e: chromium or chromedriver missing and not root with apt: the browser test will skip"
  fi
fi

# Multi-Edge runs need a real etcd (Debian's etcd-server, /usr/bin/etcd);
# install it where we may.
if ! command -v etcd >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "e2e: installing etcd-server for the multi-Edge tests"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        etcd-server >/dev/null; } || echo "e2e: warning: could not install etcd-server" >&2
  else
    echo "e2e: warning: etcd missing and not root with apt: multi-Edge tests will fail" >&2
  fi
fi

cargo build --workspace --bins --quiet
export IOP_BIN_DIR="${IOP_BIN_DIR:-$PWD/target/debug}"
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/e2e "$@"

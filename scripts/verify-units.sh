#!/usr/bin/env bash
# Checks the systemd units in packaging/systemd/ with `systemd-analyze
# verify` and that they keep the hardening docs/deployment.md promises.
#
#   scripts/verify-units.sh
#
# Installs Debian's `systemd` package when systemd-analyze is missing and
# apt-get can run (as root); otherwise says why it skips and exits 0.
# systemd older than 253 does not know Type=notify-reload: a copy with
# Type=notify is verified then, and the output says so. The binaries the
# units start are replaced by stand-ins, so no build or install is needed.
# Any message from systemd-analyze (an unknown key, a typo, a bad value) is
# a failure.
set -euo pipefail
cd "$(dirname "$0")/.."

units=(packaging/systemd/iop-edge.service packaging/systemd/iop-node.service)

if ! command -v systemd-analyze >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "systemd-analyze missing: installing Debian's systemd package"
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends systemd; } >/dev/null 2>&1; then
      echo "skip: could not install systemd (apt-get failed); units not verified"
      exit 0
    fi
  else
    echo "skip: systemd-analyze is not installed (and apt-get is not usable here); units not verified"
    exit 0
  fi
fi

# The promises, checked before systemd reads the files.
for unit in "${units[@]}"; do
  for line in 'Type=notify-reload' 'User=iop' 'NoNewPrivileges=yes' 'CapabilityBoundingSet=' \
              'AmbientCapabilities=' 'ProtectSystem=strict' 'LimitNOFILE=1048576' 'Restart=on-failure'; do
    if ! grep -qx -- "$line" "$unit"; then
      echo "error: $unit lacks the line '$line'" >&2
      exit 1
    fi
  done
done

version=$(systemd-analyze --version | awk 'NR == 1 { print $2 }')
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir "$tmp/bin"
for bin in edge-bin node-bin; do
  printf '#!/bin/sh\nexit 0\n' >"$tmp/bin/$bin"
  chmod 0755 "$tmp/bin/$bin"
done
type_note=""
for unit in "${units[@]}"; do
  copy="$tmp/$(basename "$unit")"
  sed "s#/usr/local/bin/#$tmp/bin/#g" "$unit" >"$copy"
  if [ "${version%%.*}" -lt 253 ] 2>/dev/null; then
    sed -i 's/^Type=notify-reload$/Type=notify/' "$copy"
    type_note=" (systemd $version predates Type=notify-reload, added in 253: verified a copy with Type=notify)"
  fi
done

status=0
out=$(systemd-analyze verify "$tmp"/*.service 2>&1) || status=$?
if [ "$status" != 0 ] || [ -n "$out" ]; then
  echo "$out" >&2
  echo "error: systemd-analyze verify failed (exit $status)" >&2
  exit 1
fi
echo "units ok: ${units[*]}, systemd $version$type_note"

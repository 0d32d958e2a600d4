#!/usr/bin/env bash
# Makes sure the alert test (tests/faults/alerts.rs) can run a real Prometheus server, and
# deploy/lint.sh its promtool: installs Debian's `prometheus` package (both binaries) when
# /usr/bin/prometheus or promtool is missing. Quiet when they are there.
# The package starts a Prometheus server of its own where systemd runs; the test starts its own,
# on a free port, with a throw-away configuration and storage.
set -euo pipefail

if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
echo "prometheus: installing Debian's prometheus package (server and promtool) for the alert test" >&2
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
command -v prometheus >/dev/null 2>&1 || { echo "prometheus: the package did not install /usr/bin/prometheus" >&2; exit 1; }

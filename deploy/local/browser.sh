#!/usr/bin/env bash
# Makes sure the console's browser test can run: installs Debian's `chromium` and
# `chromium-driver` packages when /usr/bin/chromium or /usr/bin/chromedriver is missing (the test
# drives headless Chromium through chromedriver). Where they cannot be installed (no apt-get, no
# root and no sudo), it says so and exits 0: under `make test` (which sets
# CARDWORKER_REQUIRE_BROWSER) the browser test then fails with the reason; run on its own, outside
# `make test`, it reports itself SKIPPED with the reason.
set -euo pipefail

if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO="sudo"
  else
    echo "browser: chromium/chromedriver missing and no root to install them; the console's browser test cannot run (make test fails on it)" >&2
    exit 0
  fi
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "browser: chromium/chromedriver missing and no apt-get; the console's browser test cannot run (make test fails on it)" >&2
  exit 0
fi
echo "browser: installing chromium and chromium-driver (Debian packages) for the console's browser test" >&2
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
if ! $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; then
  echo "browser: installing chromium failed; the console's browser test cannot run (make test fails on it)" >&2
fi

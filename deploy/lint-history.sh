#!/usr/bin/env bash
# Code comments say what the code does and why, in the present tense: the history of a change
# (which issue, what it replaced, the figures it measured) belongs in its commit message and in
# docs/BENCHMARKS.md / docs/SCALING.md. Fails, printing file:line, when src/, jobs/, wire/, sim/
# or test-kit/ (Rust, Lua, SQL, anything tracked there) mention an issue number ("issue 16",
# "issue #16"), "used to" or "as before". Quiet on success.
#   bash deploy/lint-history.sh
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

# \b keeps "refused to" and "caused to" out of "used to".
PATTERN='\bissues?[[:space:]]*#?[0-9]+|\bused to\b|\bas before\b'

if hits="$(grep -rnIiE --exclude-dir=target -e "$PATTERN" src jobs wire sim test-kit)"; then
  printf '%s\n' "$hits" >&2
  printf 'deploy/lint-history.sh: %s line(s) above narrate history (an issue number, "used to" or "as before"):\n' \
    "$(printf '%s\n' "$hits" | wc -l)" >&2
  printf 'say what the code does and why, in the present tense; history goes in the commit message and docs/.\n' >&2
  exit 1
fi

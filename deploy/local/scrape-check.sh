#!/usr/bin/env bash
# Starts a real worker (with the Gateway simulator) on a throw-away key prefix, scrapes its
# /metrics, and checks that every cardworker_* metric the alert rules and the dashboard use is one
# the binary actually exports (deploy/check_metric_names.py).
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${1:-target/debug/cardworker}
VENV="${XDG_CACHE_HOME:-$HOME/.cache}/cardworker-lint-venv"
PY=python3
[ -x "$VENV/bin/python" ] && PY="$VENV/bin/python"

work=$(mktemp -d)
prefix="scrapecheck-$$-$RANDOM"
db="cw_scrapecheck_$$_$RANDOM"
# A throw-away database: the worker runs every job (reconcile included), so it must not see the
# cards of the local development database.
psql -h 127.0.0.1 -U root -d postgres -qc "CREATE DATABASE $db" >/dev/null
cleanup() {
  [ -n "${WORKER:-}" ] && kill "$WORKER" 2>/dev/null || true
  [ -n "${SIM:-}" ] && kill "$SIM" 2>/dev/null || true
  wait 2>/dev/null || true
  redis-cli -h 127.0.0.1 --scan --pattern "$prefix:*" | xargs -r redis-cli -h 127.0.0.1 del >/dev/null
  # apalis-redis lists every queue it saw in one global key: forget this run's.
  redis-cli -h 127.0.0.1 zrange core:apalis:queues:list 0 -1 \
    | awk -v p="$prefix:" 'index($0, p) == 1' \
    | xargs -r redis-cli -h 127.0.0.1 zrem core:apalis:queues:list >/dev/null
  psql -h 127.0.0.1 -U root -d postgres -qc "DROP DATABASE IF EXISTS $db WITH (FORCE)" >/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

sim_port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
"$BIN" gateway-sim --listen "127.0.0.1:$sim_port" >"$work/sim.log" 2>&1 &
SIM=$!

export CARDWORKER__REDIS__KEY_PREFIX="$prefix"
export CARDWORKER__GATEWAY__BASE_URL="http://127.0.0.1:$sim_port"
export CARDWORKER__TELEMETRY__LISTEN="127.0.0.1:0"
export CARDWORKER__TELEMETRY__LOG_FORMAT="json"
export CARDWORKER__DATABASE__URL="postgres://root@127.0.0.1:5432/$db"
"$BIN" migrate >/dev/null
"$BIN" run 2>"$work/worker.log" &
WORKER=$!

addr=""
for _ in $(seq 1 100); do
  addr=$(grep -o '"addr":"[0-9.:]*"' "$work/worker.log" | head -n 1 | cut -d'"' -f4 || true)
  [ -n "$addr" ] && break
  kill -0 "$WORKER" 2>/dev/null || { cat "$work/worker.log" >&2; exit 1; }
  sleep 0.1
done
[ -n "$addr" ] || { echo "scrape-check: worker did not report its address" >&2; cat "$work/worker.log" >&2; exit 1; }
curl -fsS "http://$addr/metrics" >"$work/metrics.txt"
"$PY" deploy/check_metric_names.py "$work/metrics.txt"
echo "scrape-check: every metric used by the rules and the dashboard is exported"

#!/usr/bin/env bash
# The local demo behind `make run` and `make reset-demo`.
#
#   bash deploy/local/demo.sh run   BIN CONFIG   # migrate, seed cards, simulator + one worker
#   bash deploy/local/demo.sh reset BIN CONFIG   # drop the demo's database and key prefix
#
# Every address comes from the configuration as `cardworker check-config` resolves it (the file
# plus any CARDWORKER__… env override), so the worker, the simulator and this script always agree:
# the database of database.url, the keys under redis.key_prefix, the simulator on
# gateway.base_url's host and port. A second demo next to the first one is, for example,
#   CARDWORKER__DATABASE__URL=postgres://root@127.0.0.1:5432/cw_mine \
#   CARDWORKER__REDIS__KEY_PREFIX=cw_mine CARDWORKER__GATEWAY__BASE_URL=http://127.0.0.1:18089 \
#   CARDWORKER__TELEMETRY__LISTEN=127.0.0.1:19464 make run
# The database URL must carry no password (check-config redacts it); the local one has none.
#
# Knobs (env): DEMO_CARDS (how many demo cards c-demo-01.. exist, at most 99), DEMO_SIM_ARGS
# (the simulator's latency, error, garbage and change rates).
set -euo pipefail
cd "$(dirname "$0")/../.."

action=${1:?usage: demo.sh run|reset BIN CONFIG}
BIN=${2:?binary}
CONFIG=${3:?config file}
DEMO_CARDS=${DEMO_CARDS:-80}
DEMO_SIM_ARGS=${DEMO_SIM_ARGS:---latency-ms 150 --latency-jitter-ms 300 --change-rate 0.05 --error-rate 0.03 --garbage-rate 0.01 --approval-in-review-rate 1 --approval-review-ms 20000}

# database url, its name, an admin url (same server, database postgres), redis url, key prefix,
# simulator listen address, metrics endpoint; one per line.
config_json=$("$BIN" check-config --format json --config "$CONFIG")  # exits 2 naming the problem
settings=$(python3 -c '
import json, sys, urllib.parse as u
c = json.load(sys.stdin)
db = u.urlsplit(c["database"]["url"])
if "***" in (db.password or ""):
    sys.exit("demo.sh: database.url carries a password; the local demo expects none")
gw = u.urlsplit(c["gateway"]["base_url"])
print(c["database"]["url"])
print(db.path.lstrip("/"))
print(u.urlunsplit(db._replace(path="/postgres")))
print(c["redis"]["url"])
print(c["redis"]["key_prefix"])
print(f"{gw.hostname}:{gw.port or 80}")
print(c["telemetry"]["listen"])
' <<<"$config_json")
{ read -r DB_URL; read -r DB_NAME; read -r ADMIN_URL; read -r REDIS_URL; read -r PREFIX
  read -r SIM_LISTEN; read -r METRICS; } <<<"$settings"
case "$DB_NAME" in
  "" | *[!A-Za-z0-9_]*) echo "demo.sh: database name \"$DB_NAME\" must be letters, digits or _" >&2; exit 2 ;;
esac
cfg=(--config "$CONFIG")

reset() {
  echo "reset-demo: dropping database $DB_NAME and the Redis keys under $PREFIX:"
  if ! psql "$ADMIN_URL" -qc "DROP DATABASE IF EXISTS $DB_NAME" 2>/tmp/demo-reset.$$; then
    cat /tmp/demo-reset.$$ >&2; rm -f /tmp/demo-reset.$$
    echo "reset-demo: is \`make run\` still up? Stop it (Ctrl-C) and try again" >&2
    exit 1
  fi
  rm -f /tmp/demo-reset.$$
  local n
  n=$(redis-cli -u "$REDIS_URL" --scan --pattern "$PREFIX:*" | wc -l)
  redis-cli -u "$REDIS_URL" --scan --pattern "$PREFIX:*" | xargs -r -n 500 redis-cli -u "$REDIS_URL" del >/dev/null
  # apalis-redis lists every queue of every deployment in one global key; drop ours only.
  redis-cli -u "$REDIS_URL" zrange core:apalis:queues:list 0 -1 \
    | awk -v p="$PREFIX:" 'index($0, p) == 1' \
    | xargs -r redis-cli -u "$REDIS_URL" zrem core:apalis:queues:list >/dev/null
  echo "reset-demo: done ($n keys deleted); the next \`make run\` starts from fresh cards"
}

run() {
  if [ "$(psql "$ADMIN_URL" -Atqc "SELECT 1 FROM pg_database WHERE datname = '$DB_NAME'")" != "1" ]; then
    psql "$ADMIN_URL" -qc "CREATE DATABASE $DB_NAME" >/dev/null
  fi
  "$BIN" migrate "${cfg[@]}"
  local cards=$((DEMO_CARDS > 99 ? 99 : DEMO_CARDS))
  echo "seeding $cards demo cards (c-demo-01..$(printf '%02d' "$cards")) when missing"
  psql "$DB_URL" -qc "INSERT INTO cards (card_ref) SELECT 'c-demo-' || lpad(g::text, 2, '0') FROM generate_series(1, $cards) g ON CONFLICT (card_ref) DO NOTHING" >/dev/null
  echo "starting polling chains for every card that should be polled (reconcile)"
  "$BIN" reconcile "${cfg[@]}"

  # The simulator starts from the cards as the database has them, so a second `make run` answers
  # what the first one recorded instead of "pending, inactive" for every card.
  # shellcheck disable=SC2086 # DEMO_SIM_ARGS is a list of flags
  "$BIN" gateway-sim --listen "$SIM_LISTEN" $DEMO_SIM_ARGS --seed-from-db "${cfg[@]}" &
  SIM=$!
  # Ctrl-C reaches both processes (they stop on SIGINT); the trap covers every other way out
  # and keeps the worker's exit status as the demo's.
  # The operator's console, its own process; a fresh admin token unless one is given.
  local console_listen="${CONSOLE_LISTEN:-127.0.0.1:9465}"
  local token="${CARDWORKER__CONSOLE__ADMIN_TOKEN:-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')}"
  CARDWORKER__CONSOLE__ADMIN_TOKEN="$token" "$BIN" console --listen "$console_listen" "${cfg[@]}" &
  CONSOLE=$!
  trap 'rc=$?; kill "$SIM" "$CONSOLE" 2>/dev/null || true; wait "$SIM" "$CONSOLE" 2>/dev/null || true; exit $rc' EXIT
  for _ in $(seq 1 100); do
    curl -fsS "http://$SIM_LISTEN/healthz" >/dev/null 2>&1 && break
    kill -0 "$SIM" 2>/dev/null || { echo "the gateway simulator did not start" >&2; exit 1; }
    sleep 0.1
  done
  # One approval per run: answered in_review by the simulator, decided by the channel 20 s later,
  # and picked up by approval recovery (approvals.review_query_secs) about a minute after.
  local approval
  approval=$(psql "$DB_URL" -Atqc "INSERT INTO approvals (approval_id, card_ref, kind, amount_minor) VALUES (gen_random_uuid(), 'c-demo-01', 'limit_change', 500000) RETURNING approval_id")
  "$BIN" enqueue approval --approval-id "$approval" --reason "make run demo" "${cfg[@]}"
  local show="$BIN budget show ${cfg[*]}"
  cat <<BANNER
Gateway simulator on http://$SIM_LISTEN (stats: /sim/stats); worker metrics on http://$METRICS/metrics
Console at http://$console_listen/ (read-only until you log in with the admin token $token)
In another shell (README "What you should see in the first two minutes"):
  $show
  $BIN investigate --card-ref c-demo-01 ${cfg[*]}   (approval $approval: in_review, then decided in ~1-2 min)
  curl -s $SIM_LISTEN/sim/stats
Ctrl-C stops the worker, the simulator and the console.
BANNER
  "$BIN" run "${cfg[@]}"
}

case "$action" in
  run) run ;;
  reset) reset ;;
  *) echo "usage: demo.sh run|reset BIN CONFIG" >&2; exit 2 ;;
esac

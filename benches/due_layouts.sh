#!/usr/bin/env bash
# What a polling task shard's records cost Redis per card in four layouts, for the memory row of
# the one-queue issue (docs/BENCHMARKS.md, bench-redis-memory): the due queue's today and two timing
# wheels. Records only: no worker, no script of the product runs; each layout is written by one
# Lua call into an empty private redis-server and measured by `used_memory`.
#
# - today's (`jobs/src/due_queue.lua`): one sorted set (card -> due ms) and one hash
#   (card -> poll state);
# - the wheel: per time slot a list of the cards due in it, a sorted set of the slots that hold
#   any, and the cards' poll states (and slots) in small hashes, one per bucket of cards by
#   their number, each small enough to stay listpack-encoded (`hash-max-listpack-entries`,
#   default 512), at slot widths of 1, 10 and 60 s;
# - the wheel whose entries carry their card's due time and poll state (`due|card|state`, as
#   benches/due_wheel.lua writes them), with no other record per card, at 1, 5 and 10 s; and as
#   docs/SCALING.md plans it, at 5 s: a generation in each entry (`due|card|gen|state`) and each
#   card's presence in one of 1,024 hashes by card (card -> generation);
# - card-hashed buckets (benches/due_buckets.lua's records): per bucket of cards a sorted set
#   and a hash, listpack-encoded, and a sorted set of the buckets, at 32, 64 and 100 cards a
#   bucket.
#
# Every card is due once in the hour (`BENCH_INTERVAL_SECS`, default 3,600), with the poll state of
# a card polled unchanged once, as bench-redis-memory's cards are after their first round.
#
# usage: benches/due_layouts.sh (`make bench-due-layouts`); BENCH_CARDS (default 30,000).
# Needs redis-server and redis-cli.
set -euo pipefail
CARDS=${BENCH_CARDS:-30000}
INTERVAL=${BENCH_INTERVAL_SECS:-3600}
DIR=$(mktemp -d)
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
cleanup() {
  redis-cli -p "$PORT" shutdown nosave >/dev/null 2>&1 || true
  rm -rf "$DIR"
}
trap cleanup EXIT
redis-server --port "$PORT" --bind 127.0.0.1 --save "" --appendonly no --dir "$DIR" \
  --daemonize yes --logfile "$DIR/log" >/dev/null
for _ in $(seq 1 50); do redis-cli -p "$PORT" ping >/dev/null 2>&1 && break; sleep 0.1; done

cat >"$DIR/layouts.lua" <<'EOF'
local cards, interval, layout = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3]
local state = '1|t0gmqo|st0gmqo|0'
local base = 1765000000000
if layout == 'today' then
  for i = 1, cards do
    local card = string.format('m-%07d', i)
    redis.call('ZADD', 'due', base + (i % interval) * 1000, card)
    redis.call('HSET', 'state', card, state)
  end
elseif layout == 'buckets' then
  local buckets = math.ceil(cards / tonumber(ARGV[4]))
  for i = 1, cards do
    local card = string.format('m-%07d', i)
    local b = i % buckets
    redis.call('ZADD', 'due:' .. b, base + (i % interval) * 1000, card)
    redis.call('HSET', 'state:' .. b, card, state)
    redis.call('ZADD', 'heads', b, b)
  end
elseif layout == 'entries' or layout == 'planned' then
  local width = tonumber(ARGV[4]) * 1000
  local planned = layout == 'planned'
  for i = 1, cards do
    local due = base + (i % interval) * 1000
    local slot = math.floor(due / width)
    local card = string.format('m-%07d', i)
    if planned then
      redis.call('RPUSH', 'slot:' .. slot, string.format('%013d|', due) .. card .. '|0|' .. state)
      redis.call('HSET', 'cards:' .. (i % 1024), card, '0')
    else
      redis.call('RPUSH', 'slot:' .. slot, string.format('%013d|', due) .. card .. '|' .. state)
    end
    redis.call('ZADD', 'slots', slot, slot)
  end
else
  local width = tonumber(ARGV[4]) * 1000
  local buckets = math.ceil(cards / 100)
  for i = 1, cards do
    local card = string.format('m-%07d', i)
    local slot = math.floor((base + (i % interval) * 1000) / width)
    redis.call('RPUSH', 'slot:' .. slot, card)
    redis.call('ZADD', 'slots', slot, slot)
    redis.call('HSET', 'cards:' .. (i % buckets), card, slot .. '|' .. state)
  end
end
return redis.call('DBSIZE')
EOF

used() { redis-cli -p "$PORT" info memory | sed -n 's/^used_memory:\([0-9]*\).*/\1/p'; }
measure() {
  redis-cli -p "$PORT" flushall >/dev/null
  local before after keys
  before=$(used)
  keys=$(redis-cli -p "$PORT" --eval "$DIR/layouts.lua" , "$CARDS" "$INTERVAL" "$@")
  after=$(used)
  local name=$1 detail=${2:+, slots of $2 s}
  case $1 in
    wheel) name="wheel with a hash per card bucket" ;;
    entries) name="wheel, entries of due time, card and state" ;;
    planned) name="wheel as planned: entries with a generation, presence in 1,024 buckets" ;;
    buckets) name="card-hashed buckets"; detail=", $2 cards a bucket" ;;
  esac
  echo "| $name$detail | $keys | $(( (after - before) / CARDS )) |"
}
echo "$CARDS cards, each due once in $INTERVAL s, one task shard (redis $(redis-server --version | sed 's/.*v=\([^ ]*\).*/\1/')):"
echo "| layout | keys | used_memory per card and task, B |"
echo "| --- | ---: | ---: |"
measure today
for width in 1 10 60; do measure wheel "$width"; done
for width in 1 5 10; do measure entries "$width"; done
measure planned 5
for size in 32 64 100; do measure buckets "$size"; done

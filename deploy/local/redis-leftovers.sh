#!/usr/bin/env bash
# What the test suite leaves in the shared Redis (127.0.0.1:6379, db 0, the one the integration
# tests use): `before FILE` records the keys and the members of apalis-redis's global queue list
# as they are; `after FILE` lists what is there now and was not before, and fails if anything is.
# Every test cleans its own key prefix up (test-kit/src/harness.rs); this checks that, for the whole
# run, from the outside. Keys that were there before (a local `make run`'s, say) are left alone.
set -euo pipefail
mode=${1:?usage: redis-leftovers.sh before|after FILE}
file=${2:?usage: redis-leftovers.sh before|after FILE}
cli=(redis-cli -h 127.0.0.1 -p 6379 -n 0)

snapshot() {
  # redis-cli prints one empty line for an empty list: no entry.
  { "${cli[@]}" --scan | sed '/^$/d; s/^/key /'
    "${cli[@]}" zrange core:apalis:queues:list 0 -1 | sed '/^$/d; s/^/queue /'
  } | LC_ALL=C sort -u
}

case "$mode" in
  before) mkdir -p "$(dirname "$file")"; snapshot >"$file" ;;
  after)
    # A test's process may still be cleaning up when the run ends: what is left is read again
    # for up to a minute before it counts.
    for _ in $(seq 30); do
      left=$(LC_ALL=C comm -13 "$file" <(snapshot))
      [ -z "$left" ] && break
      sleep 2
    done
    if [ -n "$left" ]; then
      echo "the tests left $(wc -l <<<"$left") entries in the shared Redis:" >&2
      head -50 <<<"$left" >&2
      exit 1
    fi
    echo "redis: the tests left nothing behind"
    ;;
  *) echo "usage: redis-leftovers.sh before|after FILE" >&2; exit 2 ;;
esac

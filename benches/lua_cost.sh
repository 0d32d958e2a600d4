#!/usr/bin/env bash
# What each of a poll's Lua scripts costs Redis (issue 16), one script at a time, on a private
# redis-server on a free port (removed at the end): the chain's check and successor batches (16
# ops a call), the feeder (200 due chains a call) and a fetch + acknowledgement of 16 jobs, over
# 3,000 chain entries.
#
# `make bench-lua`: µs of command execution per op (commandstats, best of 3 runs; this VM's speed
# changes by the hour, so compare within one run). `make bench-lua VG=1`: the instructions
# redis-server ran per op, under callgrind: within about 0.5 % from run to run whatever the load
# (Redis's own hash seeds and clock still vary), which tells a change of a few per cent in a
# script from the VM's noise.
#
# usage: benches/lua_cost.sh [chain.lua] [feed.lua] [rounds]; FETCH=, ACK= other scripts; B= ops
# per chain call; W=7 for a chain script from before the job's turn (ARGV groups of 7, not 8).
# Needs redis-server, redis-cli, python3, bc (and valgrind for VG=1).
set -euo pipefail
CHAIN=${1:-jobs/src/chain.lua}; FEED=${2:-src/queue/feed.lua}; FETCH=${FETCH:-./src/queue/fetch.lua}; ACK=${ACK:-./src/queue/ack.lua}; ROUNDS=${3:-180}; B=${B:-16}; W=${W:-8}; CARDS=3000
PORT=$(python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])')
DIR=$(mktemp -d)
if [ -n "${VG:-}" ]; then
  valgrind --tool=callgrind --callgrind-out-file=$DIR/cg.out redis-server --port $PORT --save '' --appendonly no --dir $DIR >$DIR/vg.log 2>&1 &
  echo $! > $DIR/pid
else
  redis-server --port $PORT --save '' --appendonly no --dir $DIR --daemonize yes --pidfile $DIR/pid >/dev/null
fi
trap 'kill $(cat $DIR/pid) 2>/dev/null; rm -rf $DIR' EXIT
for i in $(seq 300); do redis-cli -p $PORT ping >/dev/null 2>&1 && break; sleep 0.1; done
R="redis-cli -p $PORT"
CS=$($R script load "$(cat $CHAIN)"); FS=$($R script load "$(cat $FEED)"); XS=$($R script load "$(cat $FETCH)"); AS=$($R script load "$(cat $ACK)")
P=mb
CH=$P:chain:poll_card_data; DUE=$P:chain_due:poll_card_data; IN=$P:intake:poll_card_data; IP=$P:intake_payload:poll_card_data
# chain entries
python3 - "$CARDS" > $DIR/setup.txt <<PY
import sys
n=int(sys.argv[1])
for i in range(n):
    print(f"HSET $CH card-{i:06d} ch{i:06d}|5|tk3abc|stk3aaa|0")
    print(f"ZADD $DUE 1125899906842624 card-{i:06d}")
PY
$R < $DIR/setup.txt >/dev/null
measure() { # name, command file, ops per call: the best of 3 runs
  if [ -n "${VG:-}" ]; then measure_vg "$@"; return; fi
  local best=999999 k u
  for k in 1 2 3; do u=$(measure1 "$@"); best=$(echo "if ($u < $best) $u else $best" | bc -l); done
  printf '%-10s %8.1f us/call  %6.2f us/op\n' "$1" "$best" "$(echo "$best/$3" | bc -l)"
}
# Instructions redis-server ran for the command file (callgrind: deterministic), per op; with a
# 4th argument, a file of the same commands without the measured calls, whose count is subtracted.
irs() {
  callgrind_control -z $(cat $DIR/pid) >/dev/null 2>&1
  $R < $1 > /dev/null
  rm -f $DIR/cg.out.*; callgrind_control -d $(cat $DIR/pid) >/dev/null 2>&1
  grep -h '^summary:\|^totals:' $DIR/cg.out.* | head -1 | awk '{print $2}'
}
measure_vg() {
  local a b=0 calls
  a=$(irs $2); [ -n "${4:-}" ] && b=$(irs $4)
  calls=$(grep -c EVALSHA $2)
  printf '%-10s %10.0f Ir/call  %8.0f Ir/op\n' "$1" "$(echo "($a-$b)/$calls" | bc -l)" "$(echo "($a-$b)/$calls/$3" | bc -l)"
}
measure1() {
  $R config resetstat >/dev/null
  $R < $2 > $DIR/out.$1; grep -m1 -i err $DIR/out.$1 >&2 || true
  local line calls usec
  line=$($R info commandstats | grep '^cmdstat_evalsha:' | tr -d '\r')
  calls=$(echo "$line" | sed 's/^cmdstat_evalsha:calls=\([0-9]*\).*/\1/'); usec=$(echo "$line" | sed 's/.*,usec=\([0-9]*\).*/\1/')
  echo "$usec/$calls" | bc -l
}
# One file of ROUNDS chain batches of B ops each, every op on a card of its own while ROUNDS x B
# stays within the cards (a seeded permutation: the same cards on every run, so that VG=1 counts
# the same work each time, and the check and successor files visit the cards in the same order, as
# a poll's check and its successor do): op name, then the op's five values after card and chain
# (the last one the job's turn, '' for unknown; dropped with W=7).
chain_batches() {
  python3 - "$@" <<PY
import random, sys
random.seed(1)
op, rest = sys.argv[1], sys.argv[2:$W - 1]
order = random.sample(range($CARDS), $CARDS)
for r in range($ROUNDS):
    args = []
    for k in range($B):
        i = order[(r * $B + k) % $CARDS]
        args += [op, f"card-{i:06d}", f"ch{i:06d}"] + rest
    print(f"EVALSHA $CS 4 $CH $IN $IP $DUE batch " + " ".join(args))
PY
}
chain_batches check freshid1 "''" "''" "''" "''" > $DIR/check.txt
measure check $DIR/check.txt $B
chain_batches schedule 1000 0 0 u "''" > $DIR/sched.txt
measure schedule $DIR/sched.txt $B
# feeder: 200 due chains per call, reset between calls (commandstats counts only the EVALSHA
# calls; under VG=1 the resets alone are run and subtracted)
FB=200
Q=$P:q:poll_card_data
python3 - > $DIR/feed.txt <<PY
import random
random.seed(1)
for r in range(max(1,$ROUNDS//10)):
    print(f"DEL {'$Q'}:active {'$Q'}:data {'$Q'}:signal")
    s=random.randrange($CARDS-$FB)
    print("ZADD $DUE " + " ".join(f"1 card-{i:06d}" for i in range(s,s+$FB)))
    print(f"EVALSHA $FS 11 $IN $IP $Q:active $Q:scheduled $Q:data $Q:signal $Q:meta $Q:dead $P:intakes:due $CH $DUE 100000 $FB ABCDEFGHJKMN")
    print(f"EVAL \"local k=redis.call('KEYS','$Q:meta:*') for i=1,#k,500 do redis.call('DEL',unpack(k,i,math.min(i+499,#k))) end\" 0")
PY
# the cleanup EVAL is counted under cmdstat_eval, not evalsha
grep -v EVALSHA $DIR/feed.txt > $DIR/feed0.txt
measure feed $DIR/feed.txt $FB $DIR/feed0.txt

python3 - > $DIR/fa.txt <<PY
for r in range($ROUNDS):
    ids=[f"01JX{r:06d}{k:04d}ABCDEFGHJKMN" for k in range($B)]
    print("DEL $Q:active"); print("RPUSH $Q:active " + " ".join(ids))
    print("HSET $Q:data " + " ".join(f"{i} x{i}x" for i in ids))
    for i in ids: print(f"HSET $Q:meta:{i} attempts 0 max_attempts 1 status Pending idempotency_key '' intake_entry card-000001")
    print("ZADD $Q:workers 1 w1")
    print(f"EVALSHA $XS 6 $Q:workers $Q:active $Q:inflight:w1 $Q:data $Q:signal $Q:scheduled 1000 $B w1")
    print(f"EVALSHA $AS 5 $Q:inflight:w1 $Q:dead $Q:scheduled $Q:data $Q:meta batch " + " ".join(f"{i} Done null 0" for i in ids))
PY
grep -v EVALSHA $DIR/fa.txt > $DIR/fa0.txt
measure fetch+ack $DIR/fa.txt $((B/2)) $DIR/fa0.txt

#!/usr/bin/env bash
# What the polling path's Lua scripts cost Redis, op by op, on a private redis-server on a free
# port (stopped and removed at the end):
# - the due queue (jobs/src/due_queue.lua), one shard of 3,000 cards, each with a poll state
#   (`1|t0gmqo|st0gmqo|0`), all due: a `fetch` of N cards under a 30 s lease, then one `batch`
#   acknowledging those N with the leases the fetch returned, each due again within a few ms
#   (each card's delay its own, as jittered intervals are) with the next state, at N = 1, 4, 16
#   and 32, per poll (one card fetched and acknowledged); a fetch of 256 whose polls end one by
#   one (256 `batch` calls of one card: a slow Gateway's spread), per poll; 64 fetches of one card
#   acknowledged in one `batch` (polls of different fetches that end together, each card under a
#   lease of its own), per poll; and `head` (what the lateness gauges read), per call;
# - the budget (src/budget/budget.lua with src/budget/circuit.lua prepended, as budget/mod.rs
#   loads it): a plain `acquire` of a carddata token (the default limits and circuit, no limit
#   reached, the circuit closed, no finish carried, no lease taken over), then the `release` of
#   its lease, per pair. What the pool's kept slots and the finishes an acquire carries change is
#   not measured here (bench-budget runs the whole layer);
# - two measuring prototypes of layouts that hold a card in less memory, fetch + `batch` of 32
#   over the same cards: benches/due_buckets.lua (card-hashed listpack buckets) at several bucket
#   counts and benches/due_wheel.lua (a timing wheel) at 1 s and 5 s slots, each after the due
#   queue script's prologue (LEASED, now_ms, int; BUCKETS=, WHEEL= other versions).
#
# `make bench-lua`: µs of command execution (INFO commandstats: EVALSHA's usec, which includes
# the commands the script runs; the best of 3 runs), EVALSHA calls and the commands the scripts
# run (TIME, ZRANGE, ZADD, ...), per poll, per `head` and per budget pair. This VM's speed changes
# by the hour: compare µs within one run. `make bench-lua VG=1`: the instructions redis-server
# runs instead of µs, under callgrind (one run, after a warm-up): everything the server does for
# the calls counts (reading and parsing them, the scripts, the replies). The count is within about
# 0.5 % from run to run whatever the load (Redis's clock and hash seeds still vary), so it tells a
# change of a few per cent in a script from the VM's noise.
#
# usage: benches/lua_cost.sh [due_queue.lua] [polls per run]   (defaults: the tree's script,
# 3,200 polls per run and batch size); BUDGET=, CIRCUIT= other budget scripts. Needs
# redis-server, redis-cli and python3 (and valgrind for VG=1).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DUE=${1:-$ROOT/jobs/src/due_queue.lua}; POLLS=${2:-3200}
BUDGET=${BUDGET:-$ROOT/src/budget/budget.lua}; CIRCUIT=${CIRCUIT:-$ROOT/src/budget/circuit.lua}
BUCKETS=${BUCKETS:-$ROOT/benches/due_buckets.lua}; WHEEL=${WHEEL:-$ROOT/benches/due_wheel.lua}
PORT=$(python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])')
DIR=$(mktemp -d)
if [ -n "${VG:-}" ]; then
  valgrind --tool=callgrind --callgrind-out-file=$DIR/cg.out redis-server --port $PORT --save '' --appendonly no --dir $DIR >$DIR/vg.log 2>&1 &
  echo $! > $DIR/pid
else
  redis-server --port $PORT --save '' --appendonly no --dir $DIR --daemonize yes --pidfile $DIR/pid >/dev/null
fi
cleanup() { # the server stopped (callgrind writes its last dump as it exits), then its directory
  local pid; pid=$(cat $DIR/pid 2>/dev/null || true)
  if [ -n "$pid" ]; then
    kill $pid 2>/dev/null || true
    for i in $(seq 100); do kill -0 $pid 2>/dev/null || break; sleep 0.1; done
  fi
  rm -rf $DIR
}
trap cleanup EXIT
for i in $(seq 300); do redis-cli -p $PORT ping >/dev/null 2>&1 && break; sleep 0.1; done
for i in $(seq 50); do [ -s $DIR/pid ] && break; sleep 0.1; done
echo "redis-server $(redis-server --version | sed 's/.* v=\([^ ]*\).*/\1/') on port $PORT; $(basename $DUE), $POLLS polls per run and batch size${VG:+; callgrind}"

python3 - "$PORT" "$DUE" "$CIRCUIT" "$BUDGET" "$POLLS" "${VG:-}" "$DIR" "$(cat $DIR/pid)" "$BUCKETS" "$WHEEL" <<'PY'
import glob, os, socket, subprocess, sys, time

port, due_lua, circuit_lua, budget_lua = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
polls, vg, tmp, pid = int(sys.argv[5]), bool(sys.argv[6]), sys.argv[7], sys.argv[8]
buckets_lua, wheel_lua = sys.argv[9], sys.argv[10]
CARDS, BATCHES, HEADS, PAIRS, ONE_BY_ONE = 3000, (1, 4, 16, 32), 1000, 1000, 256
BUCKET_COUNTS = (1, 8, 32, 128, 512)
WHEEL_MS = (1000, 5000)
LEASE_MS, STATE = 30000, '1|t0gmqo|st0gmqo|0'


class Redis:
    """A RESP2 client over one socket: enough for these calls."""

    def __init__(self, port):
        self.sock = socket.create_connection(('127.0.0.1', port))
        self.file = self.sock.makefile('rb')

    def __call__(self, *args):
        out = [b'*%d\r\n' % len(args)]
        for a in args:
            a = a if isinstance(a, bytes) else str(a).encode()
            out.append(b'$%d\r\n%s\r\n' % (len(a), a))
        self.sock.sendall(b''.join(out))
        return self.read()

    def read(self):
        line = self.file.readline()
        kind, rest = line[:1], line[1:-2]
        if kind == b'+':
            return rest.decode()
        if kind == b'-':
            raise RuntimeError(rest.decode())
        if kind == b':':
            return int(rest)
        if kind == b'$':
            n = int(rest)
            return None if n < 0 else self.file.read(n + 2)[:-2].decode()
        if kind == b'*':
            n = int(rest)
            return None if n < 0 else [self.read() for _ in range(n)]
        raise RuntimeError(f'unexpected reply {line!r}')


r = Redis(port)


def callgrind(flag):
    subprocess.run(['callgrind_control', flag, pid], stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, check=False)


def instructions(work):
    """The instructions redis-server ran for work() (callgrind's counters zeroed, then dumped)."""
    callgrind('-z')
    work()
    for f in glob.glob(os.path.join(tmp, 'cg.out.*')):
        os.remove(f)
    callgrind('-d')
    for f in sorted(glob.glob(os.path.join(tmp, 'cg.out.*'))):
        for line in open(f):
            if line.startswith(('summary:', 'totals:')):
                return int(line.split()[1])
    raise RuntimeError('no callgrind dump')


def stats():
    """INFO commandstats: command -> (calls, usec), without this script's CONFIG RESETSTAT."""
    out = {}
    for line in r('INFO', 'commandstats').splitlines():
        if line.startswith('cmdstat_'):
            name, fields = line[len('cmdstat_'):].split(':', 1)
            f = dict(kv.split('=') for kv in fields.split(','))
            if not name.startswith('config'):
                out[name] = (int(f['calls']), int(f['usec']))
    return out


def measure(work, units):
    """Per unit: (µs of EVALSHA, the best of 3 runs; or instructions, one run under callgrind),
    EVALSHA calls, commands the scripts ran, {command: calls}."""
    best = None
    for _ in range(1 if vg else 3):
        r('CONFIG', 'RESETSTAT')
        if vg:
            cost = instructions(work) / units
        else:
            work()
        s = stats()
        if not vg:
            cost = s['evalsha'][1] / units
        if best is None or cost < best:
            best = cost
        inner = {k: v[0] / units for k, v in s.items() if k != 'evalsha'}
    return best, s['evalsha'][0] / units, sum(inner.values()), inner


def names(inner, per):
    return ', '.join(f'{k} {v * per:g}' for k, v in sorted(inner.items(), key=lambda kv: (-kv[1], kv[0])))


# The due queue: one shard, every card due (in card order) with a state after one unchanged poll.
due_sha = r('SCRIPT', 'LOAD', open(due_lua).read())
DQ = ['cw:{poll:carddata:0}:due', 'cw:{poll:carddata:0}:last_lease', 'cw:{poll:carddata:0}:state']
setup = []
for i in range(CARDS):
    setup += [f'card-{i:06d}', i, STATE]
assert r('EVALSHA', due_sha, 3, *DQ, 'adopt', *setup) == CARDS


def fetch(n):
    """A fetch of at most n cards: [(card, lease)], from the script's answer {lease, {card, due,
    ...}, {state, ...}}, or from a flat card, lease, due, state a card (a script of before
    13a6377), so that `lua_cost.sh old.lua` compares."""
    got = r('EVALSHA', due_sha, 3, *DQ, 'fetch', n, LEASE_MS)
    if len(got) == 3 and isinstance(got[1], list):
        return [(got[1][i], got[0]) for i in range(0, len(got[1]), 2)]
    return [(got[i], got[i + 1]) for i in range(0, len(got), 4)]


def polls_of(n, rounds, per_call=None):
    """Fetches of n cards, each acknowledged per_call cards a `batch` call (all n in one call by
    default; one card a call is a slow Gateway's spread)."""
    per_call = per_call or n

    def work():
        for _ in range(rounds):
            taken = fetch(n)
            if len(taken) != n:
                raise RuntimeError(f'fetch of {n} answered {len(taken)} cards')
            acks = []
            for k, (card, lease) in enumerate(taken):
                # Each successor's delay differs, as polls' jittered intervals do; a few ms, so
                # that the cards are soon due again.
                acks += [card, lease, k, STATE]
            for i in range(0, len(acks), 4 * per_call):
                part = acks[i:i + 4 * per_call]
                done = r('EVALSHA', due_sha, 3, *DQ, 'batch', *part)
                if done != [1] * (len(part) // 4):
                    raise RuntimeError(f'batch of {len(part) // 4} answered {done}')
    return work


unit = 'instructions' if vg else 'µs'
print(f'\ndue queue: fetch + acknowledgement (batch), {CARDS} cards; per poll')
print(f'{"batch":>5}  {unit + "/poll":>16}  {"EVALSHA/poll":>12}  {"commands/poll":>13}')
for n in BATCHES:
    rounds = max(1, polls // n)
    polls_of(n, max(1, rounds // 10))()  # warm-up
    cost, calls, cmds, inner = measure(polls_of(n, rounds), rounds * n)
    print(f'{n:>5}  {cost:>16,.{0 if vg else 2}f}  {calls:>12.4g}  {cmds:>13.4g}')
print(f'  commands per fetch + batch call pair: {names(inner, 2 / calls)}')


n = ONE_BY_ONE
rounds = max(1, polls // n)
polls_of(n, 1, 1)()  # warm-up
cost, calls, cmds, inner = measure(polls_of(n, rounds, 1), rounds * n)
print(f'\ndue queue: a fetch of {n} acknowledged one card a call, per poll: '
      f'{cost:,.{0 if vg else 2}f} {unit}, {calls:.4g} EVALSHA, {cmds:.4g} commands '
      f'({names(inner, 1)})')


def lone_polls(n, rounds):
    """n fetches of one card each (n leases), then one `batch` acknowledging all n: what the
    batcher sends when polls of different fetches end together (MAX_BATCH is 64)."""
    def work():
        for _ in range(rounds):
            acks = []
            for k in range(n):
                (card, lease), = fetch(1)
                acks += [card, lease, k, STATE]
            done = r('EVALSHA', due_sha, 3, *DQ, 'batch', *acks)
            if done != [1] * n:
                raise RuntimeError(f'batch of {n} lone cards answered {done}')
    return work


n = 64
rounds = max(1, polls // n)
lone_polls(n, 1)()  # warm-up
cost, calls, cmds, inner = measure(lone_polls(n, rounds), rounds * n)
print(f'\ndue queue: {n} fetches of one card, acknowledged in one batch, per poll: '
      f'{cost:,.{0 if vg else 2}f} {unit}, {calls:.4g} EVALSHA, {cmds:.4g} commands '
      f'({names(inner, 1)})')


def heads():
    for _ in range(HEADS):
        r('EVALSHA', due_sha, 3, *DQ, 'head')


# Every card due again (the successors above were due within a fraction of a second).
for _ in range(100):
    head = r('EVALSHA', due_sha, 3, *DQ, 'head')
    if head[2] == CARDS:
        break
    time.sleep(0.05)
assert head[2] == CARDS, head
cost, calls, cmds, inner = measure(heads, HEADS)
print(f'\ndue queue: head ({CARDS} cards due), per call: {cost:,.{0 if vg else 2}f} {unit}, '
      f'{cmds:g} commands ({names(inner, 1)})')

BATCH = 32


def per_poll(one_round):
    """measure() of rounds of one_round() (one fetch of BATCH and its `batch`), after a warm-up."""
    def rounds_of(n):
        def work():
            for _ in range(n):
                one_round()
        return work
    rounds = max(1, polls // BATCH)
    rounds_of(max(1, rounds // 10))()
    return measure(rounds_of(rounds), rounds * BATCH)


def expect(what, got, want):
    if got != want:
        raise RuntimeError(f'{what} answered {got}, not {want}')


def load_prototype(path):
    """A prototype's script after the due queue's own prologue (its text up to its base-36
    digits: LEASED, now_ms and int), so that both run on the same clock and constants."""
    text = open(due_lua).read()
    return r('SCRIPT', 'LOAD', text[:text.index('local DIGITS')] + '\n' + open(path).read())


# The bucketed layout's prototype (benches/due_buckets.lua): the same cards and states spread
# by card number over B buckets, fetched and acknowledged in batches of 32 as above; a fetch
# first reads the due buckets from the heads set (one ZRANGE, at most 32), as a worker would.
bk_sha = load_prototype(buckets_lua)
print(f'\nbucketed layout (due_buckets.lua), {CARDS} cards, fetch + batch of {BATCH}; per poll')
print(f'{"buckets":>7}  {"cards/bucket":>12}  {unit + "/poll":>16}  {"calls/poll":>10}  '
      f'{"commands/poll":>13}  encoding')
for nb in BUCKET_COUNTS:
    tag = f'cw:{{poll:carddata:{nb}}}:'
    heads_key, last_key = tag + 'heads', tag + 'last_lease'
    zkey = [tag + f'due:{b}' for b in range(nb)]
    hkey = [tag + f'state:{b}' for b in range(nb)]
    for b in range(nb):
        members = [x for i in range(b, CARDS, nb) for x in (i, f'card-{i:06d}')]
        states = [x for i in range(b, CARDS, nb) for x in (f'card-{i:06d}', STATE)]
        r('ZADD', zkey[b], *members)
        r('HSET', hkey[b], *states)
        r('ZADD', heads_key, b, b)

    def bucket_round():
        now = int(time.time() * 1000)
        due = r('ZRANGE', heads_key, '-inf', now, 'BYSCORE', 'LIMIT', 0, BATCH)
        keys = [heads_key, last_key]
        for b in due:
            keys += [zkey[int(b)], hkey[int(b)]]
        got = r('EVALSHA', bk_sha, len(keys), *keys, 'fetch', BATCH, LEASE_MS, *due)
        expect('a bucketed fetch, in cards', len(got) // 4, BATCH)
        at = {b: k + 1 for k, b in enumerate(due)}
        acks = []
        for i in range(0, len(got), 4):
            acks += [at[str(int(got[i][5:]) % nb)], got[i], got[i + 1], 0, STATE]
        expect('a bucketed batch', r('EVALSHA', bk_sha, len(keys), *keys, 'batch', BATCH, *acks,
                                     *due), [1] * BATCH)

    cost, calls, cmds, inner = per_poll(bucket_round)
    enc = r('OBJECT', 'ENCODING', zkey[0]) + '/' + r('OBJECT', 'ENCODING', hkey[0])
    print(f'{nb:>7}  {CARDS / nb:>12.4g}  {cost:>16,.{0 if vg else 2}f}  {calls:>10.4g}  '
          f'{cmds:>13.4g}  {enc}')
    r('DEL', heads_key, last_key, *zkey, *hkey)

# The timing wheel's prototype (benches/due_wheel.lua): the same cards and states as entries
# of slot lists WHEEL_MS wide, fetched and acknowledged in batches of 32 as above; a fetch first
# reads the due slots (one ZRANGE, at most 4), and a successor goes to the slot of its due time
# on the caller's clock, as a worker would send them.
wh_sha = load_prototype(wheel_lua)
print(f'\ntiming wheel (due_wheel.lua), {CARDS} cards, fetch + batch of {BATCH}; per poll')
print(f'{"slot ms":>7}  {unit + "/poll":>16}  {"calls/poll":>10}  {"commands/poll":>13}')
for width in WHEEL_MS:
    tag = f'cw:{{poll:carddata:w{width}}}:'
    slots_key, last_key, fz = (tag + k for k in ('slots', 'last_lease', 'flight'))
    slot_keys = set()
    base = int(time.time() * 1000) - 60000
    for i in range(CARDS):
        due = base + i
        slot_keys.add(tag + f'slot:{due // width}')
        r('RPUSH', tag + f'slot:{due // width}', f'{due:013d}|card-{i:06d}|{STATE}')
        r('ZADD', slots_key, 'NX', due // width, due // width)

    def wheel_round():
        now = int(time.time() * 1000)
        due = r('ZRANGE', slots_key, '-inf', now // width, 'BYSCORE', 'LIMIT', 0, 4)
        keys = [slots_key, last_key, fz] + [tag + f'slot:{s}' for s in due]
        got = r('EVALSHA', wh_sha, len(keys), *keys, 'fetch', BATCH, LEASE_MS, *due)
        expect('a wheel fetch, in cards', len(got) - 1, BATCH)
        sid = int(time.time() * 1000) // width
        slot_keys.add(tag + f'slot:{sid}')
        keys = [slots_key, last_key, fz, tag + f'slot:{sid}']
        acks = []
        for e in got[1:]:
            acks += [1, e, e[14:e.index('|', 14)], got[0], 0, STATE]
        expect('a wheel batch', r('EVALSHA', wh_sha, len(keys), *keys, 'batch', BATCH, *acks,
                                  sid), [1] * BATCH)

    cost, calls, cmds, inner = per_poll(wheel_round)
    print(f'{width:>7}  {cost:>16,.{0 if vg else 2}f}  {calls:>10.4g}  {cmds:>13.4g}')
    r('DEL', slots_key, last_key, fz, *slot_keys)

# The budget: the script as budget/mod.rs loads it, its 13 keys, an acquire as Budget::acquire
# sends it with the default config (total limit 8, carddata limit 4, 60 s lease TTL, the default
# circuit, a 35 s fence; no finish carried), then the release of its lease.
budget_sha = r('SCRIPT', 'LOAD', open(circuit_lua).read() + '\n' + open(budget_lua).read())
BK = ['cw:{budget}:' + k for k in (
    'total', 'task:carddata', 'task:card_status', 'overrides', 'paused', 'circuit:carddata',
    'circuit:card_status', 'circuit:carddata:window', 'circuit:card_status:window', 'waiters',
    'expired', 'kept', 'fence')]
CIRCUIT_CFG = '1,20,60000,10,3,50,10000,120000,2'


def pairs():
    for i in range(PAIRS):
        lease = f'pod-a-4242-01JXQ5V6M8ZK3W{i:010d}'
        got = r('EVALSHA', budget_sha, len(BK), *BK, 'acquire', 2, 'carddata', lease, 8, 4, 256,
                60000, CIRCUIT_CFG, 0, 'pod-a-4242', 0, 35000, 0)
        if got[0] != 1:
            raise RuntimeError(f'acquire answered {got}')
        if r('EVALSHA', budget_sha, len(BK), *BK, 'release', lease) != 1:
            raise RuntimeError('release found no lease')


pairs()  # warm-up; the first acquire also writes the fence hash
cost, calls, cmds, inner = measure(pairs, PAIRS)
print(f'\nbudget: acquire + release, per pair: {cost:,.{0 if vg else 2}f} {unit}, '
      f'{cmds:g} commands ({names(inner, 1)})')
PY

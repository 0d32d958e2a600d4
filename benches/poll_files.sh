#!/usr/bin/env bash
# The product files and folders a poll's code runs in, from fetch to acknowledgement: the goal
# table's "files a carddata poll crosses" row (issue "polling has one queue").
#
# Sampled, not read off the source: a release worker built with frame pointers and line tables
# (its own target directory, target/poll-files) polls under bench-redis's short run (3,000 cards,
# both tasks every second, one runtime thread), `perf record -g` samples it for PERF_SECS
# (default 20) at 1,999 Hz, and every sample whose stack holds a `cardworker::polling::` frame
# counts: each frame of the worker's binary from the leaf up to the outermost polling frame (the
# fetch, or the poll's task; not the runtime, supervisor and main above it), inlined frames
# included (addr2line -i), names a source file. What is listed is every file of `src/`, `jobs/` and `wire/` named so. A card
# status poll runs the same flow, so `src/polling/card_status.rs` is listed apart and left out
# of the carddata count. A file whose code is too short-lived for a sample can be missed: the
# figure is a lower bound, and two runs may differ by a file.
#
# usage: benches/poll_files.sh (`make bench-files`). Needs perf (Debian: linux-perf), addr2line
# (binutils), python3, and what bench-redis needs (PostgreSQL, redis-server).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
SECS=${PERF_SECS:-20}
DIR=$(mktemp -d)
BENCH_PID=
cleanup() {
  if [ -n "$BENCH_PID" ]; then kill "$BENCH_PID" 2>/dev/null || true; wait "$BENCH_PID" 2>/dev/null || true; fi
  rm -rf "$DIR"
}
trap cleanup EXIT

# The profiled worker: frame pointers for perf's stacks, line tables (not stripped) for addr2line.
CARGO_TARGET_DIR=$ROOT/target/poll-files CARGO_PROFILE_RELEASE_DEBUG=line-tables-only \
  CARGO_PROFILE_RELEASE_STRIP=none RUSTFLAGS="-C force-frame-pointers=yes" \
  cargo build --release --bin cardworker
BIN=$ROOT/target/poll-files/release/cardworker
# The bench that drives it, an ordinary release build.
BENCH=$(cargo bench --bench bench_redis --no-run --message-format=json 2>/dev/null |
  python3 -c 'import json,sys
for line in sys.stdin:
    m=json.loads(line)
    if m.get("reason")=="compiler-artifact" and m["target"]["name"]=="bench_redis" and m.get("executable"):
        print(m["executable"])')

CARDWORKER_BIN=$BIN BENCH_WORKER_THREADS=1 BENCH_SHORT=1 "$BENCH" --bench >"$DIR/bench.log" 2>&1 &
BENCH_PID=$!
# Steady polling: a worker up for 10 s (the warm-up's or the window's; both poll the same way).
for _ in $(seq 1 600); do
  pgrep -f "^$BIN run" >/dev/null && break
  kill -0 "$BENCH_PID" 2>/dev/null || { cat "$DIR/bench.log"; exit 1; }
  sleep 0.5
done
sleep 10
perf record -F 1999 -g -a -o "$DIR/perf.data" -- sleep "$SECS" >/dev/null 2>&1
# The bench runs to its end, which stops its worker, its redis-server and drops its database.
wait "$BENCH_PID" || { cat "$DIR/bench.log"; exit 1; }
BENCH_PID=
perf script -i "$DIR/perf.data" -F ip,sym,dso 2>/dev/null >"$DIR/stacks.txt"

python3 - "$BIN" "$DIR/stacks.txt" "$ROOT" <<'EOF'
import re, subprocess, sys
binary, stacks, root = sys.argv[1], sys.argv[2], sys.argv[3] + "/"
# perf names a frame of a PIE binary by its file offset; addr2line wants the virtual address:
# add the difference of the loadable segment that holds the offset.
segments = []
for line in subprocess.run(["readelf", "-lW", binary], capture_output=True, text=True, check=True).stdout.splitlines():
    f = line.split()
    if f and f[0] == "LOAD":
        segments.append((int(f[1], 16), int(f[2], 16), int(f[4], 16)))
def vaddr(offset):
    for off, va, size in segments:
        if off <= offset < off + size:
            return offset + va - off
    return offset
samples, cur = [], []
for line in open(stacks, errors="replace"):
    if not line.strip():
        if cur:
            samples.append(cur)
        cur = []
        continue
    m = re.match(r"\s+([0-9a-f]+) (.*) \((.*)\)$", line.rstrip())
    if m:
        cur.append((int(m.group(1), 16), m.group(2), m.group(3)))
if cur:
    samples.append(cur)
polls = [s for s in samples if any("cardworker::polling::" in sym for _, sym, _ in s)]
addrs = set()
for s in polls:
    # The poll's own frames: from the leaf up to its outermost polling frame (the fetch, or the
    # poll's task); the frames above it (the runtime, the worker's supervisor, main) are not.
    top = max(k for k, (_, sym, _) in enumerate(s) if "cardworker::polling::" in sym)
    for k, (ip, _, dso) in enumerate(s[: top + 1]):
        if dso == binary:
            # A caller's frame holds its return address: the call is the byte before it.
            addrs.add(vaddr(ip) - (1 if k else 0))
out = subprocess.run(["addr2line", "-e", binary, "-i"], input="\n".join("%x" % a for a in sorted(addrs)),
                     capture_output=True, text=True, check=True).stdout
files = set()
for line in out.splitlines():
    path = line.split(":")[0]
    if path.startswith(root) and path[len(root):].startswith(("src/", "jobs/", "wire/")):
        files.add(path[len(root):])
status_only = {"src/polling/card_status.rs"}
carddata = sorted(files - status_only)
folders = sorted({f.rsplit("/", 1)[0] for f in carddata})
print(f"samples: {len(samples)} of the machine, {len(polls)} in a poll's stack")
print(f"files a carddata poll crosses: {len(carddata)} in {len(folders)} folders (goal: at most 12 in at most 4)")
for folder in folders:
    names = [f.rsplit("/", 1)[1] for f in carddata if f.rsplit("/", 1)[0] == folder]
    print(f"  {folder}/: {', '.join(names)}")
for f in sorted(files & status_only):
    print(f"  (left out: {f}, the card status poll's own)")
EOF

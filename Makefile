# cardworker: the two commands of the README are `make run` and `make test`.
SHELL := /bin/bash
CARGO ?= cargo
BIN := $(or $(CARGO_TARGET_DIR),target)/debug/cardworker
DEMO_CARDS ?= 80
LOCAL_CONFIG ?= config/local.toml

CONSOLE_LISTEN ?= 127.0.0.1:9465

.PHONY: run reset-demo test test-faults chaos chaos-short services prometheus build lint fmt clippy lint-history doc lint-deploy scrape-check build-tests bench-writes bench-budget bench-intake bench-plans bench-reconcile bench-approvals bench-outage bench-slowdown bench-scrape bench-redis bench-due-queue bench-redis-ab bench-redis-raw bench-redis-idle bench-redis-memory bench-burst bench-lua bench-files bench-due-layouts browser console-screenshots

## The local demo (deploy/local/demo.sh): sets up PostgreSQL and Redis, migrates, seeds
## $(DEMO_CARDS) demo cards, starts the Gateway simulator (seeded from the database) and one worker
## with $(LOCAL_CONFIG), and the console on $(CONSOLE_LISTEN). Ctrl-C stops them all.
run: services build
	CONSOLE_LISTEN=$(CONSOLE_LISTEN) DEMO_CARDS=$(DEMO_CARDS) bash deploy/local/demo.sh run $(BIN) $(LOCAL_CONFIG)

## Drops the demo's database and the Redis keys under its prefix (nothing else: never FLUSHALL).
reset-demo: build
	bash deploy/local/demo.sh reset $(BIN) $(LOCAL_CONFIG)

## Runs every test (unit, integration against real PostgreSQL and Redis, deploy lint).
## nextest runs every test in its own process, which the metrics tests need (one global
## recorder per process); `.ci/run` installs it when missing. The suite must leave nothing in
## the shared Redis (deploy/local/redis-leftovers.sh compares its keys before and after).
test: services browser prometheus
	@$(CARGO) nextest --version >/dev/null 2>&1 || { echo "cargo-nextest is required: cargo install cargo-nextest --locked" >&2; exit 1; }
	@bash deploy/local/redis-leftovers.sh before target/redis-before-test.txt
	CARDWORKER_REQUIRE_BROWSER=1 $(CARGO) nextest run --workspace --no-fail-fast
	bash deploy/local/redis-leftovers.sh after target/redis-before-test.txt
	$(MAKE) chaos-short
	$(MAKE) lint-deploy
	$(MAKE) scrape-check

## The fault-injection suite alone (also part of `make test`): each test starts its own
## redis-server or PostgreSQL cluster on a free port (needs redis-server and PostgreSQL 15's
## initdb/pg_ctl; as root, PostgreSQL runs as the `postgres` user).
test-faults: services prometheus
	$(CARGO) nextest run --test faults --no-fail-fast

## Chaos with a checker (tests/chaos): a private Redis and PostgreSQL, the simulator and 3 workers
## under a supervisor; a workload and a fault schedule drawn from CHAOS_SEED (a fresh one when
## unset) for CHAOS_SECS (faults, then a quiet period), then one line per invariant. The seed is
## printed first and last; CHAOS_SEED=N replays the same schedule. docs/RELIABILITY.md.
CHAOS_SECS ?= 600
chaos: services
	@seed="$(CHAOS_SEED)"; [ -n "$$seed" ] || seed=$$(od -An -N4 -tu4 /dev/urandom | tr -d ' '); \
	echo "chaos seed $$seed ($(CHAOS_SECS) s)"; \
	CHAOS_SEED=$$seed CHAOS_SECS=$(CHAOS_SECS) $(CARGO) nextest run --test chaos --run-ignored all --no-capture

## The chaos run of `make test` (and so CI): 2 minutes of seed $(CHAOS_TEST_SEED), about 2.5 minutes
## of wall time. The seed is fixed so that a failure replays; its schedule is listed in
## docs/RELIABILITY.md.
CHAOS_TEST_SEED ?= 369
chaos-short:
	$(MAKE) chaos CHAOS_SECS=120 CHAOS_SEED=$(CHAOS_TEST_SEED)

services:
	@bash deploy/local/services.sh

## Installs Debian's prometheus package (server and promtool) for the alert test on a real
## Prometheus (tests/faults/alerts.rs) and the rules lint.
prometheus:
	@bash deploy/local/prometheus.sh

## Installs headless Chromium and chromedriver (Debian packages) for the console's browser test.
browser:
	@bash deploy/local/browser.sh

## Re-takes the console screenshots in docs/console/ (the browser test, saving its pages).
console-screenshots: services browser
	CARDWORKER_CONSOLE_SCREENSHOTS=1 $(CARGO) nextest run --test it -E 'test(/in_a_real_browser/)'

build:
	$(CARGO) build --bin cardworker

fmt:
	$(CARGO) fmt --all -- --check

clippy:
	$(CARGO) clippy --workspace --all-targets -- -D warnings

## fmt, clippy (the workspace lints of Cargo.toml, warnings denied), present-tense comments,
## the API docs (rustdoc warnings denied: every intra-doc link resolves) and the deployment lint.
lint: fmt clippy lint-history doc lint-deploy

## Fails on history in code comments: an issue number, "used to" or "as before" in src/, jobs/,
## wire/, sim/ or test-kit/ (deploy/lint-history.sh). History goes in commit messages and docs/.
lint-history:
	bash deploy/lint-history.sh

## The API docs of both crates (target/doc), failing on any rustdoc warning.
doc:
	RUSTDOCFLAGS="-D warnings" $(CARGO) doc --no-deps --workspace

## Checks the deployment artefacts with real tools (promtool, kubernetes-validate, hadolint, yamllint).
lint-deploy:
	bash deploy/lint.sh

## Starts a worker, scrapes /metrics, and checks that every metric the rules and dashboard use is exported.
## It runs the binary of the test build: right after `nextest run` that build is a no-op, so
## `make test` builds the product once (`build` would rebuild it with other dependency features).
scrape-check: build-tests
	bash deploy/local/scrape-check.sh $(BIN)

## The build `cargo nextest run --workspace` does (test profile, dev-dependencies), $(BIN) included.
build-tests:
	$(CARGO) test --workspace --no-run

bench-writes: services
	$(CARGO) bench --bench bench_writes

bench-budget: services
	$(CARGO) bench --bench bench_budget

bench-intake: services
	$(CARGO) bench --bench bench_intake

## Seeds production volumes (3M integration logs, 1M inbound callbacks, ...) into a private
## cluster and prints every statement's plan shape, buffers and time, custom and generic
## (docs/BENCHMARKS.md). The times are PostgreSQL's, so the driving code builds in the dev profile.
bench-plans: services
	$(CARGO) bench --profile dev --bench bench_plans

bench-reconcile: services
	$(CARGO) bench --bench bench_reconcile

## Approvals/s through submission and through recovery at 1,000 rows (in-process simulator).
bench-approvals: services
	$(CARGO) bench --profile dev --bench bench_approvals

## Redis cost per poll and of an idle pod: a private redis-server, one release worker,
## 3,000 cards polled every second at 0 ms, raw apalis-redis in the same run; about 12 minutes
## (memory after 10 minutes). `make bench-redis SHORT=1`: about 2 minutes.
bench-redis: services
	BENCH_SHORT=$(SHORT) $(CARGO) bench --bench bench_redis

## The polling due queue alone (benches/bench_due_queue.rs): its fetch and acknowledgement on a
## private redis-server, 30,000 cards, 8 loops; Redis commands, CPU and memory per poll and card,
## beside raw apalis-redis no-op jobs in the same run.
bench-due-queue:
	$(CARGO) bench --bench bench_due_queue

## Phase 2 of bench-redis alone (the steady window), for two builds in turns on the same Redis and
## cards: BEFORE=<path of another release binary, e.g. main's> and this build, each first in every
## other round, AB_ROUNDS (default 3) rounds, each build's median and the ratios round by round.
## For a change too small for two separate runs to resolve on a VM whose speed drifts by the hour.
## Each round measures its own raw apalis-redis job, the Redis CPU ratio's denominator, beside its
## windows; BEFORE set to this build's own binary gives the ratio for one build, twice a round.
## About 1 minute a round.
AB_ROUNDS ?= 3
bench-redis-ab: services
	@test -x "$(BEFORE)" || { echo "usage: make bench-redis-ab BEFORE=path/to/other/cardworker"; exit 2; }
	BENCH_AB=$(abspath $(BEFORE)) BENCH_AB_ROUNDS=$(AB_ROUNDS) $(CARGO) bench --bench bench_redis

## The yardstick alone: bench-redis's raw apalis-redis measurement (the median of three runs of
## 2,000 no-op jobs) RAW_RUNS times on an emptied private redis-server, each with its system CPU
## and each command's µs a call: how far the Redis CPU ratio's denominator moves between runs
## seconds apart, and in which commands. About 2 s a run.
RAW_RUNS ?= 12
bench-redis-raw: services
	BENCH_RAW_RUNS=$(RAW_RUNS) $(CARGO) bench --bench bench_redis

## Phase 4 of bench-redis alone: an idle pod (every chain due in an hour) on a private redis-server,
## commands/s, KB/s into Redis and the commands by name over BENCH_IDLE_SECS (default 60) after an
## 8 s settle. Counts, not speed: the dev profile, no release build. About 2 minutes.
BENCH_IDLE_SECS ?= 60
bench-redis-idle: services
	BENCH_IDLE_ONLY=1 BENCH_IDLE_SECS=$(BENCH_IDLE_SECS) $(CARGO) bench --profile dev --bench bench_redis

## Gateway outages of 60 s and 10 min at 1,000 cards: records written, chains parked, time to
## resume (CARDWORKER_BIN=path runs another build, e.g. main's, for the "before" numbers).
bench-outage: services
	BENCH_SCENARIO=outage $(CARGO) bench --profile dev --bench bench_faults

## Two workers for 100 s while a quarter of the cards answer after 20 s: workers alive, no card
## polled twice at once.
bench-slowdown: services
	BENCH_SCENARIO=slowdown $(CARGO) bench --profile dev --bench bench_faults

## GET /metrics latency with Redis up and while it is down (a private redis-server, one worker):
## p50/p99/max of BENCH_SCRAPES (default 100) scrapes each. About 1 minute.
bench-scrape: services
	BENCH_SCENARIO=scrape $(CARGO) bench --profile dev --bench bench_faults

## What the due queue's fetch + acknowledgement costs Redis per poll at batch sizes 1, 4, 16 and 32,
## its head per call, the budget's acquire + release per pair, and two prototypes of smaller
## layouts (card-hashed buckets, a timing wheel) per poll, on a private redis-server
## (benches/lua_cost.sh): µs and commands, or with VG=1 the instructions redis-server ran
## (callgrind: within 0.5 % run to run). About 10 s; VG=1 about 90 s.
bench-lua:
	VG=$(VG) bash benches/lua_cost.sh

## The product files and folders a carddata poll's code runs in, from fetch to acknowledgement
## (benches/poll_files.sh): a frame-pointer release worker (target/poll-files) sampled by perf
## under bench-redis's short run, each sampled frame's source file by addr2line. Needs perf
## (Debian: linux-perf). About 8 minutes with its first build, 2 after.
bench-files: services
	bash benches/poll_files.sh

## What a polling task shard's records cost Redis per card, today's due queue against two timing
## wheels' layouts and card-hashed buckets (benches/due_layouts.sh): records only, written into a
## private redis-server.
## BENCH_CARDS (default 30,000). A few seconds.
bench-due-layouts: services
	bash benches/due_layouts.sh

## Redis memory per card: a private redis-server, 100k cards (BENCH_CARDS), a full round
## of both tasks, then 48 simulated hour boundaries; used_memory per card after the first round and
## at steady state, with MEMORY USAGE per key pattern (docs/BENCHMARKS.md, docs/SCALING.md). The
## figures are memory, not speed, so the driving code builds in the dev profile.
bench-redis-memory: services
	$(CARGO) bench --profile dev --bench bench_redis_memory

## A due burst: a private redis-server, one release worker, BENCH_CARDS (default 20,000) cards with
## both tasks due at the same moment (total limit 128, 64 per task, 0 ms Gateway); the last card's
## first poll against polls needed ÷ the steady polls/s (goal ≤ 1.25×), every card within 120 s,
## raw apalis-redis in the same run. About a minute after the release build.
bench-burst: services
	$(CARGO) bench --bench bench_burst

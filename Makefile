# cardworker: the two commands of the README are `make run` and `make test`.
SHELL := /bin/bash
CARGO ?= cargo
BIN := $(or $(CARGO_TARGET_DIR),target)/debug/cardworker
SIM_LISTEN ?= 127.0.0.1:8089
LOCAL_CONFIG ?= config/local.toml

.PHONY: run test services build lint fmt clippy lint-deploy scrape-check bench-writes bench-budget bench-intake bench-outage bench-slowdown

## Sets up PostgreSQL and Redis, migrates, starts the Gateway simulator and one worker.
run: services build
	$(BIN) migrate --config $(LOCAL_CONFIG)
	@echo "seeding 20 demo cards (c-demo-01..20) when missing"
	@psql -h 127.0.0.1 -U root -d cardworker -qc "INSERT INTO cards (card_ref) SELECT 'c-demo-' || lpad(g::text, 2, '0') FROM generate_series(1, 20) g ON CONFLICT (card_ref) DO NOTHING" >/dev/null
	@echo "starting polling chains for every card that should be polled (reconcile)"
	$(BIN) reconcile --config $(LOCAL_CONFIG)
	@\
	$(BIN) gateway-sim --listen $(SIM_LISTEN) --latency-ms 50 --change-rate 0.05 --error-rate 0.02 --config $(LOCAL_CONFIG) & SIM=$$!; \
	trap 'kill $$SIM 2>/dev/null' EXIT; \
	echo "Gateway simulator on http://$(SIM_LISTEN) (stats: /sim/stats)"; \
	echo "Metrics at http://127.0.0.1:9464/metrics  health /healthz  readiness /readyz"; \
	echo "Try: $(BIN) budget show --config $(LOCAL_CONFIG);  $(BIN) investigate --card-ref c-demo-01 --config $(LOCAL_CONFIG)"; \
	$(BIN) run --config $(LOCAL_CONFIG)

## Runs every test (unit, integration against real PostgreSQL and Redis, deploy lint).
## nextest runs every test in its own process, which the metrics tests need (one global
## recorder per process); `.ci/run` installs it when missing.
test: services
	@$(CARGO) nextest --version >/dev/null 2>&1 || { echo "cargo-nextest is required: cargo install cargo-nextest --locked" >&2; exit 1; }
	$(CARGO) nextest run --workspace --no-fail-fast
	$(MAKE) lint-deploy
	$(MAKE) scrape-check

services:
	@bash deploy/local/services.sh

build:
	$(CARGO) build --bin cardworker

fmt:
	$(CARGO) fmt --all -- --check

clippy:
	$(CARGO) clippy --workspace --all-targets -- -D warnings

lint: fmt clippy lint-deploy

## Checks the deployment artefacts with real tools (promtool, kubernetes-validate, hadolint, yamllint).
lint-deploy:
	bash deploy/lint.sh

## Starts a worker, scrapes /metrics, and checks that every metric the rules and dashboard use is exported.
scrape-check: build
	bash deploy/local/scrape-check.sh $(BIN)

bench-writes: services
	$(CARGO) bench --bench bench_writes

bench-budget: services
	$(CARGO) bench --bench bench_budget

bench-intake: services
	$(CARGO) bench --bench bench_intake

## Gateway outages of 60 s and 10 min at 1,000 cards: records written, chains parked, time to
## resume (CARDWORKER_BIN=path runs another build, e.g. main's, for the "before" numbers).
bench-outage: services
	BENCH_SCENARIO=outage $(CARGO) bench --profile dev --bench bench_faults

## Two workers for 100 s while a quarter of the cards answer after 20 s: workers alive, no card
## polled twice at once.
bench-slowdown: services
	BENCH_SCENARIO=slowdown $(CARGO) bench --profile dev --bench bench_faults

# cardworker: the two commands of the README are `make run` and `make test`.
SHELL := /bin/bash
CARGO ?= cargo
BIN := $(or $(CARGO_TARGET_DIR),target)/debug/cardworker
SIM_LISTEN ?= 127.0.0.1:8089
CONSOLE_LISTEN ?= 127.0.0.1:9465
LOCAL_CONFIG ?= config/local.toml

.PHONY: run test services browser build lint fmt clippy lint-deploy scrape-check console-screenshots bench-writes bench-budget bench-intake

## Sets up PostgreSQL and Redis, migrates, starts the Gateway simulator, the console and one worker.
run: services build
	$(BIN) migrate --config $(LOCAL_CONFIG)
	@echo "seeding 20 demo cards (c-demo-01..20) when missing"
	@psql -h 127.0.0.1 -U root -d cardworker -qc "INSERT INTO cards (card_ref) SELECT 'c-demo-' || lpad(g::text, 2, '0') FROM generate_series(1, 20) g ON CONFLICT (card_ref) DO NOTHING" >/dev/null
	@echo "starting polling chains for every card that should be polled (reconcile)"
	$(BIN) reconcile --config $(LOCAL_CONFIG)
	@\
	$(BIN) gateway-sim --listen $(SIM_LISTEN) --latency-ms 50 --change-rate 0.05 --error-rate 0.02 --config $(LOCAL_CONFIG) & SIM=$$!; \
	TOKEN=$${CARDWORKER__CONSOLE__ADMIN_TOKEN:-$$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')}; \
	CARDWORKER__CONSOLE__ADMIN_TOKEN=$$TOKEN $(BIN) console --listen $(CONSOLE_LISTEN) --config $(LOCAL_CONFIG) & CONSOLE=$$!; \
	trap 'kill $$SIM $$CONSOLE 2>/dev/null' EXIT; \
	echo "Gateway simulator on http://$(SIM_LISTEN) (stats: /sim/stats)"; \
	echo "Console at http://$(CONSOLE_LISTEN)/  (read-only until you log in with the admin token $$TOKEN)"; \
	echo "Metrics at http://127.0.0.1:9464/metrics  health /healthz  readiness /readyz"; \
	echo "Try: $(BIN) budget show --config $(LOCAL_CONFIG);  $(BIN) investigate --card-ref c-demo-01 --config $(LOCAL_CONFIG)"; \
	$(BIN) run --config $(LOCAL_CONFIG)

## Runs every test (unit, integration against real PostgreSQL and Redis, deploy lint).
## nextest runs every test in its own process, which the metrics tests need (one global
## recorder per process); `.ci/run` installs it when missing.
test: services browser
	@$(CARGO) nextest --version >/dev/null 2>&1 || { echo "cargo-nextest is required: cargo install cargo-nextest --locked" >&2; exit 1; }
	$(CARGO) nextest run --workspace --no-fail-fast
	$(MAKE) lint-deploy
	$(MAKE) scrape-check

services:
	@bash deploy/local/services.sh

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

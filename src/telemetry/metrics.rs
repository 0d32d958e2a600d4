//! Every metric cardworker exports, by name. The names and labels are an interface (spec
//! section 4): dashboards and alert rules depend on them, so they are defined once, here.

/// Counter: `task`, `outcome` = `skipped_unchanged` | `persisted_change` | `persisted_failure`.
pub const POLL_OUTCOMES: &str = "cardworker_poll_outcomes_total";
/// Counter: `task`, `reason` = `total` | `task` | `paused` | `gateway_circuit_open` |
/// `budget_unavailable`.
pub const POLL_DEFERRED: &str = "cardworker_poll_deferred_total";
/// Gauge: `scope` = `total` | `carddata` | `card_status`; tokens held by running polls,
/// fleet-wide, read from Redis in the background (`telemetry::fleet`).
pub const POLL_TOKENS_IN_USE: &str = "cardworker_poll_tokens_in_use";
/// Gauge: `scope`; tokens processes keep idle between their polls (reserved for their next
/// polls, given back under contention), fleet-wide, read from Redis in the background. A scope's
/// leases are `in_use` + `kept`.
pub const POLL_TOKENS_KEPT: &str = "cardworker_poll_tokens_kept";
/// Gauge: `task`; how long past its due time the oldest poll that is due and not yet started
/// is, fleet-wide (0 when none is), read from Redis in the background (`telemetry::fleet`). A
/// deferred poll counts from the time it was due: a deferral gives its card back at that time.
pub const POLL_OVERDUE: &str = "cardworker_poll_overdue_seconds";
/// Gauge: `task`; polls due and not yet started, fleet-wide: cards due in the task's due queue,
/// waiting or whose lease ended (a deferred card waits at its due time). Read with the overdue
/// gauge.
pub const POLL_DUE_NOW: &str = "cardworker_poll_due_now";
/// Gauge: `scope`; the effective limit.
pub const POLL_LIMIT: &str = "cardworker_poll_limit";
/// Counter: `scope`; leases that ended by expiry instead of a release (a crashed or stalled
/// holder), fleet-wide, as counted in Redis by the budget's TTL repair. 0 in a healthy fleet.
pub const BUDGET_LEASES_EXPIRED: &str = "cardworker_budget_leases_expired_total";
/// Gauge: `task`; tokens this process holds for Gateway calls its polls stopped waiting for (at
/// `gateway.timeout_ms`), until the call is answered or `polling.handler_timeout_secs` after it
/// was sent (per pod: aggregate with `sum`).
pub const BUDGET_ABANDONED_CALLS: &str = "cardworker_budget_abandoned_calls";
/// Histogram: `call` = `carddata` | `card_status` | `payment_submit` | `payment_query`.
pub const GATEWAY_REQUEST_DURATION: &str = "cardworker_gateway_request_duration_seconds";
/// Gauge: `queue`; jobs waiting (intake + apalis backlog), fleet-wide.
pub const QUEUE_DEPTH: &str = "cardworker_queue_depth";
/// Gauge: `worker` kind; 1 while that worker runs in this process.
pub const WORKER_UP: &str = "cardworker_worker_up";
/// Gauge: 1 while this process's Redis probe gets answers, 0 during an outage.
pub const REDIS_UP: &str = "cardworker_redis_up";
/// Gauge: 0 or 1.
pub const MAINTENANCE_ENABLED: &str = "cardworker_maintenance_enabled";
/// Counter: `job`, `result`.
pub const MAINTENANCE_RUNS: &str = "cardworker_maintenance_runs_total";
/// Gauge: `job`; the last processed Shanghai day as YYYYMMDD.
pub const MAINTENANCE_LAST_DAY: &str = "cardworker_maintenance_last_day";
/// Gauge: `job`; due days still waiting.
pub const MAINTENANCE_DAYS_PENDING: &str = "cardworker_maintenance_days_pending";
/// Histogram: `job`.
pub const MAINTENANCE_RUN_DURATION: &str = "cardworker_maintenance_run_duration_seconds";
/// Counter: `job`, `table`, `action` = `archived` | `deleted` | `expired_kept`.
pub const MAINTENANCE_ROWS: &str = "cardworker_maintenance_rows_total";
/// Gauge: `task`; 1 while the task's Gateway circuit is open or half-open, 0 closed
/// (fleet-wide, read from Redis; aggregate with max).
pub const GATEWAY_CIRCUIT_OPEN: &str = "cardworker_gateway_circuit_open";
/// Counter: `task`, `to` = `open` | `half_open` | `closed`; counted by the process whose call
/// made the transition, so the sum over the fleet is the fleet's count.
pub const GATEWAY_CIRCUIT_TRANSITIONS: &str = "cardworker_gateway_circuit_transitions_total";
/// Gauge: `task`; parked chains (cards whose chain of that task is parked), fleet-wide, counted
/// in PostgreSQL (aggregate with max).
pub const PARKED_CHAINS: &str = "cardworker_parked_chains";
/// Counter: `status` = `approved` | `declined` | `failed`, `via` = `response` | `query` |
/// `callback`; approval decisions applied (spec section 7), each once, by the process that
/// applied it.
pub const APPROVAL_DECISIONS: &str = "cardworker_approval_decisions_total";
/// Counter: `queue`, `result` = `succeeded` | `retried` | `dead`; jobs finished by this process.
pub const JOBS_FINISHED: &str = "cardworker_jobs_finished_total";

/// Gauge: seconds since the fleet-wide gauges (tokens, limits, circuits, parked chains, queue
/// depth) were last all read (`telemetry::fleet`); set at each scrape.
pub const FLEET_GAUGES_AGE: &str = "cardworker_fleet_gauges_age_seconds";

/// Histogram buckets (seconds) for Gateway calls and maintenance runs.
pub const DURATION_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0,
];

//! The fault-injection suite (`make test-faults`; `make test` runs it too). Every fault is
//! injected into a service of the test's own ([`private`], from the test kit: a redis-server or
//! a PostgreSQL cluster on a free port, removed afterwards) or into the Gateway (a blackhole, or the
//! simulator), never into the shared services. Each test asserts what the issue promises for its
//! fault: no process exit (where the grace allows), no lost chain, no duplicate record, no double
//! submission. [`redis_cost`] counts what an idle pod sends (its feeder, a whole `cardworker run`,
//! the Redis probe, a reconcile pass), on a private redis-server whose `INFO commandstats` sees no
//! other client; [`budget_cost`] counts what a poll's budget call runs there. [`outage_string`]
//! runs a string of short Redis outages under load against two `cardworker run` processes.
//! [`alerts`] runs the project's alert rules on a real Prometheus scraping a real worker through
//! those faults. [`due_queue`] holds the polling due queue's script to its promises, on a
//! redis-server of its own and on a three-master Redis Cluster; [`poll_backend`] runs a real apalis
//! worker on the polling backend that fetches from it.

mod abandoned;
mod alerts;
mod budget_cost;
mod due_queue;
mod empty_redis;
mod fence;
mod fence_failover;
mod outage_string;
mod ownership;
mod poll_backend;
mod redis_cost;
mod scenarios;
mod startup;
mod takeover;

// The shared machinery (test-kit/), under the names the tests use: `crate::harness`, ….
use cardworker_test_kit::{cluster, faults, harness, private, process, proxy, scripted_gateway};

//! What several benches share (each bench is a crate of its own): their database and prefix on
//! the shared servers, removed after the run, and a private redis-server.

use anyhow::Context as _;
use sqlx::{Connection as _, PgConnection};

pub use crate::private::PrivateRedis;

/// Env var `name`, else `default`.
pub fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

/// The admin URL the benches create their databases with (`CARDWORKER_BENCH_PG_ADMIN`).
pub fn admin_url() -> String {
    env_or(
        "CARDWORKER_BENCH_PG_ADMIN",
        "postgres://root@127.0.0.1:5432/postgres",
    )
}

/// The Redis of the benches (`CARDWORKER_BENCH_REDIS`).
pub fn redis_url() -> String {
    env_or("CARDWORKER_BENCH_REDIS", "redis://127.0.0.1:6379/0")
}

/// Creates database `name` through `admin_url` and returns its name and URL.
pub async fn create_database(admin_url: &str, name: &str) -> anyhow::Result<(String, String)> {
    let mut admin = PgConnection::connect(admin_url)
        .await
        .context("connecting as admin")?;
    sqlx::query(&format!("CREATE DATABASE {name}"))
        .execute(&mut admin)
        .await?;
    admin.close().await?;
    let url = match admin_url.rfind('/') {
        Some(i) => format!("{}/{name}", &admin_url[..i]),
        None => anyhow::bail!("admin URL has no database part"),
    };
    Ok((name.to_owned(), url))
}

/// Drops database `name` (`WITH (FORCE)`), ignoring errors.
pub async fn drop_database(admin_url: &str, name: &str) {
    if let Ok(mut admin) = PgConnection::connect(admin_url).await {
        let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
            .execute(&mut admin)
            .await;
    }
}

/// Deletes every key under `prefix` (`KEYS` is fine here: a bench's own prefix, after the run),
/// ignoring errors.
pub async fn delete_prefix(conn: &mut redis::aio::ConnectionManager, prefix: &str) {
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}:*"))
        .query_async(conn)
        .await
        .unwrap_or_default();
    for chunk in keys.chunks(500) {
        let _: Result<(), _> = redis::cmd("DEL").arg(chunk).query_async(conn).await;
    }
}

/// Starts a [`PrivateRedis`] of the bench's own (no persistence, on a free port, so that `INFO`
/// counts only the bench) and connects to it.
pub async fn private_redis() -> anyhow::Result<(PrivateRedis, redis::aio::ConnectionManager)> {
    let redis = PrivateRedis::start_new(false);
    let conn = cardworker::context::connect_redis(&redis.url())
        .await
        .with_context(|| format!("connecting to the private redis-server at {}", redis.url()))?;
    Ok((redis, conn))
}

//! What several benches share (included by path: each bench is its own crate).

#![allow(dead_code)]

use anyhow::Context as _;
use sqlx::{Connection as _, PgConnection};

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

/// A `redis-server` of the bench's own, on a free port (so that `INFO` counts only the bench);
/// killed when dropped.
pub struct PrivateRedis {
    /// The server process.
    child: std::process::Child,
    /// Its URL.
    pub url: String,
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts a [`PrivateRedis`] (no persistence) and connects to it.
pub async fn private_redis() -> anyhow::Result<(PrivateRedis, redis::aio::ConnectionManager)> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let child = std::process::Command::new("redis-server")
        .args([
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .stdout(std::process::Stdio::null())
        .spawn()
        .context("starting redis-server (needed for clean INFO figures)")?;
    let url = format!("redis://127.0.0.1:{port}/0");
    let redis = PrivateRedis {
        child,
        url: url.clone(),
    };
    for _ in 0..100 {
        if let Ok(conn) = cardworker::context::connect_redis(&url).await {
            return Ok((redis, conn));
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    anyhow::bail!("redis-server did not come up on {url}")
}

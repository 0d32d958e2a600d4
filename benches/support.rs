//! What several benches share (included by path: each bench is its own crate).

#![allow(dead_code)]

use anyhow::Context as _;
use sqlx::{Connection as _, PgConnection};

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

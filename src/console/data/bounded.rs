//! How every read of a page is bounded: by time ([`STORE_TIMEOUT`], after which a store is shown
//! as not answering) and by rows ([`LIST_LIMIT`]).

use std::time::Duration;

/// How long a page waits for one store before showing it as not answering.
pub const STORE_TIMEOUT: Duration = Duration::from_secs(3);
/// Rows shown per list.
pub const LIST_LIMIT: i64 = 200;

/// Runs one read of `what` within [`STORE_TIMEOUT`].
pub async fn bounded<T>(
    what: &str,
    f: impl std::future::Future<Output = anyhow::Result<T>>,
) -> anyhow::Result<T> {
    match tokio::time::timeout(STORE_TIMEOUT, f).await {
        Ok(r) => r,
        Err(_) => Err(anyhow::anyhow!(
            "{what}: no answer within {} s",
            STORE_TIMEOUT.as_secs()
        )),
    }
}

/// Reads one part of a page within [`STORE_TIMEOUT`]: its value, or `None` with the problem
/// (after `doing`, when given) added to `errors`, which the page shows.
pub async fn part<T>(
    what: &str,
    doing: Option<&str>,
    f: impl std::future::Future<Output = anyhow::Result<T>>,
    errors: &mut Vec<String>,
) -> Option<T> {
    match bounded(what, f).await {
        Ok(v) => Some(v),
        Err(e) => {
            errors.push(match doing {
                Some(doing) => format!("{doing}: {e:#}"),
                None => format!("{e:#}"),
            });
            None
        }
    }
}

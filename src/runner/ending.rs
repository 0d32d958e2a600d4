//! How a worker's run ended, read from its error: Redis trouble (a connection-level error, or
//! Redis answering without state the worker had there) or anything else. The supervisor's grace
//! ([`super::grace`]) decides on this reading.

use apalis::prelude::WorkerError;

/// How a worker's run ended, as the grace reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// Its run returned, or failed with an error that is not Redis trouble.
    Other,
    /// A connection-level Redis error: refused, dropped, timed out, I/O.
    Connection,
    /// Redis answered, but without state the worker had there: its registration ("worker not
    /// registered") or its in-flight set, lost with Redis's data or dropped by a peer.
    LostState,
}

impl Ending {
    /// How `result` ended.
    pub fn of(result: &Result<(), WorkerError>) -> Self {
        match result {
            Err(e) if is_lost_state(e) => Self::LostState,
            Err(e) if is_redis_trouble(e) => Self::Connection,
            _ => Self::Other,
        }
    }
}

/// How connection-level trouble reads once apalis has turned an error into text.
const CONNECTION_TEXTS: &[&str] = &[
    "broken pipe",
    "connection refused",
    "connection reset",
    "connection closed",
    "connection dropped",
    "timed out",
    "os error",
    "io error",
    "ioerror",
];

/// Whether a worker's error says that Redis answered without state the worker had there: its
/// registration, or the in-flight set its acknowledgement expected.
pub fn is_lost_state(error: &WorkerError) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = match error {
        WorkerError::BackendError(inner) => Some(inner.as_ref()),
        _ => return false,
    };
    while let Some(e) = source {
        let text = e.to_string();
        if LOST_STATE_TEXTS.iter().any(|t| text.contains(t)) {
            return true;
        }
        source = e.source();
    }
    false
}

/// How a lost registration or in-flight set reads (apalis-redis's scripts and `fetch.lua`).
const LOST_STATE_TEXTS: &[&str] = &[
    "worker not registered",
    "task not executed by worker",
    "WorkerOutOfSync",
];

/// Whether a worker's error is Redis trouble rather than a fault of the worker or its data: a
/// connection-level Redis error (refused, dropped, timed out, I/O), or apalis-redis finding the
/// worker's registration gone (Redis lost its data, or a peer's orphan recovery dropped it after
/// an outage).
pub fn is_redis_trouble(error: &WorkerError) -> bool {
    let WorkerError::BackendError(inner) = error else {
        return matches!(error, WorkerError::IoError(_));
    };
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(inner.as_ref());
    while let Some(e) = source {
        let redis = e.downcast_ref::<redis::RedisError>().or_else(|| {
            match e.downcast_ref::<apalis_redis::Error>() {
                Some(apalis_redis::Error::Database(redis)) => Some(redis),
                _ => None,
            }
        });
        if let Some(redis) = redis {
            if redis.is_io_error()
                || redis.is_connection_dropped()
                || redis.is_connection_refusal()
                || redis.is_timeout()
                || redis.is_unrecoverable_error()
            {
                return true;
            }
        }
        if e.downcast_ref::<std::io::Error>().is_some() {
            return true;
        }
        // apalis flattens some backend errors into text (`PollNextError: broken pipe`).
        let text = e.to_string();
        let lower = text.to_lowercase();
        // Redis restarting with its data answers `LOADING` (the redis crate names it
        // `BusyLoading`) until the dataset is in memory: an outage like any other.
        if CONNECTION_TEXTS.iter().any(|t| lower.contains(t))
            || LOST_STATE_TEXTS.iter().any(|t| text.contains(t))
            || text.contains("LOADING")
            || lower.contains("busyloading")
            || lower.contains("loading the dataset")
        {
            return true;
        }
        source = e.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_connection_and_a_lost_registration_are_redis_trouble_a_bad_queue_is_not() {
        let refused = redis::RedisError::from(std::io::Error::new(
            std::io::ErrorKind::ConnectionRefused,
            "Connection refused (os error 111)",
        ));
        let e = WorkerError::BackendError(Box::new(apalis_redis::Error::Database(refused)));
        assert!(is_redis_trouble(&e));
        let lost = redis::RedisError::from((
            redis::ErrorKind::Extension,
            "script error",
            "Heartbeat failed: worker not registered".to_owned(),
        ));
        let e = WorkerError::BackendError(Box::new(apalis_redis::Error::Database(lost)));
        assert!(is_redis_trouble(&e));
        let corrupt = WorkerError::BackendError(Box::new(apalis_redis::Error::Json(
            serde_json::from_str::<String>("{").expect_err("bad json"),
        )));
        assert!(!is_redis_trouble(&corrupt));
        let flattened = WorkerError::BackendError("PollNextError: broken pipe".into());
        assert!(is_redis_trouble(&flattened));
    }

    #[test]
    fn redis_loading_its_dataset_after_a_restart_is_redis_trouble() {
        // As a worker ended while Redis restarted with its data (`make chaos`, seed 105): the
        // process exited 1 with "worker stopped unexpectedly" instead of riding it out.
        let flattened = WorkerError::BackendError(
            "PollNextError: BusyLoading: Redis is loading the dataset in memory".into(),
        );
        assert!(is_redis_trouble(&flattened));
        let typed = redis::RedisError::from((
            redis::ErrorKind::Server(redis::ServerErrorKind::BusyLoading),
            "Redis is loading the dataset in memory",
        ));
        let e = WorkerError::BackendError(Box::new(apalis_redis::Error::Database(typed)));
        assert!(is_redis_trouble(&e));
    }

    #[test]
    fn a_lost_registration_reads_as_lost_state_a_refused_connection_as_connection_trouble() {
        // As the supervisor logged it when an empty restart had dropped the worker.
        let lost = WorkerError::BackendError(
            "PollNextError: \"Cant\": fetch next: worker not registered".into(),
        );
        assert_eq!(Ending::of(&Err(lost)), Ending::LostState);
        let refused = WorkerError::BackendError(Box::new(apalis_redis::Error::Database(
            redis::RedisError::from(std::io::Error::new(
                std::io::ErrorKind::ConnectionRefused,
                "Connection refused (os error 111)",
            )),
        )));
        assert_eq!(Ending::of(&Err(refused)), Ending::Connection);
        let corrupt = WorkerError::BackendError(Box::new(apalis_redis::Error::Json(
            serde_json::from_str::<String>("{").expect_err("bad json"),
        )));
        assert_eq!(Ending::of(&Err(corrupt)), Ending::Other);
        assert_eq!(Ending::of(&Ok(())), Ending::Other);
    }
}

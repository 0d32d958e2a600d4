//! Running jobs on apalis: the trait a job implements, the one service every worker runs, the one
//! panic and timeout policy, how workers and cron schedules are spawned, and the supervisor.
//!
//! It knows how to run *a* job, never which jobs exist: that list is [`crate::workers`], the top
//! of the wiring, like crates.io's job list.
//!
//! # Layout
//! - [`job`]: [`RunJob`] (how to run a payload type of `cardworker-jobs`), [`Scheduled`] (a job
//!   started by a cron tick) and [`JobError`], the one error type a job ends with.
//! - [`service`]: [`JobService`], the tower service of every worker: decodes the payload itself
//!   (a bad payload never stops a worker) and runs the job under [`service::guarded`], the one
//!   place where panics and timeouts are caught.
//! - [`spawn`]: the apalis storage of a queue, [`spawn::spawn_worker`], [`spawn::spawn_cron`] and
//!   the cross-pod tick claim.
//! - [`supervisor`]: [`Supervisor`], which restarts workers through a Redis outage and fails the
//!   process when one stops for any other reason or the outage outlasts the grace.
//! - [`grace`]: [`grace::Grace`], the supervisor's decision after one failure of a worker
//!   (start it again at once, after a back-off, or stop the process), per Redis outage.
//! - [`ending`]: [`ending::Ending`], how a worker's run ended as read from its error (a
//!   connection-level Redis error, state lost with Redis's data, or anything else).
//! - [`redis_watch`]: the Redis probe (up or down, data lost or not).

pub mod ending;
pub mod grace;
pub mod job;
pub mod redis_watch;
pub mod service;
pub mod spawn;
pub mod supervisor;

pub use job::{JobError, RunJob, Scheduled};
pub use service::JobService;
pub use supervisor::Supervisor;

//! Throwaway servers for idem's tests, `cargo xtask e2e`, the demo and the
//! benchmarks: one helper per kind of server, used by every test binary.
//!
//! - [`TestPostgres`]: a PostgreSQL cluster (`initdb` + `pg_ctl`);
//! - [`TestRedis`]: a Redis node, or a Redis Cluster, with replicas or not;
//! - [`TestRabbitMq`]: a RabbitMQ node of its own (name, ports, `epmd`);
//! - [`TestKafka`]: a Kafka-compatible broker (`tansu`, in memory);
//! - [`TestSqs`]: a local SQS (moto's server, from PyPI's `moto[server]`).
//!
//! Every server keeps the same rules:
//!
//! - **On 127.0.0.1, on free ports, in a fresh temporary directory.** A start
//!   that loses its port to another process is tried again on new ports.
//! - **Waited for by a readiness condition the server reports, never by a
//!   sleep:** `pg_ctl -w` and a query for PostgreSQL; `PONG` for a Redis node,
//!   `cluster_state:ok` with every slot covered on every node for a cluster,
//!   and, for replicas, `master_link_status:up` with the replica's offset at
//!   its primary's ([`TestRedis::await_replicas`]); `rabbitmqctl
//!   await_startup` and an open AMQP port for RabbitMQ. A condition not met
//!   within [`READY_LIMIT`] fails loudly with the server's own words.
//! - **Stopped by itself.** Each server has a watchdog process holding a pipe
//!   from the process that started it: when that process ends, however it
//!   ends (a panic, an abort, `SIGKILL`), the pipe closes and the watchdog stops
//!   the server and deletes its directory. Dropping the server does the same
//!   at once. So one server per test binary, kept in a static
//!   ([`TestPostgres::shared`], [`TestRedis::shared`]), is safe: give each test
//!   a database, a key prefix or a queue of its own.
//! - **A missing binary is an error that says what to install**, never a
//!   skipped test.
//!
//! [`fault`] is a TCP proxy that stalls, resets, drops, or loses COMMITs.
//!
//! [`cpu`] reads the CPU time a process, or a PostgreSQL server, has used
//! (the benchmarks' readings).
//!
//! [`shell`] holds what `cargo xtask` and the runners share: the workspace
//! root, and running `cargo` and other steps loudly.
//!
//! This crate is std-only on purpose: `cargo xtask` depends on it and must
//! reach its first step, `cargo fmt --check`, without compiling anything else.

// Test support: failing loudly is the point, and a server's output is shown
// as it was printed.
#![allow(clippy::unwrap_used, clippy::expect_used)]

pub mod cpu;
pub mod fault;
pub mod kafka;
pub mod postgres;
mod process;
pub mod rabbitmq;
pub mod redis;
pub mod shell;
pub mod sqs;
#[cfg(feature = "wait")]
pub mod wait;

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

pub use kafka::TestKafka;
pub use postgres::TestPostgres;
pub use process::free_port;
pub use rabbitmq::TestRabbitMq;
pub use redis::TestRedis;
pub use sqs::TestSqs;

/// How long a server may take to report that it is ready. Generous on
/// purpose: a loaded or cold machine is slow, and waiting costs nothing when
/// the condition comes sooner (it is polled, not slept on).
pub const READY_LIMIT: Duration = Duration::from_secs(120);

/// Whether `name` (lowercase) is a header field an HTTP server writes per
/// connection or per message: never part of a stored answer, so a replay may
/// differ in it. The HTTP suite and the e2e harness compare answers without
/// them.
pub fn is_framing_header(name: &str) -> bool {
    matches!(
        name,
        "date" | "content-length" | "transfer-encoding" | "connection" | "keep-alive"
    )
}

/// Why a test server could not be started or used.
#[derive(Debug)]
#[non_exhaustive]
pub enum Error {
    /// A server binary was not found.
    NotInstalled {
        /// What is missing (`redis-server`, `PostgreSQL's initdb and pg_ctl`…).
        what: &'static str,
        /// Where it was looked for.
        searched: String,
        /// What to do about it.
        fix: &'static str,
    },
    /// A file system or process step failed.
    Io {
        /// The step.
        what: String,
        /// What failed.
        source: std::io::Error,
    },
    /// A command ran and failed.
    Failed {
        /// The command.
        what: String,
        /// What it printed (and the server's log, when there is one).
        output: String,
    },
    /// A server did not report readiness in time.
    NotReady {
        /// The condition waited for.
        what: String,
        /// How long it was waited for.
        waited: Duration,
        /// The last state seen, and the server's log when there is one.
        last: String,
    },
    /// A name that would need quoting (a database, a virtual host).
    InvalidName(String),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NotInstalled {
                what,
                searched,
                fix,
            } => write!(f, "{what} was not found in {searched}: {fix}"),
            Self::Io { what, .. } => write!(f, "could not {what}"),
            Self::Failed { what, output } => write!(f, "{what} failed:\n{output}"),
            Self::NotReady { what, waited, last } => {
                write!(f, "{what}: not so after {waited:?}; last seen:\n{last}")
            }
            Self::InvalidName(name) => write!(
                f,
                "{name:?} is not a plain name (ASCII letters, digits, `_`, `-`)"
            ),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}

/// A fresh directory under the system's temporary directory for a test's
/// files (a SQLite database, logs), deleted when its last clone is dropped.
#[derive(Clone, Debug)]
pub struct TempDir(std::sync::Arc<PathBuf>);

impl TempDir {
    /// A fresh, empty directory whose name starts with `idem-KIND`.
    pub fn new(kind: &str) -> Result<Self, Error> {
        fresh_dir(kind).map(|dir| Self(std::sync::Arc::new(dir)))
    }

    /// The directory.
    pub fn path(&self) -> &std::path::Path {
        &self.0
    }

    /// The path of `name` in the directory, as a string (for a URL).
    pub fn file(&self, name: &str) -> String {
        self.0.join(name).display().to_string()
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if std::sync::Arc::strong_count(&self.0) == 1 {
            let _ = std::fs::remove_dir_all(&*self.0);
        }
    }
}

/// A fresh directory under the system's temporary directory, named after the
/// kind of server, this process and a counter.
fn fresh_dir(kind: &str) -> Result<PathBuf, Error> {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let dir = std::env::temp_dir().join(format!(
        "idem-{kind}-{}-{}-{nanos}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed),
    ));
    std::fs::create_dir_all(&dir).map_err(|source| Error::Io {
        what: format!("create {}", dir.display()),
        source,
    })?;
    Ok(dir)
}

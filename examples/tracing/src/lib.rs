//! The examples' log set-up, shared by the payments services and
//! `payments-consumer`: [`init`].

use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer, filter};

/// The targets of the drivers that log what they carry below `info`, held
/// at `info` whatever `RUST_LOG` says: idem's list
/// ([`idem_core::log::PAYLOAD_TARGETS`]: PostgreSQL's, RabbitMQ's, the AWS
/// SDK's, librdkafka's).
pub const QUIET_DRIVERS: &[&str] = idem_core::log::PAYLOAD_TARGETS;

/// Logs to stderr (stdout's first line is the program's own), filtered by
/// `RUST_LOG` (default `info`), with the [`QUIET_DRIVERS`] at `info` at most.
/// A second call (in tests) keeps the first subscriber.
pub fn init() {
    let env = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let output = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_filter(filter::filter_fn(|metadata| {
            *metadata.level() <= tracing::Level::INFO || !is_quiet_driver(metadata.target())
        }));
    let _ = tracing_subscriber::registry()
        .with(env)
        .with(output)
        .try_init();
}

/// Whether `target` is one of the [`QUIET_DRIVERS`] or in one of their
/// modules.
///
/// ```
/// assert!(example_tracing::is_quiet_driver("tokio_postgres::query"));
/// assert!(example_tracing::is_quiet_driver("amq_protocol_types"));
/// assert!(example_tracing::is_quiet_driver("aws_sigv4::http_request"));
/// assert!(!example_tracing::is_quiet_driver("idem"));
/// ```
pub fn is_quiet_driver(target: &str) -> bool {
    idem_core::log::carries_payloads(target)
}

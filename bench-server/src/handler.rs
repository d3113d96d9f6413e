//! The trivial handler both routes serve, and what its records look like.

use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use idem_core::{Header, StoredResponse};

/// The scope of every request to a layered route (a tenant, as an
/// application would name it; pgbench binds the same).
pub(crate) const SCOPE: &str = "bench";

/// The answer's status.
pub(crate) const STATUS: u16 = 201;

/// The answer's content type.
pub(crate) const CONTENT_TYPE: &str = "application/json";

/// How long the slow route's handler waits before answering, as a handler
/// calling a payment provider would: the duplicates check of `cargo xtask
/// bench` sends its requests there, so that they overlap.
pub(crate) const SLOW: std::time::Duration = std::time::Duration::from_millis(100);

/// Times a handler ran (answered), on any route (`GET /executions`).
static EXECUTIONS: AtomicU64 = AtomicU64::new(0);

/// Counts one run of a served handler.
pub(crate) fn executed() {
    EXECUTIONS.fetch_add(1, Ordering::Relaxed);
}

/// Times a served handler ran so far.
pub(crate) fn executions() -> u64 {
    EXECUTIONS.load(Ordering::Relaxed)
}

/// The answer to a request body of `received` bytes: a small JSON object.
pub(crate) fn answer(received: usize) -> String {
    format!(r#"{{"id":"ch_bench","status":"succeeded","received":{received}}}"#)
}

/// The response a layered route records for a request body of `received` bytes.
pub(crate) fn recorded(received: usize) -> StoredResponse {
    StoredResponse::new(
        STATUS,
        vec![Header::new("content-type", CONTENT_TYPE)],
        Bytes::from(answer(received)),
    )
}

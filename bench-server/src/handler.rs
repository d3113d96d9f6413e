//! The trivial handler both routes serve, and what its records look like.

use bytes::Bytes;
use idem_core::{Header, StoredResponse};

/// The scope of every request to a layered route (a tenant, as an
/// application would name it; pgbench binds the same).
pub(crate) const SCOPE: &str = "bench";

/// The answer's status.
pub(crate) const STATUS: u16 = 201;

/// The answer's content type.
pub(crate) const CONTENT_TYPE: &str = "application/json";

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

//! Axum extractors: what the middleware tells the handler it let through.

use std::ops::Deref;

use axum::extract::{FromRequestParts, OptionalFromRequestParts};
use axum::response::{IntoResponse, Response};
use http::StatusCode;
use http::request::Parts;

/// What the middleware tells the handler of a keyed request it let run: the
/// key, the scope, whether the execution is guarded, what the store hands it,
/// whether its lease still holds. Its accessors are [`idem_core::ExecutionInfo`]'s
/// (through `Deref`); this type makes it an axum extractor.
///
/// Requests without a key (an optional route, an uncovered method) carry no
/// `ExecutionInfo`: extract `Option<ExecutionInfo>` there.
///
/// ```
/// use idem_axum::ExecutionInfo;
///
/// async fn charge(execution: ExecutionInfo) -> String {
///     format!("charging once for key {}", execution.key().redacted())
/// }
/// # let _: axum::routing::MethodRouter = axum::routing::post(charge);
/// ```
///
/// With idem-diesel's transactional store, the handler's writes commit with the
/// record through the context:
///
/// ```no_run
/// use idem_axum::ExecutionInfo;
/// use idem_diesel::PgTransaction;
/// use http::StatusCode;
///
/// async fn charge(execution: ExecutionInfo) -> StatusCode {
///     let Some(transaction) = execution.context::<PgTransaction>() else {
///         return StatusCode::SERVICE_UNAVAILABLE;
///     };
///     let Ok(connection) = transaction.connection().await else {
///         return StatusCode::SERVICE_UNAVAILABLE;
///     };
///     // … diesel-async writes on `&mut *connection`, committed with the answer.
///     # drop(connection);
///     StatusCode::CREATED
/// }
/// # let _: axum::routing::MethodRouter = axum::routing::post(charge);
/// ```
#[derive(Clone, Debug)]
pub struct ExecutionInfo(pub idem_core::ExecutionInfo);

/// The rejection of [`ExecutionInfo`] when the request carries none:
/// the handler is not behind an [`IdempotencyLayer`](crate::IdempotencyLayer), or
/// the request had no key. `500`, as axum's `Extension` answers a missing one:
/// the route is misconfigured.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "this request has no idempotency key: is the handler behind an IdempotencyLayer that requires keys?"
)]
pub struct NoIdempotencyKey;

impl Deref for ExecutionInfo {
    type Target = idem_core::ExecutionInfo;

    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl IntoResponse for NoIdempotencyKey {
    fn into_response(self) -> Response {
        (StatusCode::INTERNAL_SERVER_ERROR, self.to_string()).into_response()
    }
}

impl<S: Send + Sync> FromRequestParts<S> for ExecutionInfo {
    type Rejection = NoIdempotencyKey;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        parts
            .extensions
            .get::<Self>()
            .cloned()
            .ok_or(NoIdempotencyKey)
    }
}

impl<S: Send + Sync> OptionalFromRequestParts<S> for ExecutionInfo {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut Parts,
        _state: &S,
    ) -> Result<Option<Self>, Self::Rejection> {
        Ok(parts.extensions.get::<Self>().cloned())
    }
}

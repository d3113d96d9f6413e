//! Axum extractors: what the middleware tells the handler it let through.

use std::any::Any;
use std::sync::Arc;

use axum::extract::{FromRequestParts, OptionalFromRequestParts};
use axum::response::{IntoResponse, Response};
use http::StatusCode;
use http::request::Parts;
use idem_core::store::ExecutionContext;
use idem_core::{IdempotencyKey, Scope};

/// What the middleware tells the handler of a keyed request it let run, in the
/// request's extensions: the key, the scope, and whether the execution is
/// guarded.
///
/// A replayed answer never reaches the handler: the middleware sends it without
/// calling the handler. So a handler that sees an `ExecutionInfo` with
/// [`is_guarded`](Self::is_guarded) is *the* execution of its `(scope, key)`:
/// while it runs, no other request with the key runs, and its answer (when the
/// status is stored) is what every retry gets. It may still be a re-run of an
/// earlier attempt that failed (a 5xx, a panic) and was released, so effects
/// outside the handler's own answer should be idempotent downstream; forwarding
/// [`key`](Self::key) to a payment provider is the usual way.
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
#[derive(Clone, Debug)]
pub struct ExecutionInfo {
    key: IdempotencyKey,
    scope: Scope,
    guarded: bool,
    context: Option<ExecutionContext>,
}

/// The request's idempotency key, as the middleware parsed it.
///
/// Extract `Option<Key>` on routes where the key is optional.
///
/// ```
/// use idem_axum::Key;
///
/// async fn deposit(key: Option<Key>) -> &'static str {
///     if key.is_some() { "deposited once" } else { "deposited (no key: every delivery counts)" }
/// }
/// # let _: axum::routing::MethodRouter = axum::routing::post(deposit);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Key(pub IdempotencyKey);

/// The rejection of [`Key`] and [`ExecutionInfo`] when the request carries none:
/// the handler is not behind an [`IdempotencyLayer`](crate::IdempotencyLayer), or
/// the request had no key. `500`, as axum's `Extension` answers a missing one:
/// the route is misconfigured.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "this request has no idempotency key: is the handler behind an IdempotencyLayer that requires keys?"
)]
pub struct NoIdempotencyKey;

impl ExecutionInfo {
    pub(crate) fn new(key: IdempotencyKey, scope: Scope, guarded: bool) -> Self {
        Self {
            key,
            scope,
            guarded,
            context: None,
        }
    }

    /// The same, with what the store hands the handler.
    pub(crate) fn with_context(self, context: Option<ExecutionContext>) -> Self {
        Self { context, ..self }
    }

    /// The request's key.
    pub fn key(&self) -> &IdempotencyKey {
        &self.key
    }

    /// The scope the key belongs to.
    pub fn scope(&self) -> &Scope {
        &self.scope
    }

    /// `true` when this execution holds the claim of its `(scope, key)`; `false`
    /// when the store failed and the route fails open
    /// ([`OnStoreFailure::FailOpen`](idem_core::OnStoreFailure::FailOpen)): the
    /// handler then runs unguarded, and a retry runs it again.
    pub fn is_guarded(&self) -> bool {
        self.guarded
    }

    /// What the store hands the handler, as a `T`
    /// ([`Execution::context`](idem_core::Execution::context)): with
    /// idem-diesel's transactional store, the open
    /// [`PgTransaction`](https://docs.rs/idem-diesel) that commits the handler's
    /// writes with the record. `None` with plain stores, for another type, and
    /// when the handler runs unguarded.
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
    pub fn context<T: Any + Send + Sync>(&self) -> Option<Arc<T>> {
        Arc::clone(self.context.as_ref()?).downcast().ok()
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

impl<S: Send + Sync> FromRequestParts<S> for Key {
    type Rejection = NoIdempotencyKey;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        parts
            .extensions
            .get::<ExecutionInfo>()
            .map(|execution| Self(execution.key.clone()))
            .ok_or(NoIdempotencyKey)
    }
}

impl<S: Send + Sync> OptionalFromRequestParts<S> for Key {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut Parts,
        _state: &S,
    ) -> Result<Option<Self>, Self::Rejection> {
        Ok(parts
            .extensions
            .get::<ExecutionInfo>()
            .map(|execution| Self(execution.key.clone())))
    }
}

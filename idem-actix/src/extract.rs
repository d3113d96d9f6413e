//! Extractors: what the middleware tells the handler of a keyed request it let
//! run. The same names and meaning as idem-axum's.

use std::any::Any;
use std::future::{Ready, ready};
use std::sync::Arc;

use actix_web::dev::Payload;
use actix_web::http::StatusCode;
use actix_web::{FromRequest, HttpMessage, HttpRequest, ResponseError};
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
/// use actix_web::HttpResponse;
/// use idem_actix::ExecutionInfo;
///
/// async fn charge(execution: ExecutionInfo) -> HttpResponse {
///     HttpResponse::Created().body(format!("charging once for key {}", execution.key().redacted()))
/// }
/// # let _ = actix_web::web::post().to(charge);
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
/// use idem_actix::Key;
///
/// async fn deposit(key: Option<Key>) -> &'static str {
///     if key.is_some() { "deposited once" } else { "deposited (no key: every delivery counts)" }
/// }
/// # let _ = actix_web::web::post().to(deposit);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Key(pub IdempotencyKey);

/// The error of [`Key`] and [`ExecutionInfo`] when the request carries none: the
/// handler is not behind [`Idempotency`](crate::Idempotency), or the request had
/// no key. `500`: the route is misconfigured.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "this request has no idempotency key: is the handler behind an Idempotency middleware that requires keys?"
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

    /// The same request, run without idempotency (the store failed, the route
    /// fails open).
    pub(crate) fn unguarded(self) -> Self {
        Self {
            guarded: false,
            context: None,
            ..self
        }
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
    /// use actix_web::HttpResponse;
    /// use idem_actix::ExecutionInfo;
    /// use idem_diesel::PgTransaction;
    ///
    /// async fn charge(execution: ExecutionInfo) -> HttpResponse {
    ///     let Some(transaction) = execution.context::<PgTransaction>() else {
    ///         return HttpResponse::ServiceUnavailable().finish();
    ///     };
    ///     let Ok(connection) = transaction.connection().await else {
    ///         return HttpResponse::ServiceUnavailable().finish();
    ///     };
    ///     // … diesel-async writes on `&mut *connection`, committed with the answer.
    ///     # drop(connection);
    ///     HttpResponse::Created().finish()
    /// }
    /// # let _ = actix_web::web::post().to(charge);
    /// ```
    pub fn context<T: Any + Send + Sync>(&self) -> Option<Arc<T>> {
        Arc::clone(self.context.as_ref()?).downcast().ok()
    }
}

impl ResponseError for NoIdempotencyKey {
    fn status_code(&self) -> StatusCode {
        StatusCode::INTERNAL_SERVER_ERROR
    }
}

impl FromRequest for ExecutionInfo {
    type Error = NoIdempotencyKey;
    type Future = Ready<Result<Self, Self::Error>>;

    fn from_request(request: &HttpRequest, _: &mut Payload) -> Self::Future {
        ready(
            request
                .extensions()
                .get::<Self>()
                .cloned()
                .ok_or(NoIdempotencyKey),
        )
    }
}

impl FromRequest for Key {
    type Error = NoIdempotencyKey;
    type Future = Ready<Result<Self, Self::Error>>;

    fn from_request(request: &HttpRequest, _: &mut Payload) -> Self::Future {
        ready(
            request
                .extensions()
                .get::<ExecutionInfo>()
                .map(|execution| Self(execution.key.clone()))
                .ok_or(NoIdempotencyKey),
        )
    }
}

//! [`ExecutionInfo`] and [`StoreContext`] as a framework's extractors: axum's
//! (feature `axum`, on axum-core) and actix-web's (feature `actix`). The
//! adapters (idem-axum, idem-actix) turn these on and put the `ExecutionInfo`
//! of each keyed request they let run in its extensions; a handler takes it as
//! an argument, or `Option<ExecutionInfo>` where a request may have no key, and
//! takes what the store hands it (a transaction) as a `StoreContext<T>`.

use std::ops::Deref;
use std::sync::Arc;

#[cfg(any(feature = "axum", feature = "actix"))]
use crate::ExecutionInfo;

/// What the store hands the handler of a keyed request, typed: a handler
/// states that it takes a `T` by taking a `StoreContext<T>` (idem-diesel names
/// `StoreContext<PgTransaction>` `Transaction`), and derefs it to the `T`.
///
/// A request whose store hands no `T` (its route has no transactional store,
/// or the request has no key, or it ran unguarded because the store failed and
/// the route fails open) is refused with [`NoStoreContext`], `500
/// route-misconfigured`, and logged at error level naming `T`: the handler
/// never runs without what it stated it needs. Take `Option<StoreContext<T>>`
/// where a route may run without one.
#[derive(Debug)]
pub struct StoreContext<T>(pub Arc<T>);

impl<T> StoreContext<T> {
    /// The store's context, shared.
    pub fn into_inner(self) -> Arc<T> {
        self.0
    }
}

impl<T> Clone for StoreContext<T> {
    fn clone(&self) -> Self {
        Self(Arc::clone(&self.0))
    }
}

impl<T> Deref for StoreContext<T> {
    type Target = T;

    fn deref(&self) -> &T {
        &self.0
    }
}

/// The rejection of [`StoreContext`] when the request's store handed no such
/// context: `500 route-misconfigured` (`docs/contract.md` §4), its detail
/// generic, this message (naming the context's type) in the log.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "this request has no {expected} from its idempotency store: is the route behind idem's middleware, over a store that hands one (idem-diesel's TransactionalPgStore hands a PgTransaction), with keys required?"
)]
pub struct NoStoreContext {
    expected: &'static str,
}

/// The `T` the execution `info` was handed by its store.
#[cfg(any(feature = "axum", feature = "actix"))]
fn store_context<T: Send + Sync + 'static>(
    info: Option<&ExecutionInfo>,
) -> Result<StoreContext<T>, NoStoreContext> {
    match info.and_then(ExecutionInfo::context::<T>) {
        Some(context) => Ok(StoreContext(context)),
        None => Err(NoStoreContext {
            expected: std::any::type_name::<T>(),
        }),
    }
}

impl NoStoreContext {
    /// Logs the refusal as it is answered (not where `Option<StoreContext<T>>`
    /// takes it as `None`).
    #[cfg(any(feature = "axum", feature = "actix"))]
    fn log(&self) {
        tracing::error!(target: "idem", error = %self, "a handler that takes a store context was refused: its request has none");
    }
}

/// The rejection of [`ExecutionInfo`] when the request carries none: the
/// handler is not behind idem's middleware, or the request had no key. `500
/// route-misconfigured` (`docs/contract.md` §4), this message in the log.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "this request has no idempotency key: is the handler behind idem's middleware, with keys required?"
)]
pub struct NoIdempotencyKey;

impl NoIdempotencyKey {
    /// Logs the refusal as it is answered.
    #[cfg(any(feature = "axum", feature = "actix"))]
    fn log(&self) {
        tracing::error!(target: "idem", error = %self, "a handler that takes the execution's info was refused: its request has none");
    }
}

/// What a refused request is answered: the detail says no more than that
/// the route is misconfigured (the log names what is missing).
#[cfg(any(feature = "axum", feature = "actix"))]
fn misconfigured() -> String {
    crate::Problem::new(
        crate::ProblemKind::RouteMisconfigured,
        500,
        "this route's handler takes what idem's middleware did not give the request; the server's log says what",
    )
    .body()
}

#[cfg(feature = "axum")]
mod axum {
    use axum_core::extract::{FromRequestParts, OptionalFromRequestParts};
    use axum_core::response::{IntoResponse, Response};
    use http::request::Parts;
    use http::{StatusCode, header};

    use super::{
        ExecutionInfo, NoIdempotencyKey, NoStoreContext, StoreContext, misconfigured, store_context,
    };
    use crate::PROBLEM_CONTENT_TYPE;

    fn answer() -> Response {
        (
            StatusCode::INTERNAL_SERVER_ERROR,
            [(header::CONTENT_TYPE, PROBLEM_CONTENT_TYPE)],
            misconfigured(),
        )
            .into_response()
    }

    impl IntoResponse for NoIdempotencyKey {
        fn into_response(self) -> Response {
            self.log();
            answer()
        }
    }

    impl IntoResponse for NoStoreContext {
        fn into_response(self) -> Response {
            self.log();
            answer()
        }
    }

    impl<S: Send + Sync, T: Send + Sync + 'static> FromRequestParts<S> for StoreContext<T> {
        type Rejection = NoStoreContext;

        async fn from_request_parts(
            parts: &mut Parts,
            _state: &S,
        ) -> Result<Self, Self::Rejection> {
            store_context(parts.extensions.get::<ExecutionInfo>())
        }
    }

    impl<S: Send + Sync, T: Send + Sync + 'static> OptionalFromRequestParts<S> for StoreContext<T> {
        type Rejection = std::convert::Infallible;

        async fn from_request_parts(
            parts: &mut Parts,
            _state: &S,
        ) -> Result<Option<Self>, Self::Rejection> {
            Ok(parts
                .extensions
                .get::<ExecutionInfo>()
                .and_then(ExecutionInfo::context::<T>)
                .map(StoreContext))
        }
    }

    impl<S: Send + Sync> FromRequestParts<S> for ExecutionInfo {
        type Rejection = NoIdempotencyKey;

        async fn from_request_parts(
            parts: &mut Parts,
            _state: &S,
        ) -> Result<Self, Self::Rejection> {
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
}

#[cfg(feature = "actix")]
mod actix {
    use std::future::{Ready, ready};

    use actix_web::dev::Payload;
    use actix_web::http::StatusCode;
    use actix_web::{FromRequest, HttpMessage, HttpRequest, HttpResponse, ResponseError};

    use super::{
        ExecutionInfo, NoIdempotencyKey, NoStoreContext, StoreContext, misconfigured, store_context,
    };
    use crate::PROBLEM_CONTENT_TYPE;

    fn answer() -> HttpResponse {
        HttpResponse::InternalServerError()
            .content_type(PROBLEM_CONTENT_TYPE)
            .body(misconfigured())
    }

    impl ResponseError for NoIdempotencyKey {
        fn status_code(&self) -> StatusCode {
            StatusCode::INTERNAL_SERVER_ERROR
        }

        fn error_response(&self) -> HttpResponse {
            self.log();
            answer()
        }
    }

    impl ResponseError for NoStoreContext {
        fn status_code(&self) -> StatusCode {
            StatusCode::INTERNAL_SERVER_ERROR
        }

        fn error_response(&self) -> HttpResponse {
            self.log();
            answer()
        }
    }

    /// `Option<StoreContext<T>>` is actix-web's own: `None` where this refuses.
    impl<T: Send + Sync + 'static> FromRequest for StoreContext<T> {
        type Error = NoStoreContext;
        type Future = Ready<Result<Self, Self::Error>>;

        fn from_request(request: &HttpRequest, _: &mut Payload) -> Self::Future {
            ready(store_context(request.extensions().get::<ExecutionInfo>()))
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
}

#[cfg(all(test, any(feature = "axum", feature = "actix")))]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// What the log says of a refusal names the context the handler takes;
    /// the answer's detail does not.
    #[test]
    fn a_refusal_names_what_the_handler_takes_in_the_log_only() {
        let refused = store_context::<String>(None).map(|_| ()).unwrap_err();
        assert_eq!(
            refused.to_string(),
            "this request has no alloc::string::String from its idempotency store: is the route behind idem's middleware, over a store that hands one (idem-diesel's TransactionalPgStore hands a PgTransaction), with keys required?"
        );
        let answer: serde_json::Value = serde_json::from_str(&misconfigured()).unwrap();
        assert_eq!(
            answer["type"],
            "https://idem.rs/problems/route-misconfigured"
        );
        assert!(!answer["detail"].to_string().contains("String"));
    }
}

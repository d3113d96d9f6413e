//! [`ExecutionInfo`] as a framework's extractor, axum's (feature `axum`, on
//! axum-core) and actix-web's (feature `actix`), and [`StoreContext`], what a
//! handler mounted with an adapter's `on` takes from the store. The adapters
//! (idem-axum, idem-actix) turn these on and put the `ExecutionInfo` of each
//! keyed request they let run in its extensions; a handler takes it as an
//! argument, or `Option<ExecutionInfo>` where a request may have no key.

use std::ops::Deref;
use std::sync::Arc;

use crate::ExecutionInfo;
use crate::store::ContextType;

/// What the store hands the handler of a keyed request, typed: a handler
/// states that it takes a `T` by taking a `StoreContext<T>` as its first
/// argument (idem-diesel names `StoreContext<PgTransaction>` `Transaction`),
/// and derefs it to the `T`.
///
/// It is not an extractor on its own: such a handler is mounted with the
/// adapter's `on` (`idem_axum::IdempotencyLayer::on`,
/// `idem_actix::Idempotency::on`), which puts the layer around it and checks,
/// when the route is built, that every request the handler sees has a `T`
/// ([`Engine::check_context`](crate::Engine::check_context)). So a route that
/// would hand it none fails the start, and a handler taking a
/// `StoreContext<T>` mounted any other way does not compile. Where a route
/// may run without one (a store chosen at run time, optional keys), take
/// `Option<ExecutionInfo>` and ask it for [`ExecutionInfo::context`].
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

/// Why a handler that takes a [`StoreContext<T>`] cannot be mounted on a
/// route ([`Engine::check_context`](crate::Engine::check_context)): some
/// request the handler would see has no `T`. The adapters' `on` returns it
/// when the route is built, so the application fails to start with this
/// message instead of answering requests `500`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ContextRouteError {
    /// The route's store hands its handlers something else, or nothing.
    #[error(
        "the handler takes a StoreContext<{expected}> from the route's idempotency store, which hands {}: build the route over a store that hands one (idem-diesel's TransactionalPgStore hands a PgTransaction)",
        handed.map_or("nothing", |handed| handed.name())
    )]
    NotHanded {
        /// What the handler takes.
        expected: &'static str,
        /// What the store hands, if anything.
        handed: Option<ContextType>,
    },
    /// Keys are optional on the route: a request without one would reach
    /// the handler with no execution, so with no context.
    #[error(
        "the handler takes a StoreContext<{expected}>, which only a keyed request has, and keys are optional on this route: use Policy::required()"
    )]
    OptionalKeys {
        /// What the handler takes.
        expected: &'static str,
    },
    /// The route fails open: when the store fails, the handler would run
    /// unguarded, so with no context.
    #[error(
        "the handler takes a StoreContext<{expected}>, and this route fails open (OnStoreFailure::FailOpen), running the handler without one when the store fails: fail closed"
    )]
    FailsOpen {
        /// What the handler takes.
        expected: &'static str,
    },
    /// The policy does not cover the method the handler is mounted on: its
    /// requests would pass through without a key.
    #[error(
        "the handler takes a StoreContext<{expected}> and is mounted on {method}, which the policy does not cover, so its requests would pass through without one: add {method} to Policy::methods"
    )]
    MethodNotCovered {
        /// What the handler takes.
        expected: &'static str,
        /// The method.
        method: String,
    },
    /// The framework routes no handler by this method (axum routes the
    /// standard methods only).
    #[error("the handler is mounted on {method}, which the framework cannot route by method")]
    UnroutableMethod {
        /// The method.
        method: String,
    },
}

/// For the adapters' `on`: the `T` the execution `info` was handed by its
/// store, or the refusal (logged when answered).
pub fn store_context<T: Send + Sync + 'static>(
    info: Option<&ExecutionInfo>,
) -> Result<StoreContext<T>, NoStoreContext> {
    match info.and_then(ExecutionInfo::context::<T>) {
        Some(context) => Ok(StoreContext(context)),
        None => Err(NoStoreContext {
            expected: std::any::type_name::<T>(),
        }),
    }
}

/// What a handler mounted with an adapter's `on` is answered when its
/// request's store handed no [`StoreContext<T>`] after all (a store that
/// declares a `T` in [`Store::execution_context_type`](crate::Store::execution_context_type)
/// and hands none; [`Engine::check_context`](crate::Engine::check_context)
/// rules out every other way): `500 route-misconfigured`
/// (`docs/contract.md` §4), its detail generic, this message (naming the
/// context's type) in the log. The handler does not run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "this request has no {expected} from its idempotency store, which declares that it hands one"
)]
pub struct NoStoreContext {
    expected: &'static str,
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

    use super::{ExecutionInfo, NoIdempotencyKey, NoStoreContext, misconfigured};
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

    use super::{ExecutionInfo, NoIdempotencyKey, NoStoreContext, misconfigured};
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
            "this request has no alloc::string::String from its idempotency store, which declares that it hands one"
        );
        let answer: serde_json::Value = serde_json::from_str(&misconfigured()).unwrap();
        assert_eq!(
            answer["type"],
            "https://idem.rs/problems/route-misconfigured"
        );
        assert!(!answer["detail"].to_string().contains("String"));
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod route_tests {
    use std::sync::Arc;

    use crate::store::{Claim, ContextType, ExecutionContext, StoreLayer};
    use crate::{ContextRouteError, Engine, MemoryStore, OnStoreFailure, Policy, Store};

    struct Till;

    /// Declares a till (what it hands does not matter to the check).
    struct Tilled(MemoryStore);

    impl StoreLayer for Tilled {
        fn inner(&self) -> &dyn Store {
            &self.0
        }
        fn execution_context(&self, _: &Claim) -> Option<ExecutionContext> {
            Some(Arc::new(Till))
        }
        fn execution_context_type(&self) -> Option<ContextType> {
            Some(ContextType::of::<Till>())
        }
    }

    fn refusal(store: impl Store, policy: Policy, method: &str) -> String {
        Engine::new(store, policy)
            .check_context::<Till>(method)
            .unwrap_err()
            .to_string()
    }

    /// Each refusal names what the handler takes and what to change, in the
    /// words the application's start fails with.
    #[test]
    fn a_route_that_cannot_hand_what_its_handler_takes_says_what_to_change() {
        let tilled = || Tilled(MemoryStore::new());
        let till = "idem_core::extract::route_tests::Till";
        assert_eq!(
            refusal(MemoryStore::new(), Policy::required(), "POST"),
            format!(
                "the handler takes a StoreContext<{till}> from the route's idempotency store, which hands nothing: build the route over a store that hands one (idem-diesel's TransactionalPgStore hands a PgTransaction)"
            )
        );
        let strings = Engine::new(tilled(), Policy::required())
            .check_context::<String>("POST")
            .unwrap_err();
        assert_eq!(
            strings,
            ContextRouteError::NotHanded {
                expected: "alloc::string::String",
                handed: Some(ContextType::of::<Till>())
            }
        );
        assert_eq!(
            strings.to_string(),
            format!(
                "the handler takes a StoreContext<alloc::string::String> from the route's idempotency store, which hands {till}: build the route over a store that hands one (idem-diesel's TransactionalPgStore hands a PgTransaction)"
            )
        );
        assert_eq!(
            refusal(tilled(), Policy::optional(), "POST"),
            format!(
                "the handler takes a StoreContext<{till}>, which only a keyed request has, and keys are optional on this route: use Policy::required()"
            )
        );
        assert_eq!(
            refusal(
                tilled(),
                Policy::required().on_store_failure(OnStoreFailure::FailOpen),
                "POST"
            ),
            format!(
                "the handler takes a StoreContext<{till}>, and this route fails open (OnStoreFailure::FailOpen), running the handler without one when the store fails: fail closed"
            )
        );
        assert_eq!(
            refusal(tilled(), Policy::required(), "put"),
            format!(
                "the handler takes a StoreContext<{till}> and is mounted on PUT, which the policy does not cover, so its requests would pass through without one: add PUT to Policy::methods"
            )
        );
        for method in ["POST", "patch"] {
            Engine::new(tilled(), Policy::required())
                .check_context::<Till>(method)
                .unwrap();
        }
    }
}

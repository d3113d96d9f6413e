//! Getting started with idem on axum: a small orders API, complete.
//!
//! | route | |
//! |---|---|
//! | `POST /orders` `{"item": STRING, "quantity": INT}` | creates an order: `201` with it; needs an `Idempotency-Key`, so a retry replays the answer instead of ordering twice |
//! | `GET /orders` | the caller's orders |
//!
//! Every route needs `Authorization: Bearer TOKEN` (`401` problem otherwise).
//! The caller's [`Principal`] is the idempotency scope: two callers never share
//! a key.
//!
//! **Layer order.** The idempotency layer reads the scope that authentication
//! put in the request, so authentication must run first, as the outer layer.
//! axum runs the layer added *last* first: the idempotency layer goes on the
//! route (`route_layer`), authentication on the router after it (`.layer`).
//! In the other order every keyed request is answered `500 scope-unavailable`.
//!
//! `src/main.rs` and [`start`] add the rest of a real server: the tracing
//! subscriber, the store's migration at start-up, the cleanup job, graceful
//! shutdown.

mod orders;
pub mod start;

/// The top README's Rust snippets, compiled and run as this crate's doctests
/// (both frameworks': actix-web is a dev-dependency for them).
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
struct ReadmeSnippets;

use axum::extract::{Request, State};
use axum::http::{Method, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json, Router};
use idem::axum::IdempotencyLayer;
use idem::diesel::{SqliteStore, SqliteTransaction, SqliteTransactionError};
use idem::{ContextRouteError, Policy, StoreContext};

pub use orders::{
    CrashPoint, NewOrder, Order, Orders, OrdersError, Principal, Publishing, problem_body,
};

/// The application: the orders routes behind authentication, `POST /orders`
/// behind the idempotency layer on `store` in transactional mode, with a
/// lease of `lease`. The orders live in the store's SQLite file and are
/// written in the request's transaction ([`Orders::create`]): the order and
/// the record's completion commit together.
///
/// Fails when the route cannot hand the handler its transaction (never, on
/// this store: `on` checks it when the route is built).
pub fn app(
    store: &SqliteStore,
    orders: Orders,
    lease: std::time::Duration,
) -> Result<Router, ContextRouteError> {
    let idempotency = IdempotencyLayer::new(store.transactional(), Policy::required().lease(lease))
        .scope_from_extension::<Principal>();
    let crashes = orders.crashes_before_answer();
    let mut router = Router::new().route(
        "/orders",
        idempotency.on(Method::POST, create_order)?.get(list_orders),
    );
    if crashes {
        router = router.layer(middleware::from_fn(crash_before_answer));
    }
    Ok(router
        // Added last, so it runs first: the idempotency layer finds the principal.
        .layer(middleware::from_fn(authenticate))
        .with_state(orders))
}

/// Puts the caller's [`Principal`] in the request, or answers `401`.
async fn authenticate(mut request: Request, next: Next) -> Response {
    let authorization = request.headers().get(header::AUTHORIZATION);
    match Principal::from_authorization(authorization.map(|value| value.as_bytes())) {
        Some(principal) => {
            request.extensions_mut().insert(principal);
            next.run(request).await
        }
        None => problem(StatusCode::UNAUTHORIZED, "a bearer token is required"),
    }
}

/// Runs once per (principal, key), in the request's transaction: retries
/// get its answer replayed.
async fn create_order(
    StoreContext(transaction): StoreContext<SqliteTransaction>,
    State(orders): State<Orders>,
    Extension(principal): Extension<Principal>,
    Json(order): Json<NewOrder>,
) -> Response {
    if order.quantity < 1 {
        return problem(
            StatusCode::UNPROCESSABLE_ENTITY,
            "quantity must be at least 1",
        );
    }
    match orders.create(&transaction, &principal, order).await {
        Ok(order) => (StatusCode::CREATED, Json(order)).into_response(),
        Err(error) => not_written(&error),
    }
}

/// The crash test's `answer` point: the order is committed, its answer lost.
async fn crash_before_answer(request: Request, next: Next) -> Response {
    let response = next.run(request).await;
    if response.status() == StatusCode::CREATED {
        CrashPoint::BeforeAnswer.crash();
    }
    response
}

async fn list_orders(
    State(orders): State<Orders>,
    Extension(principal): Extension<Principal>,
) -> Response {
    match orders.list(&principal).await {
        Ok(orders) => Json(orders).into_response(),
        Err(error) => unavailable(&error),
    }
}

/// A database failure: `503`, which the idempotency layer does not store, so
/// the retry runs again. The cause goes to the log only.
fn unavailable(error: &OrdersError) -> Response {
    tracing::error!(error = %error, "the orders table failed");
    problem(StatusCode::SERVICE_UNAVAILABLE, "try again shortly")
}

/// An order that could not be written (the file's write lock busy past its
/// timeout, the disk failing): `503`, not stored, rolled back; the retry
/// orders once.
fn not_written(error: &SqliteTransactionError) -> Response {
    tracing::error!(error = %idem::log::error_chain(error), "the order could not be written");
    problem(StatusCode::SERVICE_UNAVAILABLE, "try again shortly")
}

/// An RFC 9457 problem answer.
fn problem(status: StatusCode, detail: &str) -> Response {
    let title = status.canonical_reason().unwrap_or_default();
    let mut response = (status, problem_body(status.as_u16(), title, detail)).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/problem+json"),
    );
    if status == StatusCode::UNAUTHORIZED {
        response.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            header::HeaderValue::from_static("Bearer"),
        );
    }
    response
}

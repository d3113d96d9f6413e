//! The payments service on axum (CONTRACT §8): the routes of the
//! [`payments`] domain behind [`idem_axum::IdempotencyLayer`], scoped by the
//! bearer-token principal.
//!
//! | route | idempotency key |
//! |---|---|
//! | `POST /accounts/{account_id}/charges` | required |
//! | `POST /accounts/{account_id}/deposits` | optional (without one, every delivery takes effect) |
//! | `GET /accounts/{account_id}` | not covered |
//!
//! ```
//! use std::{sync::Arc, time::Duration};
//! use payments::{Ledger, Payments};
//!
//! let store = Arc::new(idem_core::MemoryStore::new());
//! let app: axum::Router = payments_axum::app(store, Payments::new(Ledger::new(), Duration::ZERO));
//! ```

use std::sync::Arc;

use axum::Router;
use axum::extract::{Path, Request, State};
use axum::http::header::{AUTHORIZATION, CONTENT_TYPE};
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use idem_axum::IdempotencyLayer;
use idem_core::{Policy, Store};
use payments::{Answer, Payments, Principal, charge_policy, deposit_policy};

/// The service's router over `store` (the idempotency records) and `payments`.
pub fn app(store: Arc<dyn Store>, payments: Payments) -> Router {
    let guarded = |policy: Policy| {
        IdempotencyLayer::from_shared(Arc::clone(&store))
            .policy(policy)
            .scope_from_extension::<Principal>()
    };
    Router::new()
        .route(
            "/accounts/{account_id}/charges",
            post(charge).route_layer(guarded(charge_policy())),
        )
        .route(
            "/accounts/{account_id}/deposits",
            post(deposit).route_layer(guarded(deposit_policy())),
        )
        .route("/accounts/{account_id}", get(account))
        .layer(middleware::from_fn(authenticate))
        .with_state(payments)
}

/// Every route needs a principal; it is also the idempotency scope.
async fn authenticate(mut request: Request, next: Next) -> Response {
    let authorization = request
        .headers()
        .get(AUTHORIZATION)
        .map(HeaderValue::as_bytes);
    match Principal::from_authorization(authorization) {
        Ok(principal) => {
            request.extensions_mut().insert(principal);
            next.run(request).await
        }
        Err(error) => send(error.answer()),
    }
}

async fn charge(
    State(payments): State<Payments>,
    Path(account_id): Path<String>,
    body: Bytes,
) -> Response {
    send(payments.charge(&account_id, &body).await.into())
}

async fn deposit(
    State(payments): State<Payments>,
    Path(account_id): Path<String>,
    body: Bytes,
) -> Response {
    send(payments.deposit(&account_id, &body).await.into())
}

async fn account(State(payments): State<Payments>, Path(account_id): Path<String>) -> Response {
    send(payments.account(&account_id).into())
}

fn send(answer: Answer) -> Response {
    let status = StatusCode::from_u16(answer.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (status, [(CONTENT_TYPE, answer.content_type)], answer.body).into_response()
}

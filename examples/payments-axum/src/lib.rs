//! The payments service on axum (`docs/contract.md` §8): the routes of the
//! [`payments`] domain behind [`idem_axum::IdempotencyLayer`], scoped by the
//! bearer-token principal.
//!
//! | route | idempotency key |
//! |---|---|
//! | `POST /accounts/{account_id}/charges` | required |
//! | `POST /accounts/{account_id}/deposits` | optional (without one, every delivery takes effect) |
//! | `GET /accounts/{account_id}` | not covered |
//!
//! Each keyed route runs behind its [`payments::Guard`]: on PostgreSQL in
//! transactional mode, where the handler hands the request's transaction
//! (its `ExecutionInfo`'s context, since the same handlers serve the other
//! stores: [`payments::Attempt::of`]) to the ledger, so the ledger's writes
//! commit with the idempotency record.
//!
//! ```
//! use std::{sync::Arc, time::Duration};
//! use payments::{Guards, Ledger, Payments};
//!
//! let guards = Guards::plain(Arc::new(idem_core::MemoryStore::new()));
//! let app: axum::Router = payments_axum::app(guards, Payments::new(Ledger::memory(), Duration::ZERO));
//! ```

use axum::Router;
use axum::extract::{Path, Request, State};
use axum::http::header::{AUTHORIZATION, CONTENT_TYPE, RETRY_AFTER};
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use idem_axum::{ExecutionInfo, IdempotencyLayer};
use payments::{Answer, Attempt, Guard, Guards, Payments, Principal};

#[cfg(test)]
mod attack;

/// The service's router: the keyed routes behind `guards` (their idempotency
/// stores and policies), over `payments`.
pub fn app(guards: Guards, payments: Payments) -> Router {
    let guarded = |guard: &Guard| {
        IdempotencyLayer::new(guard.store(), guard.policy().clone())
            .scope_from_extension::<Principal>()
    };
    Router::new()
        .route(
            "/accounts/{account_id}/charges",
            post(charge).route_layer(guarded(&guards.charges)),
        )
        .route(
            "/accounts/{account_id}/deposits",
            post(deposit).route_layer(guarded(&guards.deposits)),
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
    execution: Option<ExecutionInfo>,
    body: Bytes,
) -> Response {
    let attempt = Attempt::of(execution.as_ref());
    send(payments.charge(&account_id, &body, &attempt).await.into())
}

async fn deposit(
    State(payments): State<Payments>,
    Path(account_id): Path<String>,
    execution: Option<ExecutionInfo>,
    body: Bytes,
) -> Response {
    let attempt = Attempt::of(execution.as_ref());
    send(payments.deposit(&account_id, &body, &attempt).await.into())
}

async fn account(State(payments): State<Payments>, Path(account_id): Path<String>) -> Response {
    send(payments.account(&account_id).await.into())
}

fn send(answer: Answer) -> Response {
    let status = StatusCode::from_u16(answer.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut response = (status, [(CONTENT_TYPE, answer.content_type)], answer.body).into_response();
    if let Some(seconds) = answer.retry_after {
        response
            .headers_mut()
            .insert(RETRY_AFTER, HeaderValue::from(seconds));
    }
    response
}

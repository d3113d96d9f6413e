//! The payments service on actix-web (`docs/contract.md` §8): the routes of the
//! [`payments`] domain behind [`idem_actix::Idempotency`], scoped by the
//! bearer-token principal. The same routes and answers as `payments-axum`.
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
//! use actix_web::HttpServer;
//! use payments::{Guards, Ledger, Payments};
//!
//! let guards = Guards::plain(Arc::new(idem_core::MemoryStore::new()));
//! let payments = Payments::new(Ledger::memory(), Duration::ZERO);
//! let server = HttpServer::new(move || payments_actix::app(guards.clone(), payments.clone()));
//! # drop(server);
//! ```

use actix_web::body::MessageBody;
use actix_web::dev::{ServiceFactory, ServiceRequest, ServiceResponse};
use actix_web::http::StatusCode;
use actix_web::http::header::{AUTHORIZATION, CONTENT_TYPE, RETRY_AFTER};
use actix_web::middleware::{Next, from_fn};
use actix_web::{App, Error, HttpMessage, HttpResponse, web};
use idem_actix::{ExecutionInfo, Idempotency};
use payments::{Answer, Attempt, Guard, Guards, Payments, Principal};

/// The largest body a handler reads without a key (with one, the idempotency
/// middleware's limit of 1 MiB comes first): axum's default, 2 MB.
const BODY_LIMIT: usize = 2 * 1024 * 1024;

/// The service's app: the keyed routes behind `guards` (their idempotency stores
/// and policies), over `payments`. Call it in `HttpServer::new`'s factory, once
/// per worker.
pub fn app(
    guards: Guards,
    payments: Payments,
) -> App<
    impl ServiceFactory<
        ServiceRequest,
        Config = (),
        Response = ServiceResponse<impl MessageBody>,
        Error = Error,
        InitError = (),
    >,
> {
    let guarded = |guard: &Guard| {
        Idempotency::new(guard.store(), guard.policy().clone()).scope_from_extension::<Principal>()
    };
    App::new()
        .app_data(web::Data::new(payments))
        // axum's default body limit, so that both services refuse the same bodies.
        .app_data(web::PayloadConfig::new(BODY_LIMIT))
        .wrap(from_fn(authenticate))
        .service(
            web::resource("/accounts/{account_id}/charges")
                .wrap(guarded(&guards.charges))
                .route(web::post().to(charge)),
        )
        .service(
            web::resource("/accounts/{account_id}/deposits")
                .wrap(guarded(&guards.deposits))
                .route(web::post().to(deposit)),
        )
        .service(
            web::resource("/accounts/{account_id}")
                .route(web::get().to(account))
                // As axum's `get` does: HEAD is GET without the body.
                .route(web::head().to(account)),
        )
}

/// Every route needs a principal; it is also the idempotency scope, so this runs
/// before the idempotency middleware.
async fn authenticate(
    request: ServiceRequest,
    next: Next<impl MessageBody + 'static>,
) -> Result<ServiceResponse<impl MessageBody>, Error> {
    let authorization = request
        .headers()
        .get(AUTHORIZATION)
        .map(|value| value.as_bytes());
    match Principal::from_authorization(authorization) {
        Ok(principal) => {
            request.extensions_mut().insert(principal);
            Ok(next.call(request).await?.map_into_left_body())
        }
        Err(error) => Ok(request
            .into_response(send(error.answer()))
            .map_into_right_body()),
    }
}

async fn charge(
    payments: web::Data<Payments>,
    account_id: web::Path<String>,
    execution: Option<ExecutionInfo>,
    body: web::Bytes,
) -> HttpResponse {
    let attempt = Attempt::of(execution.as_ref());
    send(payments.charge(&account_id, &body, &attempt).await.into())
}

async fn deposit(
    payments: web::Data<Payments>,
    account_id: web::Path<String>,
    execution: Option<ExecutionInfo>,
    body: web::Bytes,
) -> HttpResponse {
    let attempt = Attempt::of(execution.as_ref());
    send(payments.deposit(&account_id, &body, &attempt).await.into())
}

async fn account(payments: web::Data<Payments>, account_id: web::Path<String>) -> HttpResponse {
    send(payments.account(&account_id).await.into())
}

/// The domain's answer as an actix-web response.
fn send(answer: Answer) -> HttpResponse {
    let status = StatusCode::from_u16(answer.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut response = HttpResponse::build(status);
    response.insert_header((CONTENT_TYPE, answer.content_type));
    if let Some(seconds) = answer.retry_after {
        response.insert_header((RETRY_AFTER, seconds));
    }
    response.body(answer.body)
}

//! The payments service on actix-web (CONTRACT §8): the routes of the
//! [`payments`] domain behind [`idem_actix::Idempotency`], scoped by the
//! bearer-token principal. The same routes and answers as `payments-axum`.
//!
//! | route | idempotency key |
//! |---|---|
//! | `POST /accounts/{account_id}/charges` | required |
//! | `POST /accounts/{account_id}/deposits` | optional (without one, every delivery takes effect) |
//! | `GET /accounts/{account_id}` | not covered |
//!
//! ```
//! use std::{sync::Arc, time::Duration};
//! use actix_web::HttpServer;
//! use payments::{Ledger, Payments};
//!
//! let store = Arc::new(idem_core::MemoryStore::new());
//! let payments = Payments::new(Ledger::new(), Duration::ZERO);
//! let server = HttpServer::new(move || payments_actix::app(store.clone(), payments.clone()));
//! # drop(server);
//! ```

use std::sync::Arc;

use actix_web::body::MessageBody;
use actix_web::dev::{ServiceFactory, ServiceRequest, ServiceResponse};
use actix_web::http::StatusCode;
use actix_web::http::header::{AUTHORIZATION, CONTENT_TYPE};
use actix_web::middleware::{Next, from_fn};
use actix_web::{App, Error, HttpMessage, HttpResponse, web};
use idem_actix::Idempotency;
use idem_core::{Policy, Store};
use payments::{Answer, Payments, Principal, charge_policy, deposit_policy};

/// The largest body a handler reads without a key (with one, the idempotency
/// middleware's limit of 1 MiB comes first): axum's default, 2 MB.
const BODY_LIMIT: usize = 2 * 1024 * 1024;

/// The service's app over `store` (the idempotency records) and `payments`; call
/// it in `HttpServer::new`'s factory, once per worker.
pub fn app(
    store: Arc<dyn Store>,
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
    let guarded = |policy: Policy| {
        Idempotency::from_shared(Arc::clone(&store))
            .policy(policy)
            .scope_from_extension::<Principal>()
    };
    App::new()
        .app_data(web::Data::new(payments))
        // axum's default body limit, so that both services refuse the same bodies.
        .app_data(web::PayloadConfig::new(BODY_LIMIT))
        .wrap(from_fn(authenticate))
        .service(
            web::resource("/accounts/{account_id}/charges")
                .wrap(guarded(charge_policy()))
                .route(web::post().to(charge)),
        )
        .service(
            web::resource("/accounts/{account_id}/deposits")
                .wrap(guarded(deposit_policy()))
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
    body: web::Bytes,
) -> HttpResponse {
    send(payments.charge(&account_id, &body).await.into())
}

async fn deposit(
    payments: web::Data<Payments>,
    account_id: web::Path<String>,
    body: web::Bytes,
) -> HttpResponse {
    send(payments.deposit(&account_id, &body).await.into())
}

async fn account(payments: web::Data<Payments>, account_id: web::Path<String>) -> HttpResponse {
    send(payments.account(&account_id).into())
}

/// The domain's answer as an actix-web response.
fn send(answer: Answer) -> HttpResponse {
    let status = StatusCode::from_u16(answer.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    HttpResponse::build(status)
        .insert_header((CONTENT_TYPE, answer.content_type))
        .body(answer.body)
}

//! Getting started with idem on actix-web: a small orders API, complete.
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
//! **Middleware order.** The idempotency middleware reads the scope that
//! authentication put in the request, so authentication must run first, as
//! the outer middleware. actix-web runs the enclosing scope's (or the App's)
//! `wrap` before a resource's, and on one service the `wrap` added *last*
//! first: here authentication wraps the enclosing `web::scope`, idempotency
//! the `/orders` resource. In the other order every keyed request is answered
//! `500 scope-unavailable`.
//!
//! `src/main.rs` and [`start`] add the rest of a real server: the tracing
//! subscriber, the store's migration at start-up, the cleanup job, graceful
//! shutdown.

// The framework-free parts (principal, orders table, problem body; start-up and
// shutdown) are orders-axum's, as they are.
#[path = "../../orders-axum/src/orders.rs"]
mod orders;
#[path = "../../orders-axum/src/start.rs"]
pub mod start;

use actix_web::body::{BoxBody, MessageBody};
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::{StatusCode, header};
use actix_web::middleware::{Next, from_fn};
use actix_web::{Error, HttpMessage, HttpResponse, web};
use idem::Policy;
use idem::actix::Idempotency;
use idem::diesel::SqliteStore;

pub use orders::{NewOrder, Order, Orders, OrdersError, Principal, problem_body};

/// The application's routes, for `App::configure`: the orders behind
/// authentication, `POST /orders` behind the idempotency middleware on
/// `store`. The orders live in the store's SQLite file ([`Orders::open`] on
/// `store.pool()`).
pub fn routes(store: SqliteStore, orders: Orders) -> impl Fn(&mut web::ServiceConfig) + Clone {
    move |config| {
        let idempotency =
            Idempotency::new(store.clone(), Policy::required()).scope_from_extension::<Principal>();
        config.app_data(web::Data::new(orders.clone())).service(
            web::scope("")
                // Wraps the scope, so it runs before the resource's middleware.
                .wrap(from_fn(authenticate))
                .service(
                    web::resource("/orders")
                        .wrap(idempotency)
                        .route(web::post().to(create_order))
                        .route(web::get().to(list_orders)),
                ),
        );
    }
}

/// Puts the caller's [`Principal`] in the request, or answers `401`.
async fn authenticate(
    request: ServiceRequest,
    next: Next<impl MessageBody + 'static>,
) -> Result<ServiceResponse<BoxBody>, Error> {
    let authorization = request.headers().get(header::AUTHORIZATION);
    match Principal::from_authorization(authorization.map(|value| value.as_bytes())) {
        Some(principal) => {
            request.extensions_mut().insert(principal);
            Ok(next.call(request).await?.map_into_boxed_body())
        }
        None => Ok(request.into_response(problem(
            StatusCode::UNAUTHORIZED,
            "a bearer token is required",
        ))),
    }
}

/// Runs once per (principal, key): retries get its answer replayed.
async fn create_order(
    orders: web::Data<Orders>,
    principal: web::ReqData<Principal>,
    order: web::Json<NewOrder>,
) -> HttpResponse {
    let order = order.into_inner();
    if order.quantity < 1 {
        return problem(
            StatusCode::UNPROCESSABLE_ENTITY,
            "quantity must be at least 1",
        );
    }
    match orders.create(&principal, order).await {
        Ok(order) => HttpResponse::Created().json(order),
        Err(error) => unavailable(&error),
    }
}

async fn list_orders(
    orders: web::Data<Orders>,
    principal: web::ReqData<Principal>,
) -> HttpResponse {
    match orders.list(&principal).await {
        Ok(orders) => HttpResponse::Ok().json(orders),
        Err(error) => unavailable(&error),
    }
}

/// A database failure: `503`, which the idempotency middleware does not store,
/// so the retry runs again. The cause goes to the log only.
fn unavailable(error: &OrdersError) -> HttpResponse {
    tracing::error!(error = %error, "the orders table failed");
    problem(StatusCode::SERVICE_UNAVAILABLE, "try again shortly")
}

/// An RFC 9457 problem answer.
fn problem(status: StatusCode, detail: &str) -> HttpResponse {
    let title = status.canonical_reason().unwrap_or_default();
    let mut response = HttpResponse::build(status);
    response.content_type("application/problem+json");
    if status == StatusCode::UNAUTHORIZED {
        response.insert_header((header::WWW_AUTHENTICATE, "Bearer"));
    }
    response.body(problem_body(status.as_u16(), title, detail))
}

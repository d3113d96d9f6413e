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
use actix_web::http::{Method, StatusCode, header};
use actix_web::middleware::{Next, from_fn};
use actix_web::{Error, HttpMessage, HttpResponse, web};
use idem::actix::{Idempotency, StoreContext};
use idem::diesel::{SqliteStore, SqliteTransaction, SqliteTransactionError};
use idem::{ContextRouteError, Policy};

pub use orders::{
    CrashPoint, NewOrder, Order, Orders, OrdersError, Principal, Publishing, problem_body,
};

/// The application's routes, for `App::configure`: the orders behind
/// authentication, `POST /orders` behind the idempotency middleware on
/// `store` in transactional mode, with a lease of `lease`. The orders live in
/// the store's SQLite file and are written in the request's transaction
/// ([`Orders::create`]): the order and the record's completion commit
/// together.
///
/// Fails when the route cannot hand the handler its transaction (never, on
/// this store: `on` checks it when the route is built).
pub fn routes(
    store: &SqliteStore,
    orders: Orders,
    lease: std::time::Duration,
) -> Result<impl Fn(&mut web::ServiceConfig) + Clone + use<>, ContextRouteError> {
    let idempotency = Idempotency::new(store.transactional(), Policy::required().lease(lease))
        .scope_from_extension::<Principal>();
    // Built once here, so that a route that cannot be built fails the start.
    idempotency.on(Method::POST, create_order)?;
    let crashes = orders.crashes_before_answer();
    Ok(move |config: &mut web::ServiceConfig| {
        let Ok(create) = idempotency.on(Method::POST, create_order) else {
            return;
        };
        let resource = web::resource("/orders")
            .route(create)
            .route(web::get().to(list_orders));
        let scope = web::scope("")
            // Wraps the scope, so it runs before the resource's middleware.
            .wrap(from_fn(authenticate));
        let scope = if crashes {
            scope.service(resource.wrap(from_fn(crash_before_answer)))
        } else {
            scope.service(resource)
        };
        config
            .app_data(web::Data::new(orders.clone()))
            .service(scope);
    })
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

/// Runs once per (principal, key), in the request's transaction: retries
/// get its answer replayed.
async fn create_order(
    StoreContext(transaction): StoreContext<SqliteTransaction>,
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
    match orders.create(&transaction, &principal, order).await {
        Ok(order) => HttpResponse::Created().json(order),
        Err(error) => not_written(&error),
    }
}

/// The crash test's `answer` point: the order is committed, its answer lost.
async fn crash_before_answer(
    request: ServiceRequest,
    next: Next<impl MessageBody + 'static>,
) -> Result<ServiceResponse<BoxBody>, Error> {
    let response = next.call(request).await?;
    if response.status() == StatusCode::CREATED {
        CrashPoint::BeforeAnswer.crash();
    }
    Ok(response.map_into_boxed_body())
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

/// An order that could not be written (the file's write lock busy past its
/// timeout, the disk failing): `503`, not stored, rolled back; the retry
/// orders once.
fn not_written(error: &SqliteTransactionError) -> HttpResponse {
    tracing::error!(error = %idem::log::error_chain(error), "the order could not be written");
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

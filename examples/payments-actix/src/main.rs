//! The payments service on actix-web (CONTRACT §8): the routes of the shared
//! `payments` crate, charges and deposits behind idem's actix middleware, scoped
//! by the caller's principal.
//!
//! ```text
//! payments-actix [--listen 127.0.0.1:3000] [--store URL] [--provider-latency-ms N]
//! ```
//!
//! The first line on stdout is `listening on http://HOST:PORT`; logs go to stderr.

use std::process::ExitCode;

use actix_web::body::MessageBody;
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::StatusCode;
use actix_web::http::header::{AUTHORIZATION, CONTENT_TYPE};
use actix_web::middleware::{Next, from_fn};
use actix_web::{App, Error, HttpMessage, HttpResponse, HttpServer, web};
use idem_actix::Idempotency;
use payments::{Answer, Ledger, Options, Payments, Principal, StartError};

#[actix_web::main]
async fn main() -> ExitCode {
    payments::init_tracing();
    match serve(Options::from_command_line()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            tracing::error!(error = %error_chain(&error), "payments-actix stopped");
            eprintln!("payments-actix: {}", error_chain(&error));
            ExitCode::FAILURE
        }
    }
}

/// Why the service stopped.
#[derive(Debug, thiserror::Error)]
enum ServeError {
    /// It could not start.
    #[error("cannot start")]
    Start(#[from] StartError),
    /// The HTTP server failed.
    #[error("the HTTP server failed")]
    Server(#[source] std::io::Error),
}

/// Opens the store, binds the address, prints the listening line and serves until
/// stopped (Ctrl-C).
async fn serve(options: Options) -> Result<(), ServeError> {
    let store = options.store_url()?.open().await?;
    let payments = web::Data::new(Payments::new(Ledger::new(), options.provider_latency()));
    let listener = options.bind()?;
    let addr = listener.local_addr().map_err(ServeError::Server)?;
    let server = HttpServer::new(move || {
        App::new()
            .app_data(payments.clone())
            .wrap(from_fn(authenticate))
            .service(
                web::resource("/accounts/{account_id}/charges")
                    .wrap(
                        Idempotency::from_shared(store.clone())
                            .policy(payments::charge_policy())
                            .scope_from_extension::<Principal>(),
                    )
                    .route(web::post().to(charge)),
            )
            .service(
                web::resource("/accounts/{account_id}/deposits")
                    .wrap(
                        Idempotency::from_shared(store.clone())
                            .policy(payments::deposit_policy())
                            .scope_from_extension::<Principal>(),
                    )
                    .route(web::post().to(deposit)),
            )
            .route("/accounts/{account_id}", web::get().to(account))
    })
    .listen(listener)
    .map_err(ServeError::Server)?
    .run();
    println!("{}", payments::listening_line(addr));
    server.await.map_err(ServeError::Server)
}

/// Names the caller from `Authorization: Bearer TOKEN` for every route, before
/// the idempotency middleware scopes by it; no token is `401`.
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
            .into_response(respond(error.answer()))
            .map_into_right_body()),
    }
}

/// `POST /accounts/{account_id}/charges`.
async fn charge(
    payments: web::Data<Payments>,
    account_id: web::Path<String>,
    body: web::Bytes,
) -> HttpResponse {
    respond(payments.charge(&account_id, &body).await.into())
}

/// `POST /accounts/{account_id}/deposits`.
async fn deposit(
    payments: web::Data<Payments>,
    account_id: web::Path<String>,
    body: web::Bytes,
) -> HttpResponse {
    respond(payments.deposit(&account_id, &body).await.into())
}

/// `GET /accounts/{account_id}`.
async fn account(payments: web::Data<Payments>, account_id: web::Path<String>) -> HttpResponse {
    respond(payments.account(&account_id).into())
}

/// The shared crate's answer as an actix-web response.
fn respond(answer: Answer) -> HttpResponse {
    let status = StatusCode::from_u16(answer.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    HttpResponse::build(status)
        .insert_header((CONTENT_TYPE, answer.content_type))
        .body(answer.body)
}

/// An error and its sources, for the log.
fn error_chain(error: &dyn std::error::Error) -> String {
    let mut out = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        out.push_str(": ");
        out.push_str(&cause.to_string());
        source = cause.source();
    }
    out
}

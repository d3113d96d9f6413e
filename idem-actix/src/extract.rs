//! Extractors: what the middleware tells the handler of a keyed request it let
//! run. The same names and meaning as idem-axum's.

use std::future::{Ready, ready};
use std::ops::Deref;

use actix_web::dev::Payload;
use actix_web::http::StatusCode;
use actix_web::{FromRequest, HttpMessage, HttpRequest, ResponseError};

/// What the middleware tells the handler of a keyed request it let run: the
/// key, the scope, whether the execution is guarded, what the store hands it,
/// whether its lease still holds. Its accessors are [`idem_core::ExecutionInfo`]'s
/// (through `Deref`); this type makes it an actix-web extractor.
///
/// Requests without a key (an optional route, an uncovered method) carry no
/// `ExecutionInfo`: extract `Option<ExecutionInfo>` there.
///
/// ```
/// use actix_web::HttpResponse;
/// use idem_actix::ExecutionInfo;
///
/// async fn charge(execution: ExecutionInfo) -> HttpResponse {
///     HttpResponse::Created().body(format!("charging once for key {}", execution.key().redacted()))
/// }
/// # let _ = actix_web::web::post().to(charge);
/// ```
#[derive(Clone, Debug)]
pub struct ExecutionInfo(pub idem_core::ExecutionInfo);

/// The error of [`ExecutionInfo`] when the request carries none: the
/// handler is not behind [`Idempotency`](crate::Idempotency), or the request had
/// no key. `500`: the route is misconfigured.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "this request has no idempotency key: is the handler behind an Idempotency middleware that requires keys?"
)]
pub struct NoIdempotencyKey;

impl Deref for ExecutionInfo {
    type Target = idem_core::ExecutionInfo;

    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl ResponseError for NoIdempotencyKey {
    fn status_code(&self) -> StatusCode {
        StatusCode::INTERNAL_SERVER_ERROR
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

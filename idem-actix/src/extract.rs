//! Extractors: what a handler behind [`Idempotency`](crate::Idempotency) can know
//! about its request.

use std::future::{Ready, ready};

use actix_web::dev::Payload;
use actix_web::error::ErrorInternalServerError;
use actix_web::{Error, FromRequest, HttpMessage, HttpRequest};
use idem_core::{IdempotencyKey, Scope};

/// The idempotency of the request the handler is running for: its key, its scope,
/// and whether this is the key's first execution.
///
/// Extracting it where the middleware did not run the handler under a key (the
/// route is not wrapped, or its key was optional and absent) fails with `500`;
/// take `Option<IdempotencyInfo>` on routes where the key is optional.
///
/// ```
/// use actix_web::HttpResponse;
/// use idem_actix::IdempotencyInfo;
///
/// async fn charge(info: IdempotencyInfo) -> HttpResponse {
///     // The key can name the charge at the payment provider, so that the
///     // provider deduplicates too.
///     HttpResponse::Created().body(format!("charge {}", info.key.as_str()))
/// }
/// ```
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct IdempotencyInfo {
    /// The request's key.
    pub key: IdempotencyKey,
    /// The scope the key belongs to.
    pub scope: Scope,
    /// `true` when this request holds the claim on its key, so no earlier request
    /// with the key completed; `false` when the store failed and the route fails
    /// open, so nothing is known about earlier requests.
    pub first_execution: bool,
}

impl FromRequest for IdempotencyInfo {
    type Error = Error;
    type Future = Ready<Result<Self, Error>>;

    fn from_request(request: &HttpRequest, _: &mut Payload) -> Self::Future {
        ready(
            request
                .extensions()
                .get::<Self>()
                .cloned()
                .ok_or_else(|| {
                    tracing::error!(target: "idem", "IdempotencyInfo extracted on a request the idempotency middleware did not key");
                    ErrorInternalServerError("the request has no idempotency key")
                }),
        )
    }
}

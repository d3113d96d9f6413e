//! [`ExecutionInfo`] as a framework's extractor: axum's (feature `axum`, on
//! axum-core) and actix-web's (feature `actix`). The adapters (idem-axum,
//! idem-actix) turn these on and put the `ExecutionInfo` of each keyed
//! request they let run in its extensions; a handler takes it as an argument,
//! or `Option<ExecutionInfo>` where a request may have no key.

use crate::ExecutionInfo;

/// The rejection of [`ExecutionInfo`] when the request carries none: the
/// handler is not behind idem's middleware, or the request had no key. `500`
/// (as axum's `Extension` answers a missing one): the route is
/// misconfigured.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "this request has no idempotency key: is the handler behind idem's middleware, with keys required?"
)]
pub struct NoIdempotencyKey;

#[cfg(feature = "axum")]
mod axum {
    use axum_core::extract::{FromRequestParts, OptionalFromRequestParts};
    use axum_core::response::{IntoResponse, Response};
    use http::StatusCode;
    use http::request::Parts;

    use super::{ExecutionInfo, NoIdempotencyKey};

    impl IntoResponse for NoIdempotencyKey {
        fn into_response(self) -> Response {
            (StatusCode::INTERNAL_SERVER_ERROR, self.to_string()).into_response()
        }
    }

    impl<S: Send + Sync> FromRequestParts<S> for ExecutionInfo {
        type Rejection = NoIdempotencyKey;

        async fn from_request_parts(
            parts: &mut Parts,
            _state: &S,
        ) -> Result<Self, Self::Rejection> {
            parts
                .extensions
                .get::<Self>()
                .cloned()
                .ok_or(NoIdempotencyKey)
        }
    }

    impl<S: Send + Sync> OptionalFromRequestParts<S> for ExecutionInfo {
        type Rejection = std::convert::Infallible;

        async fn from_request_parts(
            parts: &mut Parts,
            _state: &S,
        ) -> Result<Option<Self>, Self::Rejection> {
            Ok(parts.extensions.get::<Self>().cloned())
        }
    }
}

#[cfg(feature = "actix")]
mod actix {
    use std::future::{Ready, ready};

    use actix_web::dev::Payload;
    use actix_web::http::StatusCode;
    use actix_web::{FromRequest, HttpMessage, HttpRequest, ResponseError};

    use super::{ExecutionInfo, NoIdempotencyKey};

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
}

//! The edge between actix-web's `http` 0.2 types and the core's own: the only
//! place where one is turned into the other.

use std::sync::LazyLock;

use std::fmt;

use actix_web::body::BoxBody;
use actix_web::http::StatusCode;
use actix_web::http::header::{HeaderMap, HeaderName, HeaderValue};
use actix_web::{HttpResponse, ResponseError};
use idem_core::adapter::{KEYED_REQUEST_HEADERS, keyed_request_header};
use idem_core::{Header, HeaderSource, StoredResponse};

/// An answer sent as an actix-web error, where no request is left to answer it
/// with (the handler panicked, or its task was lost).
#[derive(Debug)]
pub(crate) struct AnswerError(pub(crate) StoredResponse);

impl fmt::Display for AnswerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "answered {}", self.0.status)
    }
}

impl ResponseError for AnswerError {
    fn status_code(&self) -> StatusCode {
        status_code(self.0.status)
    }

    fn error_response(&self) -> HttpResponse<BoxBody> {
        into_http_response(self.0.clone())
    }
}

/// A request's headers, as the fingerprint looks them up.
pub(crate) struct RequestHeaders<'a>(pub(crate) &'a HeaderMap);

impl HeaderSource for RequestHeaders<'_> {
    fn each_field<'a>(&'a self, name: &str, each: &mut dyn FnMut(&'a [u8])) {
        let values = match known_name(name) {
            Some(name) => self.0.get_all(name),
            None => self.0.get_all(name),
        };
        values.for_each(|value| each(value.as_bytes()));
    }
}

/// Every header field of a response, repeats kept in order.
///
/// actix-web keeps headers in a hash map: the values of one name keep their order,
/// while the order between names is the map's, both here and on the wire.
pub(crate) fn stored_headers(headers: &HeaderMap) -> Vec<Header> {
    headers
        .iter()
        .map(|(name, value)| Header::named(name.as_str(), bytes_of(value)))
        .collect()
}

/// A stored answer (a replay or a problem) as an actix-web response.
pub(crate) fn into_http_response(stored: StoredResponse) -> HttpResponse<BoxBody> {
    let mut response =
        HttpResponse::with_body(status_code(stored.status), BoxBody::new(stored.body));
    let headers = response.headers_mut();
    for header in stored.headers {
        match (
            known_name(&header.name)
                .map_or_else(|| HeaderName::from_bytes(header.name.as_bytes()), Ok),
            HeaderValue::from_maybe_shared(header.value),
        ) {
            (Ok(name), Ok(value)) => headers.append(name, value),
            _ => {
                tracing::warn!(target: "idem", header = %header.name, "a stored header is not valid HTTP; it is left out");
            }
        }
    }
    response
}

/// [`KEYED_REQUEST_HEADERS`] as header names, made once rather than parsed
/// (and, for the custom ones, allocated) per request.
fn known_name(name: &str) -> Option<HeaderName> {
    static KNOWN: LazyLock<[HeaderName; KEYED_REQUEST_HEADERS.len()]> =
        LazyLock::new(|| KEYED_REQUEST_HEADERS.map(HeaderName::from_static));
    keyed_request_header(name).and_then(|at| KNOWN.get(at).cloned())
}

fn status_code(status: u16) -> StatusCode {
    StatusCode::from_u16(status).unwrap_or_else(|_| {
        tracing::error!(target: "idem", status, "a stored status is not a valid HTTP status; answering 500");
        StatusCode::INTERNAL_SERVER_ERROR
    })
}

fn bytes_of(value: &HeaderValue) -> bytes::Bytes {
    bytes::Bytes::copy_from_slice(value.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stored_response_round_trips_repeated_headers() {
        let stored = StoredResponse::new(
            201,
            vec![
                Header::new("set-cookie", "a=1"),
                Header::new("set-cookie", "b=2"),
                Header::new("content-type", "application/json"),
            ],
            "{}",
        );
        let response = into_http_response(stored);
        assert_eq!(response.status(), StatusCode::CREATED);
        let mut headers = stored_headers(response.headers());
        headers.sort_by(|a, b| a.name.cmp(&b.name));
        assert_eq!(
            headers,
            vec![
                Header::new("content-type", "application/json"),
                Header::new("set-cookie", "a=1"),
                Header::new("set-cookie", "b=2"),
            ]
        );
    }

    #[test]
    fn invalid_stored_header_is_left_out() {
        let stored = StoredResponse::new(
            200,
            vec![Header::new("bad name", "x"), Header::new("x-ok", "y")],
            "",
        );
        let response = into_http_response(stored);
        assert_eq!(
            stored_headers(response.headers()),
            vec![Header::new("x-ok", "y")]
        );
    }
}

//! The edge between `http` 1 and idem's own response type.

use std::sync::LazyLock;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode};
use idem_core::adapter::{KEYED_REQUEST_HEADERS, keyed_request_header};
use idem_core::{Header, HeaderSource, StoredResponse};

use crate::ResponseBody;

/// Request headers as the fingerprint looks them up.
pub(crate) struct HttpHeaders<'a>(pub(crate) &'a HeaderMap);

impl HeaderSource for HttpHeaders<'_> {
    fn each_field<'a>(&'a self, name: &str, each: &mut dyn FnMut(&'a [u8])) {
        let values = match known_name(name) {
            Some(name) => self.0.get_all(name),
            None => self.0.get_all(name),
        };
        values.iter().for_each(|value| each(value.as_bytes()));
    }
}

/// Every header field of `headers`, as idem stores them. `HeaderMap` keeps the
/// fields of one name in order (two `Set-Cookie` stay two, in order) and the
/// names in the order they were first inserted.
pub(crate) fn stored_headers(headers: &HeaderMap) -> Vec<Header> {
    headers
        .iter()
        .map(|(name, value)| Header::named(name.as_str(), Bytes::copy_from_slice(value.as_bytes())))
        .collect()
}

/// The response to send for a stored one (a replay, a problem).
pub(crate) fn to_http<B>(stored: StoredResponse) -> Response<ResponseBody<B>> {
    let status = StatusCode::from_u16(stored.status).unwrap_or_else(|_| {
        tracing::error!(target: "idem", status = stored.status, "a stored status is not a valid HTTP status; answering 500");
        StatusCode::INTERNAL_SERVER_ERROR
    });
    let mut headers = HeaderMap::with_capacity(stored.headers.len());
    for header in stored.headers {
        match (
            known_name(&header.name)
                .map_or_else(|| HeaderName::from_bytes(header.name.as_bytes()), Ok),
            HeaderValue::from_maybe_shared(header.value),
        ) {
            (Ok(name), Ok(value)) => {
                headers.append(name, value);
            }
            _ => {
                tracing::warn!(target: "idem", name = %header.name, "a stored header field is not valid HTTP; left out")
            }
        }
    }
    let mut response = Response::new(ResponseBody::whole(stored.body));
    *response.status_mut() = status;
    *response.headers_mut() = headers;
    response
}

/// [`KEYED_REQUEST_HEADERS`] as header names, made once rather than parsed
/// (and, for the custom ones, allocated) per request.
fn known_name(name: &str) -> Option<HeaderName> {
    static KNOWN: LazyLock<[HeaderName; KEYED_REQUEST_HEADERS.len()]> =
        LazyLock::new(|| KEYED_REQUEST_HEADERS.map(HeaderName::from_static));
    keyed_request_header(name).and_then(|at| KNOWN.get(at).cloned())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use http_body_util::Empty;

    use super::*;

    #[test]
    fn headers_round_trip_with_repeats_in_order() {
        let mut headers = HeaderMap::new();
        headers.append("content-type", HeaderValue::from_static("application/json"));
        headers.append("set-cookie", HeaderValue::from_static("a=1"));
        headers.append("x-trace", HeaderValue::from_static("t"));
        headers.append("set-cookie", HeaderValue::from_static("b=2"));
        let stored = StoredResponse::new(201, stored_headers(&headers), "{}");
        let names: Vec<_> = stored.headers.iter().map(|h| &*h.name).collect();
        assert_eq!(
            names,
            ["content-type", "set-cookie", "set-cookie", "x-trace"]
        );
        let response = to_http::<Empty<Bytes>>(stored);
        assert_eq!(response.status(), 201);
        let cookies: Vec<_> = response.headers().get_all("set-cookie").iter().collect();
        assert_eq!(cookies, ["a=1", "b=2"]);
        assert_eq!(response.headers().len(), 4);
    }

    #[test]
    fn invalid_stored_fields_are_left_out() {
        let stored = StoredResponse::new(
            1000,
            vec![
                Header::new("bad name", "v"),
                Header::new("x-ok", "v"),
                Header::new("x-bad", "a\nb"),
            ],
            "",
        );
        let response = to_http::<Empty<Bytes>>(stored);
        assert_eq!(response.status(), 500);
        assert_eq!(response.headers().len(), 1);
        assert_eq!(response.headers()["x-ok"], "v");
    }
}

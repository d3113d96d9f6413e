//! An answer that closes its connection once sent: for a refusal that leaves
//! the request body unread (`docs/contract.md` §4).
//!
//! The core reads a refused body only within bounds (8 MiB, 2 s) and then
//! answers, leaving the rest unread, so that the connection closes after the
//! answer. hyper does close it. actix-web would read on instead: a dropped
//! chunked body to its end however long it is (keeping the connection alive),
//! a sized one for as long as its `client_disconnect_timeout` lingers, at the
//! rate the client sends. Neither setting is the middleware's to change, so
//! the answer's body ends the connection itself: once the answer is written,
//! it fails, and actix-web closes the connection without reading further.
//! actix-web logs that at error level, once per such answer, as
//! `Response payload stream error: the refused request body was left unread;
//! the connection is closed after the answer`.

use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll};

use actix_web::HttpResponse;
use actix_web::body::{BodySize, BoxBody, MessageBody};
use actix_web::dev::Payload;
use actix_web::http::ConnectionType;
use bytes::Bytes;
use futures_util::{FutureExt, StreamExt};
use idem_core::StoredResponse;

use crate::edge::into_http_response;

/// Whether `payload` has been read to its end (or never had a body).
pub(crate) fn is_finished(payload: &mut Payload) -> bool {
    matches!(payload.next().now_or_never(), Some(None))
}

/// `answer`, sent with `Connection: close`, after which the connection closes.
/// `payload`, the unread body, is held (and not read) until then, so that
/// actix-web stops reading it while the answer is written.
pub(crate) fn closing_answer(answer: StoredResponse, payload: Payload) -> HttpResponse<BoxBody> {
    let bytes = answer.body.clone();
    let mut response = into_http_response(answer).set_body(ClosingBody {
        length: bytes.len() as u64,
        answer: Some(bytes),
        written: false,
        _unread: payload,
    });
    response
        .head_mut()
        .set_connection_type(ConnectionType::Close);
    response.map_into_boxed_body()
}

/// The answer's bytes, then (once actix-web has had a turn to write them) an
/// error that makes it close the connection.
struct ClosingBody {
    length: u64,
    answer: Option<Bytes>,
    written: bool,
    _unread: Payload,
}

/// Why the connection ends: what actix-web logs.
struct LeftUnread;

impl MessageBody for ClosingBody {
    type Error = LeftUnread;

    fn size(&self) -> BodySize {
        // Sized, so the client knows it has the whole answer before the
        // connection ends.
        BodySize::Sized(self.length)
    }

    fn poll_next(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Bytes, Self::Error>>> {
        let this = self.get_mut();
        if let Some(bytes) = this.answer.take() {
            return Poll::Ready(Some(Ok(bytes)));
        }
        if !this.written {
            // actix-web writes what it holds out when the body is not ready;
            // the next poll comes after that.
            this.written = true;
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        Poll::Ready(Some(Err(LeftUnread)))
    }
}

impl fmt::Display for LeftUnread {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(
            "the refused request body was left unread; the connection is closed after the answer",
        )
    }
}

impl fmt::Debug for LeftUnread {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl std::error::Error for LeftUnread {}

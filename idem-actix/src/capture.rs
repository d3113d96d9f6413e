//! Capturing the handler's response body for the record, up to the stored-body
//! limit, without losing a byte of what the first client is sent.

use std::error::Error as StdError;
use std::pin::Pin;
use std::task::{Context, Poll};

use actix_web::body::{BodySize, MessageBody};
use bytes::{Bytes, BytesMut};

/// What reading the body up to the limit found.
pub(crate) enum Captured<B> {
    /// The whole body, within the limit: it is stored and replayed.
    Whole(Bytes),
    /// The body declared a size over the limit; nothing was read.
    Unread(B),
    /// The body grew past the limit while streaming: what was read, and the rest.
    Overflow(PrefixedBody<B>),
}

/// A body read in part: the part already read, then the rest as it streams.
pub(crate) struct PrefixedBody<B> {
    prefix: Option<Bytes>,
    rest: Option<Pin<Box<B>>>,
}

/// A boxed body error, as actix-web's bodies give them.
pub(crate) type BodyError = Box<dyn StdError>;

/// Reads `body` until it ends or passes `limit` bytes.
pub(crate) async fn capture<B: MessageBody>(
    body: B,
    limit: usize,
) -> Result<Captured<B>, BodyError> {
    match body.size() {
        BodySize::None => return Ok(Captured::Whole(Bytes::new())),
        BodySize::Sized(size) if size > limit as u64 => return Ok(Captured::Unread(body)),
        BodySize::Sized(_) | BodySize::Stream => {}
    }
    let body = match body.try_into_bytes() {
        Ok(bytes) if bytes.len() > limit => {
            // Its size said it fits, yet it does not: sent whole, not stored.
            return Ok(Captured::Overflow(PrefixedBody {
                prefix: Some(bytes),
                rest: None,
            }));
        }
        Ok(bytes) => return Ok(Captured::Whole(bytes)),
        Err(body) => body,
    };
    let mut rest = Box::pin(body);
    let mut read = BytesMut::new();
    while let Some(chunk) = std::future::poll_fn(|cx| rest.as_mut().poll_next(cx)).await {
        let chunk = chunk.map_err(Into::into)?;
        read.extend_from_slice(&chunk);
        if read.len() > limit {
            return Ok(Captured::Overflow(PrefixedBody {
                prefix: Some(read.freeze()),
                rest: Some(rest),
            }));
        }
    }
    Ok(Captured::Whole(read.freeze()))
}

impl<B: MessageBody> MessageBody for PrefixedBody<B> {
    type Error = BodyError;

    fn size(&self) -> BodySize {
        // Part of the body was read while its size was unknown; it stays unknown.
        BodySize::Stream
    }

    fn poll_next(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Bytes, Self::Error>>> {
        let this = self.get_mut();
        if let Some(prefix) = this.prefix.take() {
            return Poll::Ready(Some(Ok(prefix)));
        }
        let Some(rest) = this.rest.as_mut() else {
            return Poll::Ready(None);
        };
        match rest.as_mut().poll_next(cx) {
            Poll::Ready(Some(chunk)) => Poll::Ready(Some(chunk.map_err(Into::into))),
            Poll::Ready(None) => {
                this.rest = None;
                Poll::Ready(None)
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

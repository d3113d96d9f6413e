//! The handler's response body as the protocol reads it (a stream of chunks),
//! and as it is sent on once read in part.

use std::error::Error as StdError;
use std::pin::Pin;
use std::task::{Context, Poll};

use actix_web::body::{BodySize, BoxBody, EitherBody, MessageBody};
use bytes::Bytes;
use futures_util::Stream;
use idem_core::protocol::{Delivered, HandlerBody};

/// A boxed body error, as actix-web's bodies give them.
pub(crate) type BodyError = Box<dyn StdError>;

/// A response body as a stream of chunks.
pub(crate) struct Chunks<B>(Pin<Box<B>>);

/// A body read in part: what was read, then the rest as it streams.
struct Resumed<B> {
    read: Option<Bytes>,
    rest: Pin<Box<Chunks<B>>>,
}

/// The handler's body as the protocol takes it: whole when actix already holds
/// it in memory, else a stream with its declared size.
pub(crate) fn handler_body<B: MessageBody>(body: B) -> HandlerBody<Chunks<B>> {
    let length = match body.size() {
        BodySize::None => return HandlerBody::Complete(Bytes::new()),
        BodySize::Sized(length) => Some(length),
        BodySize::Stream => None,
    };
    match body.try_into_bytes() {
        Ok(bytes) => HandlerBody::Complete(bytes),
        Err(body) => HandlerBody::Streaming {
            body: Chunks(Box::pin(body)),
            length,
        },
    }
}

/// The body the protocol delivers, as actix sends it.
pub(crate) fn delivered_body<B>(body: Delivered<Chunks<B>>) -> EitherBody<B>
where
    B: MessageBody + 'static,
{
    match body {
        Delivered::Complete(bytes) => EitherBody::right(BoxBody::new(bytes)),
        // Declared over the limit: sent on as it streams, its size kept.
        Delivered::Untouched(Chunks(body)) => EitherBody::right(BoxBody::new(body)),
        Delivered::Resumed { read, rest } => EitherBody::right(BoxBody::new(Resumed {
            read: Some(read),
            rest,
        })),
    }
}

impl<B: MessageBody> Stream for Chunks<B> {
    type Item = Result<Bytes, BodyError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.get_mut()
            .0
            .as_mut()
            .poll_next(cx)
            .map(|chunk| chunk.map(|chunk| chunk.map_err(Into::into)))
    }
}

impl<B: MessageBody> MessageBody for Resumed<B> {
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
        match this.read.take() {
            Some(read) => Poll::Ready(Some(Ok(read))),
            None => this.rest.as_mut().poll_next(cx),
        }
    }
}

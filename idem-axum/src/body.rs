//! The bodies the middleware hands on: the request body the inner service gets,
//! and the response body the client gets.

use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use futures_util::Stream;
use http_body::{Body, Frame, SizeHint};
use idem_core::protocol::Delivered;
use pin_project_lite::pin_project;

/// A boxed body error: what the response body answers for any body it wraps.
pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;

pin_project! {
    /// The request body the inner service gets: the original body of a request
    /// that passed through, or the bytes the middleware read (and fingerprinted)
    /// from a keyed one, intact.
    ///
    /// Axum's routes and handlers accept it as they accept any body. Trailers of a
    /// keyed request are not forwarded.
    pub struct RequestBody<B> {
        #[pin]
        kind: RequestKind<B>,
    }
}

pin_project! {
    #[project = RequestKindProj]
    enum RequestKind<B> {
        Original { #[pin] body: B },
        Buffered { data: Option<Bytes> },
    }
}

pin_project! {
    /// The response body the client gets: the inner service's body as it was, a
    /// body read whole (a replay, a problem, an answer that fit the stored-body
    /// limit), or the chunks already read followed by the rest of a body that was
    /// over the limit.
    pub struct ResponseBody<B> {
        #[pin]
        kind: ResponseKind<B>,
    }
}

pin_project! {
    #[project = ResponseKindProj]
    enum ResponseKind<B> {
        Original { #[pin] body: B },
        Whole { data: Option<Bytes> },
        Resumed { read: Option<Bytes>, rest: Pin<Box<Chunks<B>>> },
    }
}

pin_project! {
    /// A body's data frames as a stream of chunks, for the protocol to read
    /// (trailers are skipped).
    pub(crate) struct Chunks<B> {
        #[pin]
        body: B,
    }
}

impl<B> RequestBody<B> {
    pub(crate) fn original(body: B) -> Self {
        Self {
            kind: RequestKind::Original { body },
        }
    }

    pub(crate) fn buffered(data: Bytes) -> Self {
        Self {
            kind: RequestKind::Buffered {
                data: (!data.is_empty()).then_some(data),
            },
        }
    }
}

impl<B> Body for RequestBody<B>
where
    B: Body<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        match self.project().kind.project() {
            RequestKindProj::Original { body } => body.poll_frame(cx),
            RequestKindProj::Buffered { data } => Poll::Ready(data.take().map(Frame::data).map(Ok)),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            RequestKind::Original { body } => body.is_end_stream(),
            RequestKind::Buffered { data } => data.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            RequestKind::Original { body } => body.size_hint(),
            RequestKind::Buffered { data } => exact(data),
        }
    }
}

impl<B> ResponseBody<B> {
    pub(crate) fn original(body: B) -> Self {
        Self {
            kind: ResponseKind::Original { body },
        }
    }

    pub(crate) fn whole(data: Bytes) -> Self {
        Self {
            kind: ResponseKind::Whole {
                data: (!data.is_empty()).then_some(data),
            },
        }
    }

    /// The body the protocol delivers.
    pub(crate) fn delivered(body: Delivered<Chunks<B>>) -> Self {
        match body {
            Delivered::Complete(data) => Self::whole(data),
            Delivered::Untouched(chunks) => Self::original(chunks.body),
            Delivered::Resumed { read, rest } => Self {
                kind: ResponseKind::Resumed {
                    read: Some(read),
                    rest,
                },
            },
        }
    }
}

impl<B> Body for ResponseBody<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.project().kind.project() {
            ResponseKindProj::Original { body } => body.poll_frame(cx).map_err(Into::into),
            ResponseKindProj::Whole { data } => Poll::Ready(data.take().map(Frame::data).map(Ok)),
            ResponseKindProj::Resumed { read, rest } => match read.take() {
                Some(chunk) => Poll::Ready(Some(Ok(Frame::data(chunk)))),
                None => rest.as_mut().poll_next(cx).map_ok(Frame::data),
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            ResponseKind::Original { body } => body.is_end_stream(),
            ResponseKind::Whole { data } => data.is_none(),
            ResponseKind::Resumed { read, rest } => read.is_none() && rest.body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            ResponseKind::Original { body } => body.size_hint(),
            ResponseKind::Whole { data } => exact(data),
            ResponseKind::Resumed { read, rest } => {
                let read = read.as_ref().map_or(0, |chunk| chunk.len() as u64);
                let rest = rest.body.size_hint();
                let mut hint = SizeHint::new();
                hint.set_lower(rest.lower() + read);
                if let Some(upper) = rest.upper() {
                    hint.set_upper(upper + read);
                }
                hint
            }
        }
    }
}

impl<B> Chunks<B> {
    pub(crate) fn new(body: B) -> Self {
        Self { body }
    }
}

impl<B> Stream for Chunks<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Item = Result<Bytes, BoxError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let mut body = self.project().body;
        loop {
            return match ready!(body.as_mut().poll_frame(cx)) {
                None => Poll::Ready(None),
                Some(Err(error)) => Poll::Ready(Some(Err(error.into()))),
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => Poll::Ready(Some(Ok(data))),
                    Err(_trailers) => continue,
                },
            };
        }
    }
}

fn exact(data: &Option<Bytes>) -> SizeHint {
    SizeHint::with_exact(data.as_ref().map_or(0, |data| data.len() as u64))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use http_body_util::{BodyExt, StreamBody};

    use super::*;

    fn stream(
        chunks: &[&'static str],
    ) -> impl Body<Data = Bytes, Error = std::convert::Infallible> {
        let frames: Vec<Result<Frame<Bytes>, std::convert::Infallible>> = chunks
            .iter()
            .map(|chunk| Ok(Frame::data(Bytes::from_static(chunk.as_bytes()))))
            .collect();
        StreamBody::new(futures_util::stream::iter(frames))
    }

    #[tokio::test]
    async fn a_resumed_body_sends_what_was_read_then_the_rest() {
        let body = ResponseBody::delivered(Delivered::Resumed {
            read: Bytes::from_static(b"abcd"),
            rest: Box::pin(Chunks::new(stream(&["ef", "g"]))),
        });
        let bytes = body.collect().await.unwrap().to_bytes();
        assert_eq!(bytes, "abcdefg");
    }

    #[tokio::test]
    async fn buffered_bodies_are_exact_and_end() {
        let body =
            RequestBody::<http_body_util::Empty<Bytes>>::buffered(Bytes::from_static(b"xyz"));
        assert_eq!(body.size_hint().exact(), Some(3));
        assert!(!body.is_end_stream());
        assert_eq!(body.collect().await.unwrap().to_bytes(), "xyz");
        let empty = ResponseBody::<http_body_util::Empty<Bytes>>::whole(Bytes::new());
        assert!(empty.is_end_stream());
        assert_eq!(empty.size_hint().exact(), Some(0));
    }
}

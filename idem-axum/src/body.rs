//! The bodies the middleware hands on: the request body the inner service gets,
//! and the response body the client gets.

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

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
        Resumed { read: VecDeque<Bytes>, rest: Pin<Box<B>> },
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

    pub(crate) fn resumed(read: VecDeque<Bytes>, rest: Pin<Box<B>>) -> Self {
        Self {
            kind: ResponseKind::Resumed { read, rest },
        }
    }
}

impl<B> Body for ResponseBody<B>
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
            ResponseKindProj::Original { body } => body.poll_frame(cx),
            ResponseKindProj::Whole { data } => Poll::Ready(data.take().map(Frame::data).map(Ok)),
            ResponseKindProj::Resumed { read, rest } => match read.pop_front() {
                Some(chunk) => Poll::Ready(Some(Ok(Frame::data(chunk)))),
                None => rest.as_mut().poll_frame(cx),
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            ResponseKind::Original { body } => body.is_end_stream(),
            ResponseKind::Whole { data } => data.is_none(),
            ResponseKind::Resumed { read, rest } => read.is_empty() && rest.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            ResponseKind::Original { body } => body.size_hint(),
            ResponseKind::Whole { data } => exact(data),
            ResponseKind::Resumed { read, rest } => {
                let read: u64 = read.iter().map(|chunk| chunk.len() as u64).sum();
                let rest = rest.size_hint();
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
        let read = VecDeque::from([Bytes::from_static(b"ab"), Bytes::from_static(b"cd")]);
        let body = ResponseBody::resumed(read, Box::pin(stream(&["ef", "g"])));
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

//! [`ResponseFuture`]: what [`Idempotency`](crate::Idempotency) answers with.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::Response;
use pin_project_lite::pin_project;

use crate::ResponseBody;

/// The boxed future of a keyed request.
pub(crate) type KeyedFuture<B, E> =
    Pin<Box<dyn Future<Output = Result<Response<ResponseBody<B>>, E>> + Send + 'static>>;

pin_project! {
    /// The response future of [`Idempotency`](crate::Idempotency).
    ///
    /// A request that passes through polls the inner service's future in place,
    /// and a refused one is answered at once. A keyed request is boxed: it reads
    /// and fingerprints the body, awaits the store (and, in wait mode, another
    /// request), and runs the inner service on a task of its own so that a client
    /// that disconnects does not cancel it; spelling that state machine out by
    /// hand would buy one allocation per keyed request, next to a store round
    /// trip and a task spawn.
    pub struct ResponseFuture<F, B, E> {
        #[pin]
        state: State<F, B, E>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<F, B, E> {
        PassThrough { #[pin] future: F },
        Answered { response: Option<Response<ResponseBody<B>>> },
        Keyed { future: KeyedFuture<B, E> },
    }
}

impl<F, B, E> ResponseFuture<F, B, E> {
    pub(crate) fn pass_through(future: F) -> Self {
        Self {
            state: State::PassThrough { future },
        }
    }

    pub(crate) fn answered(response: Response<ResponseBody<B>>) -> Self {
        Self {
            state: State::Answered {
                response: Some(response),
            },
        }
    }

    pub(crate) fn keyed(future: KeyedFuture<B, E>) -> Self {
        Self {
            state: State::Keyed { future },
        }
    }
}

impl<F, B, E> Future for ResponseFuture<F, B, E>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Result<Response<ResponseBody<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().state.project() {
            StateProj::PassThrough { future } => future
                .poll(cx)
                .map_ok(|response| response.map(ResponseBody::original)),
            StateProj::Answered { response } => match response.take() {
                Some(response) => Poll::Ready(Ok(response)),
                None => panic!("ResponseFuture polled after completion"),
            },
            StateProj::Keyed { future } => future.as_mut().poll(cx),
        }
    }
}

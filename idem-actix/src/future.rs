//! [`IdempotencyFuture`]: what the middleware answers with.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use actix_web::Error;
use actix_web::body::EitherBody;
use actix_web::dev::ServiceResponse;
use futures_util::future::LocalBoxFuture;
use pin_project_lite::pin_project;

/// What the middleware answers a request with.
pub(crate) type Answer<B> = Result<ServiceResponse<EitherBody<B>>, Error>;

pin_project! {
    /// The response future of the middleware's service.
    ///
    /// A request that passes through polls the wrapped service's future in
    /// place, and a refused one is answered at once: neither allocates. A keyed
    /// request is boxed: it reads and fingerprints the body, awaits the store
    /// (and, in wait mode, another request) and runs the handler, which
    /// spelling out by hand would save one allocation next to a store round
    /// trip.
    #[doc(hidden)]
    pub struct IdempotencyFuture<F, B> {
        #[pin]
        state: State<F, B>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<F, B> {
        PassThrough { #[pin] future: F },
        Answered { response: Option<ServiceResponse<EitherBody<B>>> },
        Keyed { future: LocalBoxFuture<'static, Answer<B>> },
    }
}

impl<F, B> IdempotencyFuture<F, B> {
    pub(crate) fn pass_through(future: F) -> Self {
        Self {
            state: State::PassThrough { future },
        }
    }

    pub(crate) fn answered(response: ServiceResponse<EitherBody<B>>) -> Self {
        Self {
            state: State::Answered {
                response: Some(response),
            },
        }
    }

    pub(crate) fn keyed(future: LocalBoxFuture<'static, Answer<B>>) -> Self {
        Self {
            state: State::Keyed { future },
        }
    }
}

impl<F, B> Future for IdempotencyFuture<F, B>
where
    F: Future<Output = Result<ServiceResponse<B>, Error>>,
{
    type Output = Answer<B>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().state.project() {
            StateProj::PassThrough { future } => {
                future.poll(cx).map_ok(ServiceResponse::map_into_left_body)
            }
            StateProj::Answered { response } => match response.take() {
                Some(response) => Poll::Ready(Ok(response)),
                None => panic!("IdempotencyFuture polled after completion"),
            },
            StateProj::Keyed { future } => future.as_mut().poll(cx),
        }
    }
}

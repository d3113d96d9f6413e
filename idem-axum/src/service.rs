//! [`Idempotency`]: the Tower service that hands each request to the protocol.

use std::task::{Context, Poll};

use bytes::Bytes;
use http::request::Parts;
use http::{Request, Response};
use http_body::Body;
use idem_core::protocol::{Handled, HandlerBody, Outcome, Start};
use idem_core::{Engine, ExecutionInfo, RequestHead, ScopeSource};
use tower_service::Service;

use crate::answer::{HttpHeaders, stored_headers, to_http};
use crate::body::{BoxError, Chunks};
use crate::future::ResponseFuture;
use crate::{RequestBody, ResponseBody};

/// Applies `Idempotency-Key` handling to the inner service. Made by
/// [`IdempotencyLayer`](crate::IdempotencyLayer).
///
/// Every decision is idem-core's protocol
/// ([`idem_core::protocol`]); this service converts between `http` types and
/// the protocol's: the request head, the body as a stream of chunks, the inner
/// service's answer. The keyed part runs the inner service on a task of its
/// own, so a client that disconnects never cancels the handler.
#[derive(Clone, Debug)]
pub struct Idempotency<S> {
    inner: S,
    engine: Engine,
    scope: ScopeSource<Parts>,
}

impl<S> Idempotency<S> {
    pub(crate) fn new(inner: S, engine: Engine, scope: ScopeSource<Parts>) -> Self {
        Self {
            inner,
            engine,
            scope,
        }
    }

    /// The engine (its store and policy).
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// The inner service, consuming this one.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for Idempotency<S>
where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Body<Data = Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, ResBody, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        // The clone takes the place of the service that was polled ready.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let (parts, body) = request.into_parts();
        let head = RequestHead {
            method: parts.method.as_str(),
            path: parts.uri.path(),
            query: parts.uri.query().unwrap_or(""),
            headers: &HttpHeaders(&parts.headers),
        };
        match self.engine.start(&head, &self.scope, &parts) {
            Start::PassThrough => {
                let request = Request::from_parts(parts, RequestBody::original(body));
                ResponseFuture::pass_through(inner.call(request))
            }
            Start::Answer(answer) => ResponseFuture::answered(to_http(answer)),
            Start::Keyed(keyed) => {
                let declared = Some(body.size_hint().lower());
                // Boxed so the protocol can hand it back unread: a request body
                // need not be `Unpin`.
                let body = Chunks::new(Box::pin(body));
                let handler = move |mut parts: Parts, body: Bytes, info: ExecutionInfo| async move {
                    parts.extensions.insert(info);
                    let request = Request::from_parts(parts, RequestBody::buffered(body));
                    let (parts, body) = inner.call(request).await?.into_parts();
                    Ok(Handled {
                        status: parts.status.as_u16(),
                        headers: stored_headers(&parts.headers),
                        body: HandlerBody::Streaming {
                            length: body.size_hint().exact(),
                            body: Chunks::new(body),
                        },
                        head: parts,
                    })
                };
                ResponseFuture::keyed(Box::pin(async move {
                    match keyed.respond(parts, declared, body, handler).await {
                        Outcome::Deliver { head, body } => {
                            Ok(Response::from_parts(head, ResponseBody::delivered(body)))
                        }
                        Outcome::Answer { answer, .. } => Ok(to_http(answer)),
                        Outcome::Failed(error) => Err(error),
                    }
                }))
            }
        }
    }
}

//! [`Idempotency`]: the Tower service that applies the engine's decisions.

use std::collections::VecDeque;
use std::marker::PhantomData;
use std::panic::AssertUnwindSafe;
use std::pin::{Pin, pin};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures_util::FutureExt;
use http::request::Parts;
use http::{HeaderValue, Request, Response};
use http_body::Body;
use http_body_util::BodyExt;
use idem_core::store::ExecutionContext;
use idem_core::{
    Admission, Begin, Engine, Execution, Fingerprint, FingerprintBuilder, IdempotencyKey,
    KEY_HEADER, RequestHead, Scope, Settlement, StoredResponse,
};
use tower_service::Service;
use tracing::Instrument;

use crate::answer::{HttpHeaders, problem, stored_headers, to_http};
use crate::future::ResponseFuture;
use crate::layer::ScopeSource;
use crate::{ExecutionInfo, RequestBody, ResponseBody};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Applies `Idempotency-Key` handling to the inner service. Made by
/// [`IdempotencyLayer`](crate::IdempotencyLayer).
///
/// For each request it asks the engine what to do and does it:
///
/// - not covered (method, or an optional key absent): calls the inner service
///   with the request untouched;
/// - refused (a malformed or missing key, an unknown scope): answers the problem;
/// - keyed: reads the body up to the policy's limit while fingerprinting it (over
///   the limit: `413`), then claims the record; replays, refuses, or runs the
///   inner service on a task of its own and records its answer.
#[derive(Clone, Debug)]
pub struct Idempotency<S> {
    inner: S,
    engine: Engine,
    scope: ScopeSource,
}

impl<S> Idempotency<S> {
    pub(crate) fn new(inner: S, engine: Engine, scope: ScopeSource) -> Self {
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
        let engine = &self.engine;
        let (parts, body) = request.into_parts();
        let fields = parts
            .headers
            .get_all(KEY_HEADER)
            .iter()
            .map(HeaderValue::as_bytes);
        let key = match engine.admit(parts.method.as_str(), fields) {
            Admission::PassThrough => {
                let request = Request::from_parts(parts, RequestBody::original(body));
                return ResponseFuture::pass_through(inner.call(request));
            }
            Admission::Reject(rejection) => return ResponseFuture::answered(problem(&rejection)),
            Admission::Keyed(key) => key,
        };
        let Some(scope) = self.scope.resolve(&parts) else {
            return ResponseFuture::answered(problem(&engine.scope_unavailable()));
        };
        let span = tracing::info_span!(
            target: "idem",
            "idempotent_request",
            key = %key.redacted(),
            %scope,
            method = %parts.method,
            path = parts.uri.path(),
        );
        let fingerprint = engine.fingerprint(&RequestHead {
            method: parts.method.as_str(),
            path: parts.uri.path(),
            query: parts.uri.query().unwrap_or(""),
            headers: &HttpHeaders(&parts.headers),
        });
        let keyed = Keyed {
            inner,
            engine: engine.clone(),
            parts,
            key,
            scope,
            bodies: PhantomData,
        };
        ResponseFuture::keyed(Box::pin(keyed.respond(body, fingerprint).instrument(span)))
    }
}

/// A keyed request on its way through.
struct Keyed<S, ReqBody, ResBody> {
    inner: S,
    engine: Engine,
    parts: Parts,
    key: IdempotencyKey,
    scope: Scope,
    bodies: PhantomData<fn(ReqBody) -> ResBody>,
}

/// Why the request body was not read.
enum Unread {
    TooLarge,
    Failed(BoxError),
}

/// The inner service's answer, read as far as the stored-body limit.
enum Collected<B> {
    /// The whole body, within the limit (trailers are not kept).
    Whole(http::response::Parts, Bytes),
    /// Over the limit: the chunks read so far, and the rest of the body.
    Over(http::response::Parts, VecDeque<Bytes>, Pin<Box<B>>),
}

/// Why the handler gave no answer to record.
enum Failure<E> {
    Service(E),
    Body(BoxError),
}

impl<S, ReqBody, ResBody> Keyed<S, ReqBody, ResBody>
where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Body<Data = Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    /// Reads the body, then hands the rest to a task of its own and awaits it.
    async fn respond(
        self,
        body: ReqBody,
        mut fingerprint: FingerprintBuilder,
    ) -> Result<Response<ResponseBody<ResBody>>, S::Error> {
        let limit = self.engine.policy().request_body_limit_bytes();
        let body = match read_limited(body, limit, &mut fingerprint).await {
            Ok(body) => body,
            Err(Unread::TooLarge) => return Ok(problem(&self.engine.payload_too_large())),
            Err(Unread::Failed(error)) => {
                tracing::debug!(target: "idem", error = %error, "the request body could not be read");
                return Ok(unreadable_body());
            }
        };
        let engine = self.engine.clone();
        // From here on the work is the record's, not the connection's: a client
        // that disconnects drops this future, not the task, so the claim is never
        // left half-done and the handler runs to completion.
        let task = tokio::spawn(self.settle(body, fingerprint.finish()).in_current_span());
        match task.await {
            Ok(outcome) => outcome,
            Err(error) => {
                tracing::error!(target: "idem", %error, "the idempotent request's task failed");
                Ok(problem(&engine.handler_failed()))
            }
        }
    }

    /// Claims the record and does what the engine decided.
    async fn settle(
        self,
        body: Bytes,
        fingerprint: Fingerprint,
    ) -> Result<Response<ResponseBody<ResBody>>, S::Error> {
        let begin = self
            .engine
            .begin(self.scope.clone(), self.key.clone(), fingerprint)
            .await;
        match begin {
            Begin::Replay(stored) => Ok(to_http(stored)),
            Begin::Reject(rejection) => Ok(problem(&rejection)),
            Begin::Unguarded => self.unguarded(body).await,
            Begin::Execute(execution) => self.execute(execution, body).await,
        }
    }

    /// Runs the inner service without a claim (the store failed; the route fails
    /// open).
    async fn unguarded(self, body: Bytes) -> Result<Response<ResponseBody<ResBody>>, S::Error> {
        let engine = self.engine.clone();
        let (mut inner, request) = self.into_request(body, false, None);
        match AssertUnwindSafe(inner.call(request)).catch_unwind().await {
            Ok(outcome) => outcome.map(|response| response.map(ResponseBody::original)),
            Err(_) => {
                tracing::warn!(target: "idem", outcome = "handler-failed", "the unguarded handler panicked");
                Ok(problem(&engine.handler_failed()))
            }
        }
    }

    /// Runs the inner service under the claim, reads its answer up to the
    /// stored-body limit, and records it.
    async fn execute(
        self,
        execution: Execution,
        body: Bytes,
    ) -> Result<Response<ResponseBody<ResBody>>, S::Error> {
        let limit = execution.stored_body_limit();
        let (mut inner, request) = self.into_request(body, true, execution.context().cloned());
        // The answer is read inside `run`, so the lease is renewed while a
        // streamed body is produced too.
        let handler = async move {
            let response = inner.call(request).await.map_err(Failure::Service)?;
            collect(response, limit).await.map_err(Failure::Body)
        };
        let outcome = execution
            .run(AssertUnwindSafe(handler).catch_unwind())
            .await;
        match outcome {
            Ok(Ok(Collected::Whole(parts, body))) => {
                let stored = StoredResponse::new(
                    parts.status.as_u16(),
                    stored_headers(&parts.headers),
                    body.clone(),
                );
                // The handler's answer, unless a transactional store lost the
                // commit (and the handler's writes with it): then a 503.
                match execution.settle(&stored).await {
                    Settlement::Deliver => {
                        Ok(Response::from_parts(parts, ResponseBody::whole(body)))
                    }
                    Settlement::Retract(rejection) => Ok(problem(&rejection)),
                }
            }
            Ok(Ok(Collected::Over(parts, read, rest))) => {
                let stored = StoredResponse::without_body(
                    parts.status.as_u16(),
                    stored_headers(&parts.headers),
                );
                match execution.settle(&stored).await {
                    Settlement::Deliver => Ok(Response::from_parts(
                        parts,
                        ResponseBody::resumed(read, rest),
                    )),
                    Settlement::Retract(rejection) => Ok(problem(&rejection)),
                }
            }
            Ok(Err(Failure::Service(error))) => {
                execution.fail().await;
                Err(error)
            }
            Ok(Err(Failure::Body(error))) => {
                tracing::warn!(target: "idem", %error, "the response body failed");
                Ok(problem(&execution.fail().await))
            }
            Err(_) => Ok(problem(&execution.fail().await)),
        }
    }

    /// The request the inner service gets: the buffered body, and the
    /// [`ExecutionInfo`] in its extensions.
    fn into_request(
        self,
        body: Bytes,
        guarded: bool,
        context: Option<ExecutionContext>,
    ) -> (S, Request<RequestBody<ReqBody>>) {
        let mut parts = self.parts;
        parts
            .extensions
            .insert(ExecutionInfo::new(self.key, self.scope, guarded).with_context(context));
        (
            self.inner,
            Request::from_parts(parts, RequestBody::buffered(body)),
        )
    }
}

/// Reads the whole body while feeding the fingerprint; refuses one over `limit`
/// bytes as soon as it shows.
async fn read_limited<B>(
    body: B,
    limit: usize,
    fingerprint: &mut FingerprintBuilder,
) -> Result<Bytes, Unread>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let mut body = pin!(body);
    if body.size_hint().lower() > limit as u64 {
        drain(body.as_mut()).await;
        return Err(Unread::TooLarge);
    }
    let mut chunks: Vec<Bytes> = Vec::new();
    let mut len = 0;
    loop {
        let frame = match body.frame().await {
            None => return Ok(join(chunks, len)),
            Some(frame) => frame.map_err(|error| Unread::Failed(error.into()))?,
        };
        let Ok(chunk) = frame.into_data() else {
            continue;
        };
        len += chunk.len();
        if len > limit {
            break;
        }
        fingerprint.update(&chunk);
        chunks.push(chunk);
    }
    drain(body.as_mut()).await;
    Err(Unread::TooLarge)
}

/// The most of a refused body that is read (and dropped) before the `413`.
const DRAIN_BYTES: u64 = 8 * 1024 * 1024;
/// The longest a refused body is read before the `413`.
const DRAIN_TIME: Duration = Duration::from_secs(2);

/// Reads and drops what is left of a refused body, within bounds, so that a
/// client still sending it reads the `413` rather than a reset connection (a
/// server that closes with unread bytes in its socket resets it). A body that is
/// declared or turns out larger than the bound, or slower than the time bound, is
/// left unread: the connection then closes after the answer.
async fn drain<B>(mut body: Pin<&mut B>)
where
    B: Body<Data = Bytes>,
{
    if body.size_hint().lower() > DRAIN_BYTES {
        return;
    }
    let read = async {
        let mut drained = 0u64;
        loop {
            let chunk = match body.frame().await {
                Some(Ok(frame)) => frame.into_data().ok(),
                None | Some(Err(_)) => return,
            };
            drained += chunk.map_or(0, |c| c.len() as u64);
            if drained > DRAIN_BYTES {
                return;
            }
        }
    };
    let _ = tokio::time::timeout(DRAIN_TIME, read).await;
}

/// Reads the answer's body until it ends or passes `limit` bytes.
async fn collect<B>(response: Response<B>, limit: usize) -> Result<Collected<B>, BoxError>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let (parts, body) = response.into_parts();
    let mut body = Box::pin(body);
    let mut chunks = VecDeque::new();
    let mut len = 0;
    while let Some(frame) = body.frame().await {
        let Ok(chunk) = frame.map_err(Into::into)?.into_data() else {
            continue;
        };
        len += chunk.len();
        chunks.push_back(chunk);
        if len > limit {
            return Ok(Collected::Over(parts, chunks, body));
        }
    }
    Ok(Collected::Whole(parts, join(chunks, len)))
}

/// One `Bytes` of the chunks, without a copy when there is only one.
fn join(chunks: impl IntoIterator<Item = Bytes>, len: usize) -> Bytes {
    let mut chunks = chunks.into_iter();
    let Some(first) = chunks.next() else {
        return Bytes::new();
    };
    if first.len() == len {
        return first;
    }
    let mut joined = BytesMut::with_capacity(len);
    joined.extend_from_slice(&first);
    for chunk in chunks {
        joined.extend_from_slice(&chunk);
    }
    joined.freeze()
}

/// The answer when the request body failed mid-way (the client is likely gone).
fn unreadable_body<B>() -> Response<ResponseBody<B>> {
    let mut response = Response::new(ResponseBody::whole(Bytes::new()));
    *response.status_mut() = http::StatusCode::BAD_REQUEST;
    response
}

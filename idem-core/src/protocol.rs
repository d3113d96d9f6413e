//! The keyed-request protocol: every step of an idempotent HTTP request, from
//! its head to the answer sent, decided once here for every adapter.
//!
//! An adapter converts its framework's types at its edge and follows four steps:
//!
//! 1. [`Engine::start`] with the request's head and the route's
//!    [`ScopeSource`]: pass the request through untouched, send an
//!    [`Answer`](Start::Answer) (a problem), or read the body through the
//!    [`Intake`];
//! 2. [`Intake::read`] with the body as a stream of chunks: the body, read
//!    against its limit while it is fingerprinted, or an answer (`413`, `400`);
//! 3. [`Claimable::claim`]: the claim and its outcome, a replay or a problem to
//!    send, or a [`Run`] of the handler;
//! 4. [`Run::respond`] with the handler: it runs under the lease, its answer is
//!    read up to the stored-body limit and recorded, and the [`Outcome`] says
//!    what to send.
//!
//! Every limit, status, header and problem, the tracing span and the metrics
//! live here; the adapter decides nothing.

use std::fmt::Display;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::{Pin, pin};
use std::task::Poll;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures_util::{FutureExt, Stream, StreamExt};
use tracing::{Instrument, Span};

use crate::engine::{Begin, Engine, Execution};
use crate::execution::ExecutionInfo;
use crate::metrics;
use crate::{
    FingerprintHasher, Header, IdempotencyKey, KEY_HEADER, RequestHead, Scope, ScopeSource,
    Settlement, StoredResponse,
};

/// What to do with a request, decided from its head by [`Engine::start`].
#[derive(Debug)]
#[must_use]
pub enum Start {
    /// Not covered (its method, or an optional key absent): call the handler with
    /// the request untouched.
    PassThrough,
    /// Send this answer (a problem: a missing or malformed key, no scope); the
    /// handler does not run.
    Answer(StoredResponse),
    /// Keyed: read the body through the intake.
    Keyed(Intake),
}

/// A keyed request whose body is still to be read: [`Intake::read`] reads it
/// against the policy's limit while fingerprinting it.
#[must_use]
pub struct Intake {
    engine: Engine,
    key: IdempotencyKey,
    scope: Scope,
    hasher: FingerprintHasher,
    span: Span,
}

/// A keyed request with its body read and fingerprinted: ready to claim its
/// record.
#[must_use]
pub struct Claimable {
    engine: Engine,
    key: IdempotencyKey,
    scope: Scope,
    hasher: FingerprintHasher,
    body: Bytes,
    span: Span,
}

/// What [`Claimable::claim`] decided.
#[derive(Debug)]
#[must_use]
// Moved once, from the claim to the adapter: boxing `Run` would cost an
// allocation per execution for nothing.
#[allow(clippy::large_enum_variant)]
pub enum Decision {
    /// Send this answer (a replay, carrying `Idempotent-Replayed: true`, or a
    /// problem); the handler does not run.
    Answer(StoredResponse),
    /// Run the handler through [`Run::respond`].
    Run(Run),
}

/// The right to run the handler of a keyed request: under its claim, or
/// unguarded when the store failed and the route fails open.
#[must_use]
pub struct Run {
    engine: Engine,
    execution: Option<Execution>,
    info: ExecutionInfo,
    body: Bytes,
    span: Span,
}

/// The handler's answer, as the adapter hands it to [`Run::respond`].
#[derive(Debug)]
pub struct Handled<T, S> {
    /// What the adapter needs back to send the answer (its response head, its
    /// request): handed back in the [`Outcome`].
    pub head: T,
    /// The status.
    pub status: u16,
    /// Every header field, repeats kept in order.
    pub headers: Vec<Header>,
    /// The body.
    pub body: HandlerBody<S>,
}

/// A handler's response body.
#[derive(Debug)]
pub enum HandlerBody<S> {
    /// Already whole in memory.
    Complete(Bytes),
    /// A stream of chunks, with its length when the handler declared it.
    Streaming {
        /// The chunks.
        body: S,
        /// The declared length, if any.
        length: Option<u64>,
    },
}

/// What to send after [`Run::respond`].
#[derive(Debug)]
#[must_use]
pub enum Outcome<T, S, E> {
    /// Send the handler's answer: its head and this body.
    Deliver {
        /// The head the handler's [`Handled`] carried.
        head: T,
        /// The body to send.
        body: Delivered<S>,
    },
    /// Send this answer instead of the handler's (a transactional store lost
    /// the commit, the handler or its body failed). `head` is the handler's
    /// head when it got that far.
    Answer {
        /// The head the handler's [`Handled`] carried, if it answered.
        head: Option<T>,
        /// The answer to send.
        answer: StoredResponse,
    },
    /// The handler returned an error (its claim was released, so a retry runs
    /// it again): hand it to the framework.
    Failed(E),
}

/// The body of the handler's answer, as it is sent on.
pub enum Delivered<S> {
    /// Whole, in memory (recorded for replay when within the limit).
    Complete(Bytes),
    /// Declared over the stored-body limit: not read, sent on as it streams.
    Untouched(S),
    /// Grew past the stored-body limit while it was read: what was read, then
    /// the rest as it streams.
    Resumed {
        /// The chunks read before the limit was passed, joined.
        read: Bytes,
        /// The rest of the body.
        rest: Pin<Box<S>>,
    },
}

/// A future that runs to its end even when whoever polls it goes away: polled
/// in place (no task, no copy) while it is awaited, and handed to `spawn` to
/// finish in the background if it is dropped before its end. Adapters wrap
/// [`Run::respond`] in it, so a client that disconnects never cancels the
/// handler or leaves its record half done, at no cost when it stays.
///
/// ```
/// use idem_core::protocol::Detached;
///
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// let answer = Detached::new(async { 42 }, |rest| {
///     tokio::spawn(rest);
/// })
/// .await;
/// assert_eq!(answer, 42);
/// # });
/// ```
#[must_use = "futures do nothing unless awaited"]
pub struct Detached<F: Future> {
    future: Option<Pin<Box<F>>>,
    spawn: fn(Pin<Box<F>>),
}

impl<F: Future> Detached<F> {
    /// `future`, finished by `spawn` (say `|rest| { tokio::spawn(rest); }`) if
    /// it is dropped before its end.
    pub fn new(future: F, spawn: fn(Pin<Box<F>>)) -> Self {
        Self {
            future: Some(Box::pin(future)),
            spawn,
        }
    }
}

impl<F: Future> Future for Detached<F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> Poll<Self::Output> {
        let Some(future) = self.future.as_mut() else {
            return Poll::Pending;
        };
        let output = std::task::ready!(future.as_mut().poll(cx));
        self.future = None;
        Poll::Ready(output)
    }
}

impl<F: Future> Drop for Detached<F> {
    fn drop(&mut self) {
        if let Some(rest) = self.future.take() {
            (self.spawn)(rest);
        }
    }
}

// `Detached` never pins its future in place: it is boxed.
impl<F: Future> Unpin for Detached<F> {}

impl<F: Future> std::fmt::Debug for Detached<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Detached")
            .field("done", &self.future.is_none())
            .finish_non_exhaustive()
    }
}

/// The most of a refused request body that is read (and dropped) before the `413`.
const DRAIN_BYTES: u64 = 8 * 1024 * 1024;
/// The longest a refused request body is read before the `413`.
const DRAIN_TIME: Duration = Duration::from_secs(2);

impl Engine {
    /// Decides from the request's head whether it is covered, refused, or keyed:
    /// the method and key (a malformed or missing key is answered here), then
    /// the scope from `scope` (nothing found: `500 scope-unavailable`, and an
    /// error naming what the source expected).
    pub fn start<R: ?Sized>(
        &self,
        head: &RequestHead<'_>,
        scope: &ScopeSource<R>,
        request: &R,
    ) -> Start {
        // Two fields are enough to tell "more than one".
        let mut fields: [Option<&[u8]>; 2] = [None, None];
        let mut count = 0;
        head.headers.each_field(KEY_HEADER, &mut |value| {
            if let Some(slot) = fields.get_mut(count) {
                *slot = Some(value);
            }
            count += 1;
        });
        let key = match self.admit(head.method, fields.into_iter().flatten()) {
            Ok(Some(key)) => key,
            Ok(None) => return Start::PassThrough,
            Err(problem) => return Start::Answer(problem.to_response()),
        };
        let Some(scope) = scope.resolve(request) else {
            return Start::Answer(self.scope_unavailable(scope.expected()).to_response());
        };
        let span = tracing::info_span!(
            target: "idem",
            "idempotent_request",
            key = %key.redacted(),
            %scope,
            method = %crate::log::bounded(head.method),
            path = %crate::log::bounded(head.path),
        );
        let hasher = self.policy().fingerprint_spec().start(head);
        Start::Keyed(Intake {
            engine: self.clone(),
            key,
            scope,
            hasher,
            span,
        })
    }
}

impl Intake {
    /// Reads the request body, its chunks as they stream, against the policy's
    /// limit while fingerprinting it.
    ///
    /// `declared` is the body's declared length (`Content-Length`), if any: a
    /// declared length over the limit is refused before a byte is read. A
    /// refused body is read and dropped within bounds (8 MiB, 2 s) before the
    /// `413 payload-too-large`, so a client still sending reads the answer
    /// rather than a reset connection. A body that fails to arrive whole (the
    /// client went away, a malformed chunked body) is answered
    /// `400 body-unreadable`; one that stalls past the policy's
    /// [`request_body_timeout`](crate::Policy::request_body_timeout) (30 s by
    /// default, counted from the first time the body is not ready) is answered
    /// `408 body-timeout`, so a client that stops sending cannot hold the
    /// connection. Nothing is claimed in either case.
    ///
    /// Nothing is logged while the body streams in, so the span is entered only
    /// around the lines a refused body logs, not at every poll.
    pub async fn read<S, E>(
        self,
        declared: Option<u64>,
        body: S,
    ) -> Result<Claimable, StoredResponse>
    where
        S: Stream<Item = Result<Bytes, E>>,
        E: Display,
    {
        let Self {
            engine,
            key,
            scope,
            mut hasher,
            span,
        } = self;
        let limit = engine.policy().request_body_limit_bytes();
        let mut body = pin!(body);
        if declared.is_some_and(|length| length > limit as u64) {
            drain(body.as_mut(), declared).await;
            let _in_span = span.enter();
            return Err(engine.payload_too_large().to_response());
        }
        let mut chunks = Joined::default();
        // Started the first time the body is not ready: a body that has
        // arrived costs no clock reading and no timer.
        let mut deadline = pin!(None::<tokio::time::Sleep>);
        let timeout = engine.policy().request_body_timeout_duration();
        loop {
            let next = std::future::poll_fn(|cx| {
                if let Poll::Ready(next) = body.as_mut().poll_next(cx) {
                    return Poll::Ready(Some(next));
                }
                if deadline.is_none() {
                    deadline.set(Some(tokio::time::sleep(timeout)));
                }
                match deadline.as_mut().as_pin_mut().map(|sleep| sleep.poll(cx)) {
                    Some(Poll::Ready(())) => Poll::Ready(None),
                    _ => Poll::Pending,
                }
            })
            .await;
            let Some(next) = next else {
                let _in_span = span.enter();
                return Err(engine.body_timeout().to_response());
            };
            let Some(chunk) = next else { break };
            let chunk = match chunk {
                Ok(chunk) => chunk,
                Err(error) => {
                    let _in_span = span.enter();
                    tracing::debug!(target: "idem", %error, "the request body could not be read");
                    return Err(engine.body_unreadable().to_response());
                }
            };
            if chunks.len() + chunk.len() > limit {
                drain(body.as_mut(), None).await;
                let _in_span = span.enter();
                return Err(engine.payload_too_large().to_response());
            }
            hasher.update(&chunk);
            chunks.push(chunk);
        }
        Ok(Claimable {
            engine,
            key,
            scope,
            hasher,
            body: chunks.join(),
            span,
        })
    }
}

impl Claimable {
    /// Claims the request's record and decides: run the handler, replay, or
    /// refuse (`409`, `422`, `410`, `503`; in wait mode it waits here first).
    ///
    /// Safe to drop at any point: when the store does not answer at once, the
    /// claim goes on in a task of its own, and a claim nobody is left to use is
    /// released, so a client that goes away mid-claim never leaves its key in
    /// progress.
    pub async fn claim(self) -> Decision {
        let Self {
            engine,
            key,
            scope,
            hasher,
            body,
            span,
        } = self;
        let fingerprint = hasher.finish();
        let begin = {
            let engine = engine.clone();
            let scope = scope.clone();
            let key = key.clone();
            async move { engine.begin(scope, key, fingerprint).await }.instrument(span.clone())
        };
        let mut begin = Box::pin(begin);
        // A store that answers at once (memory) needs no task; one that waits
        // (a database) goes on in a task, so that dropping this future cannot
        // lose a granted claim.
        let first = std::future::poll_fn(|cx| Poll::Ready(begin.as_mut().poll(cx))).await;
        let begin = match first {
            Poll::Ready(begin) => begin,
            Poll::Pending => {
                let (sender, receiver) = tokio::sync::oneshot::channel();
                tokio::spawn(async move {
                    // Nobody waiting: the decision is dropped, and an execution's
                    // drop releases its claim.
                    let _ = sender.send(begin.await);
                });
                match receiver.await {
                    Ok(begin) => begin,
                    Err(_) => return Decision::Answer(engine.handler_lost()),
                }
            }
        };
        let (execution, info) = match begin {
            Begin::Execute(execution) => {
                let info = execution.info();
                (Some(execution), info)
            }
            Begin::Unguarded => (None, ExecutionInfo::unguarded(key, scope)),
            Begin::Replay(stored) => return Decision::Answer(stored),
            Begin::Reject(problem) => return Decision::Answer(problem.to_response()),
        };
        Decision::Run(Run {
            engine,
            execution,
            info,
            body,
            span,
        })
    }
}

/// Why the handler gave no answer to record.
enum Failure<T, E> {
    Handler(E),
    Body(T),
}

impl Run {
    /// What the handler is told about its execution (the adapter also hands it
    /// to [`respond`](Self::respond)'s handler).
    pub fn info(&self) -> &ExecutionInfo {
        &self.info
    }

    /// Runs `handler` with the request body and the [`ExecutionInfo`], under the
    /// claim's lease (renewed while it runs and while its body is read), reads
    /// its answer up to the stored-body limit, records it, and says what to
    /// send.
    ///
    /// Run it to completion even when the client goes away (the adapter spawns
    /// it): the work is the record's, not the connection's. A handler that
    /// panics, returns an error or whose body fails releases the claim (a retry
    /// runs it again) and is answered `500 handler-failed` (an error is handed
    /// back as [`Outcome::Failed`]).
    pub fn respond<F, Fut, T, S, E, Er>(self, handler: F) -> impl Future<Output = Outcome<T, S, Er>>
    where
        F: FnOnce(Bytes, ExecutionInfo) -> Fut,
        Fut: Future<Output = Result<Handled<T, S>, Er>>,
        S: Stream<Item = Result<Bytes, E>>,
        E: Display,
    {
        let span = self.span.clone();
        self.respond_in_span(handler).instrument(span)
    }

    async fn respond_in_span<F, Fut, T, S, E, Er>(self, handler: F) -> Outcome<T, S, Er>
    where
        F: FnOnce(Bytes, ExecutionInfo) -> Fut,
        Fut: Future<Output = Result<Handled<T, S>, Er>>,
        S: Stream<Item = Result<Bytes, E>>,
        E: Display,
    {
        let Self {
            engine,
            execution,
            info,
            body,
            span: _,
        } = self;
        let limit = engine.policy().stored_body_limit_bytes();
        let work = async move {
            let handled = handler(body, info).await.map_err(Failure::Handler)?;
            capture(handled, limit).await.map_err(Failure::Body)
        };
        // Pinned here and lent to the lease keeper, so the handler's future is
        // laid out (and moved) once.
        let mut work = pin!(AssertUnwindSafe(work).catch_unwind());
        let started = metrics::Timer::start();
        let ran = match &execution {
            Some(execution) => execution.run(work.as_mut()).await,
            None => work.await,
        };
        metrics::handler_time(started);
        let failed = |head| {
            let answer = engine.handler_failed().to_response();
            Outcome::Answer { head, answer }
        };
        let (head, status, headers, captured) = match ran {
            Ok(Ok(captured)) => captured,
            Ok(Err(Failure::Handler(error))) => {
                tracing::warn!(target: "idem", "the handler returned an error; its claim is released");
                fail(execution).await;
                return Outcome::Failed(error);
            }
            Ok(Err(Failure::Body(head))) => {
                fail(execution).await;
                return failed(Some(head));
            }
            Err(_panic) => {
                tracing::error!(target: "idem", "the handler panicked; its claim is released");
                fail(execution).await;
                return failed(None);
            }
        };
        let Some(execution) = execution else {
            return Outcome::Deliver {
                head,
                body: captured.delivered,
            };
        };
        let stored = match &captured.stored {
            Some(body) => StoredResponse::new(status, headers, body.clone()),
            None => StoredResponse::without_body(status, headers),
        };
        match execution.settle(&stored).await {
            Settlement::Deliver => Outcome::Deliver {
                head,
                body: captured.delivered,
            },
            Settlement::Retract(problem) => Outcome::Answer {
                head: Some(head),
                answer: problem.to_response(),
            },
        }
    }
}

/// Releases the claim of a handler that gave no answer to record.
async fn fail(execution: Option<Execution>) {
    match execution {
        Some(execution) => execution.release().await,
        None => metrics::outcome(metrics::Outcome::HandlerFailed),
    }
}

/// The handler's body as read for the record and as sent on.
struct Captured<S> {
    /// The body to record, when it is within the limit.
    stored: Option<Bytes>,
    delivered: Delivered<S>,
}

/// Reads the handler's body until it ends or passes `limit` bytes.
async fn capture<T, S, E>(
    handled: Handled<T, S>,
    limit: usize,
) -> Result<(T, u16, Vec<Header>, Captured<S>), T>
where
    S: Stream<Item = Result<Bytes, E>>,
    E: Display,
{
    let Handled {
        head,
        status,
        headers,
        body,
    } = handled;
    let captured = match body {
        HandlerBody::Complete(bytes) => Captured {
            stored: (bytes.len() <= limit).then(|| bytes.clone()),
            delivered: Delivered::Complete(bytes),
        },
        HandlerBody::Streaming {
            body,
            length: Some(length),
        } if length > limit as u64 => Captured {
            stored: None,
            delivered: Delivered::Untouched(body),
        },
        HandlerBody::Streaming { body, .. } => {
            let mut rest = Box::pin(body);
            let mut chunks = Joined::default();
            let mut over = false;
            while let Some(chunk) = rest.next().await {
                let chunk = match chunk {
                    Ok(chunk) => chunk,
                    Err(error) => {
                        tracing::error!(target: "idem", %error, "the response body failed while it was read");
                        return Err(head);
                    }
                };
                chunks.push(chunk);
                if chunks.len() > limit {
                    over = true;
                    break;
                }
            }
            let read = chunks.join();
            if over {
                Captured {
                    stored: None,
                    delivered: Delivered::Resumed { read, rest },
                }
            } else {
                Captured {
                    stored: Some(read.clone()),
                    delivered: Delivered::Complete(read),
                }
            }
        }
    };
    Ok((head, status, headers, captured))
}

/// Reads and drops what is left of a refused body, within bounds, so that a
/// client still sending it reads the `413` rather than a reset connection (a
/// server that closes with unread bytes in its socket resets it). A body that is
/// declared or turns out larger than the bound, or slower than the time bound, is
/// left unread: the connection then closes after the answer.
async fn drain<S, E>(mut body: Pin<&mut S>, declared: Option<u64>)
where
    S: Stream<Item = Result<Bytes, E>>,
{
    if declared.is_some_and(|length| length > DRAIN_BYTES) {
        return;
    }
    let read = async {
        let mut drained = 0u64;
        while let Some(Ok(chunk)) = body.next().await {
            drained += chunk.len() as u64;
            if drained > DRAIN_BYTES {
                return;
            }
        }
    };
    let _ = tokio::time::timeout(DRAIN_TIME, read).await;
}

/// A body read chunk by chunk, joined into one `Bytes` at the end: a body that
/// arrives as one chunk (most do) is neither copied nor listed.
#[derive(Default)]
struct Joined {
    first: Option<Bytes>,
    more: Vec<Bytes>,
    len: usize,
}

impl Joined {
    fn push(&mut self, chunk: Bytes) {
        self.len += chunk.len();
        if self.first.is_none() {
            self.first = Some(chunk);
        } else {
            self.more.push(chunk);
        }
    }

    fn len(&self) -> usize {
        self.len
    }

    fn join(self) -> Bytes {
        let Some(first) = self.first else {
            return Bytes::new();
        };
        if self.more.is_empty() {
            return first;
        }
        let mut joined = BytesMut::with_capacity(self.len);
        joined.extend_from_slice(&first);
        for chunk in self.more {
            joined.extend_from_slice(&chunk);
        }
        joined.freeze()
    }
}

impl std::fmt::Debug for Intake {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Intake")
            .field("key", &self.key.redacted())
            .field("scope", &self.scope)
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for Claimable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Claimable")
            .field("key", &self.key.redacted())
            .field("scope", &self.scope)
            .field("body_len", &self.body.len())
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for Run {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Run")
            .field("info", &self.info)
            .finish_non_exhaustive()
    }
}

impl<S> std::fmt::Debug for Delivered<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Complete(bytes) => f.debug_tuple("Complete").field(&bytes.len()).finish(),
            Self::Untouched(_) => f.write_str("Untouched(..)"),
            Self::Resumed { read, .. } => f
                .debug_struct("Resumed")
                .field("read", &read.len())
                .finish_non_exhaustive(),
        }
    }
}

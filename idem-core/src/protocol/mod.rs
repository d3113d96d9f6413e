//! The keyed-request protocol: every step of an idempotent HTTP request, from
//! its head to the answer sent, decided once here for every adapter.
//!
//! An adapter converts its framework's types at its edge and makes two calls:
//!
//! 1. [`Engine::start`] with the request's head and the route's
//!    [`ScopeSource`]: pass the request through untouched, send an
//!    [`Answer`](Start::Answer) (a problem), or go on with the [`Keyed`]
//!    request;
//! 2. [`Keyed::respond`] (or [`Keyed::respond_local`] for handlers that are
//!    not `Send`) with what the adapter keeps of its request, the body's
//!    declared length, the body as a stream of chunks, and the handler. It
//!    reads the body against its limit while fingerprinting it, claims the
//!    record, runs the handler under the lease, reads its answer up to the
//!    stored-body limit and records it. The [`Outcome`] says what to send:
//!    the handler's answer, an [`Answer`](Outcome::Answer) (a replay or a
//!    problem) with the [`Remnant`] of the request, or the handler's error.
//!
//! Every limit, status, header and problem, the tracing span, the metrics and
//! the tasks live here; the adapter decides nothing. Once the handler runs,
//! its run is the record's, not the connection's: dropping the future
//! `respond` returned (the client went away) finishes the run in a task.

mod capture;
mod detach;
mod intake;
mod problems;
#[cfg(test)]
mod tests;

use std::fmt::Display;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::{Pin, pin};
use std::task::Poll;

use bytes::Bytes;
use futures_util::{FutureExt, Stream};
use tracing::{Instrument, Span};

use self::capture::capture;
use self::detach::Detached;
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
    /// Keyed: go on with [`Keyed::respond`].
    Keyed(Keyed),
}

/// A keyed request whose body is still to be read: [`Keyed::respond`] takes it
/// from there to the answer.
#[must_use]
pub struct Keyed {
    engine: Engine,
    key: IdempotencyKey,
    scope: Scope,
    hasher: FingerprintHasher,
    span: Span,
}

/// The handler's answer, as the handler given to [`Keyed::respond`] returns it.
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

/// What to send, as [`Keyed::respond`] decided it.
///
/// `K` is what the adapter kept of its request, `B` the request body's stream,
/// `T` the head the handler's [`Handled`] carries, `S` its body's stream and
/// `E` its error.
#[derive(Debug)]
#[must_use]
pub enum Outcome<K, B, T, S, E> {
    /// Send the handler's answer: its head and this body.
    Deliver {
        /// The head the handler's [`Handled`] carried.
        head: T,
        /// The body to send.
        body: Delivered<S>,
    },
    /// Send this answer: a replay (carrying `Idempotent-Replayed: true`) or a
    /// problem, in place of the handler's answer or without running it.
    Answer {
        /// The answer to send.
        answer: StoredResponse,
        /// What is left of the request to send it with.
        remnant: Remnant<K, B, T>,
    },
    /// The handler returned an error (its claim was released, so a retry runs
    /// it again): hand it to the framework.
    Failed(E),
}

/// What is left of the request when [`Outcome::Answer`] is sent.
#[derive(Debug)]
pub enum Remnant<K, B, T> {
    /// The handler did not run: what the adapter kept and the request body,
    /// read to its end, or left partly unread when it was refused (`413`,
    /// `408`, `400`) so that the connection should close after the answer.
    Request {
        /// What the adapter kept of its request.
        kept: K,
        /// The request body.
        body: B,
    },
    /// The handler answered and its answer is replaced (its body failed, or a
    /// transactional store lost the commit): the head its [`Handled`] carried.
    Handled(T),
    /// The handler took the request and gave nothing back: it panicked.
    Lost,
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
        let hasher = self.policy().get_fingerprint().start(head);
        Start::Keyed(Keyed {
            engine: self.clone(),
            key,
            scope,
            hasher,
            span,
        })
    }
}

impl Keyed {
    /// Reads the request body, claims the record, runs `handler` under the
    /// lease, records its answer, and says what to send.
    ///
    /// - `kept` is what the adapter keeps of its request; the handler gets it
    ///   back, or the [`Remnant`] does when the handler does not run.
    /// - `declared` is the body's declared length (`Content-Length`), if any:
    ///   a declared length over the policy's limit is refused before a byte is
    ///   read.
    /// - `body` is the request body as a stream of chunks. It is read against
    ///   the policy's limit while it is fingerprinted; a refused body is read
    ///   and dropped within bounds (8 MiB, 2 s) before the
    ///   `413 payload-too-large`, so a client still sending reads the answer;
    ///   a body that fails to arrive whole is answered `400 body-unreadable`,
    ///   one that stalls past the policy's
    ///   [`request_body_timeout`](crate::Policy::request_body_timeout)
    ///   `408 body-timeout`. Nothing is claimed then.
    /// - `handler` runs once the claim is granted (or unguarded, when the
    ///   store failed and the route fails open), with `kept`, the body read
    ///   and the [`ExecutionInfo`]. Its answer is read up to the stored-body
    ///   limit and recorded. A handler that panics, returns an error or whose
    ///   body fails releases the claim (a retry runs it again) and is answered
    ///   `500 handler-failed` (an error is handed back as
    ///   [`Outcome::Failed`]).
    ///
    /// Safe to drop at any point. Before the handler runs, dropping it gives
    /// the request up: a claim the store grants after that is released, so a
    /// client that goes away never leaves its key in progress. Once the
    /// handler runs, the rest goes on in a Tokio task: the work is the
    /// record's, not the connection's.
    pub async fn respond<K, B, BE, H, Fut, T, S, SE, E>(
        self,
        kept: K,
        declared: Option<u64>,
        mut body: B,
        handler: H,
    ) -> Outcome<K, B, T, S, E>
    where
        K: Send + 'static,
        B: Stream<Item = Result<Bytes, BE>> + Unpin,
        BE: Display,
        H: FnOnce(K, Bytes, ExecutionInfo) -> Fut + Send + 'static,
        Fut: Future<Output = Result<Handled<T, S>, E>> + Send + 'static,
        T: Send + 'static,
        S: Stream<Item = Result<Bytes, SE>> + Send + 'static,
        SE: Display + 'static,
        E: Send + 'static,
    {
        match self.claim(declared, &mut body).await {
            Ok(run) => Detached::new(run.respond(kept, handler), |rest| {
                tokio::spawn(rest);
            })
            .await
            .into(),
            Err(answer) => Outcome::Answer {
                answer,
                remnant: Remnant::Request { kept, body },
            },
        }
    }

    /// [`respond`](Self::respond), for a handler that is not `Send` (as
    /// actix-web's are): once the handler runs, a dropped future finishes in
    /// a task of the current thread's [`LocalSet`](tokio::task::LocalSet)
    /// (every actix-web worker runs on one), so call it within one.
    pub async fn respond_local<K, B, BE, H, Fut, T, S, SE, E>(
        self,
        kept: K,
        declared: Option<u64>,
        mut body: B,
        handler: H,
    ) -> Outcome<K, B, T, S, E>
    where
        K: 'static,
        B: Stream<Item = Result<Bytes, BE>> + Unpin,
        BE: Display,
        H: FnOnce(K, Bytes, ExecutionInfo) -> Fut + 'static,
        Fut: Future<Output = Result<Handled<T, S>, E>> + 'static,
        T: 'static,
        S: Stream<Item = Result<Bytes, SE>> + 'static,
        SE: Display + 'static,
        E: 'static,
    {
        match self.claim(declared, &mut body).await {
            Ok(run) => Detached::new(run.respond(kept, handler), |rest| {
                tokio::task::spawn_local(rest);
            })
            .await
            .into(),
            Err(answer) => Outcome::Answer {
                answer,
                remnant: Remnant::Request { kept, body },
            },
        }
    }

    /// Reads the body, then claims the request's record: the right to run the
    /// handler, or the answer to send instead (a refused body; a replay; `409`,
    /// `422`, `410`, `503`; in wait mode it waits here first).
    ///
    /// When the store does not answer at once, the claim goes on in a task of
    /// its own, and a claim nobody is left to use is released, so dropping
    /// this future mid-claim never leaves the key in progress.
    async fn claim<B, BE>(self, declared: Option<u64>, body: &mut B) -> Result<Run, StoredResponse>
    where
        B: Stream<Item = Result<Bytes, BE>> + Unpin,
        BE: Display,
    {
        let Self {
            engine,
            key,
            scope,
            mut hasher,
            span,
        } = self;
        let body = intake::read(&engine, &mut hasher, &span, declared, body).await?;
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
                    Err(_) => return Err(engine.handler_lost()),
                }
            }
        };
        let (execution, info) = match begin {
            Begin::Execute(execution) => {
                let info = execution.info();
                (Some(execution), info)
            }
            Begin::Unguarded => (None, ExecutionInfo::unguarded(key, scope)),
            Begin::Replay(stored) => return Err(stored),
            Begin::Reject(problem) => return Err(problem.to_response()),
        };
        Ok(Run {
            engine,
            execution,
            info,
            body,
            span,
        })
    }
}

/// The right to run the handler of a keyed request: under its claim, or
/// unguarded when the store failed and the route fails open.
struct Run {
    engine: Engine,
    execution: Option<Execution>,
    info: ExecutionInfo,
    body: Bytes,
    span: Span,
}

/// What a [`Run`] ends with: an [`Outcome`] whose request the handler took.
enum Ran<T, S, E> {
    Deliver {
        head: T,
        body: Delivered<S>,
    },
    Answer {
        answer: StoredResponse,
        head: Option<T>,
    },
    Failed(E),
}

impl<K, B, T, S, E> From<Ran<T, S, E>> for Outcome<K, B, T, S, E> {
    fn from(ran: Ran<T, S, E>) -> Self {
        match ran {
            Ran::Deliver { head, body } => Outcome::Deliver { head, body },
            Ran::Answer { answer, head } => Outcome::Answer {
                answer,
                remnant: head.map_or(Remnant::Lost, Remnant::Handled),
            },
            Ran::Failed(error) => Outcome::Failed(error),
        }
    }
}

/// Why the handler gave no answer to record.
enum Failure<T, E> {
    Handler(E),
    Body(T),
}

impl Run {
    /// Runs `handler` under the claim's lease (renewed while it runs and while
    /// its body is read), reads its answer up to the stored-body limit, records
    /// it, and says what to send.
    fn respond<K, H, Fut, T, S, SE, E>(
        self,
        kept: K,
        handler: H,
    ) -> impl Future<Output = Ran<T, S, E>>
    where
        H: FnOnce(K, Bytes, ExecutionInfo) -> Fut,
        Fut: Future<Output = Result<Handled<T, S>, E>>,
        S: Stream<Item = Result<Bytes, SE>>,
        SE: Display,
    {
        let span = self.span.clone();
        self.respond_in_span(kept, handler).instrument(span)
    }

    async fn respond_in_span<K, H, Fut, T, S, SE, E>(self, kept: K, handler: H) -> Ran<T, S, E>
    where
        H: FnOnce(K, Bytes, ExecutionInfo) -> Fut,
        Fut: Future<Output = Result<Handled<T, S>, E>>,
        S: Stream<Item = Result<Bytes, SE>>,
        SE: Display,
    {
        let Self {
            engine,
            execution,
            info,
            body,
            span: _,
        } = self;
        let limit = engine.policy().get_stored_body_limit();
        let work = async move {
            let handled = handler(kept, body, info).await.map_err(Failure::Handler)?;
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
        let captured = match ran {
            Ok(Ok(captured)) => captured,
            Ok(Err(Failure::Handler(error))) => {
                tracing::warn!(target: "idem", "the handler returned an error; its claim is released");
                fail(execution).await;
                return Ran::Failed(error);
            }
            Ok(Err(Failure::Body(head))) => {
                fail(execution).await;
                return Ran::Answer {
                    answer: engine.handler_failed().to_response(),
                    head: Some(head),
                };
            }
            Err(_panic) => {
                tracing::error!(target: "idem", "the handler panicked; its claim is released");
                fail(execution).await;
                return Ran::Answer {
                    answer: engine.handler_failed().to_response(),
                    head: None,
                };
            }
        };
        let Some(execution) = execution else {
            return Ran::Deliver {
                head: captured.head,
                body: captured.delivered,
            };
        };
        let stored = match &captured.stored {
            Some(body) => StoredResponse::new(captured.status, captured.headers, body.clone()),
            None => StoredResponse::without_body(captured.status, captured.headers),
        };
        match execution.settle(&stored).await {
            Settlement::Deliver => Ran::Deliver {
                head: captured.head,
                body: captured.delivered,
            },
            Settlement::Retract(problem) => Ran::Answer {
                answer: problem.to_response(),
                head: Some(captured.head),
            },
        }
    }
}

/// Counts a handler that gave no answer to record, and releases its claim.
async fn fail(execution: Option<Execution>) {
    metrics::outcome(metrics::Outcome::HandlerFailed);
    if let Some(execution) = execution {
        execution.release().await;
    }
}

impl std::fmt::Debug for Keyed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Keyed")
            .field("key", &self.key.redacted())
            .field("scope", &self.scope)
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

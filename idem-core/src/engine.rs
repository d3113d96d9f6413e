//! The engine: the one place where the state machine lives.
//!
//! Adapters parse nothing and decide nothing about states: they hand the engine
//! the request's method and key fields ([`Engine::admit`]), its fingerprint, and
//! then do what [`Engine::begin`] answers.

use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::{
    Claim, ClaimOutcome, ClaimRequest, Fingerprint, FingerprintBuilder, Header, IdempotencyKey,
    InProgress, KeyRequirement, OnStoreFailure, OwnerToken, Policy, Problem, ProblemKind,
    REPLAYED_HEADER, RequestHead, Scope, Store, StoreError, StoredResponse,
};

/// The state machine over a store, with a route's policy. Cheap to clone.
#[derive(Clone)]
pub struct Engine {
    inner: Arc<Inner>,
}

struct Inner {
    store: Arc<dyn Store>,
    policy: Policy,
}

/// What to do with a request, decided from its method and key fields alone.
#[derive(Debug)]
pub enum Admission {
    /// Not covered (method, or optional key absent): pass it through untouched.
    PassThrough,
    /// Answer this problem; do not run the handler.
    Reject(Problem),
    /// Covered, with a valid key: fingerprint the request and call
    /// [`Engine::begin`].
    Keyed(IdempotencyKey),
}

/// What [`Engine::begin`] decided.
#[derive(Debug)]
pub enum Begin {
    /// This request holds the claim: run the handler through
    /// [`Execution::run`], then [`Execution::finish`] with its response.
    Execute(Execution),
    /// Send this stored answer (it already carries `Idempotent-Replayed: true`).
    Replay(StoredResponse),
    /// Answer this problem; do not run the handler.
    Reject(Problem),
    /// The store failed and the route fails open: run the handler without
    /// idempotency.
    Unguarded,
}

/// A claimed request: the right to run the handler once and record its answer.
///
/// Dropping an execution without [`finish`](Self::finish) or
/// [`fail`](Self::fail) releases the claim in the background (when a Tokio
/// runtime is there to run it), so a retry need not wait for the lease to lapse.
#[derive(Debug)]
pub struct Execution {
    engine: Engine,
    claim: Claim,
    settled: bool,
}

/// How many times a completion is attempted before it is given up on.
const COMPLETE_ATTEMPTS: u32 = 3;

impl Engine {
    /// An engine over `store` applying `policy`.
    pub fn new(store: impl Store, policy: Policy) -> Self {
        Self::from_shared(Arc::new(store), policy)
    }

    /// An engine over a store already shared as `Arc<dyn Store>`.
    pub fn from_shared(store: Arc<dyn Store>, policy: Policy) -> Self {
        Self {
            inner: Arc::new(Inner { store, policy }),
        }
    }

    /// The policy.
    pub fn policy(&self) -> &Policy {
        &self.inner.policy
    }

    /// The store.
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.inner.store
    }

    /// Decides from the method and the values of every `Idempotency-Key` field
    /// whether the request is covered, refused, or keyed.
    pub fn admit<'a, I>(&self, method: &str, key_fields: I) -> Admission
    where
        I: IntoIterator<Item = &'a [u8]>,
    {
        let policy = self.policy();
        if !policy.covers(method) {
            return Admission::PassThrough;
        }
        match IdempotencyKey::from_fields(key_fields) {
            Ok(Some(key)) => Admission::Keyed(key),
            Ok(None) => match policy.key_requirement() {
                KeyRequirement::Optional => Admission::PassThrough,
                KeyRequirement::Required => {
                    tracing::debug!(target: "idem", outcome = "rejected", reason = "missing-key");
                    Admission::Reject(self.problem(
                        ProblemKind::MissingKey,
                        "this route requires an Idempotency-Key header",
                    ))
                }
            },
            Err(error) => {
                tracing::debug!(target: "idem", outcome = "rejected", reason = "invalid-key", %error);
                Admission::Reject(self.problem(ProblemKind::InvalidKey, error.to_string()))
            }
        }
    }

    /// Starts the fingerprint of a request; feed it the body as it streams.
    pub fn fingerprint(&self, head: &RequestHead<'_>) -> FingerprintBuilder {
        self.policy().fingerprint_spec().start(head)
    }

    /// The answer to a request body over the limit.
    pub fn payload_too_large(&self) -> Problem {
        let limit = self.policy().request_body_limit_bytes();
        tracing::debug!(target: "idem", outcome = "rejected", reason = "payload-too-large", limit);
        self.problem(
            ProblemKind::PayloadTooLarge,
            format!("the request body is larger than {limit} bytes"),
        )
    }

    /// The answer when the application could not name the request's scope.
    pub fn scope_unavailable(&self) -> Problem {
        tracing::error!(
            target: "idem",
            outcome = "rejected",
            reason = "scope-unavailable",
            "no idempotency scope for the request: the route's scope source found nothing",
        );
        self.problem(
            ProblemKind::ScopeUnavailable,
            "the request could not be attributed to a scope",
        )
    }

    /// The answer when the handler panicked or failed (after its claim was released).
    pub fn handler_failed(&self) -> Problem {
        self.problem(
            ProblemKind::HandlerFailed,
            "the request failed; it may be retried with the same key",
        )
    }

    /// A problem of `kind` with the status the policy gives it.
    pub fn problem(&self, kind: ProblemKind, detail: impl Into<String>) -> Problem {
        Problem::new(kind, self.policy().status_of(kind), detail)
    }

    /// Claims the request's record and decides: execute, replay or refuse.
    ///
    /// In wait mode ([`InProgress::Wait`]) a request whose key is in progress
    /// waits here, up to the bound, for the record to complete (then replays it)
    /// or be released (then claims it).
    pub async fn begin(&self, scope: Scope, key: IdempotencyKey, fingerprint: Fingerprint) -> Begin {
        let policy = self.policy();
        let deadline = match policy.in_progress {
            InProgress::Wait { up_to } => Some(Instant::now() + up_to),
            InProgress::Reject { .. } => None,
        };
        let mut poll = Duration::from_millis(5);
        let mut request = ClaimRequest {
            scope,
            key,
            fingerprint,
            owner: OwnerToken::random(),
            lease: policy.lease,
            retention: policy.retention,
        };
        loop {
            let outcome = match self.store().claim(&request).await {
                Ok(outcome) => outcome,
                Err(error) => return self.store_failed(&request, error),
            };
            match outcome {
                ClaimOutcome::Claimed(claim) => {
                    tracing::debug!(target: "idem", outcome = "claimed", scope = %claim.scope, key = %claim.key.redacted());
                    return Begin::Execute(Execution {
                        engine: self.clone(),
                        claim,
                        settled: false,
                    });
                }
                ClaimOutcome::Completed { fingerprint, .. } if fingerprint != request.fingerprint => {
                    return self.mismatch(&request);
                }
                ClaimOutcome::InProgress { fingerprint, .. } if fingerprint != request.fingerprint => {
                    return self.mismatch(&request);
                }
                ClaimOutcome::Completed { response, .. } => {
                    if !response.replayable {
                        tracing::info!(target: "idem", outcome = "not-replayable", scope = %request.scope, key = %request.key.redacted());
                        return Begin::Reject(self.problem(
                            ProblemKind::ResponseNotStored,
                            "the request with this key was executed, but its response was too large to store; it is not executed again",
                        ));
                    }
                    tracing::info!(target: "idem", outcome = "replayed", scope = %request.scope, key = %request.key.redacted(), status = response.status);
                    return Begin::Replay(replayed(response));
                }
                ClaimOutcome::InProgress { .. } => {
                    let now = Instant::now();
                    let retry_after = match (policy.in_progress, deadline) {
                        (_, Some(deadline)) if now < deadline => {
                            let wait = poll.min(deadline - now);
                            let changed =
                                self.store().changed(&request.scope, &request.key, wait);
                            match tokio::time::timeout(wait, changed).await {
                                Ok(Err(error)) => return self.store_failed(&request, error),
                                Ok(Ok(())) | Err(_) => {}
                            }
                            poll = (poll * 2).min(Duration::from_millis(200));
                            // A fresh owner for the next attempt: tokens are never reused.
                            request.owner = OwnerToken::random();
                            continue;
                        }
                        (InProgress::Reject { retry_after }, _) => retry_after,
                        (InProgress::Wait { .. }, _) => Duration::from_secs(1),
                    };
                    tracing::info!(target: "idem", outcome = "conflict", scope = %request.scope, key = %request.key.redacted());
                    return Begin::Reject(
                        self.problem(
                            ProblemKind::RequestInProgress,
                            "a request with this idempotency key is still in progress; retry later",
                        )
                        .with_retry_after(retry_after),
                    );
                }
            }
        }
    }

    fn mismatch(&self, request: &ClaimRequest) -> Begin {
        tracing::info!(target: "idem", outcome = "mismatch", scope = %request.scope, key = %request.key.redacted());
        Begin::Reject(self.problem(
            ProblemKind::KeyReused,
            "this idempotency key was already used for a different request",
        ))
    }

    fn store_failed(&self, request: &ClaimRequest, error: StoreError) -> Begin {
        let policy = self.policy();
        match policy.on_store_failure {
            OnStoreFailure::FailOpen => {
                tracing::warn!(target: "idem", outcome = "unguarded", scope = %request.scope, key = %request.key.redacted(), error = %error_chain(&error), "store failed; failing open: the handler runs without idempotency");
                Begin::Unguarded
            }
            OnStoreFailure::FailClosed => {
                tracing::error!(target: "idem", outcome = "store-unavailable", scope = %request.scope, key = %request.key.redacted(), error = %error_chain(&error), "store failed; the handler does not run");
                Begin::Reject(
                    self.problem(
                        ProblemKind::StoreUnavailable,
                        "the idempotency store is unavailable; the request was not executed",
                    )
                    .with_retry_after(policy.store_retry_after),
                )
            }
        }
    }
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("policy", &self.inner.policy)
            .finish_non_exhaustive()
    }
}

impl Execution {
    /// The claim this execution holds.
    pub fn claim(&self) -> &Claim {
        &self.claim
    }

    /// The engine.
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// The largest response body that is kept for replay.
    pub fn stored_body_limit(&self) -> usize {
        self.engine.policy().stored_body_limit_bytes()
    }

    /// Runs `handler` to completion while renewing the lease every third of it, so
    /// a handler slower than the lease is never run twice. The handler need not be
    /// `Send` (actix's are not).
    pub async fn run<F: Future>(&self, handler: F) -> F::Output {
        let lease = self.claim.lease;
        let every = (lease / 3).max(Duration::from_millis(1));
        let mut handler = pin!(handler);
        let mut renewing = true;
        let mut next = Instant::now() + every;
        loop {
            let tick = tokio::time::sleep_until(next);
            tokio::select! {
                biased;
                output = &mut handler => return output,
                () = tick, if renewing => {
                    next = Instant::now() + every;
                    match self.engine.store().renew(&self.claim, lease).await {
                        Ok(()) => {}
                        Err(StoreError::StaleOwner) => {
                            tracing::warn!(target: "idem", outcome = "lease-lost", scope = %self.claim.scope, key = %self.claim.key.redacted(), "the claim was lost while the handler ran; its answer will not be recorded");
                            renewing = false;
                        }
                        Err(error) => {
                            tracing::warn!(target: "idem", scope = %self.claim.scope, key = %self.claim.key.redacted(), error = %error_chain(&error), "lease renewal failed; retrying");
                        }
                    }
                }
            }
        }
    }

    /// Records the handler's answer: completes the record when the policy stores
    /// `response.status`, releases it otherwise (so a retry runs the handler
    /// again). Pass a response with `replayable: false` when its body was over
    /// [`stored_body_limit`](Self::stored_body_limit).
    ///
    /// The client gets the handler's answer whatever this returns; a failure is
    /// logged and returned for the caller's information.
    pub async fn finish(mut self, response: &StoredResponse) -> Result<Finished, StoreError> {
        self.settled = true;
        let engine = self.engine.clone();
        let policy = engine.policy();
        if !policy.stores(response.status) {
            tracing::info!(target: "idem", outcome = "executed", stored = false, status = response.status, scope = %self.claim.scope, key = %self.claim.key.redacted());
            self.release_now().await?;
            return Ok(Finished::Released);
        }
        let mut attempt = 1;
        loop {
            match engine
                .store()
                .complete(&self.claim, response, policy.retention)
                .await
            {
                Ok(()) => {
                    tracing::info!(target: "idem", outcome = "executed", stored = true, replayable = response.replayable, status = response.status, scope = %self.claim.scope, key = %self.claim.key.redacted());
                    return Ok(Finished::Completed);
                }
                Err(StoreError::StaleOwner) => {
                    tracing::warn!(target: "idem", outcome = "executed", stored = false, scope = %self.claim.scope, key = %self.claim.key.redacted(), "completion refused: the claim was lost (lease lapsed) while the handler ran");
                    return Err(StoreError::StaleOwner);
                }
                Err(error) if attempt >= COMPLETE_ATTEMPTS => {
                    tracing::error!(target: "idem", outcome = "executed", stored = false, scope = %self.claim.scope, key = %self.claim.key.redacted(), error = %error_chain(&error), "could not record the answer; a retry after the lease lapses will run the handler again");
                    return Err(error);
                }
                Err(error) => {
                    tracing::warn!(target: "idem", attempt, error = %error_chain(&error), "completion failed; retrying");
                    tokio::time::sleep(Duration::from_millis(20 * u64::from(attempt))).await;
                    attempt += 1;
                }
            }
        }
    }

    /// Releases the claim after the handler panicked or failed, and answers the
    /// problem to send (`500 handler-failed`).
    pub async fn fail(mut self) -> Problem {
        self.settled = true;
        tracing::warn!(target: "idem", outcome = "handler-failed", scope = %self.claim.scope, key = %self.claim.key.redacted(), "the handler failed; claim released");
        if let Err(error) = self.release_now().await {
            tracing::error!(target: "idem", error = %error_chain(&error), "could not release the claim; it will lapse with its lease");
        }
        self.engine.handler_failed()
    }

    async fn release_now(&self) -> Result<(), StoreError> {
        self.engine.store().release(&self.claim).await
    }
}

/// What [`Execution::finish`] did with the answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finished {
    /// The record completed; retries replay the answer.
    Completed,
    /// The status is not stored: the claim was released; a retry runs again.
    Released,
}

impl Drop for Execution {
    fn drop(&mut self) {
        if self.settled {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let store = Arc::clone(self.engine.store());
        let claim = self.claim.clone();
        runtime.spawn(async move {
            if let Err(error) = store.release(&claim).await {
                tracing::warn!(target: "idem", error = %error_chain(&error), "could not release an abandoned claim; it will lapse with its lease");
            }
        });
    }
}

fn replayed(mut response: StoredResponse) -> StoredResponse {
    response
        .headers
        .retain(|h| !h.name.eq_ignore_ascii_case(REPLAYED_HEADER));
    response.headers.push(Header::new(REPLAYED_HEADER, "true"));
    response
}

/// An error and its sources, for logs.
pub(crate) fn error_chain(error: &dyn std::error::Error) -> String {
    let mut out = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        out.push_str(": ");
        out.push_str(&cause.to_string());
        source = cause.source();
    }
    out
}

//! The engine: the one place where the state machine lives, transport-neutral.
//!
//! The HTTP protocol ([`Engine::start`], then
//! [`Keyed::respond`](crate::protocol::Keyed::respond)) and the consumer
//! protocol's [`StoreInbox`](crate::consume::StoreInbox) both drive it; other
//! callers (a job runner) can claim a fingerprinted request themselves with
//! [`Engine::begin`], run it with [`Execution::run`] (the lease keeper,
//! `lease.rs`) and record its answer with [`Execution::settle`] (the
//! completion, deferred when the store is away, `completion.rs`).

use std::any::Any;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use tokio::time::Instant;

mod completion;
mod lease;

use crate::execution::ExecutionInfo;
use crate::metrics;

use crate::store::{Claim, ClaimOutcome, ClaimRequest, ExecutionContext, NotReady, OwnerToken};
use crate::{
    Fingerprint, Header, IdempotencyKey, InProgress, KeyRequirement, OnStoreFailure, Policy,
    Problem, ProblemKind, REPLAYED_HEADER, Scope, Store, StoreError, StoredResponse,
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

/// What [`Engine::begin`] decided.
#[derive(Debug)]
pub enum Begin {
    /// This request holds the claim: run the handler through
    /// [`Execution::run`], then [`Execution::settle`] with its response and send
    /// what the settlement says.
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
/// Dropping an execution without [`settle`](Self::settle) releases the claim in the
/// background (when a Tokio runtime is there to run it), so a retry need not
/// wait for the lease to lapse.
pub struct Execution {
    engine: Engine,
    claim: Claim,
    context: Option<ExecutionContext>,
    lease_lost: Arc<AtomicBool>,
    /// Until when the lease certainly holds (on this process's clock, counted
    /// from before the claim or renewal that set it was sent).
    held_until: std::sync::Mutex<Instant>,
    settled: bool,
}

/// What to send once [`Execution::settle`] has recorded the handler's answer.
#[derive(Debug)]
#[must_use]
pub enum Settlement {
    /// Send the handler's answer. It is recorded, or released (a status that is
    /// not stored), or (a plain store) could not be recorded, which is logged:
    /// the handler's effect happened outside the store, so the client gets the
    /// real answer.
    Deliver,
    /// Send this problem instead of the handler's answer: the store lost the
    /// completion together with the handler's writes (a transactional store's
    /// failed commit), so the answer would report an effect that did not happen.
    /// `503 store-unavailable` with `Retry-After`; the retry with the same key
    /// replays the answer if the commit did happen after all, and runs the
    /// handler again if not.
    Retract(Problem),
}

/// How many times a completion is attempted before the client gets its answer
/// (the completion then goes on in the background while the lease holds).
const COMPLETE_ATTEMPTS: u32 = 3;

impl Engine {
    /// An engine over `store` applying `policy`.
    ///
    /// # Panics
    ///
    /// When the store is not ready; see [`from_shared`](Self::from_shared),
    /// and [`try_new`](Self::try_new) for the refusal as a `Result`.
    pub fn new(store: impl Store, policy: Policy) -> Self {
        Self::from_shared(Arc::new(store), policy)
    }

    /// An engine over a store already shared as `Arc<dyn Store>`.
    ///
    /// # Panics
    ///
    /// When the store is not ready ([`Store::readiness`]): with idem-diesel's
    /// stores, when neither `migrate()` nor `check_schema()` succeeded before
    /// the route was built. The message names the fix; an application builds
    /// its routes at start-up, so a forgotten migration stops the start
    /// instead of answering every keyed request `503`. An application that
    /// would rather handle the refusal itself builds with
    /// [`try_from_shared`](Self::try_from_shared) (each adapter's layer has
    /// `from_engine`).
    pub fn from_shared(store: Arc<dyn Store>, policy: Policy) -> Self {
        match Self::try_from_shared(store, policy) {
            Ok(engine) => engine,
            Err(not_ready) => panic!("idem: {not_ready}"),
        }
    }

    /// [`new`](Self::new), its refusal of a store that is not ready answered
    /// as a `Result` instead of a panic.
    ///
    /// ```
    /// use idem_core::{Engine, MemoryStore, Policy};
    ///
    /// let engine = Engine::try_new(MemoryStore::new(), Policy::required());
    /// assert!(engine.is_ok(), "the in-memory store is always ready");
    /// ```
    pub fn try_new(store: impl Store, policy: Policy) -> Result<Self, NotReady> {
        Self::try_from_shared(Arc::new(store), policy)
    }

    /// [`from_shared`](Self::from_shared), its refusal answered as a `Result`.
    pub fn try_from_shared(store: Arc<dyn Store>, policy: Policy) -> Result<Self, NotReady> {
        store.readiness()?;
        Ok(Self {
            inner: Arc::new(Inner { store, policy }),
        })
    }

    /// The policy.
    pub fn policy(&self) -> &Policy {
        &self.inner.policy
    }

    /// The store.
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.inner.store
    }

    /// Whether every request a handler mounted on `method` behind this
    /// engine sees has a `T` from the store, as a handler that takes a
    /// [`StoreContext<T>`](crate::StoreContext) needs: the store declares that
    /// it hands a `T` ([`Store::execution_context_type`]), keys are required
    /// (a request without one has no execution), the route fails closed (a
    /// failed store runs no handler), and the policy covers `method` (an
    /// uncovered request passes through without a key). The adapters' `on`
    /// asks when the route is built, so a route that cannot hand the handler
    /// its `T` fails the start.
    ///
    /// ```
    /// use idem_core::{ContextRouteError, Engine, MemoryStore, Policy};
    ///
    /// let engine = Engine::new(MemoryStore::new(), Policy::required());
    /// let refused = engine.check_context::<String>("POST").unwrap_err();
    /// assert_eq!(
    ///     refused,
    ///     ContextRouteError::NotHanded { expected: "alloc::string::String", handed: None }
    /// );
    /// ```
    pub fn check_context<T: Any>(&self, method: &str) -> Result<(), crate::ContextRouteError> {
        use crate::ContextRouteError::{FailsOpen, MethodNotCovered, NotHanded, OptionalKeys};
        let expected = std::any::type_name::<T>();
        let policy = self.policy();
        let handed = self.store().execution_context_type();
        if !handed.is_some_and(|handed| handed.is::<T>()) {
            return Err(NotHanded { expected, handed });
        }
        if policy.key_requirement() != KeyRequirement::Required {
            return Err(OptionalKeys { expected });
        }
        if policy.get_on_store_failure() != OnStoreFailure::FailClosed {
            return Err(FailsOpen { expected });
        }
        if !policy.covers(method) {
            return Err(MethodNotCovered {
                expected,
                method: method.to_ascii_uppercase(),
            });
        }
        Ok(())
    }

    /// A problem of `kind` with the status the policy gives it.
    pub(crate) fn problem(&self, kind: ProblemKind, detail: impl Into<String>) -> Problem {
        Problem::new(kind, self.policy().status_of(kind), detail)
    }

    /// Claims the request's record and decides: execute, replay or refuse.
    ///
    /// In wait mode ([`InProgress::Wait`]) a request whose key is in progress
    /// waits here, up to the bound, for the record to complete (then replays it)
    /// or be released (then claims it).
    pub async fn begin(
        &self,
        scope: Scope,
        key: IdempotencyKey,
        fingerprint: Fingerprint,
    ) -> Begin {
        let policy = self.policy();
        let deadline = match policy.get_in_progress() {
            InProgress::Wait { up_to } => Some(Instant::now() + up_to),
            InProgress::Reject { .. } => None,
        };
        let mut poll = Duration::from_millis(5);
        let mut request = ClaimRequest {
            scope,
            key,
            fingerprint,
            owner: OwnerToken::random(),
            lease: policy.get_lease(),
            retention: policy.get_retention(),
        };
        loop {
            let timer = metrics::Timer::start();
            let claimed = self.store().claim(&request).await;
            metrics::store_time("claim", timer);
            let claimed_at = Instant::now();
            let outcome = match claimed {
                Ok(outcome) => outcome,
                Err(error) => return self.store_failed(&request, error),
            };
            match outcome {
                ClaimOutcome::Claimed(claim) => {
                    tracing::debug!(target: "idem", outcome = "claimed", scope = %claim.scope, key = %claim.key.redacted());
                    let context = self.store().execution_context(&claim);
                    return Begin::Execute(Execution {
                        engine: self.clone(),
                        claim,
                        context,
                        lease_lost: Arc::new(AtomicBool::new(false)),
                        held_until: std::sync::Mutex::new(claimed_at + policy.get_lease()),
                        settled: false,
                    });
                }
                ClaimOutcome::Completed { fingerprint, .. }
                    if fingerprint != request.fingerprint =>
                {
                    return self.mismatch(&request);
                }
                ClaimOutcome::InProgress { fingerprint, .. }
                    if fingerprint != request.fingerprint =>
                {
                    return self.mismatch(&request);
                }
                ClaimOutcome::Completed { response, .. } => {
                    if !response.replayable {
                        tracing::info!(target: "idem", outcome = "not-replayable", scope = %request.scope, key = %request.key.redacted());
                        metrics::outcome(metrics::Outcome::NotReplayable);
                        return Begin::Reject(self.problem(
                            ProblemKind::ResponseNotStored,
                            "the request with this key was executed, but its response was too large to store; it is not executed again",
                        ));
                    }
                    tracing::info!(target: "idem", outcome = "replayed", scope = %request.scope, key = %request.key.redacted(), status = response.status);
                    metrics::outcome(metrics::Outcome::Replayed);
                    return Begin::Replay(replayed(response));
                }
                ClaimOutcome::InProgress { .. } => {
                    let now = Instant::now();
                    let retry_after = match (policy.get_in_progress(), deadline) {
                        (_, Some(deadline)) if now < deadline => {
                            let wait = poll.min(deadline - now);
                            let changed = self.store().changed(&request.scope, &request.key, wait);
                            // A timeout only means "look again".
                            if let Ok(Err(error)) = tokio::time::timeout(wait, changed).await {
                                return self.store_failed(&request, error);
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
                    metrics::outcome(metrics::Outcome::Conflict);
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
        metrics::outcome(metrics::Outcome::Mismatch);
        Begin::Reject(self.problem(
            ProblemKind::KeyReused,
            "this idempotency key was already used for a different request",
        ))
    }

    fn store_failed(&self, request: &ClaimRequest, error: StoreError) -> Begin {
        let policy = self.policy();
        match policy.get_on_store_failure() {
            OnStoreFailure::FailOpen => {
                tracing::warn!(target: "idem", outcome = "unguarded", scope = %request.scope, key = %request.key.redacted(), error = %error_chain(&error), "store failed; failing open: the handler runs without idempotency");
                metrics::outcome(metrics::Outcome::Unguarded);
                Begin::Unguarded
            }
            OnStoreFailure::FailClosed => {
                tracing::error!(target: "idem", outcome = "store-unavailable", scope = %request.scope, key = %request.key.redacted(), error = %error_chain(&error), "store failed; the handler does not run");
                metrics::outcome(metrics::Outcome::StoreFailure);
                Begin::Reject(
                    self.problem(
                        ProblemKind::StoreUnavailable,
                        "the idempotency store is unavailable; the request was not executed",
                    )
                    .with_retry_after(policy.get_store_retry_after()),
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

    /// What the store hands the handler (see [`Store::execution_context`]): for
    /// a transactional store, the open transaction that the claim was made in
    /// and that the completion commits. `None` for plain stores.
    pub fn context(&self) -> Option<&ExecutionContext> {
        self.context.as_ref()
    }

    /// What the handler is told about this execution.
    pub fn info(&self) -> ExecutionInfo {
        ExecutionInfo::new(
            self.claim.key.clone(),
            self.claim.scope.clone(),
            true,
            self.context.clone(),
            Arc::clone(&self.lease_lost),
        )
    }

    /// Records the handler's answer and says what to send: the handler's
    /// answer, or (when a transactional store could not commit, so the
    /// handler's writes were rolled back) a `503 store-unavailable` problem with
    /// `Retry-After`.
    ///
    /// The answer is recorded when the policy stores its status (retries replay
    /// it) and released otherwise (a retry runs the handler again). Pass a
    /// response built with [`StoredResponse::without_body`] when its body was
    /// over the stored-body limit. A plain store that fails to record is logged
    /// and the handler's answer is still delivered: its effect happened outside
    /// the store.
    ///
    /// ```
    /// use idem_core::{Begin, Engine, IdempotencyKey, MemoryStore, Policy, Scope, StoredResponse};
    /// # use idem_core::Fingerprint;
    ///
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
    /// let engine = Engine::new(MemoryStore::new(), Policy::required());
    /// let key = IdempotencyKey::new("order-7").unwrap();
    /// # let fingerprint = Fingerprint::from_bytes([1; 32]);
    /// let Begin::Execute(execution) = engine.begin(Scope::new("alice"), key, fingerprint).await else {
    ///     unreachable!("a new key is executed")
    /// };
    /// let response = execution.run(async { StoredResponse::new(201, vec![], "charged") }).await;
    /// let sent = execution.settle(&response).await.answer(response);
    /// assert_eq!(sent.status, 201);
    /// # });
    /// ```
    pub async fn settle(mut self, response: &StoredResponse) -> Settlement {
        match self.record(response).await {
            Err(StoreError::Uncommitted(_)) => {
                let engine = &self.engine;
                Settlement::Retract(
                    engine
                        .problem(
                            ProblemKind::StoreUnavailable,
                            "the request's outcome could not be committed; retry it with the same key",
                        )
                        .with_retry_after(engine.policy().get_store_retry_after()),
                )
            }
            Ok(_) | Err(_) => Settlement::Deliver,
        }
    }

    /// Releases the claim after the handler panicked or failed, so that a retry
    /// runs it again. (Dropping an execution unsettled does the same in the
    /// background.)
    pub async fn release(mut self) {
        self.settled = true;
        tracing::warn!(target: "idem", outcome = "handler-failed", scope = %self.claim.scope, key = %self.claim.key.redacted(), "the handler failed; claim released");
        if let Err(error) = self.release_now().await {
            tracing::error!(target: "idem", error = %error_chain(&error), "could not release the claim; it will lapse with its lease");
        }
    }

    async fn release_now(&self) -> Result<(), StoreError> {
        let timer = metrics::Timer::start();
        let released = self.engine.store().release(&self.claim).await;
        metrics::store_time("release", timer);
        released
    }
}

impl std::fmt::Debug for Execution {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Execution")
            .field("claim", &self.claim)
            .field("context", &self.context.is_some())
            .field("settled", &self.settled)
            .finish_non_exhaustive()
    }
}

impl Settlement {
    /// The answer to send: `response` when delivering, the problem's answer when
    /// retracting.
    pub fn answer(self, response: StoredResponse) -> StoredResponse {
        match self {
            Self::Deliver => response,
            Self::Retract(problem) => problem.to_response(),
        }
    }
}

/// What [`Execution::settle`] did with the answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Recorded {
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

pub(crate) use crate::log::error_chain;

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::store::{Record, StoreFuture};
    use crate::{Fingerprint, IdempotencyKey, MemoryStore, ProblemKind};

    fn fp(n: u8) -> Fingerprint {
        Fingerprint::from_bytes([n; 32])
    }

    fn key(k: &str) -> IdempotencyKey {
        IdempotencyKey::new(k).unwrap()
    }

    fn ok(status: u16, body: &'static str) -> StoredResponse {
        StoredResponse::new(
            status,
            vec![Header::new("x-a", "1"), Header::new("x-a", "2")],
            body,
        )
    }

    fn expect_execute(begin: Begin) -> Execution {
        match begin {
            Begin::Execute(e) => e,
            other => panic!("expected Execute, got {other:?}"),
        }
    }

    fn expect_problem(begin: Begin) -> Problem {
        match begin {
            Begin::Reject(p) => p,
            other => panic!("expected Reject, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn completed_request_replays_with_marker_header() {
        let engine = Engine::new(MemoryStore::new(), Policy::required());
        let scope = Scope::new("s");
        let exec = expect_execute(engine.begin(scope.clone(), key("k"), fp(1)).await);
        assert_eq!(
            finish(exec, &ok(201, "made")).await.unwrap(),
            Recorded::Completed
        );

        let Begin::Replay(replay) = engine.begin(scope, key("k"), fp(1)).await else {
            panic!("expected a replay")
        };
        assert_eq!(replay.status, 201);
        assert_eq!(&replay.body[..], b"made");
        let names: Vec<_> = replay
            .headers
            .iter()
            .map(|h| (&*h.name, &h.value[..]))
            .collect();
        assert_eq!(
            names,
            vec![
                ("x-a", &b"1"[..]),
                ("x-a", &b"2"[..]),
                ("idempotent-replayed", &b"true"[..])
            ]
        );
    }

    #[tokio::test]
    async fn different_fingerprint_is_key_reused_in_both_states() {
        let engine = Engine::new(MemoryStore::new(), Policy::required());
        let scope = Scope::new("s");
        let exec = expect_execute(engine.begin(scope.clone(), key("k"), fp(1)).await);
        let p = expect_problem(engine.begin(scope.clone(), key("k"), fp(2)).await);
        assert_eq!((p.kind, p.status), (ProblemKind::KeyReused, 422));
        finish(exec, &ok(200, "")).await.unwrap();
        let p = expect_problem(engine.begin(scope, key("k"), fp(2)).await);
        assert_eq!((p.kind, p.status), (ProblemKind::KeyReused, 422));
    }

    #[tokio::test]
    async fn in_progress_is_conflict_with_retry_after() {
        let engine = Engine::new(MemoryStore::new(), Policy::required());
        let scope = Scope::new("s");
        let _exec = expect_execute(engine.begin(scope.clone(), key("k"), fp(1)).await);
        let p = expect_problem(engine.begin(scope, key("k"), fp(1)).await);
        assert_eq!((p.kind, p.status), (ProblemKind::RequestInProgress, 409));
        assert_eq!(p.retry_after, Some(Duration::from_secs(1)));
    }

    #[tokio::test]
    async fn released_statuses_let_the_retry_run_again() {
        let engine = Engine::new(MemoryStore::new(), Policy::required());
        let scope = Scope::new("s");
        for status in [500, 503, 408, 425, 429] {
            let k = key(&format!("k{status}"));
            let exec = expect_execute(engine.begin(scope.clone(), k.clone(), fp(1)).await);
            assert_eq!(
                finish(exec, &ok(status, "")).await.unwrap(),
                Recorded::Released
            );
            expect_execute(engine.begin(scope.clone(), k, fp(1)).await);
        }
    }

    #[tokio::test]
    async fn failed_and_dropped_executions_release_their_claim() {
        let engine = Engine::new(MemoryStore::new(), Policy::required());
        let scope = Scope::new("s");
        let exec = expect_execute(engine.begin(scope.clone(), key("a"), fp(1)).await);
        exec.release().await;
        expect_execute(engine.begin(scope.clone(), key("a"), fp(1)).await);

        drop(expect_execute(
            engine.begin(scope.clone(), key("b"), fp(1)).await,
        ));
        // The release runs on a spawned task; give it a turn.
        for _ in 0..100 {
            tokio::task::yield_now().await;
            if engine
                .store()
                .load(&scope, &key("b"))
                .await
                .unwrap()
                .is_none()
            {
                break;
            }
        }
        expect_execute(engine.begin(scope, key("b"), fp(1)).await);
    }

    #[tokio::test]
    async fn unreplayable_response_answers_response_not_stored() {
        let engine = Engine::new(MemoryStore::new(), Policy::required());
        let scope = Scope::new("s");
        let exec = expect_execute(engine.begin(scope.clone(), key("k"), fp(1)).await);
        finish(exec, &StoredResponse::without_body(200, vec![]))
            .await
            .unwrap();
        let p = expect_problem(engine.begin(scope, key("k"), fp(1)).await);
        assert_eq!((p.kind, p.status), (ProblemKind::ResponseNotStored, 410));
    }

    #[tokio::test(start_paused = true)]
    async fn wait_mode_replays_once_the_first_request_completes() {
        let policy = Policy::required().in_progress(InProgress::Wait {
            up_to: Duration::from_secs(5),
        });
        let engine = Engine::new(MemoryStore::new(), policy);
        let scope = Scope::new("s");
        let exec = expect_execute(engine.begin(scope.clone(), key("k"), fp(1)).await);
        let waiter = tokio::spawn({
            let engine = engine.clone();
            let scope = scope.clone();
            async move { engine.begin(scope, key("k"), fp(1)).await }
        });
        tokio::time::sleep(Duration::from_millis(700)).await;
        finish(exec, &ok(201, "done")).await.unwrap();
        match waiter.await.unwrap() {
            Begin::Replay(r) => assert_eq!(&r.body[..], b"done"),
            other => panic!("expected a replay, got {other:?}"),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn wait_mode_gives_up_with_conflict_after_its_bound() {
        let policy = Policy::required().in_progress(InProgress::Wait {
            up_to: Duration::from_millis(300),
        });
        let engine = Engine::new(MemoryStore::new(), policy);
        let scope = Scope::new("s");
        let _exec = expect_execute(engine.begin(scope.clone(), key("k"), fp(1)).await);
        let p = expect_problem(engine.begin(scope, key("k"), fp(1)).await);
        assert_eq!((p.kind, p.status), (ProblemKind::RequestInProgress, 409));
        assert_eq!(p.retry_after, Some(Duration::from_secs(1)));
    }

    #[tokio::test(start_paused = true)]
    async fn lease_is_renewed_while_a_slow_handler_runs() {
        let policy = Policy::required().lease(Duration::from_millis(300));
        let engine = Engine::new(MemoryStore::new(), policy);
        let scope = Scope::new("s");
        let exec = expect_execute(engine.begin(scope.clone(), key("k"), fp(1)).await);
        let probe = tokio::spawn({
            let engine = engine.clone();
            let scope = scope.clone();
            async move {
                // Well past the lease: without renewal this would claim the record.
                tokio::time::sleep(Duration::from_millis(1_000)).await;
                engine.begin(scope, key("k"), fp(1)).await
            }
        });
        let out = exec
            .run(async {
                tokio::time::sleep(Duration::from_millis(2_000)).await;
                7
            })
            .await;
        assert_eq!(out, 7);
        let p = expect_problem(probe.await.unwrap());
        assert_eq!(p.kind, ProblemKind::RequestInProgress);
        assert_eq!(
            finish(exec, &ok(200, "")).await.unwrap(),
            Recorded::Completed
        );
    }

    /// A store whose first `failures` renewals fail, then behaves.
    struct StumblingRenewals {
        memory: MemoryStore,
        failures: std::sync::atomic::AtomicU32,
    }

    impl crate::store::StoreLayer for StumblingRenewals {
        fn inner(&self) -> &dyn Store {
            &self.memory
        }
        fn renew<'a>(&'a self, claim: &'a Claim, lease: Duration) -> StoreFuture<'a, ()> {
            let left = self.failures.load(std::sync::atomic::Ordering::SeqCst);
            if left > 0 {
                self.failures
                    .store(left - 1, std::sync::atomic::Ordering::SeqCst);
                return Box::pin(async { Err(StoreError::unavailable(Refused)) });
            }
            self.memory.renew(claim, lease)
        }
    }

    /// The issue's reproduction: two failed renewals in a row, the default
    /// lease, a 90 s handler, a duplicate waiting from 15 s: one execution.
    #[tokio::test(start_paused = true)]
    async fn two_failed_renewals_in_a_row_do_not_run_the_handler_twice() {
        let store = Arc::new(StumblingRenewals {
            memory: MemoryStore::new(),
            failures: std::sync::atomic::AtomicU32::new(2),
        });
        let policy = Policy::required().in_progress(InProgress::Wait {
            up_to: Duration::from_secs(120),
        });
        let engine = Engine::from_shared(store, policy);
        let runs = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let attempt = |engine: Engine, runs: Arc<std::sync::atomic::AtomicU32>| async move {
            match engine.begin(Scope::new("s"), key("k"), fp(1)).await {
                Begin::Execute(execution) => {
                    runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    let response = execution
                        .run(async {
                            tokio::time::sleep(Duration::from_secs(90)).await;
                            ok(201, "once")
                        })
                        .await;
                    let _ = execution.settle(&response).await;
                    response
                }
                Begin::Replay(response) => response,
                other => panic!("unexpected {other:?}"),
            }
        };
        let first = tokio::spawn(attempt(engine.clone(), Arc::clone(&runs)));
        tokio::time::sleep(Duration::from_secs(15)).await;
        let duplicate = tokio::spawn(attempt(engine, Arc::clone(&runs)));
        let (first, duplicate) = (first.await.unwrap(), duplicate.await.unwrap());
        assert_eq!(
            runs.load(std::sync::atomic::Ordering::SeqCst),
            1,
            "one execution"
        );
        assert_eq!(first.body, duplicate.body);
    }

    struct FailingStore;

    #[derive(Debug, thiserror::Error)]
    #[error("connection refused")]
    struct Refused;

    impl Store for FailingStore {
        fn claim<'a>(&'a self, _: &'a ClaimRequest) -> StoreFuture<'a, ClaimOutcome> {
            Box::pin(async { Err(StoreError::unavailable(Refused)) })
        }
        fn renew<'a>(&'a self, _: &'a Claim, _: Duration) -> StoreFuture<'a, ()> {
            Box::pin(async { Err(StoreError::unavailable(Refused)) })
        }
        fn complete<'a>(
            &'a self,
            _: &'a Claim,
            _: &'a StoredResponse,
            _: Duration,
        ) -> StoreFuture<'a, ()> {
            Box::pin(async { Err(StoreError::unavailable(Refused)) })
        }
        fn release<'a>(&'a self, _: &'a Claim) -> StoreFuture<'a, ()> {
            Box::pin(async { Err(StoreError::unavailable(Refused)) })
        }
        fn load<'a>(
            &'a self,
            _: &'a Scope,
            _: &'a IdempotencyKey,
        ) -> StoreFuture<'a, Option<Record>> {
            Box::pin(async { Err(StoreError::unavailable(Refused)) })
        }
        fn delete_expired(&self, _: usize) -> StoreFuture<'_, u64> {
            Box::pin(async { Err(StoreError::unavailable(Refused)) })
        }
    }

    /// A store whose claims come with a context, standing in for a transactional
    /// store: its completions fail as told, and it counts them.
    struct TransactionalFake {
        memory: MemoryStore,
        completion: fn() -> Result<(), StoreError>,
        completions: std::sync::atomic::AtomicU32,
    }

    /// The context the fake hands out: the claim's owner, so that a test can tell
    /// it is the claim's own.
    #[derive(Debug, PartialEq)]
    struct FakeTransaction(OwnerToken);

    impl TransactionalFake {
        fn new(completion: fn() -> Result<(), StoreError>) -> Arc<Self> {
            Arc::new(Self {
                memory: MemoryStore::new(),
                completion,
                completions: std::sync::atomic::AtomicU32::new(0),
            })
        }

        fn completions(&self) -> u32 {
            self.completions.load(std::sync::atomic::Ordering::SeqCst)
        }
    }

    impl crate::store::StoreLayer for TransactionalFake {
        fn inner(&self) -> &dyn Store {
            &self.memory
        }
        fn complete<'a>(
            &'a self,
            claim: &'a Claim,
            response: &'a StoredResponse,
            retention: Duration,
        ) -> StoreFuture<'a, ()> {
            Box::pin(async move {
                self.completions
                    .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                match (self.completion)() {
                    Ok(()) => self.memory.complete(claim, response, retention).await,
                    Err(error @ StoreError::Uncommitted(_)) => {
                        // Like a rolled-back transaction: the claim is gone too.
                        self.memory.release(claim).await?;
                        Err(error)
                    }
                    Err(error) => Err(error),
                }
            })
        }
        fn execution_context(&self, claim: &Claim) -> Option<ExecutionContext> {
            Some(Arc::new(FakeTransaction(claim.owner)))
        }
    }

    #[tokio::test]
    async fn the_stores_context_reaches_the_execution() {
        let store = TransactionalFake::new(|| Ok(()));
        let engine = Engine::from_shared(store, Policy::required());
        let exec = expect_execute(engine.begin(Scope::new("s"), key("k"), fp(1)).await);
        let context = exec.context().expect("a context").clone();
        let transaction = context
            .downcast::<FakeTransaction>()
            .expect("the store's type");
        assert_eq!(*transaction, FakeTransaction(exec.claim().owner));

        let plain = Engine::new(MemoryStore::new(), Policy::required());
        let exec = expect_execute(plain.begin(Scope::new("s"), key("k"), fp(1)).await);
        assert!(exec.context().is_none(), "plain stores hand out nothing");
    }

    #[tokio::test]
    async fn settle_delivers_what_was_completed_or_released() {
        let store = TransactionalFake::new(|| Ok(()));
        let engine = Engine::from_shared(store.clone(), Policy::required());
        let scope = Scope::new("s");
        let exec = expect_execute(engine.begin(scope.clone(), key("a"), fp(1)).await);
        let settlement = exec.settle(&ok(201, "made")).await;
        assert!(matches!(settlement, Settlement::Deliver), "{settlement:?}");
        assert_eq!(settlement.answer(ok(201, "made")), ok(201, "made"));
        assert!(matches!(
            engine.begin(scope.clone(), key("a"), fp(1)).await,
            Begin::Replay(_)
        ));

        let exec = expect_execute(engine.begin(scope.clone(), key("b"), fp(1)).await);
        let settlement = exec.settle(&ok(503, "later")).await;
        assert!(matches!(settlement, Settlement::Deliver), "{settlement:?}");
        assert_eq!(store.completions(), 1, "a released status is not completed");
        expect_execute(engine.begin(scope, key("b"), fp(1)).await);
    }

    #[tokio::test]
    async fn an_uncommitted_completion_is_retracted_with_503_and_not_retried() {
        let store = TransactionalFake::new(|| Err(StoreError::uncommitted(Refused)));
        let engine = Engine::from_shared(store.clone(), Policy::required());
        let scope = Scope::new("s");
        let exec = expect_execute(engine.begin(scope.clone(), key("k"), fp(1)).await);
        let Settlement::Retract(problem) = exec.settle(&ok(201, "made")).await else {
            panic!("an uncommitted completion must not deliver the handler's answer")
        };
        assert_eq!(
            (problem.kind, problem.status, problem.retry_after),
            (
                ProblemKind::StoreUnavailable,
                503,
                Some(Duration::from_secs(5))
            )
        );
        assert!(
            !problem.detail.contains("refused"),
            "nothing internal leaks"
        );
        let sent = Settlement::Retract(problem).answer(ok(201, "made"));
        assert_eq!(sent.status, 503);
        assert_eq!(sent.header_values("retry-after").next(), Some(&b"5"[..]));
        assert_eq!(store.completions(), 1, "a lost transaction is not retried");
        // The retry runs the handler again.
        expect_execute(engine.begin(scope, key("k"), fp(1)).await);
    }

    #[tokio::test(start_paused = true)]
    async fn a_plain_store_failure_still_delivers_the_handlers_answer() {
        let store = TransactionalFake::new(|| Err(StoreError::unavailable(Refused)));
        let engine = Engine::from_shared(store.clone(), Policy::required());
        let started = Instant::now();
        let exec = expect_execute(engine.begin(Scope::new("s"), key("k"), fp(1)).await);
        let settlement = exec.settle(&ok(201, "made")).await;
        assert!(matches!(settlement, Settlement::Deliver), "{settlement:?}");
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "the client is not kept waiting"
        );
        assert_eq!(store.completions(), COMPLETE_ATTEMPTS);
        // The completion goes on in the background while the lease (30 s)
        // holds, then stops.
        tokio::time::sleep(Duration::from_secs(20)).await;
        let attempts = store.completions();
        assert!(attempts > COMPLETE_ATTEMPTS + 15, "{attempts} attempts");
        tokio::time::sleep(Duration::from_secs(20)).await;
        let attempts = store.completions();
        tokio::time::sleep(Duration::from_secs(30)).await;
        assert_eq!(
            store.completions(),
            attempts,
            "given up once the lease ran out"
        );
    }

    #[tokio::test]
    async fn store_failure_fails_closed_by_default_and_open_on_request() {
        let engine = Engine::new(FailingStore, Policy::required());
        let p = expect_problem(engine.begin(Scope::new("s"), key("k"), fp(1)).await);
        assert_eq!((p.kind, p.status), (ProblemKind::StoreUnavailable, 503));
        assert_eq!(p.retry_after, Some(Duration::from_secs(5)));
        assert!(
            !p.detail.contains("refused"),
            "the answer leaks nothing internal"
        );

        let engine = Engine::new(
            FailingStore,
            Policy::required().on_store_failure(OnStoreFailure::FailOpen),
        );
        assert!(matches!(
            engine.begin(Scope::new("s"), key("k"), fp(1)).await,
            Begin::Unguarded
        ));
    }

    /// A test's way to record an answer and see what was done with it.
    async fn finish(
        mut execution: Execution,
        response: &StoredResponse,
    ) -> Result<Recorded, StoreError> {
        execution.record(response).await
    }
}

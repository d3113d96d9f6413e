//! What a route does with idempotency keys: the policy an adapter applies.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::{FingerprintSpec, ProblemKind};

/// How a route treats idempotency keys. Built with consuming setters from
/// [`Policy::required`] or [`Policy::optional`]; every default is the one the
/// behaviour specification (`docs/contract.md`) names.
///
/// ```
/// use std::time::Duration;
/// use idem_core::{InProgress, Policy};
///
/// let policy = Policy::required()
///     .lease(Duration::from_secs(10))
///     .retention(Duration::from_secs(3600))
///     .in_progress(InProgress::Wait { up_to: Duration::from_secs(5) });
/// assert!(policy.covers("POST"));
/// assert!(!policy.covers("GET"));
/// ```
#[derive(Clone, Debug)]
#[must_use]
pub struct Policy {
    pub(crate) requirement: KeyRequirement,
    pub(crate) methods: Vec<String>,
    pub(crate) stored: StatusFilter,
    pub(crate) request_body_limit: usize,
    pub(crate) request_body_timeout: Duration,
    pub(crate) stored_body_limit: usize,
    pub(crate) lease: Duration,
    pub(crate) retention: Duration,
    pub(crate) in_progress: InProgress,
    pub(crate) on_store_failure: OnStoreFailure,
    pub(crate) store_retry_after: Duration,
    pub(crate) statuses: ProblemStatuses,
    pub(crate) fingerprint: FingerprintSpec,
}

/// Whether a request without a key is refused or passed through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyRequirement {
    /// Missing key: `400 missing-key`.
    Required,
    /// Missing key: the request passes through untouched.
    Optional,
}

/// What a request does when the first request with its key is still running.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum InProgress {
    /// Answer `409 request-in-progress` at once, with `Retry-After`.
    Reject {
        /// The `Retry-After` sent.
        retry_after: Duration,
    },
    /// Wait up to `up_to` for the first request to complete and replay its answer;
    /// past the bound, answer `409` as `Reject` does (with a one-second
    /// `Retry-After`).
    Wait {
        /// How long to wait at most.
        up_to: Duration,
    },
}

/// What happens when the store fails.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum OnStoreFailure {
    /// Answer `503 store-unavailable` and do not run the handler. The default.
    FailClosed,
    /// Run the handler without idempotency (logged as a warning). Only for routes
    /// whose effect is harmless to repeat.
    FailOpen,
}

/// Which statuses are stored and replayed; the others release the claim so that a
/// retry runs the handler again.
#[derive(Clone)]
pub struct StatusFilter(Arc<dyn Fn(u16) -> bool + Send + Sync>);

/// The status code of each problem answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProblemStatuses {
    /// `missing-key`, default 400.
    pub missing_key: u16,
    /// `invalid-key`, default 400.
    pub invalid_key: u16,
    /// `key-reused`, default 422.
    pub key_reused: u16,
    /// `request-in-progress`, default 409.
    pub request_in_progress: u16,
    /// `payload-too-large`, default 413.
    pub payload_too_large: u16,
    /// `body-unreadable`, default 400.
    pub body_unreadable: u16,
    /// `body-timeout`, default 408.
    pub body_timeout: u16,
    /// `store-unavailable`, default 503.
    pub store_unavailable: u16,
    /// `response-not-stored`, default 410.
    pub response_not_stored: u16,
    /// `handler-failed`, default 500.
    pub handler_failed: u16,
    /// `scope-unavailable`, default 500.
    pub scope_unavailable: u16,
}

impl Default for ProblemStatuses {
    fn default() -> Self {
        Self {
            missing_key: 400,
            invalid_key: 400,
            key_reused: 422,
            request_in_progress: 409,
            payload_too_large: 413,
            body_unreadable: 400,
            body_timeout: 408,
            store_unavailable: 503,
            response_not_stored: 410,
            handler_failed: 500,
            scope_unavailable: 500,
        }
    }
}

impl ProblemStatuses {
    /// The status configured for `kind`.
    pub fn of(&self, kind: ProblemKind) -> u16 {
        match kind {
            ProblemKind::MissingKey => self.missing_key,
            ProblemKind::InvalidKey => self.invalid_key,
            ProblemKind::KeyReused => self.key_reused,
            ProblemKind::RequestInProgress => self.request_in_progress,
            ProblemKind::PayloadTooLarge => self.payload_too_large,
            ProblemKind::StoreUnavailable => self.store_unavailable,
            ProblemKind::ResponseNotStored => self.response_not_stored,
            ProblemKind::HandlerFailed => self.handler_failed,
            ProblemKind::ScopeUnavailable => self.scope_unavailable,
            ProblemKind::BodyUnreadable => self.body_unreadable,
            ProblemKind::BodyTimeout => self.body_timeout,
        }
    }
}

impl StatusFilter {
    /// `docs/contract.md` §5: every status below 500 except 408, 425 and 429.
    pub fn contract() -> Self {
        Self(Arc::new(|status| {
            status < 500 && !matches!(status, 408 | 425 | 429)
        }))
    }

    /// A filter of the application's own.
    pub fn new(stored: impl Fn(u16) -> bool + Send + Sync + 'static) -> Self {
        Self(Arc::new(stored))
    }

    /// Whether an answer with `status` is stored.
    pub fn stores(&self, status: u16) -> bool {
        (self.0)(status)
    }
}

impl fmt::Debug for StatusFilter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("StatusFilter(..)")
    }
}

/// 1 MiB.
const MIB: usize = 1024 * 1024;

impl Policy {
    /// Keys are required: a covered request without one is answered `400`.
    pub fn required() -> Self {
        Self::with_requirement(KeyRequirement::Required)
    }

    /// Keys are optional: a request without one passes through untouched.
    pub fn optional() -> Self {
        Self::with_requirement(KeyRequirement::Optional)
    }

    fn with_requirement(requirement: KeyRequirement) -> Self {
        Self {
            requirement,
            methods: vec!["POST".into(), "PATCH".into()],
            stored: StatusFilter::contract(),
            request_body_limit: MIB,
            request_body_timeout: Duration::from_secs(30),
            stored_body_limit: MIB,
            lease: Duration::from_secs(30),
            retention: Duration::from_secs(24 * 60 * 60),
            in_progress: InProgress::Reject {
                retry_after: Duration::from_secs(1),
            },
            on_store_failure: OnStoreFailure::FailClosed,
            store_retry_after: Duration::from_secs(5),
            statuses: ProblemStatuses::default(),
            fingerprint: FingerprintSpec::default(),
        }
    }

    /// Changes whether keys are required.
    pub fn requirement(mut self, requirement: KeyRequirement) -> Self {
        self.requirement = requirement;
        self
    }

    /// The methods covered (default POST and PATCH); others pass through.
    pub fn methods<I, M>(mut self, methods: I) -> Self
    where
        I: IntoIterator<Item = M>,
        M: AsRef<str>,
    {
        self.methods = methods
            .into_iter()
            .map(|m| m.as_ref().to_ascii_uppercase())
            .collect();
        self
    }

    /// Which statuses are stored (default: `docs/contract.md` §5).
    pub fn stored_statuses(mut self, filter: StatusFilter) -> Self {
        self.stored = filter;
        self
    }

    /// The largest request body accepted (default 1 MiB); over it, `413`.
    pub fn request_body_limit(mut self, bytes: usize) -> Self {
        self.request_body_limit = bytes;
        self
    }

    /// How long a keyed request's body may take to arrive once it is awaited
    /// (default 30 s); past it, `408 body-timeout`, nothing claimed. A body
    /// that stalls (a client that stops sending) cannot hold its connection
    /// open for longer. The clock starts when the body is first not ready, so
    /// a body that has already arrived costs no timer.
    pub fn request_body_timeout(mut self, timeout: Duration) -> Self {
        self.request_body_timeout = timeout;
        self
    }

    /// The largest response body kept for replay (default 1 MiB).
    pub fn stored_body_limit(mut self, bytes: usize) -> Self {
        self.stored_body_limit = bytes;
        self
    }

    /// How long a claim holds without renewal (default 30 s). The lease is renewed
    /// every quarter of it while the handler runs.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// How long completed records are kept (default 24 h).
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// What a request does while another with its key runs (default: `409` with
    /// a one-second `Retry-After`).
    pub fn in_progress(mut self, behaviour: InProgress) -> Self {
        self.in_progress = behaviour;
        self
    }

    /// Fail closed (default) or open when the store fails.
    pub fn on_store_failure(mut self, mode: OnStoreFailure) -> Self {
        self.on_store_failure = mode;
        self
    }

    /// The `Retry-After` of `503 store-unavailable` (default 5 s).
    pub fn store_retry_after(mut self, after: Duration) -> Self {
        self.store_retry_after = after;
        self
    }

    /// The status code of each problem answer.
    pub fn problem_statuses(mut self, statuses: ProblemStatuses) -> Self {
        self.statuses = statuses;
        self
    }

    /// What the fingerprint covers.
    pub fn fingerprint(mut self, spec: FingerprintSpec) -> Self {
        self.fingerprint = spec;
        self
    }

    /// Whether requests with `method` are covered.
    pub fn covers(&self, method: &str) -> bool {
        self.methods.iter().any(|m| m.eq_ignore_ascii_case(method))
    }

    /// Whether keys are required.
    pub fn key_requirement(&self) -> KeyRequirement {
        self.requirement
    }

    /// The request body limit.
    pub fn request_body_limit_bytes(&self) -> usize {
        self.request_body_limit
    }

    /// The request body's read deadline.
    pub fn request_body_timeout_duration(&self) -> Duration {
        self.request_body_timeout
    }

    /// The stored-body limit.
    pub fn stored_body_limit_bytes(&self) -> usize {
        self.stored_body_limit
    }

    /// The fingerprint spec.
    pub fn fingerprint_spec(&self) -> &FingerprintSpec {
        &self.fingerprint
    }

    /// The lease.
    pub fn lease_duration(&self) -> Duration {
        self.lease
    }

    /// The retention.
    pub fn retention_duration(&self) -> Duration {
        self.retention
    }

    /// Whether a response with `status` is stored.
    pub fn stores(&self, status: u16) -> bool {
        self.stored.stores(status)
    }

    /// The status configured for a problem of `kind`.
    pub fn status_of(&self, kind: ProblemKind) -> u16 {
        self.statuses.of(kind)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn contract_statuses_are_stored_and_released() {
        let policy = Policy::required();
        for stored in [200, 201, 204, 301, 400, 404, 409, 422, 499] {
            assert!(policy.stores(stored), "{stored} should be stored");
        }
        for released in [408, 425, 429, 500, 502, 503, 599] {
            assert!(!policy.stores(released), "{released} should be released");
        }
    }

    #[test]
    fn methods_are_case_insensitive() {
        let policy = Policy::optional().methods(["put", "Delete"]);
        assert!(policy.covers("PUT"));
        assert!(policy.covers("delete"));
        assert!(!policy.covers("POST"));
    }
}

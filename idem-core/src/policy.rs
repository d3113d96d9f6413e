//! What a route does with idempotency keys: the policy an adapter applies.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::{FingerprintSpec, ProblemKind};

/// The methods HTTP does not make idempotent, which a key protects: those a
/// [`Policy`] covers by default, and those a client mints a key for
/// (idem-client).
pub const KEYED_METHODS: &[&str] = &["POST", "PATCH"];

/// How a route treats idempotency keys. Built from [`Policy::required`] or
/// [`Policy::optional`] (the one choice every route makes); every default is
/// the one the behaviour specification (`docs/contract.md`) names.
///
/// Each setting is set by the method named for it, which consumes and returns
/// the policy (`policy.lease(d)`), and read by `get_` and the same name
/// (`policy.get_lease()`); [`covers`](Self::covers), [`stores`](Self::stores)
/// and [`status_of`](Self::status_of) are questions asked of the settings.
///
/// ```
/// use std::time::Duration;
/// use idem_core::{InProgress, KeyRequirement, Policy};
///
/// let policy = Policy::required()
///     .lease(Duration::from_secs(10))
///     .retention(Duration::from_secs(3600))
///     .in_progress(InProgress::Wait { up_to: Duration::from_secs(5) });
/// assert_eq!(policy.get_lease(), Duration::from_secs(10));
/// assert_eq!(policy.key_requirement(), KeyRequirement::Required);
/// assert!(policy.covers("POST"));
/// assert!(!policy.covers("GET"));
/// ```
#[derive(Clone, Debug)]
#[must_use]
pub struct Policy {
    key_requirement: KeyRequirement,
    methods: Vec<String>,
    stored_statuses: StatusFilter,
    request_body_limit: usize,
    request_body_timeout: Duration,
    stored_body_limit: usize,
    lease: Duration,
    retention: Duration,
    in_progress: InProgress,
    on_store_failure: OnStoreFailure,
    store_retry_after: Duration,
    problem_statuses: ProblemStatuses,
    fingerprint: FingerprintSpec,
}

/// Whether a request without a key is refused or passed through: chosen by
/// [`Policy::required`] or [`Policy::optional`], read by
/// [`Policy::key_requirement`].
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

/// The status code of each problem answer: one field per [`ProblemKind`], set
/// by [`status`](Self::status) and read by [`get_status`](Self::get_status) (or
/// the field). More fields come with more kinds, so it is built from
/// [`ProblemStatuses::default`], not by a struct literal.
///
/// ```
/// use idem_core::{Policy, ProblemKind, ProblemStatuses};
///
/// let statuses = ProblemStatuses::default().status(ProblemKind::KeyReused, 409);
/// assert_eq!(statuses.get_status(ProblemKind::KeyReused), 409);
/// assert_eq!(statuses.key_reused, 409);
/// let policy = Policy::required().problem_statuses(statuses);
/// assert_eq!(policy.status_of(ProblemKind::KeyReused), 409);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
#[must_use]
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
    /// Answers problems of `kind` with `status`. `route-misconfigured` is
    /// always `500` (idem's extractors answer it, past the layer): setting it
    /// changes nothing.
    pub fn status(mut self, kind: ProblemKind, status: u16) -> Self {
        if let Some(slot) = self.slot(kind) {
            *slot = status;
        }
        self
    }

    /// The status configured for `kind`.
    pub fn get_status(&self, kind: ProblemKind) -> u16 {
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
            ProblemKind::RouteMisconfigured => 500,
        }
    }

    fn slot(&mut self, kind: ProblemKind) -> Option<&mut u16> {
        Some(match kind {
            ProblemKind::MissingKey => &mut self.missing_key,
            ProblemKind::InvalidKey => &mut self.invalid_key,
            ProblemKind::KeyReused => &mut self.key_reused,
            ProblemKind::RequestInProgress => &mut self.request_in_progress,
            ProblemKind::PayloadTooLarge => &mut self.payload_too_large,
            ProblemKind::StoreUnavailable => &mut self.store_unavailable,
            ProblemKind::ResponseNotStored => &mut self.response_not_stored,
            ProblemKind::HandlerFailed => &mut self.handler_failed,
            ProblemKind::ScopeUnavailable => &mut self.scope_unavailable,
            ProblemKind::BodyUnreadable => &mut self.body_unreadable,
            ProblemKind::BodyTimeout => &mut self.body_timeout,
            ProblemKind::RouteMisconfigured => return None,
        })
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

    fn with_requirement(key_requirement: KeyRequirement) -> Self {
        Self {
            key_requirement,
            methods: KEYED_METHODS.iter().map(|&m| m.to_owned()).collect(),
            stored_statuses: StatusFilter::contract(),
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
            problem_statuses: ProblemStatuses::default(),
            fingerprint: FingerprintSpec::default(),
        }
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
        self.stored_statuses = filter;
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
        self.problem_statuses = statuses;
        self
    }

    /// What the fingerprint covers.
    pub fn fingerprint(mut self, spec: FingerprintSpec) -> Self {
        self.fingerprint = spec;
        self
    }

    /// Whether keys are required ([`Policy::required`]) or optional
    /// ([`Policy::optional`]).
    pub fn key_requirement(&self) -> KeyRequirement {
        self.key_requirement
    }

    /// The methods covered, upper-case.
    pub fn get_methods(&self) -> &[String] {
        &self.methods
    }

    /// Which statuses are stored; [`stores`](Self::stores) asks it.
    pub fn get_stored_statuses(&self) -> &StatusFilter {
        &self.stored_statuses
    }

    /// The largest request body accepted, in bytes.
    pub fn get_request_body_limit(&self) -> usize {
        self.request_body_limit
    }

    /// The request body's read deadline.
    pub fn get_request_body_timeout(&self) -> Duration {
        self.request_body_timeout
    }

    /// The largest response body kept for replay, in bytes.
    pub fn get_stored_body_limit(&self) -> usize {
        self.stored_body_limit
    }

    /// How long a claim holds without renewal.
    pub fn get_lease(&self) -> Duration {
        self.lease
    }

    /// How long completed records are kept.
    pub fn get_retention(&self) -> Duration {
        self.retention
    }

    /// What a request does while another with its key runs.
    pub fn get_in_progress(&self) -> InProgress {
        self.in_progress
    }

    /// Whether the route fails closed or open when the store fails.
    pub fn get_on_store_failure(&self) -> OnStoreFailure {
        self.on_store_failure
    }

    /// The `Retry-After` of `503 store-unavailable`.
    pub fn get_store_retry_after(&self) -> Duration {
        self.store_retry_after
    }

    /// The status code of each problem answer; [`status_of`](Self::status_of)
    /// asks it.
    pub fn get_problem_statuses(&self) -> &ProblemStatuses {
        &self.problem_statuses
    }

    /// What the fingerprint covers.
    pub fn get_fingerprint(&self) -> &FingerprintSpec {
        &self.fingerprint
    }

    /// Whether requests with `method` are covered.
    pub fn covers(&self, method: &str) -> bool {
        self.methods.iter().any(|m| m.eq_ignore_ascii_case(method))
    }

    /// Whether a response with `status` is stored.
    pub fn stores(&self, status: u16) -> bool {
        self.stored_statuses.stores(status)
    }

    /// The status configured for a problem of `kind`.
    pub fn status_of(&self, kind: ProblemKind) -> u16 {
        self.problem_statuses.get_status(kind)
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
    fn each_problem_status_is_set_and_read_by_its_kind() {
        for kind in ProblemKind::ALL {
            let statuses = ProblemStatuses::default().status(kind, 599);
            let set = if kind == ProblemKind::RouteMisconfigured {
                500
            } else {
                599
            };
            assert_eq!(statuses.get_status(kind), set, "{kind:?}");
            let others = ProblemKind::ALL.into_iter().filter(|other| *other != kind);
            for other in others {
                assert_eq!(
                    statuses.get_status(other),
                    ProblemStatuses::default().get_status(other),
                    "setting {kind:?} changed {other:?}"
                );
            }
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

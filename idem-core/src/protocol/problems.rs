//! The HTTP protocol's own answers: a key missing or malformed, a body too
//! large, unreadable or late, no scope, a failed handler. Each is logged and
//! counted here, once, and its status comes from the route's policy.

use crate::engine::Engine;
use crate::metrics;
use crate::{IdempotencyKey, KeyRequirement, Problem, ProblemKind, StoredResponse};

impl Engine {
    /// Decides from the method and the values of every `Idempotency-Key` field
    /// whether the request is covered (`Ok(Some(key))`), passes through
    /// (`Ok(None)`), or is refused.
    pub(super) fn admit<'a, I>(
        &self,
        method: &str,
        key_fields: I,
    ) -> Result<Option<IdempotencyKey>, Problem>
    where
        I: IntoIterator<Item = &'a [u8]>,
    {
        let policy = self.policy();
        if !policy.covers(method) {
            return Ok(None);
        }
        match IdempotencyKey::from_fields(key_fields) {
            Ok(Some(key)) => Ok(Some(key)),
            Ok(None) => match policy.key_requirement() {
                KeyRequirement::Optional => Ok(None),
                KeyRequirement::Required => {
                    tracing::debug!(target: "idem", outcome = "rejected", reason = "missing-key");
                    metrics::outcome(metrics::Outcome::Refused);
                    Err(self.problem(
                        ProblemKind::MissingKey,
                        "this route requires an Idempotency-Key header",
                    ))
                }
            },
            Err(error) => {
                tracing::debug!(target: "idem", outcome = "rejected", reason = "invalid-key", %error);
                metrics::outcome(metrics::Outcome::Refused);
                Err(self.problem(ProblemKind::InvalidKey, error.to_string()))
            }
        }
    }

    /// The answer to a request body over the limit.
    pub(super) fn payload_too_large(&self) -> Problem {
        let limit = self.policy().get_request_body_limit();
        tracing::debug!(target: "idem", outcome = "rejected", reason = "payload-too-large", limit);
        metrics::outcome(metrics::Outcome::Refused);
        self.problem(
            ProblemKind::PayloadTooLarge,
            format!("the request body is larger than {limit} bytes"),
        )
    }

    /// The answer to a request body that failed to arrive whole.
    pub(super) fn body_unreadable(&self) -> Problem {
        metrics::outcome(metrics::Outcome::Refused);
        self.problem(
            ProblemKind::BodyUnreadable,
            "the request body could not be read whole",
        )
    }

    /// The answer to a request body that did not arrive within the deadline.
    pub(super) fn body_timeout(&self) -> Problem {
        let timeout = self.policy().get_request_body_timeout();
        tracing::debug!(target: "idem", outcome = "rejected", reason = "body-timeout", timeout_ms = timeout.as_millis() as u64);
        metrics::outcome(metrics::Outcome::Refused);
        self.problem(
            ProblemKind::BodyTimeout,
            format!(
                "the request body did not arrive within {} ms; nothing was executed",
                timeout.as_millis()
            ),
        )
    }

    /// The answer when the application could not name the request's scope:
    /// logged at error level with what the source expected, since it is a
    /// misconfiguration (most often the authentication that sets the scope runs
    /// after the idempotency middleware instead of before it).
    pub(super) fn scope_unavailable(&self, expected: &str) -> Problem {
        tracing::error!(
            target: "idem",
            outcome = "rejected",
            reason = "scope-unavailable",
            expected,
            "no idempotency scope for the request: the route's scope source found nothing. It looks for {expected}: is the middleware that provides it (authentication) applied before the idempotency middleware, i.e. as an outer layer?",
        );
        metrics::outcome(metrics::Outcome::Refused);
        self.problem(
            ProblemKind::ScopeUnavailable,
            "the request could not be attributed to a scope",
        )
    }

    /// The answer when the task that ran a keyed request was lost (its runtime
    /// shut down): its claim, if any, was released.
    pub(super) fn handler_lost(&self) -> StoredResponse {
        self.handler_failed().to_response()
    }

    /// The answer when the handler panicked or failed (after its claim was released).
    pub(super) fn handler_failed(&self) -> Problem {
        self.problem(
            ProblemKind::HandlerFailed,
            "the request failed; it may be retried with the same key",
        )
    }
}

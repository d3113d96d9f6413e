//! Problem answers: RFC 9457 `application/problem+json` bodies (`docs/contract.md` §4).

use std::time::Duration;

use crate::{Header, StoredResponse};

/// The base of every problem `type` URI; the slug follows it.
pub const PROBLEM_TYPE_BASE: &str = "https://idem.rs/problems/";

/// The media type of problem answers.
pub const PROBLEM_CONTENT_TYPE: &str = "application/problem+json";

/// Every answer idem gives in place of the handler's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ProblemKind {
    /// A required key is absent. `400 missing-key`.
    MissingKey,
    /// The key header is malformed. `400 invalid-key`.
    InvalidKey,
    /// The key was used before for a different request. `422 key-reused`.
    KeyReused,
    /// The first request with this key is still running. `409 request-in-progress`.
    RequestInProgress,
    /// The request body is over the limit. `413 payload-too-large`.
    PayloadTooLarge,
    /// The request body did not arrive whole (the client went away mid-body, a
    /// malformed chunked encoding). `400 body-unreadable`.
    BodyUnreadable,
    /// The request body stalled: it did not arrive whole within the policy's
    /// read deadline. `408 body-timeout`; nothing was claimed or stored.
    BodyTimeout,
    /// The store failed; the handler did not run. `503 store-unavailable`.
    StoreUnavailable,
    /// The request ran, but its response was too large to keep, so it cannot be
    /// replayed. `410 response-not-stored`.
    ResponseNotStored,
    /// The handler panicked or failed; the claim was released. `500 handler-failed`.
    HandlerFailed,
    /// The route's scope could not be determined (a configuration error).
    /// `500 scope-unavailable`.
    ScopeUnavailable,
    /// A handler takes what idem did not give its request (a configuration
    /// error): an [`ExecutionInfo`](crate::ExecutionInfo) on a route that is
    /// not behind idem's middleware, or whose keys are optional; a
    /// [`StoreContext`](crate::StoreContext) over a store that hands none.
    /// `500 route-misconfigured`; the handler does not run, and the log names
    /// what it takes. Always `500`: idem's extractors answer it, past the
    /// layer whose [`ProblemStatuses`](crate::ProblemStatuses) they cannot
    /// see.
    RouteMisconfigured,
}

/// A problem answer: kind, status and a human-readable detail.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    /// Which problem.
    pub kind: ProblemKind,
    /// The status code (configurable per layer, see [`crate::ProblemStatuses`]).
    pub status: u16,
    /// What happened, for a person. Never holds anything internal.
    pub detail: String,
    /// Sent as `Retry-After` (whole seconds, at least 1) when set.
    pub retry_after: Option<Duration>,
}

impl ProblemKind {
    /// Every kind, for tests and documentation.
    pub const ALL: [ProblemKind; 12] = [
        Self::MissingKey,
        Self::InvalidKey,
        Self::KeyReused,
        Self::RequestInProgress,
        Self::PayloadTooLarge,
        Self::BodyUnreadable,
        Self::BodyTimeout,
        Self::StoreUnavailable,
        Self::ResponseNotStored,
        Self::HandlerFailed,
        Self::ScopeUnavailable,
        Self::RouteMisconfigured,
    ];

    /// The stable slug that ends the `type` URI.
    pub fn slug(self) -> &'static str {
        match self {
            Self::MissingKey => "missing-key",
            Self::InvalidKey => "invalid-key",
            Self::KeyReused => "key-reused",
            Self::RequestInProgress => "request-in-progress",
            Self::PayloadTooLarge => "payload-too-large",
            Self::StoreUnavailable => "store-unavailable",
            Self::ResponseNotStored => "response-not-stored",
            Self::HandlerFailed => "handler-failed",
            Self::ScopeUnavailable => "scope-unavailable",
            Self::BodyUnreadable => "body-unreadable",
            Self::BodyTimeout => "body-timeout",
            Self::RouteMisconfigured => "route-misconfigured",
        }
    }

    /// A short summary that does not change between occurrences.
    pub fn title(self) -> &'static str {
        match self {
            Self::MissingKey => "Idempotency-Key header required",
            Self::InvalidKey => "Invalid Idempotency-Key header",
            Self::KeyReused => "Idempotency key reused for a different request",
            Self::RequestInProgress => "A request with this idempotency key is in progress",
            Self::PayloadTooLarge => "Request body too large",
            Self::StoreUnavailable => "Idempotency store unavailable",
            Self::ResponseNotStored => "Original response was not stored",
            Self::HandlerFailed => "The request failed",
            Self::ScopeUnavailable => "Idempotency scope unavailable",
            Self::BodyUnreadable => "Request body unreadable",
            Self::BodyTimeout => "Request body timed out",
            Self::RouteMisconfigured => "The route is misconfigured",
        }
    }

    /// The `type` URI.
    pub fn type_uri(self) -> String {
        format!("{PROBLEM_TYPE_BASE}{}", self.slug())
    }
}

impl Problem {
    /// A problem of `kind` answered with `status`.
    pub fn new(kind: ProblemKind, status: u16, detail: impl Into<String>) -> Self {
        Self {
            kind,
            status,
            detail: detail.into(),
            retry_after: None,
        }
    }

    /// Adds a `Retry-After`.
    pub fn with_retry_after(mut self, after: Duration) -> Self {
        self.retry_after = Some(after);
        self
    }

    /// The JSON body.
    pub fn body(&self) -> String {
        serde_json::json!({
            "type": self.kind.type_uri(),
            "title": self.kind.title(),
            "status": self.status,
            "detail": self.detail,
        })
        .to_string()
    }

    /// The whole answer, ready for an adapter to send.
    pub fn to_response(&self) -> StoredResponse {
        let mut headers = vec![Header::new("content-type", PROBLEM_CONTENT_TYPE)];
        if let Some(after) = self.retry_after {
            let secs = (after.as_secs() + u64::from(after.subsec_nanos() > 0)).max(1);
            headers.push(Header::new("retry-after", secs.to_string()));
        }
        StoredResponse::new(self.status, headers, self.body())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn problem_body_is_rfc9457_with_stable_type() {
        let p = Problem::new(ProblemKind::KeyReused, 422, "different body")
            .with_retry_after(Duration::from_millis(1500));
        let r = p.to_response();
        assert_eq!(r.status, 422);
        assert_eq!(
            r.header_values("content-type").collect::<Vec<_>>(),
            vec![b"application/problem+json".as_ref()]
        );
        assert_eq!(
            r.header_values("retry-after").collect::<Vec<_>>(),
            vec![b"2".as_ref()]
        );
        let body: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
        assert_eq!(
            body,
            serde_json::json!({
                "type": "https://idem.rs/problems/key-reused",
                "title": "Idempotency key reused for a different request",
                "status": 422,
                "detail": "different body",
            })
        );
    }

    #[test]
    fn sub_second_retry_after_rounds_up_to_one() {
        let p = Problem::new(ProblemKind::RequestInProgress, 409, "")
            .with_retry_after(Duration::from_millis(200));
        let r = p.to_response();
        assert_eq!(
            r.header_values("retry-after").collect::<Vec<_>>(),
            vec![b"1".as_ref()]
        );
    }

    #[test]
    fn slugs_are_distinct() {
        let mut slugs: Vec<_> = ProblemKind::ALL.iter().map(|k| k.slug()).collect();
        slugs.sort();
        slugs.dedup();
        assert_eq!(slugs.len(), ProblemKind::ALL.len());
    }
}

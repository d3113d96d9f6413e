//! The client half of idem: retries that keep the `Idempotency-Key`
//! contract (`docs/contract.md`).
//!
//! A server that keeps keys is half of the story: a retried `POST` is safe
//! only if every attempt carries the same key. [`IdempotentRetry`], a
//! [`reqwest_middleware`] middleware, mints the key once, before the first
//! attempt (a UUID v4, unless the request carries one already), and sends it
//! on every retry of that request; the server answers a retry of a request
//! it applied with the stored answer (`Idempotent-Replayed: true`, see
//! [`replayed`]), never with a second effect.
//!
//! What is retried, when, and how often is [`idem_core::retry::RetryPolicy`]'s
//! decision: no answer at all (a refused, broken or timed-out connection),
//! `409` (in progress), `429` and `503`, `502` and `504`; never a `422` (the
//! key was reused with another body: a bug to report) nor any other `4xx`
//! or `500`. Backoff has full jitter, after the answer's `Retry-After`
//! (capped) when it has one: clients told the same time do not come back in
//! the same instant. A
//! per-request deadline bounds the whole exchange, and a **retry budget**
//! shared by every request through one middleware ([`tower`]'s
//! [`TpsBudget`]: retries at most a share of the first attempts of the last
//! seconds, plus a small floor) keeps a failing server from being buried
//! under retries.
//!
//! ```no_run
//! use idem_client::IdempotentRetry;
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
//!     .with(IdempotentRetry::new())
//!     .build();
//! let answer = client
//!     .post("http://127.0.0.1:3000/charges")
//!     .body(r#"{"account":"acct_1","amount":100}"#)
//!     .send()
//!     .await?;
//! println!("{} (replayed: {})", answer.status(), idem_client::replayed(&answer));
//! # Ok(())
//! # }
//! ```
//!
//! With the feature `metrics`, the `metrics` facade counts the attempts
//! (`idem_client_attempts_total`), the retries (`idem_client_retries_total`)
//! and the retries refused (`idem_client_retries_refused_total`, `reason`
//! `budget` or `deadline`). The span of an attempt (`idem_client.attempt`,
//! at debug) names its method and path, never its key or body.
//!
//! Tower clients (hyper's, tonic's) get the same retries from
//! [`IdempotentRetryLayer`].
//!
//! Which methods get a key: `POST` and `PATCH`, the ones HTTP does not make
//! idempotent. The others (`GET`, `PUT`, `DELETE`…) are retried as they
//! are, by the same policy. A request whose body is a stream cannot be sent
//! twice: it is sent once, as it would be without the middleware.
//!
//! Crates: `reqwest-middleware` (TrueLayer's, the middleware chain reqwest's
//! users already have, with `reqwest-retry` and `reqwest-tracing` on it) and
//! tower's retry budget (the one tower's own retry layer uses), rather than a
//! client or a budget of this crate's own.

use std::sync::Arc;
use std::time::{Duration, Instant};

use http::{Extensions, HeaderMap, HeaderValue, Method};
use idem_core::retry::{Attempt, Decision, RetryPolicy};
use idem_core::{KEY_HEADER, KEYED_METHODS, REPLAYED_HEADER};
use reqwest::{Request, Response};
use reqwest_middleware::{Middleware, Next};
use tower::retry::budget::{Budget, TpsBudget};
use tracing::Instrument;

mod layer;

/// The middleware chain [`IdempotentRetry`] plugs into, re-exported so that
/// its version is the one this crate was built with.
pub use reqwest_middleware;

pub use layer::{IdempotentRetryLayer, MintKey, TowerPolicy};

/// Retries with one `Idempotency-Key` per request: see the [crate] docs.
#[derive(Clone, Debug)]
pub struct IdempotentRetry {
    policy: RetryPolicy,
    budget: Option<Arc<TpsBudget>>,
    deadline: Option<Duration>,
}

impl Default for IdempotentRetry {
    fn default() -> Self {
        Self::new()
    }
}

impl IdempotentRetry {
    /// The default [`RetryPolicy`] (3 retries, backoff within 1 s doubling
    /// to 30 s, `Retry-After` up to 30 s), a budget of 20 % of the first
    /// attempts of the last 10 s plus 10 retries a second, no deadline.
    pub fn new() -> Self {
        Self {
            policy: RetryPolicy::default(),
            budget: Some(Arc::new(TpsBudget::new(Duration::from_secs(10), 10, 0.2))),
            deadline: None,
        }
    }

    /// Sets what is retried, when, and how often.
    #[must_use]
    pub fn policy(mut self, policy: RetryPolicy) -> Self {
        self.policy = policy;
        self
    }

    /// Sets the retry budget: over the last `window`, retries may add at
    /// most `share` (0.0 to 1000.0; 0.2 is 20 %) of the first attempts, plus
    /// `floor` retries a second (tower's [`TpsBudget::new`]). Shared by
    /// every request through this middleware and its clones.
    ///
    /// # Panics
    ///
    /// If `window` is not within 1 to 60 s, or `share` not within 0.0 to
    /// 1000.0 (tower's bounds): a configuration error, at start-up.
    #[must_use]
    pub fn budget(mut self, window: Duration, floor: u32, share: f32) -> Self {
        self.budget = Some(Arc::new(TpsBudget::new(window, floor, share)));
        self
    }

    /// No budget: every request retries as its policy says, however many
    /// others do.
    #[must_use]
    pub fn without_budget(mut self) -> Self {
        self.budget = None;
        self
    }

    /// Bounds each request, every attempt and wait included: an attempt
    /// still unanswered at the deadline ends with reqwest's timeout error,
    /// and no retry starts whose wait would end past it (the last answer, or
    /// error, is the caller's). Through [`IdempotentRetryLayer`] it bounds
    /// the waits only: each attempt's own time is the inner service's (a
    /// `tower::timeout` layer).
    #[must_use]
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.deadline = Some(deadline);
        self
    }

    /// Counts a request's first attempt in the budget.
    fn deposit(&self) {
        if let Some(budget) = &self.budget {
            budget.deposit();
        }
    }

    /// After attempt number `sent` of a request begun at `started` ended in
    /// `ended`: how long to wait before the next, or `None` to hand the
    /// caller this one's result (the policy says so, the wait would end
    /// past the deadline, or the budget is spent).
    fn next(&self, started: Instant, sent: u32, ended: Attempt) -> Option<Duration> {
        count(Counted::Attempt);
        let wait = match self.policy.decide(sent, ended, rand::random()) {
            Decision::Finish => return None,
            Decision::RetryAfter(wait) => wait,
        };
        if self
            .deadline
            .is_some_and(|deadline| started.elapsed() + wait > deadline)
        {
            tracing::debug!(attempt = sent, "no retry: it would end past the deadline");
            count(Counted::Refused("deadline"));
            return None;
        }
        if !self.budget.as_ref().is_none_or(|budget| budget.withdraw()) {
            tracing::debug!(attempt = sent, "no retry: the retry budget is spent");
            count(Counted::Refused("budget"));
            return None;
        }
        tracing::debug!(
            attempt = sent,
            wait_ms = wait.as_millis() as u64,
            "retrying"
        );
        count(Counted::Retry);
        Some(wait)
    }
}

/// What the `metrics` feature counts.
#[derive(Clone, Copy)]
#[cfg_attr(not(feature = "metrics"), allow(dead_code))]
enum Counted {
    /// `idem_client_attempts_total`: an attempt ended (answered or not).
    Attempt,
    /// `idem_client_retries_total`: a retry was scheduled.
    Retry,
    /// `idem_client_retries_refused_total{reason}`: the policy wanted a
    /// retry, and the `budget` or the `deadline` refused it.
    Refused(&'static str),
}

#[cfg(feature = "metrics")]
fn count(counted: Counted) {
    match counted {
        Counted::Attempt => metrics::counter!("idem_client_attempts_total").increment(1),
        Counted::Retry => metrics::counter!("idem_client_retries_total").increment(1),
        Counted::Refused(reason) => {
            metrics::counter!("idem_client_retries_refused_total", "reason" => reason).increment(1);
        }
    }
}

#[cfg(not(feature = "metrics"))]
fn count(_: Counted) {}

/// The key every attempt of a request carries: its own, else one minted
/// for a method HTTP does not make idempotent, else none.
fn key_for(method: &Method, headers: &HeaderMap) -> Option<HeaderValue> {
    if let Some(key) = headers.get(KEY_HEADER) {
        return Some(key.clone());
    }
    if !needs_key(method) {
        return None;
    }
    HeaderValue::from_str(&uuid::Uuid::new_v4().hyphenated().to_string()).ok()
}

/// What the middleware did for a request, in its response's extensions
/// ([`attempts`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Attempts {
    /// The attempts sent: 1 when the first was answered for good.
    pub sent: u32,
    /// The key every attempt carried, if the request had one.
    pub key: Option<HeaderValue>,
}

/// Whether the server answered with the answer it stored for the key
/// (`Idempotent-Replayed: true`): an earlier attempt, whose answer was
/// lost, had been applied.
pub fn replayed(response: &Response) -> bool {
    response
        .headers()
        .get(REPLAYED_HEADER)
        .is_some_and(|value| value.as_bytes().eq_ignore_ascii_case(b"true"))
}

/// How many attempts the middleware sent for `response`, and with which key.
pub fn attempts(response: &Response) -> Option<&Attempts> {
    attempts_of(response.extensions())
}

/// The [`Attempts`] in an answer's extensions (an `http::Response`'s, from
/// [`IdempotentRetryLayer`]).
pub fn attempts_of(extensions: &Extensions) -> Option<&Attempts> {
    extensions.get::<Attempts>()
}

/// Whether a request of `method` gets a key: [`KEYED_METHODS`], those the
/// server's [`idem_core::Policy`] covers by default.
fn needs_key(method: &Method) -> bool {
    KEYED_METHODS.contains(&method.as_str())
}

/// A `Retry-After` in seconds (an HTTP date is read as none: the policy's
/// backoff applies).
fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let value = headers.get(http::header::RETRY_AFTER)?;
    let seconds: u64 = value.to_str().ok()?.trim().parse().ok()?;
    Some(Duration::from_secs(seconds))
}

/// How an attempt ended, or `None` for an error no resend can mend (a
/// request that cannot be built, another middleware's refusal).
fn ended(result: &reqwest_middleware::Result<Response>) -> Option<Attempt> {
    match result {
        Ok(response) => Some(Attempt::Answered {
            status: response.status().as_u16(),
            retry_after: retry_after(response.headers()),
        }),
        Err(reqwest_middleware::Error::Reqwest(error))
            if !(error.is_builder() || error.is_redirect() || error.is_status()) =>
        {
            Some(Attempt::NoAnswer)
        }
        Err(_) => None,
    }
}

#[async_trait::async_trait]
impl Middleware for IdempotentRetry {
    async fn handle(
        &self,
        mut request: Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<Response> {
        let started = Instant::now();
        let key = key_for(request.method(), request.headers());
        if let Some(key) = &key {
            request.headers_mut().insert(KEY_HEADER, key.clone());
        }
        self.deposit();
        let mut sent = 0;
        loop {
            sent += 1;
            let Some(mut copy) = request.try_clone() else {
                // A streamed body: one attempt, as without the middleware.
                return next.run(request, extensions).await;
            };
            if let Some(deadline) = self.deadline {
                let left = deadline.saturating_sub(started.elapsed());
                let timeout = copy.timeout_mut();
                *timeout = Some(timeout.map_or(left, |own| own.min(left)));
            }
            let span = tracing::debug_span!(
                "idem_client.attempt",
                attempt = sent,
                method = %copy.method(),
                path = copy.url().path(),
            );
            let result = next.clone().run(copy, extensions).instrument(span).await;
            let wait = match ended(&result) {
                Some(ended) => self.next(started, sent, ended),
                None => {
                    count(Counted::Attempt);
                    None
                }
            };
            let Some(wait) = wait else {
                return finished(result, sent, key);
            };
            drop(result);
            tokio::time::sleep(wait).await;
        }
    }
}

/// The caller's result, its response marked with the [`Attempts`] sent.
fn finished(
    result: reqwest_middleware::Result<Response>,
    sent: u32,
    key: Option<HeaderValue>,
) -> reqwest_middleware::Result<Response> {
    result.map(|mut response| {
        response.extensions_mut().insert(Attempts { sent, key });
        response
    })
}

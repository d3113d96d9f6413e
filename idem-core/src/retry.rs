//! When to retry: capped exponential backoff with full jitter.
//!
//! A client or consumer that failed retries after a delay. With plain exponential
//! backoff every client that failed at the same instant (a failover, a broker
//! redelivering a batch) also retries at the same instants, so each retry round
//! hits the recovering server as one spike as tall as the first. **Full jitter**
//! draws each delay uniformly from `[0, min(cap, base · 2^(attempt-1))]`: the
//! same expected progress, but the round is spread over the whole interval and the
//! spike flattens in proportion to it. (See the "exponential backoff and jitter"
//! analysis of AWS's architecture blog: full jitter does the least total work and
//! finishes soonest among the jitter schemes.)
//!
//! How flat: N clients spread uniformly over `B` seconds put about
//! `N · w / B` retries in a window of `w` seconds. For 100 clients and 100 ms
//! windows, a first-retry bound of 5 s ([`Backoff::for_consumers`]) gives about 2
//! per window and a peak under 10, against 100 without jitter (the
//! [`simulate_storm`] test holds it to at least 10× less); the interactive preset
//! ([`Backoff::for_clients`], 1 s) still cuts the peak about 4×, trading
//! flatness for latency. The cap keeps a long outage from pushing retries out
//! indefinitely.
//!
//! ```
//! use std::time::Duration;
//! use idem_core::retry::Backoff;
//!
//! let backoff = Backoff::for_clients();
//! assert_eq!(backoff.ceiling(1), Duration::from_secs(1));
//! assert_eq!(backoff.ceiling(3), Duration::from_secs(4));
//! assert_eq!(backoff.ceiling(30), Duration::from_secs(30)); // capped
//! assert!(backoff.delay(3) <= Duration::from_secs(4));
//! ```

use std::time::Duration;

use rand::Rng;
#[cfg(any(test, feature = "test-util"))]
use rand::SeedableRng;
#[cfg(any(test, feature = "test-util"))]
use rand::rngs::StdRng;

/// Capped exponential backoff, with full jitter unless told otherwise.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[must_use]
pub struct Backoff {
    base: Duration,
    cap: Duration,
    jitter: Jitter,
}

/// How a delay is drawn below its ceiling.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Jitter {
    /// Uniform in `[0, ceiling]`. The default.
    Full,
    /// Exactly the ceiling: every client that failed together retries together.
    /// Only for comparison.
    None,
}

impl Backoff {
    /// Backoff whose first retry comes within `base` and no delay exceeds `cap`.
    pub const fn new(base: Duration, cap: Duration) -> Self {
        Self {
            base,
            cap,
            jitter: Jitter::Full,
        }
    }

    /// For interactive HTTP clients: first retry within 1 s, delays capped at 30 s.
    pub fn for_clients() -> Self {
        Self::new(Duration::from_secs(1), Duration::from_secs(30))
    }

    /// For message consumers: first retry within 5 s, delays capped at 5 minutes.
    pub fn for_consumers() -> Self {
        Self::new(Duration::from_secs(5), Duration::from_secs(300))
    }

    /// Sets the jitter.
    pub fn jitter(mut self, jitter: Jitter) -> Self {
        self.jitter = jitter;
        self
    }

    /// The bound of the first retry's delay.
    pub fn base(&self) -> Duration {
        self.base
    }

    /// The bound of every delay.
    pub fn cap(&self) -> Duration {
        self.cap
    }

    /// How a delay is drawn below its ceiling.
    pub fn get_jitter(&self) -> Jitter {
        self.jitter
    }

    /// The longest delay before retry number `attempt` (1 for the first retry):
    /// `min(cap, base · 2^(attempt-1))`.
    pub fn ceiling(&self, attempt: u32) -> Duration {
        let doublings = attempt.saturating_sub(1).min(63);
        self.base
            .checked_mul(1u32.checked_shl(doublings).unwrap_or(u32::MAX))
            .unwrap_or(self.cap)
            .min(self.cap)
    }

    /// The delay before retry number `attempt`, drawn from the thread's RNG.
    pub fn delay(&self, attempt: u32) -> Duration {
        self.delay_at(attempt, rand::rng().random_range(0.0..=1.0))
    }

    /// The delay before retry number `attempt` at `point` of its jitter's
    /// range (`0.0` the shortest, `1.0` the [`ceiling`](Self::ceiling);
    /// clamped): [`delay`](Self::delay) with a draw of the caller's, for a
    /// deterministic schedule.
    pub fn delay_at(&self, attempt: u32, point: f64) -> Duration {
        let ceiling = self.ceiling(attempt);
        match self.jitter {
            Jitter::None => ceiling,
            Jitter::Full => ceiling.mul_f64(if point.is_nan() {
                1.0
            } else {
                point.clamp(0.0, 1.0)
            }),
        }
    }
}

/// How one attempt of a request ended, as its client saw it: what
/// [`RetryPolicy::decide`] judges.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Attempt {
    /// The server answered with `status`, and a `Retry-After` of this many
    /// seconds if it sent one (the delta-seconds form; an HTTP date is read
    /// as none).
    Answered {
        /// The answer's status code.
        status: u16,
        /// Its `Retry-After`, if it had one in seconds.
        retry_after: Option<Duration>,
    },
    /// No answer: the connection failed, broke or timed out. The server may
    /// have applied the request: only a retry with the same key is safe.
    NoAnswer,
}

/// What to do after an attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Hand the answer (or the error) to the caller: it succeeded, or it
    /// can never succeed by being sent again.
    Finish,
    /// Send the same request, with the same key, after this delay.
    RetryAfter(Duration),
}

/// When a client retries a request that carries an `Idempotency-Key`
/// (`docs/contract.md`): the same key on every attempt, so a retry of a
/// request that was applied gets its replay, never a second effect.
///
/// Retried: no answer (a broken connection, a timeout), `409` (the key's
/// first request is still in progress), `429` and `503` (the server asks for
/// time: its `Retry-After` is honoured, up to [`retry_after_cap`]), `502` and
/// `504` (a gateway lost the server). Never retried: every other answer —
/// a `2xx`, a `422` (the key was sent with another request: a bug to
/// report, which a retry would only repeat), any other `4xx` (the request
/// is wrong), a `500` (the server failed the request, and says so). The
/// delay is [`Backoff`]'s, full jitter by default, after the answer's
/// `Retry-After` when it has one: the server's time is a floor, and the
/// jitter spreads the clients over the window after it. (Waiting exactly the
/// `Retry-After` brings every client the server told "1 s" back in the same
/// instant: `cargo xtask storm` measured it, 100 clients in 10 ms, whatever
/// their own backoff.) At most [`max_retries`] retries (Stripe's clients
/// retry twice by default; the default here is 3).
///
/// [`retry_after_cap`]: RetryPolicy::retry_after_cap
/// [`max_retries`]: RetryPolicy::max_retries
///
/// ```
/// use std::time::Duration;
/// use idem_core::retry::{Attempt, Decision, RetryPolicy};
///
/// let policy = RetryPolicy::default();
/// let busy = Attempt::Answered { status: 503, retry_after: Some(Duration::from_secs(2)) };
/// // 2 s, then half of the first retry's 1 s window.
/// assert_eq!(policy.decide(1, busy, 0.5), Decision::RetryAfter(Duration::from_millis(2_500)));
/// let reused = Attempt::Answered { status: 422, retry_after: None };
/// assert_eq!(policy.decide(1, reused, 0.5), Decision::Finish);
/// assert_eq!(policy.decide(4, Attempt::NoAnswer, 0.5), Decision::Finish); // 3 retries done
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[must_use]
pub struct RetryPolicy {
    backoff: Backoff,
    max_retries: u32,
    retry_after_cap: Duration,
}

impl Default for RetryPolicy {
    /// [`Backoff::for_clients`], 3 retries, a `Retry-After` honoured up to 30 s.
    fn default() -> Self {
        Self {
            backoff: Backoff::for_clients(),
            max_retries: 3,
            retry_after_cap: Duration::from_secs(30),
        }
    }
}

impl RetryPolicy {
    /// Sets the backoff used when the server gives no `Retry-After`.
    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = backoff;
        self
    }

    /// Sets how many retries follow the first attempt (0: none).
    pub fn max_retries(mut self, retries: u32) -> Self {
        self.max_retries = retries;
        self
    }

    /// Sets the longest `Retry-After` waited; a longer one is waited this long.
    pub fn retry_after_cap(mut self, cap: Duration) -> Self {
        self.retry_after_cap = cap;
        self
    }

    /// The backoff used when the server gives no `Retry-After`.
    pub fn get_backoff(&self) -> Backoff {
        self.backoff
    }

    /// How many retries may follow the first attempt.
    pub fn get_max_retries(&self) -> u32 {
        self.max_retries
    }

    /// Whether an answer of `status` may be retried with the same key.
    pub fn retries_status(status: u16) -> bool {
        matches!(status, 409 | 429 | 502 | 503 | 504)
    }

    /// What to do after attempt number `attempt` (1 for the first) ended in
    /// `ended`; `point` is the jitter's draw in `[0, 1]`
    /// ([`Backoff::delay_at`]), the caller's so that a schedule can be
    /// replayed.
    pub fn decide(&self, attempt: u32, ended: Attempt, point: f64) -> Decision {
        if attempt > self.max_retries {
            return Decision::Finish;
        }
        match ended {
            Attempt::Answered { status, .. } if !Self::retries_status(status) => Decision::Finish,
            Attempt::Answered {
                retry_after: Some(after),
                ..
            } => Decision::RetryAfter(
                after.min(self.retry_after_cap) + self.backoff.delay_at(attempt, point),
            ),
            Attempt::Answered { .. } | Attempt::NoAnswer => {
                Decision::RetryAfter(self.backoff.delay_at(attempt, point))
            }
        }
    }
}

/// What [`simulate_storm`] saw.
#[cfg(any(test, feature = "test-util"))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Storm {
    /// Retries sent in all.
    pub retries: usize,
    /// The most retries in any 100 ms window.
    pub peak_per_100ms: usize,
}

/// Simulates `clients` that all fail at instant 0 against a server that is back
/// after `outage`: each retries by `backoff` until a retry lands after the outage.
/// Deterministic for a given `seed`. (Feature `test-util`: the demo's and the
/// tests' model, not part of the library; `cargo xtask storm` measures the
/// same storm against a real server.)
#[cfg(any(test, feature = "test-util"))]
pub fn simulate_storm(backoff: Backoff, clients: usize, outage: Duration, seed: u64) -> Storm {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut times = Vec::new();
    for _ in 0..clients {
        let mut at = Duration::ZERO;
        let mut attempt = 1;
        loop {
            at += backoff.delay_at(attempt, rng.random_range(0.0..=1.0));
            times.push(at);
            if at >= outage {
                break;
            }
            attempt += 1;
        }
    }
    times.sort();
    let window = Duration::from_millis(100);
    let (mut peak, mut start) = (0, 0);
    for end in 0..times.len() {
        while times[end] - times[start] >= window {
            start += 1;
        }
        peak = peak.max(end - start + 1);
    }
    Storm {
        retries: times.len(),
        peak_per_100ms: peak,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answered(status: u16, retry_after: Option<u64>) -> Attempt {
        Attempt::Answered {
            status,
            retry_after: retry_after.map(Duration::from_secs),
        }
    }

    #[test]
    fn only_what_a_resend_can_mend_is_retried() {
        let policy = RetryPolicy::default();
        for status in [409, 429, 502, 503, 504] {
            assert_eq!(
                policy.decide(1, answered(status, None), 1.0),
                Decision::RetryAfter(Duration::from_secs(1)),
                "{status}"
            );
        }
        for status in [200, 201, 204, 301, 400, 401, 403, 404, 422, 500, 501] {
            assert_eq!(
                policy.decide(1, answered(status, Some(1)), 1.0),
                Decision::Finish,
                "{status}"
            );
        }
        assert_eq!(
            policy.decide(2, Attempt::NoAnswer, 1.0),
            Decision::RetryAfter(Duration::from_secs(2))
        );
    }

    #[test]
    fn retry_after_is_honoured_up_to_its_cap_and_retries_end() {
        let policy = RetryPolicy::default()
            .retry_after_cap(Duration::from_secs(10))
            .max_retries(2);
        assert_eq!(
            policy.decide(1, answered(429, Some(7)), 0.0),
            Decision::RetryAfter(Duration::from_secs(7))
        );
        assert_eq!(
            policy.decide(2, answered(503, Some(3_600)), 0.0),
            Decision::RetryAfter(Duration::from_secs(10))
        );
        assert_eq!(
            policy.decide(3, answered(503, Some(1)), 0.0),
            Decision::Finish
        );
        assert_eq!(
            RetryPolicy::default()
                .max_retries(0)
                .decide(1, Attempt::NoAnswer, 0.0),
            Decision::Finish
        );
    }

    #[test]
    fn clients_told_the_same_retry_after_come_back_spread_after_it() {
        let policy = RetryPolicy::default();
        let told = answered(503, Some(1));
        let delays: Vec<_> = [0.0, 0.25, 1.0]
            .map(|point| policy.decide(1, told, point))
            .to_vec();
        assert_eq!(
            delays,
            [1_000, 1_250, 2_000].map(|ms| Decision::RetryAfter(Duration::from_millis(ms)))
        );
        let unjittered = policy.backoff(Backoff::for_clients().jitter(Jitter::None));
        assert_eq!(
            unjittered.decide(1, told, 0.0),
            Decision::RetryAfter(Duration::from_secs(2))
        );
    }

    #[test]
    fn ceiling_doubles_up_to_the_cap() {
        let b = Backoff::new(Duration::from_millis(100), Duration::from_secs(1));
        let ceilings: Vec<_> = (1..=6).map(|a| b.ceiling(a).as_millis()).collect();
        assert_eq!(ceilings, vec![100, 200, 400, 800, 1000, 1000]);
        assert_eq!(b.ceiling(u32::MAX), Duration::from_secs(1));
    }

    #[test]
    fn full_jitter_stays_below_the_ceiling_and_spreads() {
        let b = Backoff::for_clients();
        let mut rng = StdRng::seed_from_u64(7);
        let delays: Vec<_> = (0..1000)
            .map(|_| b.delay_at(2, rng.random_range(0.0..=1.0)))
            .collect();
        assert!(delays.iter().all(|d| *d <= Duration::from_secs(2)));
        let below_half = delays
            .iter()
            .filter(|d| **d < Duration::from_secs(1))
            .count();
        assert!(
            (400..=600).contains(&below_half),
            "{below_half} of 1000 below half"
        );
        assert_eq!(
            b.jitter(Jitter::None)
                .delay_at(2, rng.random_range(0.0..=1.0)),
            Duration::from_secs(2)
        );
    }

    #[test]
    fn full_jitter_cuts_the_retry_peak_at_least_tenfold() {
        let outage = Duration::from_secs(1);
        let plain = simulate_storm(
            Backoff::for_consumers().jitter(Jitter::None),
            100,
            outage,
            1,
        );
        assert_eq!(
            plain.peak_per_100ms, 100,
            "without jitter every client retries together"
        );
        for seed in 0..20 {
            let jittered = simulate_storm(Backoff::for_consumers(), 100, outage, seed);
            assert!(
                jittered.peak_per_100ms * 10 <= plain.peak_per_100ms,
                "seed {seed}: peak {} with full jitter against {} without",
                jittered.peak_per_100ms,
                plain.peak_per_100ms
            );
        }
    }
}

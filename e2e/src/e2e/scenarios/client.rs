//! idem-client's [`IdempotentRetry`] against the example as a real process:
//! the client half of the contract (one key on every attempt of a request,
//! `Retry-After` honoured, a `422` never retried, a retry budget) meeting the
//! server half over TCP.
//!
//! The first three rows (scenario `client`) run on every store: the client
//! is the same, but what it meets is not. A lost answer is replayed from
//! each store's record; a key reused with another body is refused from each
//! store's fingerprint; and a duplicate of a running charge is answered
//! `409` at once on the plain stores (memory, Redis) while on the
//! transactional ones (SQLite, PostgreSQL, `docs/contract.md` §7–§8) the
//! route first waits up to 10 s for the running charge: there the first
//! charge outlasts that wait, so that the client still meets the `409` it
//! must wait out. The budget row (scenario `client-budget`) needs a store
//! that can be cut off under a running server: PostgreSQL, reached through
//! a fault proxy that resets every connection, as `docs/contract.md` §4's
//! "store unreachable" (`503 store-unavailable`, `Retry-After: 5`).
//!
//! Requests are counted on the wire by testkit's TCP [`Proxy`] in front of
//! the server, with clients that keep no idle connection, so that each
//! attempt is one connection: the middleware's own count ([`attempts`]) is
//! checked against the proxy's, not taken on trust.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use idem_client::reqwest_middleware::{ClientBuilder, ClientWithMiddleware};
use idem_client::{Attempts, IdempotentRetry, attempts};
use idem_core::retry::{Backoff, Jitter, RetryPolicy};
use idem_testkit::fault::{Fault, Proxy};
use serde_json::json;

use super::{Checks, unique};
use crate::e2e::api::{Answer, Call, Failure, KEY_HEADER, Outcome, effects, expect_account};
use crate::e2e::site::{Deployment, Instance, StoreKind};

pub(super) const LOST_ANSWER: &str = "client_lost_answer";
pub(super) const IN_PROGRESS: &str = "client_in_progress";
pub(super) const REUSED_KEY: &str = "client_reused_key_not_retried";
pub(super) const BUDGET: &str = "client_budget";

/// The rows of scenario `client`.
pub(super) const CHECKS: &[&str] = &[LOST_ANSWER, IN_PROGRESS, REUSED_KEY];

/// Every charge's amount, unless a row needs two.
const AMOUNT: i64 = 100;

/// The lost-answer row's retry, fixed (no jitter) so that the harness has
/// this long to lift the fault before it comes.
const LOST_ANSWER_RETRY: Duration = Duration::from_millis(300);

/// How long after the first charge the client sends the same one: the first
/// has claimed its key by then, and is far from done.
const DUPLICATE_AFTER: Duration = Duration::from_millis(500);
/// The `Retry-After` of a `409` (`docs/contract.md` §4's default).
const CONFLICT_RETRY_AFTER: Duration = Duration::from_secs(1);
/// The in-progress row's backoff, fixed: the middleware waits a `409`'s
/// `Retry-After`, then this (the backoff's jitter, none here, comes after the
/// server's time).
const IN_PROGRESS_BACKOFF: Duration = Duration::from_millis(200);
/// The first charge's provider latency on a route that answers a duplicate
/// `409` at once: done 700 ms after the client's first attempt, 500 ms
/// before its retry (`DUPLICATE_AFTER` + `CONFLICT_RETRY_AFTER` +
/// `IN_PROGRESS_BACKOFF` in). A retry that did not wait the `Retry-After`
/// would meet the charge still running.
const PLAIN_LATENCY: Duration = Duration::from_millis(1200);
/// How long a duplicate waits for a running charge in transactional mode
/// (`payments::TRANSACTIONAL_WAIT`) before it is answered `409`.
const TRANSACTIONAL_WAIT: Duration = Duration::from_secs(10);
/// The first charge's provider latency in transactional mode: past the
/// client's first wait (its `409` 10.5 s in) and past its retry's start
/// (11.7 s), with 1.3 s to spare; the retry waits for it and replays it.
const PAST_THE_WAIT_LATENCY: Duration = Duration::from_secs(13);

/// Charges fired at once in the budget row, each with a key of its own.
const STORM: u32 = 50;
/// Retries the storm's policy allows each charge: 45 waits of 200 ms, so
/// that the server answers `503` for about 10 s to the storm without a
/// budget, while the storm with one runs beside it.
const STORM_RETRIES: u32 = 45;
/// The storm's fixed backoff, and its cap on the `503`'s `Retry-After: 5`:
/// each wait is the capped `Retry-After` and the backoff, 200 ms.
const STORM_DELAY: Duration = Duration::from_millis(100);
/// The budget: over the last 10 s, retries may add at most 20 % of the
/// first attempts, and no floor.
const BUDGET_WINDOW: Duration = Duration::from_secs(10);
const BUDGET_SHARE: f32 = 0.2;

/// Rows `client_*` but the budget's, each on an account of its own; the
/// in-progress row on a server of its own, whose provider is slow.
pub(super) async fn run(deployment: Arc<Deployment>) -> Result<Checks, Failure> {
    let site = deployment.site("client").await?;
    let waits = waits_for_running(deployment.store);
    let latency = if waits {
        PAST_THE_WAIT_LATENCY
    } else {
        PLAIN_LATENCY
    };
    // One after the other: on SQLite and PostgreSQL both migrate one database.
    let quick = site.start(&[]).await?;
    let latency_ms = latency.as_millis().to_string();
    let slow = site.start(&["--provider-latency-ms", &latency_ms]).await?;
    let principal = &unique("judy");
    let (lost, in_progress, reused) = tokio::join!(
        lost_answer(&quick, principal),
        duplicate_in_flight(&slow, principal, waits, latency),
        reused_key(&quick, principal),
    );
    Ok(vec![
        (LOST_ANSWER, lost),
        (IN_PROGRESS, in_progress),
        (REUSED_KEY, reused),
    ])
}

/// Whether the example's charges route waits for a running charge with the
/// same key before it answers `409`: in transactional mode, on SQLite and
/// PostgreSQL (`docs/contract.md` §8).
fn waits_for_running(store: StoreKind) -> bool {
    matches!(store, StoreKind::Sqlite | StoreKind::Postgres)
}

/// The charge is applied, its answer lost on the way back (the proxy closes
/// the connection on it); the middleware's retry, with the key it minted,
/// gets the replay.
async fn lost_answer(instance: &Instance, principal: &str) -> Outcome {
    let account = &unique("lost");
    let proxy = proxy_to(instance)?;
    proxy.set(Fault::LoseAnswers);
    let client = client(IdempotentRetry::new().policy(fixed(LOST_ANSWER_RETRY)))?;
    let charge = Charge::new(principal, account, None, AMOUNT);
    let front = format!("http://{}", proxy.addr());
    let (sent, lifted) = tokio::join!(charge.send(&client, &front), async {
        // Lifted once the proxy has closed a connection on an answer (the
        // charge applied, its answer lost), not merely seen the request:
        // the retry, 300 ms later, passes.
        let started = Instant::now();
        while proxy.lost_answers() == 0 {
            if started.elapsed() > Duration::from_secs(30) {
                proxy.set(Fault::None);
                return Err(Failure::new(
                    "no answer lost",
                    format!(
                        "request: {} through idem-client and a proxy losing answers\n\
                         expected: an answer lost within 30 s\n\
                         got: none ({} connections)",
                        charge.call(),
                        proxy.connections()
                    ),
                ));
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        proxy.set(Fault::None);
        Ok(())
    });
    lifted?;
    let sent = sent?;
    let call = charge.call();
    let body = sent.answer.json().unwrap_or_default();
    if sent.answer.status != 201
        || !sent.answer.replayed()
        || body["amount"] != AMOUNT
        || body["balance"] != AMOUNT
    {
        return Err(Failure::unexpected(
            &call,
            format!(
                "through idem-client, the first answer lost: 201 replayed, \
                 amount {AMOUNT}, balance {AMOUNT}"
            ),
            &sent.answer,
        ));
    }
    let (lost, connections) = (proxy.lost_answers(), proxy.connections());
    if sent.attempts.sent != 2 || lost != 1 || connections != 2 {
        return Err(Failure::new(
            format!("{} attempts", sent.attempts.sent),
            format!(
                "request: {call} through idem-client, retried after {LOST_ANSWER_RETRY:?}\n\
                 expected: 2 attempts, 2 connections at the proxy, 1 answer lost\n\
                 got: {} attempts, {connections} connections, {lost} answers lost",
                sent.attempts.sent
            ),
        ));
    }
    // The key the middleware minted is the record's: sent again by the
    // plain client, it replays the same answer.
    let key = minted(&sent.attempts).ok_or_else(|| {
        Failure::new(
            "no key",
            format!("request: {call} through idem-client\nexpected: a minted key\ngot: none"),
        )
    })?;
    let again_call = Charge::new(principal, account, Some(&key), AMOUNT).call();
    let again = instance.api.send(&again_call).await?;
    again.replays(&sent.answer).map_err(|why| {
        Failure::wrong(
            &again_call,
            "the replay of the charge, with the key idem-client minted",
            &again,
            &why,
        )
    })?;
    expect_account(
        &instance.api,
        principal,
        account,
        effects(1, AMOUNT),
        "a charge whose answer was lost, retried by idem-client",
    )
    .await?;
    Ok(format!(
        "answer lost, retry {}ms later with the minted key → 201 replayed; \
         2 attempts = 2 connections; 1 operation",
        LOST_ANSWER_RETRY.as_millis()
    ))
}

/// A charge still running when the client sends it again with the same key:
/// `409` with `Retry-After` (on a transactional route after its 10 s wait),
/// waited out, then the replay. The client goes through a proxy that notes
/// when each attempt reaches the server: the retry comes the `Retry-After`
/// and the backoff after the `409`, not the backoff alone.
async fn duplicate_in_flight(
    instance: &Instance,
    principal: &str,
    waits: bool,
    latency: Duration,
) -> Outcome {
    let account = &unique("running");
    let key = unique("key");
    let charge = Charge::new(principal, account, Some(&key), AMOUNT);
    let call = charge.call();
    let proxy = proxy_to(instance)?;
    let client = client(IdempotentRetry::new().policy(fixed(IN_PROGRESS_BACKOFF)))?;
    let (first, (second, arrivals)) = tokio::join!(instance.api.send(&call), async {
        tokio::time::sleep(DUPLICATE_AFTER).await;
        send_watched(&charge, &client, &proxy).await
    });
    let (first, second) = (first?, second?);
    if first.status != 201 || first.replayed() {
        return Err(Failure::unexpected(
            &call,
            "201, not replayed (the plain client's charge)",
            &first,
        ));
    }
    second.answer.replays(&first).map_err(|why| {
        Failure::wrong(
            &call,
            format!(
                "through idem-client, {}ms into the first: the replay of the first",
                DUPLICATE_AFTER.as_millis()
            ),
            &second.answer,
            &why,
        )
    })?;
    // The first attempt's 409 comes at once, or after the route's wait; the
    // retry reaches the server its Retry-After and the backoff later, give
    // or take what the 5 ms polling of a busy machine misses (300 ms: a
    // retry on the backoff alone would come 1 s early); the replay comes
    // once the first is done, at the latest 1 s after either.
    let answered = if waits {
        TRANSACTIONAL_WAIT
    } else {
        Duration::ZERO
    };
    let retried = answered + CONFLICT_RETRY_AFTER + IN_PROGRESS_BACKOFF;
    let done = latency.saturating_sub(DUPLICATE_AFTER);
    let took = retried..retried.max(done) + Duration::from_secs(1);
    let gap = match arrivals.as_slice() {
        [first, second] => Some(second.duration_since(*first)),
        _ => None,
    };
    let least_gap = retried.saturating_sub(Duration::from_millis(300));
    let keyed = sent_key(&second.attempts).as_deref() == Some(key.as_str());
    if second.attempts.sent != 2
        || !keyed
        || !took.contains(&second.took)
        || gap.is_none_or(|gap| gap < least_gap)
    {
        return Err(Failure::new(
            format!(
                "{} attempts in {:.1} s",
                second.attempts.sent,
                second.took.as_secs_f64()
            ),
            format!(
                "request: {call} through idem-client, {}ms into the first \
                 (provider latency {latency:?})\n\
                 expected: 2 attempts with the caller's key, 2 connections at the \
                 proxy {least_gap:?} or more apart (a 409, its Retry-After of \
                 {CONFLICT_RETRY_AFTER:?} and the backoff's {IN_PROGRESS_BACKOFF:?} \
                 waited, the replay), the answer within {took:?}\n\
                 got: {} attempts with key {:?}, {} connections, {}, the answer in {:?}",
                DUPLICATE_AFTER.as_millis(),
                second.attempts.sent,
                sent_key(&second.attempts),
                proxy.connections(),
                gap.map_or("no gap".to_owned(), |gap| format!("{gap:?} apart")),
                second.took
            ),
        ));
    }
    expect_account(
        &instance.api,
        principal,
        account,
        effects(1, AMOUNT),
        "a charge sent again through idem-client while it ran",
    )
    .await?;
    let (waited, apart) = match waits {
        true => ("after the route's 10 s wait ", "10 s + 1 s + 200 ms"),
        false => ("", "1 s + 200 ms"),
    };
    Ok(format!(
        "409 {waited}→ retry {:.2} s after the first attempt ({apart}) → 201 replayed; \
         2 attempts in {:.1} s; 1 operation",
        gap.unwrap_or_default().as_secs_f64(),
        second.took.as_secs_f64()
    ))
}

/// Sends `charge` through `client` to the server behind `proxy`, noting when
/// each connection (each attempt: the client keeps none idle) reached the
/// proxy, polled every 5 ms.
async fn send_watched(
    charge: &Charge<'_>,
    client: &ClientWithMiddleware,
    proxy: &Proxy,
) -> (Result<Sent, Failure>, Vec<Instant>) {
    let front = format!("http://{}", proxy.addr());
    let sending = charge.send(client, &front);
    tokio::pin!(sending);
    let mut arrivals = Vec::new();
    let note = |arrivals: &mut Vec<Instant>| {
        let now = Instant::now();
        let seen = usize::try_from(proxy.connections()).unwrap_or(usize::MAX);
        while arrivals.len() < seen {
            arrivals.push(now);
        }
    };
    loop {
        tokio::select! {
            sent = &mut sending => {
                note(&mut arrivals);
                return (sent, arrivals);
            }
            () = tokio::time::sleep(Duration::from_millis(5)) => note(&mut arrivals),
        }
    }
}

/// The key sent again with another body: `422`, never retried.
async fn reused_key(instance: &Instance, principal: &str) -> Outcome {
    let account = &unique("reused");
    let key = unique("key");
    let call = Call::charge(principal, account, &key, AMOUNT);
    let first = instance.api.send(&call).await?;
    if first.status != 201 {
        return Err(Failure::unexpected(&call, "201", &first));
    }
    let proxy = proxy_to(instance)?;
    let client = client(IdempotentRetry::new().policy(fixed(Duration::from_millis(100))))?;
    let other = Charge::new(principal, account, Some(&key), 2 * AMOUNT);
    let sent = other
        .send(&client, &format!("http://{}", proxy.addr()))
        .await?;
    sent.answer
        .problem(422, Some("key-reused"))
        .map_err(|why| {
            Failure::wrong(
                &other.call(),
                "through idem-client: 422 problem key-reused",
                &sent.answer,
                &why,
            )
        })?;
    let connections = proxy.connections();
    if sent.attempts.sent != 1 || connections != 1 {
        return Err(Failure::new(
            format!("{} attempts", sent.attempts.sent),
            format!(
                "request: {} through idem-client\n\
                 expected: 1 attempt, 1 connection at the proxy (a 422 is never retried)\n\
                 got: {} attempts, {connections} connections",
                other.call(),
                sent.attempts.sent
            ),
        ));
    }
    expect_account(
        &instance.api,
        principal,
        account,
        effects(1, AMOUNT),
        "a key reused through idem-client",
    )
    .await?;
    Ok("422 key-reused; 1 attempt = 1 connection; 1 operation".to_owned())
}

/// `STORM` charges at once against a server whose store is cut off, through
/// one middleware without a budget, then through one with: every charge
/// ends `503 store-unavailable`; the first storm sends each 4 times, the
/// second at most a fifth more than its first attempts. Then the store comes
/// back and a charge passes.
pub(super) async fn budget(deployment: Arc<Deployment>) -> Result<Checks, Failure> {
    let site = deployment.site("client-budget").await?;
    let (database, through) = split_postgres_url(site.store_url())?;
    let store = Proxy::tcp(database)
        .map_err(|e| Failure::new("no proxy", format!("a proxy to PostgreSQL: {e}")))?;
    let instance = site.start_on(&through(store.port()), &[]).await?;
    let outcome: Outcome = async {
        // A front each, to count each storm's requests while both run.
        let front = proxy_to(&instance)?;
        let base = &format!("http://{}", front.addr());
        let budget_front = proxy_to(&instance)?;
        let budget_base = &format!("http://{}", budget_front.addr());
        let principal = &unique("mallory");
        let account = &unique("storm");
        let cut = Instant::now();
        store.set(Fault::Reset);
        let storm_policy = fixed(STORM_DELAY)
            .max_retries(STORM_RETRIES)
            .retry_after_cap(STORM_DELAY);
        let unbudgeted = IdempotentRetry::new().policy(storm_policy).without_budget();
        let budgeted =
            IdempotentRetry::new()
                .policy(storm_policy)
                .budget(BUDGET_WINDOW, 0, BUDGET_SHARE);
        let (without, with) = tokio::join!(
            storm(&front, base, principal, account, unbudgeted),
            storm(&budget_front, budget_base, principal, account, budgeted),
        );
        let (without, with) = (without?, with?);
        let down = cut.elapsed();
        store.set(Fault::None);

        let (counted_without, counted_with) = (without.requests, with.requests);
        let attempts = STORM * (STORM_RETRIES + 1);
        if counted_without != attempts || without.sent.iter().any(|&sent| sent != STORM_RETRIES + 1)
        {
            return Err(Failure::new(
                format!("{counted_without} requests without budget"),
                format!(
                    "{STORM} charges at once through idem-client without a budget, \
                     {STORM_RETRIES} retries each, the store cut off\n\
                     expected: {attempts} requests at the server, {} attempts per charge\n\
                     got: {counted_without} requests; attempts per charge {:?}",
                    STORM_RETRIES + 1,
                    without.sent
                ),
            ));
        }
        // 20 % of the first attempts, which all fall in the window: the
        // budgeted storm's refusals end it within a second.
        let most = STORM + STORM / 5;
        let sent: u32 = with.sent.iter().sum();
        if !(STORM + 1..=most).contains(&counted_with) || sent != counted_with {
            return Err(Failure::new(
                format!("{counted_with} requests with the budget"),
                format!(
                    "{STORM} charges at once through idem-client with a budget of \
                     {:.0} % over {BUDGET_WINDOW:?}, no floor, the store cut off \
                     (for {down:?} in all)\n\
                     expected: {} to {most} requests at the server, as many as the \
                     middleware counted\n\
                     got: {counted_with} requests, {sent} counted by the middleware \
                     (attempts per charge {:?})",
                    BUDGET_SHARE * 100.0,
                    STORM + 1,
                    with.sent,
                ),
            ));
        }

        // Back: a charge passes (the pool reconnects), and the storms left
        // nothing on the account.
        let recovery = IdempotentRetry::new()
            .policy(fixed(Duration::from_millis(200)).retry_after_cap(Duration::from_secs(1)));
        let charge = Charge::new(principal, account, None, AMOUNT);
        let back = charge.send(&client(recovery)?, base).await?;
        if back.answer.status != 201 || back.answer.replayed() {
            return Err(Failure::unexpected(
                &charge.call(),
                "through idem-client, the store back: 201, not replayed",
                &back.answer,
            ));
        }
        expect_account(
            &instance.api,
            principal,
            account,
            effects(1, AMOUNT),
            "two storms of charges answered 503, then one charge once the store was back",
        )
        .await?;
        let retry_after: BTreeSet<String> = without
            .retry_after
            .union(&with.retry_after)
            .cloned()
            .collect();
        Ok(format!(
            "{STORM} charges × 503 (Retry-After {}): without budget {counted_without} requests, \
             with {counted_with} (+{} retries); store back → 201 in {} attempt(s), 1 operation; \
             down {:.1} s",
            retry_after.into_iter().collect::<Vec<_>>().join(", "),
            counted_with - STORM,
            back.attempts.sent,
            down.as_secs_f64()
        ))
    }
    .await;
    Ok(vec![(BUDGET, outcome)])
}

/// `STORM` charges at once through one `retry` middleware, each with a key it
/// mints, every one to end in `503 store-unavailable` with a `Retry-After`.
async fn storm(
    front: &Proxy,
    base: &str,
    principal: &str,
    account: &str,
    retry: IdempotentRetry,
) -> Result<Storm, Failure> {
    let client = client(retry)?;
    let before = front.connections();
    let sent = join_all((1..=i64::from(STORM)).map(|amount| {
        let client = &client;
        async move {
            let charge = Charge::new(principal, account, None, amount);
            let sent = charge.send(client, base).await?;
            sent.answer
                .problem(503, Some("store-unavailable"))
                .map_err(|why| {
                    Failure::wrong(
                        &charge.call(),
                        "through idem-client, the store cut off: 503 store-unavailable",
                        &sent.answer,
                        &why,
                    )
                })?;
            let retry_after = sent.answer.header("retry-after").ok_or_else(|| {
                Failure::wrong(
                    &charge.call(),
                    "503 with Retry-After",
                    &sent.answer,
                    "no Retry-After",
                )
            })?;
            Ok((sent.attempts.sent, retry_after))
        }
    }))
    .await;
    let counted = front.connections() - before;
    let mut storm = Storm {
        sent: Vec::new(),
        requests: u32::try_from(counted).unwrap_or(u32::MAX),
        retry_after: BTreeSet::new(),
    };
    for answer in sent {
        let (sent, retry_after) = answer?;
        storm.sent.push(sent);
        storm.retry_after.insert(retry_after);
    }
    Ok(storm)
}

/// What a storm did.
struct Storm {
    /// The attempts the middleware sent for each charge.
    sent: Vec<u32>,
    /// The requests that reached the server.
    requests: u32,
    /// The `Retry-After` values of the final answers.
    retry_after: BTreeSet<String>,
}

/// A charge sent through idem-client.
struct Charge<'a> {
    principal: &'a str,
    account: &'a str,
    /// The caller's key; without one, the middleware mints it.
    key: Option<&'a str>,
    amount: i64,
}

/// What the client got for a [`Charge`], and what the middleware did for it.
struct Sent {
    answer: Answer,
    attempts: Attempts,
    /// From the first attempt to the final answer's head.
    took: Duration,
}

impl<'a> Charge<'a> {
    fn new(principal: &'a str, account: &'a str, key: Option<&'a str>, amount: i64) -> Self {
        Self {
            principal,
            account,
            key,
            amount,
        }
    }

    /// The same charge as the plain client writes it (the same body bytes,
    /// so the same fingerprint), for failure reports.
    fn call(&self) -> Call {
        match self.key {
            Some(key) => Call::charge(self.principal, self.account, key, self.amount),
            None => Call::charge(self.principal, self.account, "", self.amount).keys(&[]),
        }
    }

    /// Sends it to the server at `base` through `client`, and reads the
    /// whole answer; a transport error after the middleware's last attempt
    /// is a failure.
    async fn send(&self, client: &ClientWithMiddleware, base: &str) -> Result<Sent, Failure> {
        let described = || format!("{} through idem-client", self.call());
        let mut request = client
            .post(format!("{base}/accounts/{}/charges", self.account))
            .bearer_auth(self.principal)
            .header("content-type", "application/json")
            .body(json!({"amount": self.amount, "currency": "EUR"}).to_string());
        if let Some(key) = self.key {
            request = request.header(KEY_HEADER, key);
        }
        let started = Instant::now();
        let response = request.send().await.map_err(|error| {
            Failure::new(
                "no answer",
                format!(
                    "request: {}\nexpected: an answer\ngot: {}",
                    described(),
                    idem_core::log::error_chain(&error)
                ),
            )
        })?;
        let took = started.elapsed();
        let attempts = attempts(&response).cloned().ok_or_else(|| {
            Failure::new(
                "no attempts",
                format!(
                    "request: {}\nexpected: the middleware's Attempts on the answer\ngot: none",
                    described()
                ),
            )
        })?;
        let answer = Answer::read(response).await.map_err(|error| {
            Failure::new(
                "body cut off",
                format!(
                    "request: {}\nexpected: a whole answer\ngot: {}",
                    described(),
                    idem_core::log::error_chain(&error)
                ),
            )
        })?;
        Ok(Sent {
            answer,
            attempts,
            took,
        })
    }
}

/// A client through `retry` that keeps no idle connection: every attempt
/// opens a connection of its own, so that a proxy's `connections()` counts
/// the requests that reached the server.
fn client(retry: IdempotentRetry) -> Result<ClientWithMiddleware, Failure> {
    let http = reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(0)
        .build()
        .map_err(|e| Failure::new("no client", format!("cannot build the HTTP client: {e}")))?;
    Ok(ClientBuilder::new(http).with(retry).build())
}

/// The default policy with a fixed backoff of `delay`, no jitter: the
/// harness knows when a retry without `Retry-After` comes.
fn fixed(delay: Duration) -> RetryPolicy {
    RetryPolicy::default().backoff(Backoff::new(delay, delay).jitter(Jitter::None))
}

/// The key every attempt carried, as text.
fn sent_key(attempts: &Attempts) -> Option<String> {
    attempts
        .key
        .as_ref()
        .map(|key| String::from_utf8_lossy(key.as_bytes()).into_owned())
}

/// The key the middleware minted (the request had none).
fn minted(attempts: &Attempts) -> Option<String> {
    sent_key(attempts).filter(|key| !key.is_empty())
}

/// A TCP proxy in front of `instance`, passing everything until told otherwise.
fn proxy_to(instance: &Instance) -> Result<Proxy, Failure> {
    let base = instance.base();
    let addr: SocketAddr = base
        .strip_prefix("http://")
        .and_then(|addr| addr.parse().ok())
        .ok_or_else(|| {
            Failure::new(
                "no address",
                format!("the server listens on {base:?}, not http://IP:PORT"),
            )
        })?;
    Proxy::tcp(addr).map_err(|e| Failure::new("no proxy", format!("a proxy to {addr}: {e}")))
}

/// The address of the database a `postgres://USER@HOST:PORT/NAME` URL names,
/// and the same URL with another port on 127.0.0.1 (a proxy's).
fn split_postgres_url(url: &str) -> Result<(SocketAddr, impl Fn(u16) -> String), Failure> {
    let unreadable = || {
        Failure::new(
            "unreadable store URL",
            format!("expected postgres://USER@HOST:PORT/NAME, got {url:?}"),
        )
    };
    let (head, tail) = url.split_once('@').ok_or_else(unreadable)?;
    let (host, database) = tail.split_once('/').ok_or_else(unreadable)?;
    let addr: SocketAddr = host.parse().map_err(|_| unreadable())?;
    let (head, database) = (head.to_owned(), database.to_owned());
    Ok((addr, move |port: u16| {
        format!("{head}@127.0.0.1:{port}/{database}")
    }))
}

//! Charges still running when the client asks again or gives up; the
//! provider latency (`--provider-latency-ms`) keeps them in flight.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::join_all;
use payments_provider::Provider;

use super::{Checks, random_millis, unique};
use crate::e2e::api::{Answer, Call, Failure, Outcome, effects, expect_account};
use crate::e2e::site::{Deployment, Site};

pub(super) const IN_PROGRESS: &str = "in progress → 409 Retry-After";
pub(super) const TIMEOUTS: &str = "random client timeouts, retried";
pub(super) const DISCONNECT: &str = "client disconnect, then retry";

/// Distinct keys in the timeouts scenario; their amounts are 1..=KEYS.
const KEYS: i64 = 40;

pub(super) async fn in_progress(deployment: Arc<Deployment>) -> Result<Checks, Failure> {
    let site = deployment.site("in-progress").await?;
    let outcome: Outcome = async {
        match duplicate_in_flight(&site, Duration::from_millis(1500)).await? {
            Duplicate::Conflict(retry_after) => Ok(format!(
                "409 request-in-progress, Retry-After: {retry_after}; then 201, replay; 1 operation"
            )),
            // The route waits for the running request (`docs/contract.md` §4, "configured
            // to wait"); past its bound the answer is 409.
            Duplicate::Waited => match duplicate_in_flight(&site, PAST_ANY_WAIT).await? {
                Duplicate::Conflict(retry_after) => Ok(format!(
                    "waits, then replays; past the wait 409, Retry-After: {retry_after}; 1 operation"
                )),
                Duplicate::Waited => Err(Failure::new(
                    "never 409",
                    format!(
                        "request: a charge twice, the second 300 ms into the first, \
                         with --provider-latency-ms {}\n\
                         expected: 409 request-in-progress once the wait is over\n\
                         got: the second waited to the end and replayed the first",
                        PAST_ANY_WAIT.as_millis()
                    ),
                )),
            },
        }
    }
    .await;
    Ok(vec![(IN_PROGRESS, outcome)])
}

/// Longer than any route of the examples waits for a running request (10 s in
/// transactional mode, `payments::TRANSACTIONAL_WAIT`).
const PAST_ANY_WAIT: Duration = Duration::from_secs(14);

/// How a duplicate of a running charge was answered.
enum Duplicate {
    /// `409` with this `Retry-After`.
    Conflict(String),
    /// After the first completed, with its replay.
    Waited,
}

/// A charge that takes `latency`, and the same charge again 300 ms into it;
/// then a third time, which replays it, and the account shows one operation.
///
/// Whichever of the two the server claimed first runs: on a loaded machine
/// the first may not have reached the idempotency layer 300 ms in, and then
/// the second runs and the first is its duplicate. Either way one is a fresh
/// `201` and the other its duplicate.
async fn duplicate_in_flight(site: &Site, latency: Duration) -> Result<Duplicate, Failure> {
    let latency = latency.as_millis().to_string();
    let instance = site.start(&["--provider-latency-ms", &latency]).await?;
    let api = &instance.api;
    let principal = &unique("carol");
    let account = &unique("busy");
    let call = Call::charge(principal, account, &unique("key"), 100);
    let (first, second) = tokio::join!(api.send(&call), async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        api.send(&call).await
    });
    let (first, second) = (first?, second?);
    let fresh = |answer: &Answer| answer.status == 201 && !answer.replayed();
    let (first, second) = match (fresh(&first), fresh(&second)) {
        (true, _) => (first, second),
        (false, true) => (second, first),
        (false, false) => {
            return Err(Failure::unexpected(&call, "201, not replayed", &first));
        }
    };
    let duplicate = if second.status == 409 {
        second
            .problem(409, Some("request-in-progress"))
            .map_err(|why| {
                Failure::wrong(
                    &call,
                    "409 request-in-progress (the first is in flight)",
                    &second,
                    &why,
                )
            })?;
        let retry_after = second.header("retry-after").ok_or_else(|| {
            Failure::wrong(&call, "409 with Retry-After", &second, "no Retry-After")
        })?;
        Duplicate::Conflict(retry_after)
    } else {
        second.replays(&first).map_err(|why| {
            Failure::wrong(
                &call,
                "409 request-in-progress, or (a route that waits) the replay of the first",
                &second,
                &why,
            )
        })?;
        Duplicate::Waited
    };
    let third = api.send(&call).await?;
    third
        .replays(&first)
        .map_err(|why| Failure::wrong(&call, "a replay once completed", &third, &why))?;
    expect_account(
        api,
        principal,
        account,
        effects(1, 100),
        "a charge asked twice in flight",
    )
    .await?;
    Ok(duplicate)
}

pub(super) async fn timeouts(deployment: Arc<Deployment>) -> Result<Checks, Failure> {
    let site = deployment.site("timeouts").await?;
    let instance = site.start(&["--provider-latency-ms", "200"]).await?;
    let api = &instance.api;
    let principal = &unique("dave");
    let account = &unique("flaky");
    let calls: Vec<(i64, Call)> = (1..=KEYS)
        .map(|amount| {
            (
                amount,
                Call::charge(principal, account, &unique("key"), amount),
            )
        })
        .collect();
    let outcome: Outcome = async {
        // Each attempt gives up after 20..=300 ms: some before the charge
        // starts, some while it runs, some never.
        let settled = join_all(calls.iter().map(|(_, call)| {
            api.settle(
                call,
                || Some(Duration::from_millis(random_millis(20, 300))),
                Duration::from_secs(60),
            )
        }))
        .await;
        let (mut timeouts, mut conflicts, mut broken) = (0, 0, 0);
        for ((amount, call), settled) in calls.iter().zip(settled) {
            let settled = settled?;
            let answer = &settled.answer;
            let body = answer.json().unwrap_or_default();
            if answer.status != 201 || body["amount"] != *amount {
                return Err(Failure::unexpected(
                    call,
                    format!("201 for amount {amount}, fresh or replayed"),
                    answer,
                ));
            }
            timeouts += settled.timeouts;
            broken += settled.broken;
            conflicts += settled.on_the_way.get(&409).copied().unwrap_or(0);
        }
        let total = KEYS * (KEYS + 1) / 2;
        expect_account(
            api,
            principal,
            account,
            effects(KEYS, total),
            "every key settled",
        )
        .await?;
        let broken = if broken > 0 {
            format!(", {broken} broken connections")
        } else {
            String::new()
        };
        Ok(format!(
            "{KEYS} keys → {KEYS} operations, balance {total}; \
             {timeouts} timeouts, {conflicts} × 409 on the way{broken}"
        ))
    }
    .await;
    Ok(vec![(TIMEOUTS, outcome)])
}

/// What the disconnect scenario needs from the example: the stand-in
/// provider tells when the charge's handler runs.
pub(super) const DISCONNECT_FLAGS: &[&str] = &["--provider-url"];

/// How long the stand-in provider takes to accept the charge the client gives
/// up on.
const PROVIDER_DELAY: Duration = Duration::from_millis(1500);

/// The client gives up on its charge once the provider has it, so its handler
/// runs (`docs/contract.md` §5: a client that disconnects does not cancel the
/// work). Giving up after a fixed time instead would, on a loaded machine,
/// sometimes give up before the handler started: the request is then given up
/// whole, its claim released, and the retry is its first run.
pub(super) async fn disconnect(deployment: Arc<Deployment>) -> Result<Checks, Failure> {
    let site = deployment.site("disconnect").await?;
    let provider = Provider::start()
        .await
        .map_err(|e| Failure::new("no provider", format!("the stand-in provider: {e}")))?;
    provider.answer_after(PROVIDER_DELAY);
    let instance = site.start(&["--provider-url", &provider.url()]).await?;
    let api = &instance.api;
    let principal = &unique("erin");
    let account = &unique("gone");
    let call = Call::charge(principal, account, &unique("key"), 100);
    let outcome: Outcome = async {
        let reached = idem_testkit::wait::until(
            "the charge's call to the provider",
            Duration::from_secs(10),
            || async {
                match provider.received().len() {
                    0 => Err("no call yet".to_owned()),
                    _ => Ok(()),
                }
            },
        );
        tokio::select! {
            answer = api.send(&call) => {
                return Err(Failure::unexpected(
                    &call,
                    "no answer before the provider accepts the charge (it takes 1.5 s)",
                    &answer?,
                ));
            }
            reached = reached => reached.map_err(|why| {
                Failure::new(
                    "the charge never reached the provider",
                    format!("request: {call}\n{why}"),
                )
            })?,
        }
        // The client has gone; its charge's handler runs on.
        let settled = api.settle(&call, || None, Duration::from_secs(30)).await?;
        let answer = &settled.answer;
        if answer.status != 201 || !answer.replayed() {
            // A fresh 201 means the first charge was cancelled with its client.
            return Err(Failure::unexpected(
                &call,
                "the replay of the charge the client gave up on (docs/contract.md §5)",
                answer,
            ));
        }
        let calls = provider.received().len();
        if calls != 1 {
            return Err(Failure::new(
                format!("{calls} provider calls"),
                format!(
                    "request: {call}, given up once the provider had it, then retried\n\
                     expected: one provider call\ngot: {calls}"
                ),
            ));
        }
        expect_account(
            api,
            principal,
            account,
            effects(1, 100),
            "a disconnect and a retry",
        )
        .await?;
        Ok(format!(
            "gave up once the provider had the charge; retry → {}replay; 1 operation",
            waits(&settled.on_the_way)
        ))
    }
    .await;
    Ok(vec![(DISCONNECT, outcome)])
}

/// "2 × 409, " for the answers a retry got before its final one.
pub(super) fn waits(on_the_way: &BTreeMap<u16, u32>) -> String {
    on_the_way
        .iter()
        .map(|(status, n)| format!("{n} × {status}, "))
        .collect()
}

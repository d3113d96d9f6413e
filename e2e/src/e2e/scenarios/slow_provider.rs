//! A payment provider slower than the lease (`--lease-secs 1`,
//! `--provider-url` of a stand-in provider that answers after 2.5 s) while a
//! client retries the same charge every 250 ms: the lease is renewed while the
//! charge runs, so the provider is called once, the first client gets its
//! `201`, and every retry is told the charge is running or replays it.

use std::sync::Arc;
use std::time::Duration;

use futures_util::future::join_all;
use payments_provider::Provider;

use super::{Checks, unique};
use crate::e2e::api::{Answer, Call, Failure, Outcome, effects, expect_account};
use crate::e2e::site::Deployment;

pub(super) const CHECK: &str = "provider slower than the lease → 1 call";

/// The flags the scenario needs from the example.
pub(super) const FLAGS: &[&str] = &["--provider-url", "--lease-secs"];

/// The lease, and how long the provider takes: two and a half leases.
const LEASE_SECS: u64 = 1;
const PROVIDER_DELAY: Duration = Duration::from_millis(2500);

/// How often the impatient client sends the charge again.
const RETRY_EVERY: Duration = Duration::from_millis(250);

pub(super) async fn run(deployment: Arc<Deployment>) -> Result<Checks, Failure> {
    let site = deployment.site("slow-provider").await?;
    let provider = Provider::start()
        .await
        .map_err(|e| Failure::new("no provider", format!("the stand-in provider: {e}")))?;
    provider.answer_after(PROVIDER_DELAY);
    let url = provider.url();
    let lease = LEASE_SECS.to_string();
    let instance = site
        .start(&["--lease-secs", &lease, "--provider-url", &url])
        .await?;
    let api = &instance.api;
    let principal = &unique("erin");
    let account = &unique("slow");
    let call = Call::charge(principal, account, &unique("key"), 100);
    let outcome: Outcome = async {
        let first = api.send(&call);
        let retries = async {
            // A retry every 250 ms while the first runs, each on its own: on
            // routes that wait for a running request, a retry waits too.
            let mut sent = Vec::new();
            let mut elapsed = Duration::ZERO;
            while elapsed < PROVIDER_DELAY + Duration::from_millis(500) {
                tokio::time::sleep(RETRY_EVERY).await;
                elapsed += RETRY_EVERY;
                let (api, call) = (api.clone(), call.clone());
                sent.push(tokio::spawn(async move { api.send(&call).await }));
            }
            join_all(sent).await
        };
        let (first, retries) = tokio::join!(first, retries);
        let first = first?;
        if first.status != 201 || first.replayed() {
            return Err(Failure::unexpected(
                &call,
                "201, not replayed (the first client keeps its charge)",
                &first,
            ));
        }
        let (mut conflicts, mut replays) = (0, 0);
        for retry in retries {
            let retry = retry.map_err(|e| Failure::new("harness task failed", e.to_string()))??;
            if in_progress(&retry).is_ok() {
                conflicts += 1;
            } else {
                retry.replays(&first).map_err(|why| {
                    Failure::wrong(
                        &call,
                        "409 request-in-progress, or the replay of the first",
                        &retry,
                        &why,
                    )
                })?;
                replays += 1;
            }
        }
        let last = api.send(&call).await?;
        last.replays(&first)
            .map_err(|why| Failure::wrong(&call, "the replay of the first", &last, &why))?;
        let calls = provider.calls_per_key();
        if calls.len() != 1 || calls.values().any(|&n| n != 1) {
            return Err(Failure::new(
                format!("{} provider calls", calls.values().sum::<usize>()),
                format!(
                    "request: {call}, retried every {RETRY_EVERY:?}, with --lease-secs \
                     {LEASE_SECS} and a provider answering after {PROVIDER_DELAY:?}\n\
                     expected: one provider call\ngot: calls per forwarded key {calls:?}"
                ),
            ));
        }
        expect_account(
            api,
            principal,
            account,
            effects(1, 100),
            "a charge slower than its lease, retried",
        )
        .await?;
        Ok(format!(
            "1 provider call, 201; retries: {conflicts} × 409, {replays} replays"
        ))
    }
    .await;
    Ok(vec![(CHECK, outcome)])
}

fn in_progress(answer: &Answer) -> Result<(), String> {
    answer.problem(409, Some("request-in-progress"))
}

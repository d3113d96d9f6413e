//! PostgreSQL stops under load and comes back. Each scenario has a cluster of
//! its own: stopping the shared one would fail every scenario beside it.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::join_all;

use super::{Checks, unique};
use crate::e2e::api::{Answer, Api, Call, Failure, Outcome, effects, expect_account};
use crate::e2e::postgres::Cluster;
use crate::e2e::site::{Deployment, Instance, blocking};

pub(super) const DOWN: &str = "PostgreSQL down → 503, back → settles";
pub(super) const CUT_OFF: &str = "PostgreSQL stops mid-charge → 1 effect";

/// Keys charged before the outage, and keys first sent during it.
const BEFORE: i64 = 4;
const DURING: i64 = 8;
/// Times every key is sent while the database is down.
const ROUNDS: usize = 3;
/// Charges in flight when the database stops.
const STOPPED_MID_CHARGE: i64 = 8;

const PATIENCE: Option<Duration> = Some(Duration::from_secs(60));

/// Nothing in flight when it stops: every request while down fails closed
/// (`503`, the handler does not run), and once it is back every key settles
/// with exactly one effect.
pub(super) async fn down(deployment: Arc<Deployment>) -> Result<Checks, Failure> {
    let (cluster, instance) = start(&deployment, "outage", &[]).await?;
    let api = &instance.api;
    let principal = &unique("ivan");
    let account = &unique("outage");
    let calls = charges(principal, account, BEFORE + DURING);
    let outcome: Outcome = async {
        for call in &calls[..BEFORE as usize] {
            let answer = api.send(call).await?;
            if answer.status != 201 {
                return Err(Failure::unexpected(call, "201 before the outage", &answer));
            }
        }
        stop(&cluster).await?;
        let mut unavailable = 0;
        for _ in 0..ROUNDS {
            let answers = join_all(calls.iter().map(|call| api.send_within(call, PATIENCE))).await;
            for (call, answer) in calls.iter().zip(answers) {
                let Some(answer) = answer? else {
                    return Err(Failure::new(
                        "no answer while down",
                        format!("request: {call}\nexpected: 503 within 60 s\ngot: a timeout"),
                    ));
                };
                answer.problem(503, Some("store-unavailable")).map_err(|why| {
                    Failure::wrong(call, "503 problem store-unavailable (fail closed)", &answer, &why)
                })?;
                if answer.header("retry-after").is_none() {
                    return Err(Failure::wrong(call, "503 with Retry-After", &answer, "no Retry-After"));
                }
                unavailable += 1;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        resume(&cluster).await?;
        let keys = settle_all(api, &calls).await?.len() as i64;
        expect_account(api, principal, account, effects(keys, keys * (keys + 1) / 2), "an outage and its retries")
            .await?;
        Ok(format!(
            "down: {unavailable}/{unavailable} × 503 Retry-After; back: {keys} keys → {keys} operations"
        ))
    }
    .await;
    Ok(vec![(DOWN, outcome)])
}

/// Charges in flight when it stops: whatever they answered, their retries
/// settle with one effect each. This takes transactional mode (`docs/contract.md` §7):
/// without it a charge's effect outlives its unrecorded answer.
pub(super) async fn cut_off(deployment: Arc<Deployment>) -> Result<Checks, Failure> {
    let flags = ["--provider-latency-ms", "500"];
    let (cluster, instance) = start(&deployment, "outage-mid-charge", &flags).await?;
    let api = &instance.api;
    let principal = &unique("ivan");
    let account = &unique("cut-off");
    let calls = charges(principal, account, STOPPED_MID_CHARGE);
    let outcome: Outcome = async {
        let (answers, stopped) = tokio::join!(
            join_all(calls.iter().map(|call| api.send_within(call, PATIENCE))),
            async {
                tokio::time::sleep(Duration::from_millis(200)).await;
                stop(&cluster).await
            }
        );
        stopped?;
        // A broken connection is no answer, like a timeout.
        let cut_off: Vec<Option<Answer>> = answers.into_iter().map(|a| a.ok().flatten()).collect();
        resume(&cluster).await?;
        let keys = settle_all(api, &calls).await?.len() as i64;
        expect_account(
            api,
            principal,
            account,
            effects(keys, keys * (keys + 1) / 2),
            &format!(
                "charges cut off 200 ms in by the outage (they answered {}), then retried",
                summary(&cut_off)
            ),
        )
        .await?;
        Ok(format!(
            "cut off: {}; back: {keys} keys → {keys} operations",
            summary(&cut_off)
        ))
    }
    .await;
    Ok(vec![(CUT_OFF, outcome)])
}

/// "3 × 201, 5 × 503" for the answers of charges cut off.
fn summary(answers: &[Option<Answer>]) -> String {
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    for answer in answers {
        let status = answer
            .as_ref()
            .map_or("no answer".to_owned(), |a| a.status.to_string());
        *counts.entry(status).or_default() += 1;
    }
    counts
        .iter()
        .map(|(status, n)| format!("{n} × {status}"))
        .collect::<Vec<_>>()
        .join(", ")
}

async fn start(
    deployment: &Deployment,
    scenario: &str,
    flags: &[&str],
) -> Result<(Arc<Cluster>, Instance), Failure> {
    let cluster = deployment.own_cluster(scenario).await?;
    let site = deployment.site_on(scenario, Some(cluster.clone())).await?;
    let instance = site.start(flags).await?;
    Ok((cluster, instance))
}

/// Charges of 1, 2, … `n`, each with a key of its own.
fn charges(principal: &str, account: &str, n: i64) -> Vec<Call> {
    (1..=n)
        .map(|amount| Call::charge(principal, account, &unique("key"), amount))
        .collect()
}

/// Retries every call until it has its final answer, a `201`.
async fn settle_all(api: &Api, calls: &[Call]) -> Result<Vec<Answer>, Failure> {
    let settled = join_all(
        calls
            .iter()
            .map(|call| api.settle(call, || PATIENCE, Duration::from_secs(90))),
    )
    .await;
    let mut answers = Vec::new();
    for (call, settled) in calls.iter().zip(settled) {
        let settled = settled?;
        if settled.answer.status != 201 {
            return Err(Failure::unexpected(
                call,
                "201 once PostgreSQL is back",
                &settled.answer,
            ));
        }
        answers.push(settled.answer);
    }
    Ok(answers)
}

async fn stop(cluster: &Arc<Cluster>) -> Result<(), Failure> {
    let cluster = cluster.clone();
    blocking(move || cluster.stop()).await
}

async fn resume(cluster: &Arc<Cluster>) -> Result<(), Failure> {
    let cluster = cluster.clone();
    blocking(move || cluster.resume()).await
}

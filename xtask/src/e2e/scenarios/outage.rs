//! PostgreSQL stops under load and comes back. The scenario has a cluster of
//! its own: stopping the shared one would fail every scenario beside it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::future::join_all;

use super::{Checks, unique};
use crate::e2e::api::{Call, Failure, Outcome, effects, expect_account};
use crate::e2e::site::{Deployment, blocking};

pub(super) const CHECK: &str = "PostgreSQL down → 503, back → settles";

/// Charges in flight when the database stops, and charges sent while it is down.
const IN_FLIGHT: i64 = 8;
const WHILE_DOWN: i64 = 8;

pub(super) async fn run(deployment: Arc<Deployment>) -> Result<Checks, Failure> {
    let cluster = deployment.own_cluster("outage").await?;
    let site = deployment.site_on("outage", Some(cluster.clone())).await?;
    let instance = site.start(&["--provider-latency-ms", "500"]).await?;
    let api = &instance.api;
    let principal = &unique("ivan");
    let account = &unique("outage");
    let calls: Vec<Call> = (1..=IN_FLIGHT + WHILE_DOWN)
        .map(|amount| Call::charge(principal, account, &unique("key"), amount))
        .collect();
    let (in_flight, while_down) = calls.split_at(IN_FLIGHT as usize);
    let patience = Some(Duration::from_secs(60));

    let outcome: Outcome = async {
        // 1. Charges in flight when the database stops: any answer will do,
        //    what matters is that their retries settle once, below.
        let stopping = cluster.clone();
        let (_, stopped) = tokio::join!(
            join_all(in_flight.iter().map(|call| api.send_within(call, patience))),
            async {
                tokio::time::sleep(Duration::from_millis(200)).await;
                blocking(move || stopping.stop()).await
            }
        );
        stopped?;

        // 2. While it is down: fail closed, the handler does not run.
        let started = Instant::now();
        let answers = join_all(
            while_down
                .iter()
                .map(|call| api.send_within(call, patience)),
        )
        .await;
        let slowest = started.elapsed();
        for (call, answer) in while_down.iter().zip(answers) {
            let Some(answer) = answer? else {
                return Err(Failure::new(
                    "no answer while down",
                    format!("request: {call}\nexpected: 503 within 60 s\ngot: a timeout"),
                ));
            };
            answer
                .problem(503, Some("store-unavailable"))
                .map_err(|why| {
                    Failure::wrong(
                        call,
                        "503 problem store-unavailable with Retry-After",
                        &answer,
                        &why,
                    )
                })?;
            if answer.header("retry-after").is_none() {
                return Err(Failure::wrong(
                    call,
                    "503 with Retry-After",
                    &answer,
                    "no Retry-After",
                ));
            }
        }

        // 3. Back: every key settles, and took effect exactly once.
        let resuming = cluster.clone();
        blocking(move || resuming.resume()).await?;
        let settled = join_all(
            calls
                .iter()
                .map(|call| api.settle(call, || patience, Duration::from_secs(90))),
        )
        .await;
        for (call, settled) in calls.iter().zip(settled) {
            let settled = settled?;
            if settled.answer.status != 201 {
                return Err(Failure::unexpected(
                    call,
                    "201 once PostgreSQL is back",
                    &settled.answer,
                ));
            }
        }
        let keys = IN_FLIGHT + WHILE_DOWN;
        let total = keys * (keys + 1) / 2;
        expect_account(
            api,
            principal,
            account,
            effects(keys, total),
            "an outage and its retries",
        )
        .await?;
        Ok(format!(
            "down: {WHILE_DOWN}/{WHILE_DOWN} × 503 Retry-After within {} ms; \
             back: {keys} keys → {keys} operations",
            slowest.as_millis()
        ))
    }
    .await;
    Ok(vec![(CHECK, outcome)])
}

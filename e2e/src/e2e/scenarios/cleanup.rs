//! The cleanup job deletes expired records while the app serves.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Checks, unique};
use crate::e2e::api::{Call, Failure, Outcome, effects, expect_account};
use crate::e2e::site::Deployment;

pub(super) const CHECK: &str = "cleanup deletes expired records";

/// What the example must offer: a short retention, and the cleanup job
/// running often enough to see within seconds.
pub(super) const FLAGS: &[&str] = &["--retention-secs", "--cleanup-interval-secs"];

const RETENTION_SECS: u64 = 2;

pub(super) async fn run(deployment: Arc<Deployment>) -> Result<Checks, Failure> {
    let site = deployment.site("cleanup").await?;
    let retention = RETENTION_SECS.to_string();
    let instance = site.start(&[FLAGS[0], &retention, FLAGS[1], "1"]).await?;
    let api = &instance.api;
    let principal = &unique("judy");
    let account = &unique("expiring");
    let busy = &unique("busy");
    let call = Call::charge(principal, account, &unique("key"), 100);
    let outcome: Outcome = async {
        let first = api.send(&call).await?;
        let again = api.send(&call).await?;
        if first.status != 201 {
            return Err(Failure::unexpected(&call, "201", &first));
        }
        again
            .replays(&first)
            .map_err(|why| Failure::wrong(&call, "a replay while the record lives", &again, &why))?;
        // Serve while the record expires and the job runs; where the harness
        // can count records (SQLite, PostgreSQL), wait for them to go.
        let started = Instant::now();
        let deadline = started + Duration::from_secs(RETENTION_SECS + 15);
        let mut served = 0;
        let deleted = loop {
            let deposit = Call::deposit(principal, busy, 1);
            let answer = api.send(&deposit).await?;
            if answer.status != 201 {
                return Err(Failure::unexpected(&deposit, "201 while cleanup runs", &answer));
            }
            served += 1;
            let expired = started.elapsed() > Duration::from_secs(RETENTION_SECS + 2);
            match site.records().await? {
                Some(0) => break Some(started.elapsed()),
                None if expired => break None,
                _ if Instant::now() > deadline => {
                    return Err(Failure::new(
                        "records not deleted",
                        format!(
                            "after: a charge, retention {RETENTION_SECS} s, cleanup every 1 s\n\
                             expected: no records in the store within {} s\ngot: {:?} records",
                            RETENTION_SECS + 15,
                            site.records().await?
                        ),
                    ));
                }
                _ => tokio::time::sleep(Duration::from_millis(500)).await,
            }
        };
        // Expired counts as absent: the same charge runs afresh.
        let later = api.send(&call).await?;
        if later.status != 201 || later.replayed() {
            return Err(Failure::unexpected(&call, "201, not replayed (the record expired)", &later));
        }
        expect_account(api, principal, account, effects(2, 200), "a charge retried after its record expired")
            .await?;
        Ok(match deleted {
            Some(after) => format!(
                "record deleted {:.1} s after the charge, {served} requests served meanwhile; retry ran afresh",
                after.as_secs_f64()
            ),
            None => format!("expired after {RETENTION_SECS} s, {served} requests served meanwhile; retry ran afresh"),
        })
    }
    .await;
    Ok(vec![(CHECK, outcome)])
}

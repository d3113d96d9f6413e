//! The process goes away and comes back on the same store: stopped cleanly
//! after a charge, or killed in the middle of one.

use std::sync::Arc;
use std::time::Duration;

use super::in_flight::waits;
use super::{Checks, unique};
use crate::e2e::api::{Call, Failure, Outcome, effects, expect_account};
use crate::e2e::site::Deployment;

pub(super) const RESTART: &str = "restart, retry → replay";
pub(super) const CRASH: &str = "SIGKILL mid-charge, restart, retry";
pub(super) const CRASH_AT_WRITE: &str =
    "crash once the charge is written, before its record completes; retry";

pub(super) async fn restart(deployment: Arc<Deployment>) -> Result<Checks, Failure> {
    let site = deployment.site("restart").await?;
    let principal = &unique("grace");
    let account = &unique("durable");
    let call = Call::charge(principal, account, &unique("key"), 100);
    let before = site.start(&[]).await?;
    let first = before.api.send(&call).await?;
    before.terminate().await;
    let after = site.start(&[]).await?;
    let outcome: Outcome = async {
        if first.status != 201 {
            return Err(Failure::unexpected(&call, "201", &first));
        }
        let again = after.api.send(&call).await?;
        again.replays(&first).map_err(|why| {
            Failure::wrong(&call, "the replay of the answer given before the restart", &again, &why)
        })?;
        // Whether accounts outlive the process is the example's business
        // (`docs/contract.md` §8 is silent); a second effect is never right.
        let seen = after.api.account(principal, account).await?;
        if seen.operations > 1 {
            return Err(Failure::new(
                format!("{} operations", seen.operations),
                format!("request: {call}, before and after a restart\nexpected: at most 1 operation\ngot: {}", seen.operations),
            ));
        }
        Ok(format!(
            "replay after restart, {}-byte body identical; account shows {} operation(s)",
            again.body.len(),
            seen.operations
        ))
    }
    .await;
    Ok(vec![(RESTART, outcome)])
}

pub(super) async fn crash(deployment: Arc<Deployment>) -> Result<Checks, Failure> {
    let site = deployment.site("crash").await?;
    let principal = &unique("heidi");
    let account = &unique("crashed");
    // A charge completed before the crash: unless it is still there after the
    // restart, the account cannot show how many effects the cut-off charge had.
    let witness = Call::charge(principal, account, &unique("key"), 1);
    let call = Call::charge(principal, account, &unique("key"), 100);
    let doomed = site.start(&["--provider-latency-ms", "2000"]).await?;
    let api = doomed.api.clone();
    let witnessed = api.send(&witness).await?;
    let killed_after = Duration::from_millis(500);
    // The answer cannot come: the process dies while the provider "works".
    let (_, ()) = tokio::join!(
        api.send_within(&call, Some(Duration::from_secs(10))),
        async {
            tokio::time::sleep(killed_after).await;
            doomed.kill();
        }
    );
    let after = site.start(&[]).await?;
    let outcome: Outcome = async {
        if witnessed.status != 201 {
            return Err(Failure::unexpected(&witness, "201", &witnessed));
        }
        // Up to a lease (30 s by default) may pass before the claim is void.
        let settled = after
            .api
            .settle(&call, || None, Duration::from_secs(75))
            .await?;
        if settled.answer.status != 201 {
            return Err(Failure::unexpected(&call, "201", &settled.answer));
        }
        expect_account(
            &after.api,
            principal,
            account,
            effects(2, 101),
            "a charge of 1, then a charge of 100 cut off by SIGKILL and retried",
        )
        .await?;
        Ok(format!(
            "killed {} ms into the charge; retry → {}201; 1 effect",
            killed_after.as_millis(),
            waits(&settled.on_the_way)
        ))
    }
    .await;
    Ok(vec![(CRASH, outcome)])
}

/// The instant between the handler's write and the record's completion,
/// reached exactly: the server is started with `PAYMENTS_CRASH_AT=write` and
/// dies there (in transactional mode inside the request's transaction; on
/// Redis after the ledger's own step). The retry, once the claim's lease
/// (1 s here) has lapsed, leaves exactly one effect.
pub(super) async fn crash_at_write(deployment: Arc<Deployment>) -> Result<Checks, Failure> {
    let site = deployment.site("crash-at-write").await?;
    let principal = &unique("ivan");
    let account = &unique("written");
    let witness = Call::charge(principal, account, &unique("key"), 1);
    let call = Call::charge(principal, account, &unique("key"), 100);
    let lease = ["--lease-secs", "1"];
    let before = site.start(&lease).await?;
    let witnessed = before.api.send(&witness).await?;
    before.terminate().await;
    let doomed = site
        .start_with_env(&lease, &[("PAYMENTS_CRASH_AT", "write")])
        .await?;
    let lost = doomed
        .api
        .send_within(&call, Some(Duration::from_secs(10)))
        .await;
    doomed.kill();
    let after = site.start(&lease).await?;
    let outcome: Outcome = async {
        if witnessed.status != 201 {
            return Err(Failure::unexpected(&witness, "201", &witnessed));
        }
        // A timeout (`Ok(None)`) or a broken connection (`Err`): no answer.
        if let Ok(Some(answer)) = lost {
            return Err(Failure::unexpected(
                &call,
                "no answer: the server dies at its crash point",
                &answer,
            ));
        }
        let settled = after
            .api
            .settle(&call, || None, Duration::from_secs(30))
            .await?;
        if settled.answer.status != 201 {
            return Err(Failure::unexpected(&call, "201", &settled.answer));
        }
        expect_account(
            &after.api,
            principal,
            account,
            effects(2, 101),
            "a charge of 1, then a charge of 100 whose server died once it was written, retried",
        )
        .await?;
        Ok(format!(
            "died once the charge was written; retry → {}201; 1 effect",
            waits(&settled.on_the_way)
        ))
    }
    .await;
    Ok(vec![(CRASH_AT_WRITE, outcome)])
}

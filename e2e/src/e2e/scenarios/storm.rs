//! A storm: hundreds of concurrent deliveries of one charge, over two
//! instances when the store is shared (PostgreSQL, Redis).

use std::sync::Arc;

use futures_util::future::join_all;

use super::{Checks, unique};
use crate::e2e::api::{Answer, Call, Failure, effects, expect_account};
use crate::e2e::site::{Deployment, Instance, StoreKind};

pub(super) const CHECK: &str = "storm: 500 requests, one key";

const REQUESTS: usize = 500;

pub(super) async fn run(deployment: Arc<Deployment>) -> Result<Checks, Failure> {
    let site = deployment.site("storm").await?;
    // The latency keeps the charge in flight while the storm arrives.
    let flags = ["--provider-latency-ms", "300"];
    let mut instances = vec![site.start(&flags).await?];
    if matches!(deployment.store, StoreKind::Postgres | StoreKind::Redis) {
        // Started one after the other: both would migrate the same database.
        instances.push(site.start(&flags).await?);
    }
    let principal = &unique("frank");
    let account = &unique("storm");
    let call = Call::charge(principal, account, &unique("key"), 100);
    let answers = join_all((0..REQUESTS).map(|i| {
        let by = i % instances.len();
        let api = &instances[by].api;
        let call = &call;
        async move { (by, api.send(call).await) }
    }))
    .await;

    // Fresh answers, with the instance that ran the charge.
    let mut fresh: Vec<(usize, Answer)> = Vec::new();
    let mut replays: Vec<Answer> = Vec::new();
    let mut conflicts = 0;
    let mut wrong = Vec::new();
    for (by, answer) in answers {
        match answer {
            Err(failure) => wrong.push(failure.details),
            Ok(answer) if answer.status == 409 => {
                match answer.problem(409, Some("request-in-progress")) {
                    Ok(()) if answer.header("retry-after").is_some() => conflicts += 1,
                    Ok(()) => wrong.push(format!("409 without Retry-After: {answer}")),
                    Err(why) => wrong.push(format!("{why}: {answer}")),
                }
            }
            Ok(answer) if answer.replayed() => replays.push(answer),
            Ok(answer) if answer.status == 201 => fresh.push((by, answer)),
            Ok(answer) => wrong.push(format!("{answer}")),
        }
    }
    let mut wrong_replays = 0;
    if let [(_, original)] = fresh.as_slice() {
        for replay in &replays {
            if let Err(why) = replay.replays(original) {
                wrong_replays += 1;
                if wrong_replays <= 3 {
                    wrong.push(format!("replay not identical: {why}"));
                }
            }
        }
    }
    let figure = format!(
        "{} × 201, {conflicts} × 409, {} × replay{}",
        fresh.len(),
        replays.len(),
        if instances.len() > 1 {
            ", 2 instances"
        } else {
            ""
        }
    );
    let outcome = if fresh.len() != 1 || !wrong.is_empty() {
        let others = REQUESTS - fresh.len() - replays.len() - conflicts;
        Err(Failure::new(
            figure.clone(),
            format!(
                "request: {REQUESTS} × {call}\n\
                 expected: one 201, every other answer a 409 or its byte-identical replay\n\
                 got: {figure}, {others} other answers, {wrong_replays} replays that differ\n{}",
                wrong.iter().take(5).cloned().collect::<Vec<_>>().join("\n")
            ),
        ))
    } else {
        settled(&instances, &fresh[0], principal, account, &call)
            .await
            .map(|ledgers| format!("1 effect / {REQUESTS} requests: {figure}{ledgers}"))
    };
    Ok(vec![(CHECK, outcome)])
}

/// Once the storm is over: the instance that ran the charge shows exactly one
/// operation, every other shows that one too (a ledger shared through the
/// database) or none (the examples' in-memory ledger, one per process), and
/// every instance replays the one answer.
async fn settled(
    instances: &[Instance],
    (ran_by, original): &(usize, Answer),
    principal: &str,
    account: &str,
    call: &Call,
) -> Result<String, Failure> {
    let after = "a storm of one charge";
    expect_account(
        &instances[*ran_by].api,
        principal,
        account,
        effects(1, 100),
        after,
    )
    .await?;
    let mut separate = false;
    for (i, instance) in instances.iter().enumerate() {
        if i != *ran_by {
            let seen = instance.api.account(principal, account).await?;
            if seen != effects(0, 0) {
                expect_account(&instance.api, principal, account, effects(1, 100), after).await?;
            }
            separate |= seen == effects(0, 0);
        }
        let again = instance.api.send(call).await?;
        again.replays(original).map_err(|why| {
            Failure::wrong(call, "the replay of the storm's one 201", &again, &why)
        })?;
    }
    Ok(if separate {
        " (ledger per process)".to_owned()
    } else {
        String::new()
    })
}

//! The crash test: servers killed with `SIGKILL` while charges are in flight,
//! at many different points; afterwards every charge has taken effect exactly
//! once, and the ledger proves it.

use std::sync::Arc;
use std::time::Duration;

use payments::Principal;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::Suite;
use crate::database::{Database, OperationRow, RecordCounts, Sight};
use crate::server::{Endpoint, Post, Reply, Server};

/// Rounds of start, charge, kill.
const ROUNDS: usize = 18;

/// Charges per round, each with its own key.
const KEYS_PER_ROUND: usize = 8;

/// When a round's server is killed, by round number modulo 3.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kill {
    /// The test holds the account's row while the charges run and kills the
    /// server once one of them waits for it: that charge is caught inside its
    /// transaction, past its claim and its provider call, with the others
    /// wherever they are.
    Held,
    /// As soon as the first `201` arrives: the charges queued behind it on the
    /// account's row are committing, or sending their answers.
    AtFirstAnswer,
    /// After a random delay.
    AfterDelay,
}

/// The simulated provider's latency is drawn from `0..=MAX_LATENCY_MS`.
const MAX_LATENCY_MS: u64 = 40;

const ACCOUNT: &str = "acct-crash";
const PRINCIPAL: &str = "alice";
const PATH: &str = "/accounts/acct-crash/charges";

/// One charge of the test: its key and amount.
struct Charge {
    key: String,
    amount: i64,
    body: String,
}

/// What a key's client saw: the `201`s before the kill, if any, and the final
/// answer after the restart.
struct Outcome {
    charge: Arc<Charge>,
    before_kill: Vec<Reply>,
    last: Reply,
}

/// The receipt of a charge, as its final answer names it.
#[derive(Debug)]
struct Receipt {
    id: String,
    amount: i64,
    balance: i64,
}

pub(crate) async fn sigkill_mid_charge_applies_each_charge_exactly_once(suite: Arc<Suite>) {
    let seed = std::env::var("PAYMENTS_CRASH_SEED")
        .ok()
        .and_then(|seed| seed.parse().ok())
        .unwrap_or_else(rand::random::<u64>);
    // Run apart, so that a failure names the seed that replays it.
    match tokio::spawn(crash_rounds(Arc::clone(&suite), seed)).await {
        Ok(()) => {}
        Err(error) if error.is_panic() => {
            let payload = error.into_panic();
            let message = payload
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| payload.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                .unwrap_or_default();
            panic!("{message}\n(replay with PAYMENTS_CRASH_SEED={seed})");
        }
        Err(error) => panic!("{error} (PAYMENTS_CRASH_SEED={seed})"),
    }
}

async fn crash_rounds(suite: Arc<Suite>, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let url = suite.fresh_database().await;
    let binary = suite.binary();
    let latency = rng.random_range(0..=MAX_LATENCY_MS);
    let mut server = Server::start(binary, &url, latency).await;
    let mut holder = Database::connect(&url).await;
    let mut observer = Database::connect(&url).await;
    let mut outcomes = Vec::new();
    let mut held_rounds = 0;

    for round in 0..ROUNDS {
        let charges: Vec<Arc<Charge>> = (0..KEYS_PER_ROUND)
            .map(|i| {
                let amount = i64::try_from(round * KEYS_PER_ROUND + i + 1).unwrap_or(i64::MAX);
                Arc::new(Charge {
                    key: format!("round-{round}-charge-{i}"),
                    amount,
                    body: format!(r#"{{"amount": {amount}, "currency": "EUR"}}"#),
                })
            })
            .collect();
        let kill = [Kill::Held, Kill::AtFirstAnswer, Kill::AfterDelay][round % 3];
        if kill == Kill::Held {
            holder.hold(ACCOUNT).await;
            held_rounds += 1;
        }

        // The batch: each key sent once or twice at once, at a random moment
        // within the provider's latency. A request whose moment comes after
        // the kill is not sent: the dead server's port may already be another
        // process's (a server or a database of a test running beside this one).
        let (answered, mut first_answer) = tokio::sync::mpsc::unbounded_channel();
        let (killing, killed) = tokio::sync::watch::channel(false);
        let mut sent = Vec::new();
        for (index, charge) in charges.iter().enumerate() {
            let copies = if rng.random_bool(0.3) { 2 } else { 1 };
            let offset = Duration::from_millis(rng.random_range(0..=latency + 40));
            for _ in 0..copies {
                let (endpoint, charge) = (server.endpoint().clone(), Arc::clone(charge));
                let (answered, mut killed) = (answered.clone(), killed.clone());
                sent.push((
                    index,
                    tokio::spawn(async move {
                        tokio::select! {
                            biased;
                            _ = killed.wait_for(|killed| *killed) => return None,
                            () = tokio::time::sleep(offset) => {}
                        }
                        let reply = endpoint.post(post(&charge)).await;
                        if reply.as_ref().is_ok_and(|reply| reply.status == 201) {
                            let _ = answered.send(());
                        }
                        Some(reply)
                    }),
                ));
            }
        }
        drop((answered, killed));

        // The kill.
        match kill {
            Kill::Held => {
                observer.wait_for(Sight::LockWait).await;
                let extra = rng.random_range(0..=5);
                tokio::time::sleep(Duration::from_millis(extra)).await;
            }
            // `None`: every attempt ended without a 201; kill all the same.
            Kill::AtFirstAnswer => drop(first_answer.recv().await),
            Kill::AfterDelay => {
                let delay = rng.random_range(0..=2 * latency + 120);
                tokio::time::sleep(Duration::from_millis(delay)).await;
            }
        }
        let _ = killing.send(true);
        server.kill().await;
        if kill == Kill::Held {
            holder.release().await;
        }
        let mut before_kill = vec![Vec::new(); charges.len()];
        for (index, attempt) in sent {
            match attempt.await.expect("a first attempt's task") {
                Some(Ok(reply)) if reply.status == 201 => before_kill[index].push(reply),
                Some(Ok(reply)) => assert!(
                    matches!(reply.status, 409 | 503),
                    "round {round}, {}: {reply:?}",
                    charges[index].key
                ),
                // Cut off by the kill, or not sent before it.
                Some(Err(_)) | None => {}
            }
        }

        // A new server on the same database; every client retries its key.
        let latency = rng.random_range(0..=MAX_LATENCY_MS);
        server = Server::start(binary, &url, latency).await;
        let retries: Vec<_> = charges
            .iter()
            .map(|charge| {
                let (endpoint, charge) = (server.endpoint().clone(), Arc::clone(charge));
                tokio::spawn(async move { endpoint.until_final(post(&charge)).await })
            })
            .collect();
        for ((charge, before_kill), retry) in charges.into_iter().zip(before_kill).zip(retries) {
            let last = retry.await.expect("a retry's task");
            outcomes.push(Outcome {
                charge,
                before_kill,
                last,
            });
        }
    }

    let report = verify(server.endpoint(), &mut observer, &outcomes).await;
    assert!(
        report.cut_off >= held_rounds,
        "every held round cuts off at least the charge caught behind the held row: {report:?}"
    );
    eprintln!(
        "crash test ({}): {ROUNDS} SIGKILLs, {} charges: {} answered before a kill, {} cut off \
         ({} had committed and were replayed, {} ran again); seed {seed}",
        binary.display(),
        outcomes.len(),
        report.answered,
        report.cut_off,
        report.committed_unanswered,
        report.cut_off - report.committed_unanswered,
    );
    server.kill().await;
}

/// How the kills fell.
#[derive(Debug)]
struct Report {
    /// Keys that got their `201` before the kill.
    answered: usize,
    /// Keys without a `201` before the kill: every attempt was cut off by it,
    /// refused (`409`, `503`), or not yet sent.
    cut_off: usize,
    /// Cut-off keys whose charge had committed: the retry replayed it.
    committed_unanswered: usize,
}

/// Every charge took effect exactly once, and every client was told so.
async fn verify(endpoint: &Endpoint, observer: &mut Database, outcomes: &[Outcome]) -> Report {
    let mut report = Report {
        answered: 0,
        cut_off: 0,
        committed_unanswered: 0,
    };
    let mut receipts = Vec::new();
    for outcome in outcomes {
        let key = &outcome.charge.key;
        let last = &outcome.last;
        assert_eq!(last.status, 201, "{key}: {last:?}");
        // An answer sent before the kill was committed: the retry replays it,
        // byte for byte.
        for early in &outcome.before_kill {
            assert!(
                last.replayed,
                "{key}: answered {early:?}, then ran again: {last:?}"
            );
            assert_eq!(early.body, last.body, "{key}: the replay differs");
        }
        if outcome.before_kill.is_empty() {
            report.cut_off += 1;
            if last.replayed {
                report.committed_unanswered += 1;
            }
        } else {
            report.answered += 1;
        }
        let receipt: serde_json::Value =
            serde_json::from_str(&last.body).unwrap_or_else(|error| panic!("{key}: {error}"));
        assert_eq!(receipt["account_id"], ACCOUNT, "{key}: {receipt}");
        assert_eq!(receipt["currency"], "EUR", "{key}: {receipt}");
        receipts.push(Receipt {
            id: receipt["id"].as_str().unwrap_or_default().to_owned(),
            amount: receipt["amount"].as_i64().unwrap_or_default(),
            balance: receipt["balance"].as_i64().unwrap_or_default(),
        });
        assert_eq!(
            receipts.last().map(|r| r.amount),
            Some(outcome.charge.amount)
        );
    }

    // The account: one effect per key.
    let keys = u64::try_from(outcomes.len()).unwrap_or(u64::MAX);
    let sum: i64 = outcomes.iter().map(|outcome| outcome.charge.amount).sum();
    assert_eq!(
        endpoint.account(ACCOUNT).await,
        (sum, keys),
        "(balance, operations)"
    );

    // The rows: one charge per key, the one its client was told about.
    let mut expected: Vec<OperationRow> = outcomes
        .iter()
        .zip(&receipts)
        .map(|(outcome, receipt)| OperationRow {
            id: receipt.id.clone(),
            kind: "charge".to_owned(),
            amount: outcome.charge.amount,
            idempotency_scope: Some(Principal::from_token(PRINCIPAL).as_str().to_owned()),
            idempotency_key: Some(outcome.charge.key.clone()),
        })
        .collect();
    let mut rows = observer.operations(ACCOUNT).await;
    expected.sort_by(|a, b| a.idempotency_key.cmp(&b.idempotency_key));
    rows.sort_by(|a, b| a.idempotency_key.cmp(&b.idempotency_key));
    assert_eq!(rows, expected, "the ledger's rows against the receipts");

    // The balances the receipts name are one history: in commit order, each
    // is the one before it plus the charge's amount.
    receipts.sort_by_key(|receipt| receipt.balance);
    let mut balance = 0;
    for receipt in &receipts {
        balance += receipt.amount;
        assert_eq!(receipt.balance, balance, "{receipt:?} in {receipts:?}");
    }

    // No record left in progress.
    assert_eq!(
        observer.records().await,
        RecordCounts {
            completed: i64::try_from(outcomes.len()).unwrap_or(i64::MAX),
            in_progress: 0
        }
    );
    report
}

fn post(charge: &Charge) -> Post<'_> {
    Post {
        path: PATH,
        principal: PRINCIPAL,
        key: Some(&charge.key),
        body: &charge.body,
    }
}

//! The scenarios: one behaviour each, run against the binary.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use futures_util::FutureExt;
use futures_util::future::BoxFuture;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

use super::faults;
use super::process::{Case, Client, PATIENCE, accounts, processed};
use payments_consumer::database::Database;
use payments_consumer::ledger::Account;
use payments_consumer::payment::MAX_ACCOUNT_ID_LEN;

/// A scenario: its name (a queue and a database are named after it), the
/// check it proves (its row in `cargo xtask e2e`), whether it stops the broker,
/// and how to run it: the figure behind a pass, or what failed.
pub(crate) struct Scenario {
    /// A plain name (ASCII letters, digits, `_`).
    pub(crate) name: &'static str,
    /// What it proves, for the e2e table.
    pub(crate) check: &'static str,
    /// It stops the broker: no other scenario may use the node meanwhile,
    /// and its [`Case`] needs the node ([`Case::with_broker`]).
    pub(crate) stops_broker: bool,
    /// It takes tens of seconds (five kills, an outage waited out, a broker
    /// restart): a runner starts it before the others, so that it does not
    /// end the run alone.
    pub(crate) long: bool,
    /// It runs on PostgreSQL only: it puts a fault proxy between the
    /// consumers and their PostgreSQL database ([`Case::proxy_database`]),
    /// or it faults the broker, which one database shows as well as two.
    pub(crate) postgres_only: bool,
    /// Runs it on a fresh case.
    pub(crate) run: fn(Case) -> BoxFuture<'static, Result<String, String>>,
}

/// Every scenario.
pub(crate) const SCENARIOS: &[Scenario] = &[
    Scenario {
        name: "consumer_lost_commit_answers",
        check: "consumer: every 5th COMMIT answer lost (the commit landed), 240 messages, balances exact",
        stops_broker: false,
        long: false,
        postgres_only: true,
        run: |case| lost_commit_answers(case, &["--concurrency", "4"], 10).boxed(),
    },
    Scenario {
        name: "consumer_batch_lost_commit_answers",
        check: "consumer: --batch 8, every 5th COMMIT answer lost (a batch's commit landed), 240 messages, balances exact",
        stops_broker: false,
        long: false,
        postgres_only: true,
        run: |case| lost_commit_answers(case, &["--batch", "8", "--concurrency", "2"], 4).boxed(),
    },
    Scenario {
        name: "consumer_db_outage",
        check: "consumer: a 25 s database outage mid-stream, nothing dead-lettered, balances exact",
        stops_broker: false,
        long: true,
        postgres_only: true,
        run: |case| a_database_outage(case, &["--handler-latency-ms", "20"]).boxed(),
    },
    Scenario {
        name: "consumer_batch_db_outage",
        check: "consumer: --batch 16, a 25 s database outage mid-stream, nothing dead-lettered, balances exact",
        stops_broker: false,
        long: true,
        postgres_only: true,
        run: |case| {
            a_database_outage(case, &["--batch", "16", "--handler-latency-ms", "20"]).boxed()
        },
    },
    Scenario {
        name: "consumer_duplicates",
        check: "consumer: 10 deliveries of one message_id, one effect",
        stops_broker: false,
        long: false,
        postgres_only: false,
        run: |case| ten_identical_deliveries_take_effect_once(case).boxed(),
    },
    Scenario {
        name: "consumer_reused_id",
        check: "consumer: another body under an applied message_id, dead-lettered",
        stops_broker: false,
        long: false,
        postgres_only: false,
        run: |case| another_body_under_an_applied_id_is_dead_lettered(case).boxed(),
    },
    Scenario {
        name: "consumer_invalid",
        check: "consumer: invalid payments dead-lettered at once",
        stops_broker: false,
        long: false,
        postgres_only: false,
        run: |case| invalid_payments_are_dead_lettered_at_once(case).boxed(),
    },
    Scenario {
        name: "consumer_sigkill",
        check: "consumer: SIGKILL x5 over 500 messages, every balance exact",
        stops_broker: false,
        long: false,
        postgres_only: false,
        run: |case| sigkill_and_restarts_leave_every_balance_exact(case, &[]).boxed(),
    },
    Scenario {
        name: "consumer_batch_sigkill",
        check: "consumer: --batch 32, SIGKILL x5 over 500 messages, every balance exact",
        stops_broker: false,
        long: false,
        postgres_only: false,
        run: |case| {
            sigkill_and_restarts_leave_every_balance_exact(
                case,
                &["--batch", "32", "--concurrency", "2"],
            )
            .boxed()
        },
    },
    Scenario {
        name: "consumer_batch_poison",
        check: "consumer: --batch 64, 3 failing among 300 messages: each dead-lettered alone after exactly 3 attempts, the rest applied once",
        stops_broker: false,
        long: false,
        postgres_only: false,
        run: |case| a_failing_message_fails_no_batch_but_its_own(case).boxed(),
    },
    Scenario {
        name: "consumer_sigterm",
        check: "consumer: SIGTERM under load exits 0, nothing lost",
        stops_broker: false,
        long: false,
        postgres_only: false,
        run: |case| sigterm_under_load_loses_nothing(case).boxed(),
    },
    Scenario {
        name: "consumer_concurrency",
        check: "consumer: --concurrency 8 over 450 messages, every balance exact",
        stops_broker: false,
        long: false,
        postgres_only: false,
        run: |case| eight_at_once_leave_every_balance_exact(case).boxed(),
    },
    Scenario {
        name: "consumer_broker_restart",
        check: "consumer: broker restarted mid-stream, resumed by itself",
        stops_broker: true,
        long: false,
        postgres_only: false,
        run: |case| {
            a_broker_restart_mid_stream_loses_nothing(case, &["--concurrency", "4"]).boxed()
        },
    },
    Scenario {
        name: "consumer_batch_broker_restart",
        check: "consumer: --batch 32, broker restarted mid-stream, resumed by itself",
        stops_broker: true,
        long: false,
        postgres_only: false,
        run: |case| {
            a_broker_restart_mid_stream_loses_nothing(
                case,
                &["--batch", "32", "--concurrency", "2"],
            )
            .boxed()
        },
    },
    Scenario {
        name: "consumer_dead_letter",
        check: "consumer: failing message dead-lettered after 3 attempts",
        stops_broker: false,
        long: false,
        postgres_only: false,
        run: |case| a_failing_message_is_dead_lettered_after_its_last_attempt(case).boxed(),
    },
    Scenario {
        name: "consumer_alert",
        check: "consumer: 11 dead letters, one alert",
        stops_broker: false,
        long: false,
        postgres_only: false,
        run: |case| eleven_dead_letters_raise_one_alert(case).boxed(),
    },
    Scenario {
        name: "consumer_redrive",
        check: "consumer: redrive after the fix, applied once",
        stops_broker: false,
        long: false,
        postgres_only: false,
        run: |case| a_redriven_dead_letter_is_applied_once(case).boxed(),
    },
    Scenario {
        name: "consumer_trace_logs",
        check: "consumer: RUST_LOG=trace, no message_id or body logged",
        stops_broker: false,
        long: false,
        postgres_only: false,
        run: |case| trace_logs_hold_no_message_id_and_no_body(case).boxed(),
    },
];

/// Fails the scenario with `message` unless `condition` holds.
macro_rules! ensure {
    ($condition:expr, $($message:tt)+) => {
        if !$condition {
            return Err(format!($($message)+));
        }
    };
}

pub(super) fn payment(account: &str, amount: i64) -> Vec<u8> {
    json!({"account_id": account, "amount": amount})
        .to_string()
        .into_bytes()
}

/// Waits until `account` has `operations` operations.
pub(crate) async fn wait_operations(
    case: &Case,
    account: &str,
    operations: i64,
) -> Result<Account, String> {
    let started = Instant::now();
    loop {
        let found = case.balance(account).await?;
        if found.operations >= operations {
            return Ok(found);
        }
        ensure!(
            started.elapsed() < PATIENCE,
            "{account} had {found:?} after {PATIENCE:?}, not {operations} operations"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Messages to publish, with the balances they make when each is applied
/// once.
pub(super) struct Stream {
    pub(super) messages: Vec<(String, Vec<u8>)>,
    pub(super) expected: BTreeMap<String, (i64, i64)>,
    pub(super) unique: usize,
}

/// `unique` payments of 1 to 1000 to `accounts` accounts, ids
/// `<prefix>-<n>`, and `duplicates` copies, each after its original.
pub(super) fn stream(
    rng: &mut StdRng,
    prefix: &str,
    unique: usize,
    duplicates: usize,
    accounts: usize,
) -> Stream {
    let mut messages: Vec<(String, Vec<u8>)> = Vec::new();
    let mut expected: BTreeMap<String, (i64, i64)> = BTreeMap::new();
    for i in 0..unique {
        let account = format!("acct-{prefix}-{:02}", rng.random_range(0..accounts));
        let amount = rng.random_range(1..=1000);
        let entry = expected.entry(account.clone()).or_default();
        entry.0 += amount;
        entry.1 += 1;
        messages.push((format!("pay-{prefix}-{i}"), payment(&account, amount)));
    }
    for _ in 0..duplicates {
        let original = rng.random_range(0..messages.len());
        let copy = messages[original].clone();
        let at = rng.random_range(original + 1..=messages.len());
        messages.insert(at, copy);
    }
    Stream {
        messages,
        expected,
        unique,
    }
}

/// A random generator, seeded from `PAYMENTS_CONSUMER_SEED` when set; and
/// the seed, to name in a failure.
pub(super) fn seeded() -> (StdRng, u64) {
    let seed = std::env::var("PAYMENTS_CONSUMER_SEED")
        .ok()
        .and_then(|seed| seed.parse().ok())
        .unwrap_or_else(rand::random::<u64>);
    (StdRng::seed_from_u64(seed), seed)
}

impl Stream {
    async fn publish(&self, client: &Client) -> Result<(), String> {
        for (id, body) in &self.messages {
            client.publish(Some(id), body).await?;
        }
        Ok(())
    }

    /// Every account's balance and operations are the expected ones; answers
    /// how many effects.
    pub(super) async fn exact(&self, database: &Database) -> Result<i64, String> {
        let found: BTreeMap<String, (i64, i64)> = accounts(database)
            .await?
            .into_iter()
            .map(|account| (account.account_id, (account.balance, account.operations)))
            .collect();
        ensure!(
            found == self.expected,
            "balances (balance, operations) by account: {found:?}, expected {:?}",
            self.expected
        );
        Ok(found.values().map(|(_, operations)| operations).sum())
    }
}

/// Waits until the inbox holds `count` messages of the case's consumer;
/// fails once it has held the same number for [`PATIENCE`]. A consumer that
/// keeps applying messages is not stuck, however slow the machine (moto's
/// SQS slows as a queue's history grows, with the other rows beside it).
pub(super) async fn wait_processed(
    case: &Case,
    database: &Database,
    count: i64,
) -> Result<i64, String> {
    let consumer = case.inbox_consumer();
    let (mut last, mut since) = (-1, Instant::now());
    loop {
        let done = processed(database, &consumer).await?;
        if done >= count {
            return Ok(done);
        }
        if done != last {
            (last, since) = (done, Instant::now());
        }
        ensure!(
            since.elapsed() < PATIENCE,
            "the inbox held {done} messages, not {count}, and none more for {PATIENCE:?}"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// 240 messages (40 of them a producer's resends), consumed as `flags` say,
/// while the answer to every 5th COMMIT of the consumer's database is lost
/// (`at_least` of them): each delivery whose commit landed unseen is decided
/// again and found applied. Every balance exact, no dead letter, the
/// consumer alive.
async fn lost_commit_answers(
    mut case: Case,
    flags: &'static [&'static str],
    at_least: u64,
) -> Result<String, String> {
    let (mut rng, seed) = seeded();
    let failed = |why: String| format!("{why} (seed {seed}: set PAYMENTS_CONSUMER_SEED to replay)");
    let stream = stream(&mut rng, "lc", 200, 40, 10);
    let client = Client::connect(&case).await?;
    stream.publish(&client).await?;
    client.close().await;
    let proxy = faults::losing_commit_answers(&mut case)?;
    let database = case.database().await?;
    let consumer = case.consumer(flags).await?;
    drained(&case, &database, stream.unique)
        .await
        .map_err(failed)?;
    let lost = faults::lost_at_least(&proxy, at_least)?;
    faults::alive(consumer).await?;
    let effects = stream.exact(&database).await.map_err(failed)?;
    Ok(format!(
        "{} messages (40 duplicates), {lost} COMMIT answers lost; {effects} effects, {} balances exact, 0 dead letters",
        stream.messages.len(),
        stream.expected.len()
    ))
}

/// 150 messages; after 30 are applied the database goes away for 25 s
/// (every connection reset and refused) and comes back. The consumer holds
/// what it has, takes nothing more, counts no attempt, and resumes by
/// itself: every balance exact, nothing dead-lettered, the consumer alive.
async fn a_database_outage(
    mut case: Case,
    flags: &'static [&'static str],
) -> Result<String, String> {
    let (mut rng, seed) = seeded();
    let failed = |why: String| format!("{why} (seed {seed}: set PAYMENTS_CONSUMER_SEED to replay)");
    let stream = stream(&mut rng, "do", 150, 0, 10);
    let client = Client::connect(&case).await?;
    stream.publish(&client).await?;
    client.close().await;
    let proxy = case.proxy_database()?;
    let database = case.database().await?;
    let consumer = case.consumer(flags).await?;
    wait_processed(&case, &database, 30).await.map_err(failed)?;
    faults::outage(&proxy).await;
    let during = processed(&database, &case.inbox_consumer()).await?;
    drained(&case, &database, stream.unique)
        .await
        .map_err(failed)?;
    faults::alive(consumer).await?;
    let effects = stream.exact(&database).await.map_err(failed)?;
    Ok(format!(
        "{} messages; {during} applied when the database came back after {} s; {effects} effects, {} balances exact, 0 dead letters",
        stream.messages.len(),
        faults::OUTAGE.as_secs(),
        stream.expected.len()
    ))
}

/// Waits until the inbox holds `unique` messages and the work queue is
/// empty, then a moment for the duplicates still in flight.
async fn drained(case: &Case, database: &Database, unique: usize) -> Result<(), String> {
    let client = Client::connect(case).await?;
    let started = Instant::now();
    loop {
        let done = processed(database, &case.inbox_consumer()).await?;
        let left = client.ready(&case.queue).await?;
        if done == unique as i64 && left == 0 {
            break;
        }
        ensure!(
            started.elapsed() < PATIENCE,
            "after {PATIENCE:?}: {done} of {unique} processed, {left} messages left in the queue"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let left = client.ready(&case.queue).await?;
    let dead = client.ready(&client.topology.dead_letter_queue()).await?;
    client.close().await;
    ensure!(
        left == 0 && dead == 0,
        "{left} messages left in the queue and {dead} dead letters, expected none"
    );
    Ok(())
}

/// 10 deliveries of one `message_id` apply once; a changed field under a new
/// id applies a second time.
async fn ten_identical_deliveries_take_effect_once(case: Case) -> Result<String, String> {
    let consumer = case.consumer(&[]).await?;
    let client = Client::connect(&case).await?;
    for _ in 0..10 {
        client
            .publish(Some("pay-dup-1"), &payment("acct-dup", 100))
            .await?;
    }
    // One consumer takes the queue in order: once the next message is applied,
    // the ten before it were handled.
    client
        .publish(Some("pay-dup-2"), &payment("acct-dup", 250))
        .await?;
    let account = wait_operations(&case, "acct-dup", 2).await?;
    ensure!(
        account.balance == 350 && account.operations == 2,
        "after 10 deliveries of pay-dup-1 (100) and one of pay-dup-2 (250): {account:?}, \
         expected balance 350 in 2 operations"
    );
    let inbox = processed(&case.database().await?, &case.inbox_consumer()).await?;
    ensure!(inbox == 2, "the inbox holds {inbox} messages, expected 2");
    consumer.terminate().await?;
    Ok(
        "10 deliveries of pay-dup-1 -> 1 effect; pay-dup-2 -> a 2nd; balance 350, 2 operations"
            .into(),
    )
}

/// Another body under a `message_id` already applied is dead-lettered at
/// once with the reason `message-id-reused`, logged at warn; the balance is
/// the first body's, and the first body sent again is still a duplicate.
async fn another_body_under_an_applied_id_is_dead_lettered(case: Case) -> Result<String, String> {
    let consumer = case.consumer(&[]).await?;
    let client = Client::connect(&case).await?;
    client
        .publish(Some("pay-reuse-1"), &payment("acct-reuse", 5))
        .await?;
    client
        .publish(Some("pay-reuse-1"), &payment("acct-reuse", 7))
        .await?;
    client
        .publish(Some("pay-reuse-1"), &payment("acct-reuse", 5))
        .await?;
    client
        .publish(Some("pay-reuse-2"), &payment("acct-reuse-end", 1))
        .await?;
    wait_operations(&case, "acct-reuse-end", 1).await?;
    let dlq = client.topology.dead_letter_queue();
    client.wait_ready(&dlq, 1).await?;
    let account = case.balance("acct-reuse").await?;
    ensure!(
        account.balance == 5 && account.operations == 1,
        "after 5, then 7, then 5 again under pay-reuse-1: {account:?}, expected balance 5 in 1 \
         operation"
    );
    let letters = case.dead_letters().await?;
    ensure!(
        letters.len() == 1
            && letters[0]["message_id"] == "pay-reuse-1"
            && letters[0]["reason"] == "message-id-reused"
            && letters[0]["body"] == json!({"account_id": "acct-reuse", "amount": 7})
            && letters[0]["attempts"]
                .as_array()
                .is_some_and(|a| a.len() == 1),
        "dead letters {letters:?}: expected the body of 7, reason message-id-reused, one attempt"
    );
    let warned = consumer.log_lines("message-id-reused");
    ensure!(
        warned.iter().any(|line| line.contains("WARN")),
        "no warn line names message-id-reused: {warned:?}"
    );
    consumer.terminate().await?;
    Ok("5 applied; 7 under the same id dead-lettered (message-id-reused, warned); 5 again a duplicate".into())
}

/// Bodies that are not payments, and a payment that would overflow its
/// balance, go to the dead-letter queue at once (one attempt each), with
/// reasons that quote nothing of the body; the good ones around them apply.
async fn invalid_payments_are_dead_lettered_at_once(case: Case) -> Result<String, String> {
    let long_account = "a".repeat(MAX_ACCOUNT_ID_LEN + 1);
    let invalid: Vec<(&str, Vec<u8>, &str)> = vec![
        (
            "pay-inv-negative",
            payment("acct-inv", -5),
            "the amount is not positive",
        ),
        (
            "pay-inv-zero",
            payment("acct-inv", 0),
            "the amount is not positive",
        ),
        (
            "pay-inv-float",
            br#"{"account_id": "acct-inv", "amount": 2.5}"#.to_vec(),
            "the amount is not an integer",
        ),
        (
            "pay-inv-string",
            br#"{"account_id": "acct-inv", "amount": "5"}"#.to_vec(),
            "the body is not a payment",
        ),
        (
            "pay-inv-long-account",
            payment(&long_account, 1),
            "more than 255",
        ),
        (
            "pay-inv-overflow",
            payment("acct-inv-max", 1),
            "the balance would pass the largest 64-bit integer",
        ),
    ];
    let consumer = case.consumer(&[]).await?;
    let client = Client::connect(&case).await?;
    client
        .publish(Some("pay-inv-max"), &payment("acct-inv-max", i64::MAX))
        .await?;
    for (id, body, _) in &invalid {
        client.publish(Some(id), body).await?;
    }
    client
        .publish(Some("pay-inv-ok"), &payment("acct-inv", 7))
        .await?;
    wait_operations(&case, "acct-inv", 1).await?;
    let dlq = client.topology.dead_letter_queue();
    client.wait_ready(&dlq, invalid.len() as u32).await?;

    let fine = case.balance("acct-inv").await?;
    let max = case.balance("acct-inv-max").await?;
    ensure!(
        (fine.balance, fine.operations, max.balance, max.operations) == (7, 1, i64::MAX, 1),
        "balances {fine:?}, {max:?}: expected 7 (1 operation) and i64::MAX (1 operation)"
    );
    let long = case.balance(&long_account).await?;
    ensure!(
        long.operations == 0,
        "the over-long account was paid: {long:?}"
    );
    let letters = case.dead_letters().await?;
    for (id, _, reason) in &invalid {
        let letter = letters
            .iter()
            .find(|letter| letter["message_id"] == *id)
            .ok_or(format!("{id} is not among the dead letters: {letters:?}"))?;
        let said = letter["reason"].as_str().unwrap_or_default();
        let attempts = letter["attempts"].as_array().map_or(0, Vec::len);
        ensure!(
            said.contains(reason) && attempts == 1,
            "{id}: reason {said:?} after {attempts} attempts, expected {reason:?} after 1"
        );
        ensure!(
            !said.contains("acct-inv") && !said.contains("aaaa"),
            "{id}: the reason {said:?} quotes the body"
        );
    }
    ensure!(
        letters.len() == invalid.len(),
        "{} dead letters, expected {}",
        letters.len(),
        invalid.len()
    );
    consumer.terminate().await?;
    Ok(format!(
        "{} dead-lettered at once (amount -5, 0, 2.5, \"5\"; a 256-byte account; an overflow), the valid ones applied",
        invalid.len()
    ))
}

/// 500 messages, 100 of them duplicates, while the consumer is killed with
/// `SIGKILL` 5 times at random points and restarted: every balance is exact.
async fn sigkill_and_restarts_leave_every_balance_exact(
    case: Case,
    flags: &'static [&'static str],
) -> Result<String, String> {
    const KILLS: usize = 5;
    let (mut rng, seed) = seeded();
    let failed = |why: String| format!("{why} (seed {seed}: set PAYMENTS_CONSUMER_SEED to replay)");
    let stream = stream(&mut rng, "k", 400, 100, 20);
    let client = Client::connect(&case).await?;
    stream.publish(&client).await?;
    let database = case.database().await?;
    let consumer_name = case.inbox_consumer();
    // Kill when the inbox reaches random counts: mid-stream every time.
    let mut targets: Vec<i64> = (20..380).collect();
    targets.shuffle(&mut rng);
    let mut targets = targets[..KILLS].to_vec();
    targets.sort_unstable();
    let mut at_kills = Vec::new();
    for target in targets {
        let consumer = case.consumer(flags).await?;
        wait_processed(&case, &database, target)
            .await
            .map_err(failed)?;
        consumer.kill().await;
        at_kills.push(processed(&database, &consumer_name).await?);
    }
    let consumer = case.consumer(flags).await?;
    drained(&case, &database, stream.unique)
        .await
        .map_err(failed)?;
    consumer.terminate().await?;
    let effects = stream.exact(&database).await.map_err(failed)?;
    Ok(format!(
        "{} messages (100 duplicates), {KILLS} kills at {at_kills:?} processed, {effects} \
         effects, {} balances exact",
        stream.messages.len(),
        stream.expected.len()
    ))
}

/// 300 messages through `--batch 64`, 3 of them to the account of
/// `--fail-account`: each of the 3 fails every batch it is in until it is
/// alone, then is retried and dead-lettered after exactly 3 attempts; the
/// other 297 are applied once (every balance exact), none dead-lettered.
async fn a_failing_message_fails_no_batch_but_its_own(case: Case) -> Result<String, String> {
    let (mut rng, seed) = seeded();
    let failed = |why: String| format!("{why} (seed {seed}: set PAYMENTS_CONSUMER_SEED to replay)");
    let mut stream = stream(&mut rng, "b", 297, 0, 10);
    let poison: Vec<String> = (0..3).map(|i| format!("pay-b-poison-{i}")).collect();
    for (i, id) in poison.iter().enumerate() {
        let at = rng.random_range(0..=stream.messages.len());
        stream
            .messages
            .insert(at, (id.clone(), payment("acct-b-broken", 10 + i as i64)));
    }
    let client = Client::connect(&case).await?;
    stream.publish(&client).await?;
    let database = case.database().await?;
    let consumer = case
        .consumer(&[
            "--batch",
            "64",
            "--fail-account",
            "acct-b-broken",
            "--max-attempts",
            "3",
            "--retry-base-ms",
            "50",
        ])
        .await?;
    let dlq = client.topology.dead_letter_queue();
    client.wait_ready(&dlq, 3).await?;
    wait_processed(&case, &database, 297)
        .await
        .map_err(failed)?;
    client.wait_ready(&case.queue, 0).await?;
    consumer.terminate().await?;
    let effects = stream.exact(&database).await.map_err(failed)?;
    let letters = case.dead_letters().await?;
    let mut ids: Vec<&str> = letters
        .iter()
        .filter_map(|letter| letter["message_id"].as_str())
        .collect();
    ids.sort_unstable();
    ensure!(ids == poison, "dead letters {ids:?}, expected {poison:?}");
    for letter in &letters {
        let attempts = letter["attempts"].as_array().map_or(0, Vec::len);
        ensure!(
            attempts == 3,
            "{}: {attempts} attempts, expected exactly 3",
            letter["message_id"]
        );
    }
    ensure!(
        client.ready(&dlq).await? == 3,
        "the dead-letter queue holds {} messages, expected 3",
        client.ready(&dlq).await?
    );
    Ok(format!(
        "{effects} effects of 297, 3 dead letters of 3 attempts each, {} balances exact",
        stream.expected.len()
    ))
}

/// SIGTERM while 4 handlers run: the consumer exits 0, every message it
/// applied was acknowledged (none is back in the queue) and every other one
/// is back in the queue; the next consumer finishes with every balance exact.
async fn sigterm_under_load_loses_nothing(case: Case) -> Result<String, String> {
    let (mut rng, seed) = seeded();
    let failed = |why: String| format!("{why} (seed {seed}: set PAYMENTS_CONSUMER_SEED to replay)");
    let stream = stream(&mut rng, "t", 300, 0, 10);
    let client = Client::connect(&case).await?;
    stream.publish(&client).await?;
    let database = case.database().await?;
    let consumer = case.consumer(&["--concurrency", "4"]).await?;
    wait_processed(&case, &database, 60).await?;
    let stopping = Instant::now();
    consumer.terminate().await?;
    let took = stopping.elapsed();
    // What was received and not applied goes back as the connection closes.
    let started = Instant::now();
    let (applied, left) = loop {
        let applied = processed(&database, &case.inbox_consumer()).await?;
        let left = client.ready(&case.queue).await?;
        if applied + i64::from(left) == 300 || started.elapsed() > Duration::from_secs(5) {
            break (applied, left);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    ensure!(
        applied + i64::from(left) == 300,
        "after SIGTERM: {applied} applied + {left} in the queue != 300 (more: applied and not \
         acknowledged; fewer: lost)"
    );
    ensure!(
        applied < 300,
        "the consumer finished before SIGTERM: no load"
    );
    let consumer = case.consumer(&["--concurrency", "4"]).await?;
    drained(&case, &database, stream.unique)
        .await
        .map_err(failed)?;
    consumer.terminate().await?;
    stream.exact(&database).await.map_err(failed)?;
    Ok(format!(
        "exit 0 in {} ms with {applied} applied, {left} back in the queue; the next consumer: 300 exact",
        took.as_millis()
    ))
}

/// 450 messages (50 duplicates) on 10 accounts through `--concurrency 8`:
/// every balance exact.
async fn eight_at_once_leave_every_balance_exact(case: Case) -> Result<String, String> {
    let (mut rng, seed) = seeded();
    let failed = |why: String| format!("{why} (seed {seed}: set PAYMENTS_CONSUMER_SEED to replay)");
    let stream = stream(&mut rng, "c", 400, 50, 10);
    let client = Client::connect(&case).await?;
    stream.publish(&client).await?;
    let database = case.database().await?;
    let started = Instant::now();
    let consumer = case.consumer(&["--concurrency", "8"]).await?;
    drained(&case, &database, stream.unique)
        .await
        .map_err(failed)?;
    let took = started.elapsed();
    let declared = consumer.log_lines("concurrency=8");
    consumer.terminate().await?;
    ensure!(
        !declared.is_empty(),
        "the consumer's log does not say it runs 8 at once"
    );
    let effects = stream.exact(&database).await.map_err(failed)?;
    Ok(format!(
        "{} messages in {} ms, {effects} effects, {} balances exact",
        stream.messages.len(),
        took.as_millis(),
        stream.expected.len()
    ))
}

/// The broker stopped and started while the consumer works through 300
/// messages: the same process reconnects by itself, takes 200 more published
/// after the restart, and every balance is exact.
async fn a_broker_restart_mid_stream_loses_nothing(
    case: Case,
    flags: &'static [&'static str],
) -> Result<String, String> {
    let (mut rng, seed) = seeded();
    let failed = |why: String| format!("{why} (seed {seed}: set PAYMENTS_CONSUMER_SEED to replay)");
    let stream = stream(&mut rng, "b", 500, 0, 10);
    let (before, after) = stream.messages.split_at(300);
    let client = Client::connect(&case).await?;
    for (id, body) in before {
        client.publish(Some(id), body).await?;
    }
    client.close().await;
    let database = case.database().await?;
    let mut consumer = case.consumer(flags).await?;
    let at_stop = wait_processed(&case, &database, 100).await?;
    case.restart_broker(Duration::from_secs(1)).await?;
    let client = Client::connect(&case).await?;
    for (id, body) in after {
        client.publish(Some(id), body).await?;
    }
    client.close().await;
    drained(&case, &database, stream.unique)
        .await
        .map_err(failed)?;
    ensure!(
        consumer.running(),
        "the consumer exited; its log:\n{}",
        consumer.log_text()
    );
    let reconnections = consumer.log_lines("reconnecting").len();
    ensure!(
        reconnections > 0,
        "the consumer's log says nothing of reconnecting"
    );
    consumer.terminate().await?;
    let effects = stream.exact(&database).await.map_err(failed)?;
    Ok(format!(
        "stopped at {at_stop} processed; {reconnections} reconnection attempts; 200 more after; \
         {effects} effects, {} balances exact",
        stream.expected.len()
    ))
}

/// A message for the failing account is dead-lettered after exactly 3
/// attempts, with their 3 times, the reason and its `x-death` history; reading
/// the dead letters leaves them there.
async fn a_failing_message_is_dead_lettered_after_its_last_attempt(
    case: Case,
) -> Result<String, String> {
    let consumer = case
        .consumer(&[
            "--fail-account",
            "acct-broken",
            "--max-attempts",
            "3",
            "--retry-base-ms",
            "50",
        ])
        .await?;
    let client = Client::connect(&case).await?;
    client
        .publish(Some("pay-dl-1"), &payment("acct-broken", 70))
        .await?;
    client
        .publish(Some("pay-dl-2"), &payment("acct-fine", 30))
        .await?;
    let dlq = client.topology.dead_letter_queue();
    client.wait_ready(&dlq, 1).await?;
    let letters = case.dead_letters().await?;
    ensure!(
        letters.len() == 1,
        "dead-letters printed {letters:?}, expected one line"
    );
    let letter = &letters[0];
    let reason = "payments to the account of --fail-account fail on purpose";
    ensure!(
        letter["queue"] == case.queue.as_str()
            && letter["message_id"] == "pay-dl-1"
            && letter["reason"] == reason
            && letter["body"] == json!({"account_id": "acct-broken", "amount": 70}),
        "dead-letters printed {letter}"
    );
    let times: Vec<chrono::DateTime<chrono::FixedOffset>> = letter["attempts"]
        .as_array()
        .map(|times| {
            times
                .iter()
                .filter_map(|time| chrono::DateTime::parse_from_rfc3339(time.as_str()?).ok())
                .collect()
        })
        .unwrap_or_default();
    ensure!(
        times.len() == 3 && times.windows(2).all(|pair| pair[0] < pair[1]),
        "attempts {}: expected 3 increasing RFC 3339 times",
        letter["attempts"]
    );
    let again = case.dead_letters().await?;
    ensure!(
        again == letters,
        "a second read printed {again:?}, not {letters:?}"
    );
    ensure!(
        client.ready(&dlq).await? == 1,
        "reading the dead letters removed them"
    );
    let [message] = case
        .dead_letter_messages()
        .await?
        .try_into()
        .map_err(|letters: Vec<_>| format!("{} dead letters, expected 1", letters.len()))?;
    let hop = client.topology.dead_letter_hop();
    let retry_prefix = format!("{}.retry.", case.queue);
    let retried: u64 = message
        .deaths
        .iter()
        .filter(|death| death.queue.starts_with(&retry_prefix) && death.reason == "expired")
        .map(|death| death.count)
        .sum();
    ensure!(
        retried == 2
            && message
                .deaths
                .iter()
                .any(|death| death.queue == hop && death.reason == "expired"),
        "x-death of the dead letter: {:?}, expected two retries through {retry_prefix}* and the \
         way through {hop}",
        message.deaths
    );
    let broken = case.balance("acct-broken").await?;
    let fine = case.balance("acct-fine").await?;
    ensure!(
        broken.operations == 0 && fine.balance == 30 && fine.operations == 1,
        "balances {broken:?}, {fine:?}: expected the failing account untouched and the other paid"
    );
    consumer.terminate().await?;
    let spacing: Vec<i64> = times
        .windows(2)
        .map(|pair| (pair[1] - pair[0]).num_milliseconds())
        .collect();
    Ok(format!(
        "3 attempts ({spacing:?} ms apart), reason and body in dead-letters, x-death kept ({} entries)",
        message.deaths.len()
    ))
}

/// Invalid bodies and messages without an id go to the dead-letter queue at
/// once with their reason; the 11th dead letter raises the alert, once.
async fn eleven_dead_letters_raise_one_alert(case: Case) -> Result<String, String> {
    let consumer = case.consumer(&["--dlq-alert-threshold", "10"]).await?;
    let client = Client::connect(&case).await?;
    for i in 0..6 {
        client
            .publish(
                Some(&format!("pay-bad-{i}")),
                format!("not json {i}").as_bytes(),
            )
            .await?;
    }
    for i in 1..=5 {
        client.publish(None, &payment("acct-anon", i)).await?;
    }
    let dlq = client.topology.dead_letter_queue();
    client.wait_ready(&dlq, 11).await?;
    let alerts = consumer.log_lines("dead-letter alert");
    ensure!(
        alerts.len() == 1 && alerts[0].contains("dead-letter alert: 11 dead letters"),
        "alert lines after 11 dead letters: {alerts:?}, expected one with the count"
    );
    ensure!(
        alerts[0].contains("ERROR"),
        "the alert is not an error: {}",
        alerts[0]
    );
    client.publish(Some("pay-bad-6"), b"not json 6").await?;
    client.wait_ready(&dlq, 12).await?;
    let after = consumer.log_lines("dead-letter alert").len();
    ensure!(
        after == 1,
        "{after} alert lines at 12 dead letters: the same crossing raised it again"
    );

    let letters = case.dead_letters().await?;
    let invalid = letters
        .iter()
        .filter(|letter| {
            letter["reason"]
                .as_str()
                .is_some_and(|reason| reason.starts_with("the body is not a payment"))
        })
        .count();
    let anonymous = letters
        .iter()
        .filter(|letter| letter["message_id"].is_null() && letter["reason"] == "no-message-id")
        .count();
    let single = letters
        .iter()
        .all(|letter| letter["attempts"].as_array().is_some_and(|a| a.len() == 1));
    ensure!(
        letters.len() == 12 && invalid == 7 && anonymous == 5 && single,
        "dead letters: {letters:?}; expected 7 invalid bodies and 5 without an id, one attempt each"
    );
    consumer.terminate().await?;
    let alert = alerts[0]
        .split("dead-letter alert")
        .nth(1)
        .and_then(|rest| rest.split(',').next())
        .unwrap_or_default();
    Ok(format!(
        "permanent errors dead-lettered at once; 11 -> 1 alert (\"dead-letter alert{alert}\"), 12 -> still 1"
    ))
}

/// A dead letter stays put until `redrive`; after a restart without the bug,
/// the re-driven message is applied once, and a later copy of it is a
/// duplicate.
async fn a_redriven_dead_letter_is_applied_once(case: Case) -> Result<String, String> {
    let buggy = case
        .consumer(&["--fail-account", "acct-late", "--max-attempts", "3"])
        .await?;
    let client = Client::connect(&case).await?;
    client
        .publish(Some("pay-rd-1"), &payment("acct-late", 500))
        .await?;
    let dlq = client.topology.dead_letter_queue();
    client.wait_ready(&dlq, 1).await?;
    buggy.terminate().await?;

    let fixed = case.consumer(&[]).await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let untouched = case.balance("acct-late").await?;
    ensure!(
        untouched.operations == 0 && client.ready(&dlq).await? == 1,
        "before the redrive: {untouched:?}; nothing may re-drive automatically"
    );
    let out = case
        .command(&["redrive", "--amqp", &case.amqp, "--queue", &case.queue])
        .await?;
    let said = format!("re-drove 1 dead letters from {dlq} to {}", case.queue);
    ensure!(
        out.trim() == said,
        "redrive printed {out:?}, expected {said:?}"
    );
    let applied = wait_operations(&case, "acct-late", 1).await?;
    ensure!(
        applied.balance == 500 && applied.operations == 1,
        "after the redrive: {applied:?}"
    );
    // A producer sends it again: a duplicate. The next message shows it was
    // handled.
    client
        .publish(Some("pay-rd-1"), &payment("acct-late", 500))
        .await?;
    client
        .publish(Some("pay-rd-2"), &payment("acct-late", 1))
        .await?;
    let last = wait_operations(&case, "acct-late", 2).await?;
    ensure!(
        last.balance == 501 && last.operations == 2,
        "after a copy of pay-rd-1 and pay-rd-2: {last:?}, expected balance 501 in 2 operations"
    );
    let out = case
        .command(&["redrive", "--amqp", &case.amqp, "--queue", &case.queue])
        .await?;
    ensure!(
        out.trim() == format!("re-drove 0 dead letters from {dlq} to {}", case.queue),
        "a second redrive printed {out:?}"
    );
    ensure!(
        client.ready(&dlq).await? == 0,
        "dead letters left after the redrive"
    );
    fixed.terminate().await?;
    let letters: Vec<Value> = case.dead_letters().await?;
    ensure!(letters.is_empty(), "dead letters left: {letters:?}");
    Ok("dead letter kept until redrive; applied once after it (balance 500, 1 operation), a later copy a duplicate".into())
}

/// At `RUST_LOG=trace`, through a success, a retried failure and its dead
/// letter, a reused id, an invalid body and a message without an id, the
/// consumer's stderr holds no whole message id and nothing of a body (long,
/// distinctive ids, accounts and values, looked for verbatim).
async fn trace_logs_hold_no_message_id_and_no_body(case: Case) -> Result<String, String> {
    let tag = format!("{:032x}", rand::random::<u128>());
    let id = |n: u32| format!("trace-message-id-{tag}-{n}");
    let account = |n: u32| format!("trace-account-{tag}-{n}");
    let secret = format!("trace-body-value-{tag}");
    let failing = account(2);
    let consumer = case
        .consumer_with_env(
            &[("RUST_LOG", "trace")],
            &["--fail-account", &failing, "--max-attempts", "2"],
        )
        .await?;
    let client = Client::connect(&case).await?;
    client
        .publish(Some(&id(1)), &payment(&account(1), 11))
        .await?;
    client.publish(Some(&id(2)), &payment(&failing, 12)).await?;
    client
        .publish(Some(&id(1)), &payment(&account(1), 13))
        .await?;
    let invalid = json!({"account_id": secret, "amount": secret}).to_string();
    client.publish(Some(&id(3)), invalid.as_bytes()).await?;
    client.publish(None, &payment(&account(3), 14)).await?;
    client
        .publish(Some(&id(4)), &payment(&account(4), 15))
        .await?;
    wait_operations(&case, &account(4), 1).await?;
    client
        .wait_ready(&client.topology.dead_letter_queue(), 4)
        .await?;
    consumer_terminated(consumer, &tag, &secret).await
}

async fn consumer_terminated(
    consumer: super::ConsumerProcess,
    tag: &str,
    secret: &str,
) -> Result<String, String> {
    let lines = stopped_without(consumer, &[tag, secret]).await?;
    Ok(format!(
        "{lines} lines at trace, none with a message id, an account or a body value"
    ))
}

/// Stops `consumer` (SIGTERM), then checks its log: it has debug lines
/// (`RUST_LOG=trace` took), and none of them holds any of `secrets`.
/// Answers how many lines it has.
pub(super) async fn stopped_without(
    consumer: super::ConsumerProcess,
    secrets: &[&str],
) -> Result<usize, String> {
    let log = consumer.log.clone();
    consumer.terminate().await?;
    let text = super::process::read_log(&log);
    let lines = text.lines().count();
    // idem itself logs nothing below debug, and the drivers that would (every
    // frame, every statement's parameters) are held at info.
    ensure!(
        text.contains("DEBUG"),
        "the log has no debug lines: RUST_LOG=trace did not take ({lines} lines)"
    );
    let leaks: Vec<&str> = text
        .lines()
        .filter(|line| secrets.iter().any(|secret| line.contains(secret)))
        .take(3)
        .collect();
    ensure!(
        leaks.is_empty(),
        "log lines with one of {secrets:?} ({}): {leaks:#?}",
        log.display()
    );
    Ok(lines)
}

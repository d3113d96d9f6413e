//! The scenarios: one behaviour each, run against the binary.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use futures_util::FutureExt;
use futures_util::future::BoxFuture;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

use super::process::{Case, Client, PATIENCE, accounts, processed};
use crate::alert::WATCH_INTERVAL;
use crate::ledger::Account;

/// A scenario: its name (a queue and a database are named after it), the
/// check it proves (its row in `cargo xtask e2e`), and how to run it: the
/// figure behind a pass, or what failed.
pub struct Scenario {
    /// A plain name (ASCII letters, digits, `_`).
    pub name: &'static str,
    /// What it proves, for the e2e table.
    pub check: &'static str,
    /// Runs it on a fresh case.
    pub run: fn(Case) -> BoxFuture<'static, Result<String, String>>,
}

/// Every scenario.
pub const SCENARIOS: &[Scenario] = &[
    Scenario {
        name: "consumer_duplicates",
        check: "consumer: 10 deliveries of one message_id, one effect",
        run: |case| ten_identical_deliveries_take_effect_once(case).boxed(),
    },
    Scenario {
        name: "consumer_sigkill",
        check: "consumer: SIGKILL x5 over 500 messages, every balance exact",
        run: |case| sigkill_and_restarts_leave_every_balance_exact(case).boxed(),
    },
    Scenario {
        name: "consumer_dead_letter",
        check: "consumer: failing message dead-lettered after 3 attempts",
        run: |case| a_failing_message_is_dead_lettered_after_its_last_attempt(case).boxed(),
    },
    Scenario {
        name: "consumer_alert",
        check: "consumer: 11 dead letters, one alert",
        run: |case| eleven_dead_letters_raise_one_alert(case).boxed(),
    },
    Scenario {
        name: "consumer_redrive",
        check: "consumer: redrive after the fix, applied once",
        run: |case| a_redriven_dead_letter_is_applied_once(case).boxed(),
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

fn payment(account: &str, amount: i64) -> Vec<u8> {
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
    let inbox = processed(&case.pool().await?, &case.inbox_consumer()).await?;
    ensure!(inbox == 2, "the inbox holds {inbox} messages, expected 2");
    consumer.terminate().await?;
    Ok(
        "10 deliveries of pay-dup-1 -> 1 effect; pay-dup-2 -> a 2nd; balance 350, 2 operations"
            .into(),
    )
}

/// 500 messages, 100 of them duplicates, while the consumer is killed with
/// `SIGKILL` 5 times at random points and restarted: every balance is exact.
async fn sigkill_and_restarts_leave_every_balance_exact(case: Case) -> Result<String, String> {
    const ACCOUNTS: usize = 20;
    const UNIQUE: usize = 400;
    const DUPLICATES: usize = 100;
    const KILLS: usize = 5;
    let seed = std::env::var("PAYMENTS_CONSUMER_CRASH_SEED")
        .ok()
        .and_then(|seed| seed.parse().ok())
        .unwrap_or_else(rand::random::<u64>);
    let mut rng = StdRng::seed_from_u64(seed);
    let failed =
        |why: String| format!("{why} (seed {seed}: set PAYMENTS_CONSUMER_CRASH_SEED to replay)");

    let mut messages: Vec<(String, Vec<u8>)> = Vec::new();
    let mut expected: BTreeMap<String, (i64, i64)> = BTreeMap::new();
    for i in 0..UNIQUE {
        let account = format!("acct-k-{:02}", rng.random_range(0..ACCOUNTS));
        let amount = rng.random_range(-500..=1000);
        let entry = expected.entry(account.clone()).or_default();
        entry.0 += amount;
        entry.1 += 1;
        messages.push((format!("pay-k-{i}"), payment(&account, amount)));
    }
    // Each duplicate goes somewhere after its original.
    for _ in 0..DUPLICATES {
        let original = rng.random_range(0..messages.len());
        let copy = messages[original].clone();
        let at = rng.random_range(original + 1..=messages.len());
        messages.insert(at, copy);
    }
    let client = Client::connect(&case).await?;
    for (id, body) in &messages {
        client.publish(Some(id), body).await?;
    }
    let pool = case.pool().await?;
    let consumer_name = case.inbox_consumer();
    // Kill when the inbox reaches random counts: mid-stream every time.
    let mut targets: Vec<i64> = (20..380).collect();
    targets.shuffle(&mut rng);
    let mut targets = targets[..KILLS].to_vec();
    targets.sort_unstable();
    let mut at_kills = Vec::new();
    for target in targets {
        let consumer = case.consumer(&[]).await?;
        let started = Instant::now();
        loop {
            if processed(&pool, &consumer_name).await? >= target {
                break;
            }
            if started.elapsed() > PATIENCE {
                return Err(failed(format!("the inbox never reached {target} messages")));
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        consumer.kill().await;
        at_kills.push(processed(&pool, &consumer_name).await?);
    }
    let consumer = case.consumer(&[]).await?;
    let started = Instant::now();
    loop {
        let done = processed(&pool, &consumer_name).await? == UNIQUE as i64
            && client.ready(case.queue.as_str()).await? == 0;
        if done {
            break;
        }
        if started.elapsed() > PATIENCE {
            return Err(failed("the queue was not drained".into()));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The duplicates still in flight are acknowledged within moments.
    tokio::time::sleep(Duration::from_millis(500)).await;
    consumer.terminate().await?;
    let left = client.ready(&case.queue).await?;
    let dead = client.ready(&client.topology.dead_letter_queue()).await?;
    if left != 0 || dead != 0 {
        return Err(failed(format!(
            "{left} messages left in the queue and {dead} dead letters, expected none"
        )));
    }
    let found: BTreeMap<String, (i64, i64)> = accounts(&pool)
        .await?
        .into_iter()
        .map(|account| (account.account_id, (account.balance, account.operations)))
        .collect();
    if found != expected {
        return Err(failed(format!(
            "balances (balance, operations) by account: {found:?}, expected {expected:?}"
        )));
    }
    let effects: i64 = found.values().map(|(_, operations)| operations).sum();
    Ok(format!(
        "{} messages ({DUPLICATES} duplicates), {KILLS} kills at {at_kills:?} processed, \
         {effects} effects, {} balances exact",
        messages.len(),
        found.len()
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
    let reason = "payments to account acct-broken fail on purpose (--fail-account)";
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
    let deaths = client.x_deaths().await?;
    let retry = client.topology.retry_queue();
    ensure!(
        deaths.len() == 1 && deaths[0].contains(&(retry.clone(), "expired".to_owned(), 3)),
        "x-death of the dead letter: {deaths:?}, expected ({retry}, expired, 3): two retries and \
         the way to the dead-letter queue"
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
        "3 attempts ({spacing:?} ms apart), reason and body in dead-letters, x-death kept"
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
    for i in 0..5 {
        client.publish(None, &payment("acct-anon", i)).await?;
    }
    let dlq = client.topology.dead_letter_queue();
    client.wait_ready(&dlq, 11).await?;
    // A few looks of the watcher.
    tokio::time::sleep(WATCH_INTERVAL * 4).await;
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
    tokio::time::sleep(WATCH_INTERVAL * 4).await;
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
        .filter(|letter| {
            letter["message_id"].is_null()
                && letter["reason"]
                    == "the message has no message_id property: it cannot be processed exactly once"
        })
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
        .and_then(|rest| rest.split(';').next())
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

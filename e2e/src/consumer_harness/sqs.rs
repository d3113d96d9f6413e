//! The scenarios on SQS (`run --sqs`, `docs/contract.md` §12), against
//! moto's server ([`Case::with_sqs`]): each case's queue name is its SQS
//! queue's, created by the scenario with the visibility timeout it needs.
//!
//! The consumers run with `RUST_LOG=info,idem=debug`, so that their logs
//! hold one `outcome` line per delivery the protocol decided (`processed`,
//! `duplicate`, `retried`, `dead_lettered`): what SQS delivered, beside what
//! the database shows took effect.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use futures_util::FutureExt;
use idem_sqs::aws_sdk_sqs::Client;
use idem_sqs::aws_sdk_sqs::types::QueueAttributeName;
use idem_sqs::{ClientConfig, Outgoing, Publisher};
use idem_testkit::TestSqs;
use rand::seq::SliceRandom;
use serde_json::json;

use super::faults;
use super::process::{Case, ConsumerProcess, PATIENCE, processed, read_log};
use super::scenarios::{
    Scenario, Stream, payment, seeded, stopped_without, stream, wait_operations, wait_processed,
};
use payments_consumer::database::Database;

/// Every scenario on SQS.
pub(crate) const SQS_SCENARIOS: &[Scenario] = &[
    Scenario {
        name: "sqs_lost_commit_answers",
        check: "consumer on SQS: every 5th COMMIT answer lost, 240 messages, balances exact",
        stops_broker: false,
        long: false,
        postgres_only: true,
        run: |case| lost_commit_answers(case).boxed(),
    },
    Scenario {
        name: "sqs_endpoint_outage",
        check: "consumer on SQS: SQS unreachable for 25 s mid-stream, resumed by itself, balances exact",
        stops_broker: false,
        long: true,
        postgres_only: true,
        run: |case| an_endpoint_outage(case).boxed(),
    },
    Scenario {
        name: "sqs_binary_id",
        check: "consumer on SQS: a Binary message_id keys its message; a resend is a duplicate; one not UTF-8 dead-lettered",
        stops_broker: false,
        long: false,
        postgres_only: true,
        run: |case| a_binary_id_keys_its_message(case).boxed(),
    },
    Scenario {
        name: "sqs_trace_logs",
        check: "consumer on SQS: at RUST_LOG=trace no line holds a body, a message id or the access key id",
        stops_broker: false,
        long: false,
        postgres_only: true,
        run: |case| trace_logs_hold_no_payload_and_no_credential(case).boxed(),
    },
    Scenario {
        name: "sqs_db_outage",
        check: "consumer on SQS: a 25 s database outage, maxReceiveCount 3: nothing dead-lettered, balances exact",
        stops_broker: false,
        long: true,
        postgres_only: true,
        run: |case| a_database_outage_spends_no_receive(case).boxed(),
    },
    Scenario {
        name: "sqs_sigkill",
        check: "consumer on SQS: SIGKILL x5 over 300 messages (50 duplicates), balances exact",
        stops_broker: false,
        long: true,
        postgres_only: false,
        // 300 messages: moto's CPU, beside the other rows, made 500 the
        // e2e's longest row (107 s on each database).
        run: |case| sigkill_mid_stream(case, &[], (250, 50)).boxed(),
    },
    Scenario {
        name: "sqs_batch_sigkill",
        check: "consumer on SQS: --batch 10, SIGKILL x5 over 180 messages (30 duplicates), balances exact",
        stops_broker: false,
        long: false,
        postgres_only: false,
        run: |case| sigkill_mid_stream(case, &["--batch", "10"], (150, 30)).boxed(),
    },
    Scenario {
        name: "sqs_batch_dead_letter",
        check: "consumer on SQS: --batch 10, a failing message among others dead-lettered alone after exactly 3 receives, the others applied once",
        stops_broker: false,
        long: false,
        postgres_only: false,
        run: |case| dead_letter_then(case, false, &["--batch", "10"]).boxed(),
    },
    Scenario {
        name: "sqs_slow_handler",
        check: "consumer on SQS: a 3 s handler on a 1 s visibility timeout runs once",
        stops_broker: false,
        long: false,
        postgres_only: false,
        run: |case| a_handler_slower_than_the_visibility_timeout_runs_once(case).boxed(),
    },
    Scenario {
        name: "sqs_dead_letter",
        check: "consumer on SQS: failing message in <queue>-dlq after exactly 3 receives",
        stops_broker: false,
        long: false,
        postgres_only: false,
        run: |case| a_failing_message_is_dead_lettered_after_three_receives(case).boxed(),
    },
    Scenario {
        name: "sqs_redrive",
        check: "consumer on SQS: redrive after the fix, applied once; a second moves nothing",
        stops_broker: false,
        long: true,
        postgres_only: false,
        run: |case| a_redrive_is_applied_once(case).boxed(),
    },
    Scenario {
        name: "sqs_fifo_dedup",
        check: "consumer on SQS FIFO: content dedup narrows duplicates, the inbox removes them",
        stops_broker: false,
        long: false,
        postgres_only: false,
        run: |case| the_fifo_content_deduplication_exercise(case).boxed(),
    },
];

/// The environment the binary reads its credentials and region from
/// (moto takes any credentials).
pub(crate) const AWS_ENV: [(&str, &str); 3] = [
    ("AWS_ACCESS_KEY_ID", "test"),
    ("AWS_SECRET_ACCESS_KEY", "test"),
    ("AWS_REGION", "us-east-1"),
];

/// The consumers' log filter: the protocol's outcome lines.
const OUTCOMES: [(&str, &str); 1] = [("RUST_LOG", "info,idem=debug")];

/// Fails the scenario with `message` unless `condition` holds.
macro_rules! ensure {
    ($condition:expr, $($message:tt)+) => {
        if !$condition {
            return Err(format!($($message)+));
        }
    };
}

fn server(case: &Case) -> Result<&TestSqs, String> {
    case.sqs
        .as_deref()
        .ok_or_else(|| "an SQS case needs Case::with_sqs".to_owned())
}

/// An SDK client of the case's server.
fn client(case: &Case) -> Result<Client, String> {
    ClientConfig::from_env()
        .endpoint(server(case)?.endpoint())
        .region("us-east-1")
        .credentials("test", "test")
        .build()
        .map_err(|e| format!("the SQS client: {e}"))
}

/// Creates the case's queue with `attributes`; answers its URL, the one the
/// case's consumers are given.
async fn create_queue(
    case: &Case,
    client: &Client,
    attributes: &[(QueueAttributeName, &str)],
) -> Result<String, String> {
    let mut create = client.create_queue().queue_name(&case.queue);
    for (attribute, value) in attributes {
        create = create.attributes(attribute.clone(), *value);
    }
    let created = create
        .send()
        .await
        .map_err(|e| format!("creating {}: {e:?}", case.queue))?;
    let url = created.queue_url().unwrap_or_default().to_owned();
    let expected = server(case)?.queue_url(&case.queue);
    ensure!(
        url == expected,
        "moto named the queue {url:?}, the consumers are given {expected:?}"
    );
    Ok(url)
}

/// The messages of the queue at `url`: visible, in flight, delayed.
async fn depth(client: &Client, url: &str) -> Result<u64, String> {
    let answer = client
        .get_queue_attributes()
        .queue_url(url)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessages)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesNotVisible)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesDelayed)
        .send()
        .await
        .map_err(|e| format!("counting the messages of {url}: {e:?}"))?;
    let attributes = answer.attributes().cloned().unwrap_or_default();
    Ok(attributes
        .values()
        .filter_map(|n| n.parse::<u64>().ok())
        .sum())
}

/// The URL of the case's dead-letter queue (`<queue>-dlq`, created by the
/// consumer at its start).
fn dead_letter_queue(case: &Case) -> Result<String, String> {
    Ok(server(case)?.queue_url(&idem_sqs::dead_letter_queue_name(&case.queue)))
}

/// How often a wait on the queue alone asks moto again: every SQS row shares
/// the one server, which spends a core on the calls it is sent.
const MOTO_POLL: Duration = Duration::from_millis(200);

/// Waits until the queue at `url` holds `count` messages.
async fn wait_depth(client: &Client, url: &str, count: u64) -> Result<(), String> {
    let started = Instant::now();
    loop {
        let found = depth(client, url).await?;
        if found == count {
            return Ok(());
        }
        ensure!(
            started.elapsed() < PATIENCE,
            "{url} held {found} messages after {PATIENCE:?}, not {count}"
        );
        tokio::time::sleep(MOTO_POLL).await;
    }
}

/// Sends `stream` with each message's `message_id` attribute.
async fn publish(client: &Client, url: &str, stream: &Stream) -> Result<(), String> {
    let publisher = Publisher::new(client.clone(), url).map_err(|e| e.to_string())?;
    for (id, body) in &stream.messages {
        let body = String::from_utf8(body.clone()).map_err(|e| e.to_string())?;
        publisher
            .send(&Outgoing::new(body).message_id(id))
            .await
            .map_err(|e| format!("sending {id}: {e}"))?;
    }
    Ok(())
}

/// Waits until the inbox holds `unique` messages and the queue holds none
/// (none in flight either: every delivery was settled and deleted), then
/// checks that the dead-letter queue is empty.
async fn drained(
    case: &Case,
    client: &Client,
    url: &str,
    database: &Database,
    unique: usize,
) -> Result<(), String> {
    // Fails once nothing moved for PATIENCE (see `wait_processed`). The
    // queue is counted once the inbox is complete: moto, which every SQS row
    // shares, spends a core on the calls it is sent.
    let (mut last, mut since) = ((-1, None), Instant::now());
    loop {
        let done = processed(database, &case.inbox_consumer()).await?;
        let left = match done == unique as i64 {
            true => Some(depth(client, url).await?),
            false => None,
        };
        if left == Some(0) {
            break;
        }
        if (done, left) != last {
            (last, since) = ((done, left), Instant::now());
        }
        ensure!(
            since.elapsed() < PATIENCE,
            "{done} of {unique} processed, {} messages left in the queue, and nothing moved for {PATIENCE:?}",
            left.map_or("some".to_owned(), |left| left.to_string())
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let dead = depth(client, &dead_letter_queue(case)?).await?;
    ensure!(dead == 0, "{dead} dead letters, expected none");
    Ok(())
}

/// The `outcome="NAME"` lines of the logs.
fn outcomes(logs: &[PathBuf], outcome: &str) -> Vec<String> {
    let needle = format!("outcome=\"{outcome}\"");
    logs.iter()
        .flat_map(|log| {
            read_log(log)
                .lines()
                .filter(|line| line.contains(&needle))
                .map(str::to_owned)
                .collect::<Vec<_>>()
        })
        .collect()
}

/// A consumer of the case logging its outcomes, with `extra` flags.
async fn consumer(case: &Case, extra: &[&str]) -> Result<ConsumerProcess, String> {
    case.consumer_with_env(&OUTCOMES, extra).await
}

/// 240 messages (40 of them a producer's resends), 4 at a time, while the
/// answer to every 5th COMMIT of the consumer's database is lost: every
/// balance exact, no dead letter, the consumer alive.
async fn lost_commit_answers(mut case: Case) -> Result<String, String> {
    let (mut rng, seed) = seeded();
    let failed = |why: String| format!("{why} (seed {seed}: set PAYMENTS_CONSUMER_SEED to replay)");
    let client = client(&case)?;
    let url = create_queue(
        &case,
        &client,
        &[(QueueAttributeName::VisibilityTimeout, "5")],
    )
    .await?;
    let stream = stream(&mut rng, "sl", 200, 40, 10);
    publish(&client, &url, &stream).await?;
    let proxy = faults::losing_commit_answers(&mut case)?;
    let database = case.database().await?;
    let consumer = consumer(&case, &["--concurrency", "4"]).await?;
    drained(&case, &client, &url, &database, stream.unique)
        .await
        .map_err(failed)?;
    let lost = faults::lost_at_least(&proxy, 10)?;
    faults::alive(consumer).await?;
    let effects = stream.exact(&database).await.map_err(failed)?;
    Ok(format!(
        "{} messages (40 duplicates), {lost} COMMIT answers lost; {effects} effects, {} balances exact, 0 dead letters",
        stream.messages.len(),
        stream.expected.len()
    ))
}

/// 100 messages; after 20 are applied, SQS stops answering the consumer
/// for 25 s (its connections reset, new ones refused: the endpoint behind a
/// fault proxy), then answers again. The consumer polls again with
/// full-jitter backoff and resumes by itself; what it could not delete comes
/// back and is a duplicate. Every balance exact, nothing dead-lettered, the
/// consumer alive.
async fn an_endpoint_outage(mut case: Case) -> Result<String, String> {
    let (mut rng, seed) = seeded();
    let failed = |why: String| format!("{why} (seed {seed}: set PAYMENTS_CONSUMER_SEED to replay)");
    let client = client(&case)?;
    let url = create_queue(
        &case,
        &client,
        &[(QueueAttributeName::VisibilityTimeout, "2")],
    )
    .await?;
    let stream = stream(&mut rng, "se", 100, 0, 10);
    publish(&client, &url, &stream).await?;
    let proxy = case.proxy_sqs()?;
    let database = case.database().await?;
    let consumer = consumer(&case, &["--concurrency", "4", "--handler-latency-ms", "20"]).await?;
    wait_processed(&case, &database, 20).await.map_err(failed)?;
    faults::outage(&proxy).await;
    let during = processed(&database, &case.inbox_consumer()).await?;
    drained(&case, &client, &url, &database, stream.unique)
        .await
        .map_err(failed)?;
    faults::alive(consumer).await?;
    let effects = stream.exact(&database).await.map_err(failed)?;
    Ok(format!(
        "{} messages; {during} applied when SQS answered again after {} s; {effects} effects, {} balances exact, 0 dead letters",
        stream.messages.len(),
        faults::OUTAGE.as_secs(),
        stream.expected.len()
    ))
}

/// The consumer at `RUST_LOG=trace`, with an access key id of its own:
/// three payments and a body that is no payment, each with a distinctive
/// id, account and value. No line of its log holds any of them, nor the
/// access key id (the AWS SDK logs requests whole, and signs them, below
/// `INFO`: `idem_core::log::PAYLOAD_TARGETS`).
async fn trace_logs_hold_no_payload_and_no_credential(case: Case) -> Result<String, String> {
    let tag = format!("{:032x}", rand::random::<u128>());
    let key_id = format!("AKIDTRACE{}", &tag[..16]).to_uppercase();
    let secret = format!("trace-body-value-{tag}");
    let client = client(&case)?;
    let url = create_queue(
        &case,
        &client,
        &[(QueueAttributeName::VisibilityTimeout, "5")],
    )
    .await?;
    let publisher = Publisher::new(client.clone(), &url).map_err(|e| e.to_string())?;
    let account = format!("trace-account-{tag}");
    for n in 1..=3 {
        let body = String::from_utf8(payment(&account, n)).map_err(|e| e.to_string())?;
        publisher
            .send(&Outgoing::new(body).message_id(format!("trace-message-id-{tag}-{n}")))
            .await
            .map_err(|e| e.to_string())?;
    }
    let invalid = json!({"account_id": secret, "amount": secret}).to_string();
    publisher
        .send(&Outgoing::new(invalid).message_id(format!("trace-message-id-{tag}-4")))
        .await
        .map_err(|e| e.to_string())?;
    let consumer = case
        .consumer_with_env(
            &[
                ("RUST_LOG", "trace"),
                ("AWS_ACCESS_KEY_ID", key_id.as_str()),
            ],
            &[],
        )
        .await?;
    wait_operations(&case, &account, 3).await?;
    wait_depth(&client, &dead_letter_queue(&case)?, 1).await?;
    let lines = stopped_without(consumer, &[&tag, &secret, &key_id]).await?;
    Ok(format!(
        "{lines} lines at trace, none with a message id, an account, a body value or the access key id"
    ))
}

/// A queue whose redrive policy moves a message after 3 receives; 100
/// messages, 4 at a time; after 20 are applied the database goes away for
/// 25 s (connections reset and refused). The consumer holds the messages it
/// has (their visibility extended) and receives no more: no message is
/// received a 3rd time, so SQS moves none to the policy's target. Every
/// balance exact, the target empty, the consumer alive.
async fn a_database_outage_spends_no_receive(mut case: Case) -> Result<String, String> {
    let (mut rng, seed) = seeded();
    let failed = |why: String| format!("{why} (seed {seed}: set PAYMENTS_CONSUMER_SEED to replay)");
    let client = client(&case)?;
    let target = format!("{}-target", case.queue);
    let created = client
        .create_queue()
        .queue_name(&target)
        .send()
        .await
        .map_err(|e| format!("creating {target}: {e:?}"))?;
    let target_url = created.queue_url().unwrap_or_default().to_owned();
    let policy = format!(
        r#"{{"deadLetterTargetArn":"arn:aws:sqs:us-east-1:123456789012:{target}","maxReceiveCount":3}}"#
    );
    let url = create_queue(
        &case,
        &client,
        &[
            (QueueAttributeName::VisibilityTimeout, "2"),
            (QueueAttributeName::RedrivePolicy, policy.as_str()),
        ],
    )
    .await?;
    let stream = stream(&mut rng, "so", 100, 0, 10);
    publish(&client, &url, &stream).await?;
    let proxy = case.proxy_database()?;
    let database = case.database().await?;
    let consumer = consumer(&case, &["--concurrency", "4", "--handler-latency-ms", "20"]).await?;
    wait_processed(&case, &database, 20).await.map_err(failed)?;
    faults::outage(&proxy).await;
    let during = processed(&database, &case.inbox_consumer()).await?;
    let started = Instant::now();
    loop {
        let done = processed(&database, &case.inbox_consumer()).await?;
        // The queue is counted once the inbox is complete (see `drained`).
        if done == stream.unique as i64 && depth(&client, &url).await? == 0 {
            break;
        }
        ensure!(
            started.elapsed() < PATIENCE,
            "after {PATIENCE:?}: {done} of {} processed, messages left in the queue",
            stream.unique
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let moved = depth(&client, &target_url).await?;
    ensure!(
        moved == 0,
        "SQS moved {moved} healthy messages to the redrive policy's target"
    );
    faults::alive(consumer).await?;
    let effects = stream.exact(&database).await.map_err(failed)?;
    Ok(format!(
        "{} messages; {during} applied when the database came back after {} s; 0 moved by maxReceiveCount 3; {effects} effects, {} balances exact",
        stream.messages.len(),
        faults::OUTAGE.as_secs(),
        stream.expected.len()
    ))
}

/// `unique` messages and `resent` more (a producer's resends) on a queue
/// whose visibility timeout is 2 s; the consumer (run with `flags`) is
/// `SIGKILL`ed 5 times at random points of the stream and restarted: every
/// balance exact. What was received and not deleted at a kill comes back
/// after its timeout: the deliveries beyond the producer's resends that the
/// inbox absorbed are the ones committed and not yet deleted at a kill.
async fn sigkill_mid_stream(
    case: Case,
    flags: &'static [&'static str],
    (unique, resent): (usize, usize),
) -> Result<String, String> {
    const KILLS: usize = 5;
    let (mut rng, seed) = seeded();
    let failed = |why: String| format!("{why} (seed {seed}: set PAYMENTS_CONSUMER_SEED to replay)");
    let client = client(&case)?;
    let url = create_queue(
        &case,
        &client,
        &[(QueueAttributeName::VisibilityTimeout, "2")],
    )
    .await?;
    let stream = stream(&mut rng, "sk", unique, resent, 20);
    publish(&client, &url, &stream).await?;
    let database = case.database().await?;
    let inbox = case.inbox_consumer();
    let mut targets: Vec<i64> = (20..unique as i64 - 20).collect();
    targets.shuffle(&mut rng);
    let mut targets = targets[..KILLS].to_vec();
    targets.sort_unstable();
    let mut at_kills = Vec::new();
    let mut logs = Vec::new();
    for target in targets {
        let consumer = consumer(&case, flags).await?;
        logs.push(consumer.log.clone());
        wait_processed(&case, &database, target)
            .await
            .map_err(failed)?;
        consumer.kill().await;
        at_kills.push(processed(&database, &inbox).await?);
    }
    let consumer = consumer(&case, flags).await?;
    logs.push(consumer.log.clone());
    drained(&case, &client, &url, &database, stream.unique)
        .await
        .map_err(failed)?;
    consumer.terminate().await?;
    let effects = stream.exact(&database).await.map_err(failed)?;
    let duplicates = outcomes(&logs, "duplicate").len();
    let decided = outcomes(&logs, "processed").len() + duplicates;
    ensure!(
        decided >= stream.messages.len(),
        "the consumers decided {decided} deliveries, fewer than the {} messages sent",
        stream.messages.len()
    );
    Ok(format!(
        "{} messages ({resent} duplicates), {KILLS} kills at {at_kills:?} processed; {duplicates} \
         deliveries absorbed as duplicates ({} redelivered after a kill); {effects} effects, {} \
         balances exact",
        stream.messages.len(),
        duplicates.saturating_sub(resent),
        stream.expected.len()
    ))
}

/// A payment with a 3 s handler (`--handler-latency-ms`, inside its
/// transaction) on a queue whose visibility timeout is 1 s, the consumer
/// with a free slot (it keeps polling): the handler runs once (1
/// `processed`, no `duplicate`), and another receiver polling the queue
/// meanwhile gets nothing: the lease was extended while the handler ran;
/// the message is deleted after its commit. One payment: on SQLite a second
/// transaction would wait for the first's write lock, and give up after the
/// busy timeout (the delivery back to the queue, uncounted), which is not
/// what this shows.
async fn a_handler_slower_than_the_visibility_timeout_runs_once(
    case: Case,
) -> Result<String, String> {
    let client = client(&case)?;
    let url = create_queue(
        &case,
        &client,
        &[(QueueAttributeName::VisibilityTimeout, "1")],
    )
    .await?;
    let publisher = Publisher::new(client.clone(), &url).map_err(|e| e.to_string())?;
    let body = String::from_utf8(payment("acct-slow", 7)).map_err(|e| e.to_string())?;
    publisher
        .send(&Outgoing::new(body).message_id("pay-slow"))
        .await
        .map_err(|e| e.to_string())?;
    let started = Instant::now();
    let consumer = consumer(
        &case,
        &["--handler-latency-ms", "3000", "--concurrency", "2"],
    )
    .await?;
    // Once the consumer holds it, another receiver polls until it is gone: a
    // message it got would be one whose lease lapsed.
    loop {
        let answer = client
            .get_queue_attributes()
            .queue_url(&url)
            .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesNotVisible)
            .send()
            .await
            .map_err(|e| format!("{e:?}"))?;
        let in_flight = answer
            .attributes()
            .and_then(|a| a.get(&QueueAttributeName::ApproximateNumberOfMessagesNotVisible))
            .and_then(|n| n.parse::<u64>().ok())
            .unwrap_or(0);
        if in_flight == 1 {
            break;
        }
        ensure!(
            started.elapsed() < PATIENCE,
            "the consumer did not take the message within {PATIENCE:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut spied = 0u32;
    let mut seen = 0usize;
    while depth(&client, &url).await? > 0 {
        let answer = client
            .receive_message()
            .queue_url(&url)
            .max_number_of_messages(10)
            .wait_time_seconds(1)
            .visibility_timeout(0)
            .send()
            .await
            .map_err(|e| format!("the other receiver: {e:?}"))?;
        spied += 1;
        seen += answer.messages().len();
        ensure!(
            started.elapsed() < PATIENCE,
            "the queue still held the message after {PATIENCE:?}"
        );
    }
    let took = started.elapsed();
    let database = case.database().await?;
    let applied = processed(&database, &case.inbox_consumer()).await?;
    let log = consumer.log.clone();
    consumer.terminate().await?;
    let logs = std::slice::from_ref(&log);
    let (runs, duplicates) = (
        outcomes(logs, "processed").len(),
        outcomes(logs, "duplicate").len(),
    );
    ensure!(
        seen == 0,
        "another receiver got the message {seen} times while its handler ran: the lease lapsed"
    );
    ensure!(
        applied == 1 && runs == 1 && duplicates == 0,
        "{applied} in the inbox, {runs} processed and {duplicates} duplicate outcomes; expected \
         1, 1 and 0"
    );
    let account = case.balance("acct-slow").await?;
    ensure!(
        (account.balance, account.operations) == (7, 1),
        "acct-slow: {account:?}, expected 7 in 1 operation"
    );
    Ok(format!(
        "a 3 s handler on a 1 s visibility timeout ran once (1 processed, 0 duplicates); \
         {spied} receives by another receiver meanwhile got nothing; deleted after {:.1} s",
        took.as_secs_f64()
    ))
}

/// A payment to `--fail-account` between two good ones: received exactly
/// 3 times (2 retries, then the dead letter), then in `<queue>-dlq` with
/// the attributes `idem-reason` and `idem-attempts` (3 times), listed by
/// `dead-letters --sqs` and kept there; the others applied.
async fn a_failing_message_is_dead_lettered_after_three_receives(
    case: Case,
) -> Result<String, String> {
    dead_letter_then(case, false, &[]).await
}

/// The dead letter above, re-driven after the fix (a consumer without
/// `--fail-account`): applied once; a producer's later copy is a duplicate;
/// a second redrive moves nothing, and the listing is empty.
async fn a_redrive_is_applied_once(case: Case) -> Result<String, String> {
    dead_letter_then(case, true, &[]).await
}

const REASON: &str = "payments to the account of --fail-account fail on purpose";

async fn dead_letter_then(
    case: Case,
    redrive: bool,
    flags: &'static [&'static str],
) -> Result<String, String> {
    let client = client(&case)?;
    let url = create_queue(&case, &client, &[]).await?;
    let ok = format!("acct-{}-ok", case.queue);
    let bad = format!("acct-{}-bad", case.queue);
    let publisher = Publisher::new(client.clone(), &url).map_err(|e| e.to_string())?;
    let send = |id: &'static str, account: &str, amount: i64| {
        let outgoing = String::from_utf8(payment(account, amount))
            .map(|body| Outgoing::new(body).message_id(id));
        let publisher = &publisher;
        async move {
            publisher
                .send(&outgoing.map_err(|e| e.to_string())?)
                .await
                .map(drop)
                .map_err(|e| format!("sending {id}: {e}"))
        }
    };
    send("m-1", &ok, 10).await?;
    send("m-2", &bad, 7).await?;
    send("m-3", &ok, 20).await?;
    let mut buggy_flags = vec![
        "--fail-account",
        bad.as_str(),
        "--max-attempts",
        "3",
        "--retry-base-ms",
        "50",
    ];
    buggy_flags.extend_from_slice(flags);
    let buggy = consumer(&case, &buggy_flags).await?;
    let dlq = dead_letter_queue(&case)?;
    wait_depth(&client, &dlq, 1).await?;
    wait_depth(&client, &url, 0).await?;
    let paid = wait_operations(&case, &ok, 2).await?;
    ensure!(
        (paid.balance, paid.operations) == (30, 2),
        "the payments around the failing one: {paid:?}, expected 30 in 2 operations"
    );
    let untouched = case.balance(&bad).await?;
    ensure!(
        untouched.operations == 0,
        "the failing account was paid: {untouched:?}"
    );
    let log = buggy.log.clone();
    buggy.terminate().await?;
    // Received 3 times: retried after the 1st and the 2nd, dead-lettered at
    // the 3rd (the attempts counted from ApproximateReceiveCount).
    let logs = std::slice::from_ref(&log);
    let retried = outcomes(logs, "retried");
    let dead = outcomes(logs, "dead_lettered");
    ensure!(
        retried.len() == 2
            && retried[0].contains("attempts=1")
            && retried[1].contains("attempts=2")
            && dead.len() == 1
            && dead[0].contains("attempts=3"),
        "the consumer's outcomes: retried {retried:?}, dead-lettered {dead:?}; expected retries \
         at attempts 1 and 2, the dead letter at 3"
    );
    let attributes = dead_letter_attributes(&client, &dlq).await?;
    let times: Vec<&str> = attributes
        .get("idem-attempts")
        .map(|times| times.split(',').collect())
        .unwrap_or_default();
    ensure!(
        attributes.get("idem-reason").map(String::as_str) == Some(REASON)
            && attributes.get("message_id").map(String::as_str) == Some("m-2")
            && times.len() == 3,
        "the dead letter's attributes: {attributes:?}"
    );
    let letters = list(&case, &url).await?;
    let [letter] = letters.as_slice() else {
        return Err(format!("dead-letters printed {letters:?}, expected one"));
    };
    let attempts: Vec<chrono::DateTime<chrono::FixedOffset>> = letter["attempts"]
        .as_array()
        .map(|times| {
            times
                .iter()
                .filter_map(|time| chrono::DateTime::parse_from_rfc3339(time.as_str()?).ok())
                .collect()
        })
        .unwrap_or_default();
    ensure!(
        letter["queue"] == case.queue.as_str()
            && letter["message_id"] == "m-2"
            && letter["reason"] == REASON
            && letter["body"] == json!({"account_id": bad, "amount": 7})
            && attempts.len() == 3
            && attempts.windows(2).all(|pair| pair[0] < pair[1]),
        "dead-letters printed {letter}, expected m-2 from {} with 3 increasing attempts and its \
         reason",
        case.queue
    );
    let again = list(&case, &url).await?;
    ensure!(again == letters, "a second listing printed {again:?}");
    ensure!(
        depth(&client, &dlq).await? == 1,
        "listing the dead letters removed them"
    );
    if !redrive {
        let spacing: Vec<i64> = attempts
            .windows(2)
            .map(|pair| (pair[1] - pair[0]).num_milliseconds())
            .collect();
        return Ok(format!(
            "m-2 received 3 times ({spacing:?} ms apart), then in {}-dlq with idem-reason and \
             idem-attempts (3 times), listed by dead-letters and kept; the 2 others applied (30)",
            case.queue
        ));
    }
    let fixed = consumer(&case, &[]).await?;
    let endpoint = server(&case)?.endpoint();
    let redrive = ["redrive", "--sqs", &url, "--sqs-endpoint", &endpoint];
    let out = case.command(&redrive).await?;
    ensure!(
        out.trim() == "re-drove 1 dead letters",
        "redrive printed {out:?}"
    );
    let applied = wait_operations(&case, &bad, 1).await?;
    ensure!(
        (applied.balance, applied.operations) == (7, 1),
        "after the redrive: {applied:?}, expected 7 in 1 operation"
    );
    // A producer sends it again: a duplicate; the next payment shows it was
    // handled.
    send("m-2", &bad, 7).await?;
    send("m-4", &ok, 30).await?;
    wait_operations(&case, &ok, 3).await?;
    wait_depth(&client, &url, 0).await?;
    let out = case.command(&redrive).await?;
    ensure!(
        out.trim() == "re-drove 0 dead letters",
        "a second redrive printed {out:?}"
    );
    let left = list(&case, &url).await?;
    ensure!(left.is_empty(), "dead-letters after the redrive: {left:?}");
    let log = fixed.log.clone();
    fixed.terminate().await?;
    let paid = case.balance(&bad).await?;
    ensure!(
        (paid.balance, paid.operations) == (7, 1),
        "after a copy of m-2: {paid:?}, expected 7 in 1 operation"
    );
    let logs = std::slice::from_ref(&log);
    let (processed, duplicates) = (
        outcomes(logs, "processed").len(),
        outcomes(logs, "duplicate").len(),
    );
    ensure!(
        (processed, duplicates) == (2, 1),
        "the fixed consumer's outcomes: {processed} processed, {duplicates} duplicates; expected \
         2 (m-2 re-driven, m-4) and 1 (the copy of m-2)"
    );
    Ok(
        "re-drove 1: applied once (7, 1 operation); a producer's copy a duplicate; a second \
         redrive moved 0, none listed"
            .to_owned(),
    )
}

/// A payment sent twice with the same `message_id` attribute of type Binary
/// (a producer's resend: two SQS messages, two SQS MessageIds), then one
/// whose Binary id is not UTF-8: the first is applied once, the second is
/// dead-lettered at once as `unreadable-message-id`, its id shown escaped.
async fn a_binary_id_keys_its_message(case: Case) -> Result<String, String> {
    use idem_sqs::aws_sdk_sqs::primitives::Blob;
    use idem_sqs::aws_sdk_sqs::types::MessageAttributeValue;
    let client = client(&case)?;
    let url = create_queue(
        &case,
        &client,
        &[(QueueAttributeName::VisibilityTimeout, "5")],
    )
    .await?;
    let account = format!("acct-{}", case.queue);
    let body = String::from_utf8(payment(&account, 7)).map_err(|e| e.to_string())?;
    for id in [&b"pay-binary"[..], b"pay-binary", &[0xff, 0xfe]] {
        let attribute = MessageAttributeValue::builder()
            .data_type("Binary")
            .binary_value(Blob::new(id))
            .build()
            .map_err(|e| e.to_string())?;
        client
            .send_message()
            .queue_url(&url)
            .message_body(&body)
            .message_attributes(idem_sqs::MESSAGE_ID_ATTRIBUTE, attribute)
            .send()
            .await
            .map_err(|e| format!("sending: {e:?}"))?;
    }
    let database = case.database().await?;
    let consumer = consumer(&case, &[]).await?;
    wait_depth(&client, &dead_letter_queue(&case)?, 1).await?;
    let started = Instant::now();
    while depth(&client, &url).await? != 0 {
        ensure!(
            started.elapsed() < PATIENCE,
            "{url} still held messages after {PATIENCE:?}"
        );
        tokio::time::sleep(MOTO_POLL).await;
    }
    faults::alive(consumer).await?;
    let applied = case.balance(&account).await?;
    ensure!(
        (applied.balance, applied.operations) == (7, 1),
        "{account}: {applied:?}, expected 7 over 1 operation (the resend a duplicate)"
    );
    let inbox = processed(&database, &case.inbox_consumer()).await?;
    let letters = list(&case, &url).await?;
    ensure!(
        letters.len() == 1
            && letters[0]["reason"] == "unreadable-message-id"
            && letters[0]["message_id"] == "\\xff\\xfe",
        "dead letters: {letters:?}"
    );
    Ok(format!(
        "a Binary id applied once over 2 sends (7, 1 operation; {inbox} inbox rows); one not UTF-8 dead-lettered as unreadable-message-id, shown \\xff\\xfe"
    ))
}

/// `dead-letters --sqs`, one JSON value per line.
async fn list(case: &Case, url: &str) -> Result<Vec<serde_json::Value>, String> {
    let endpoint = server(case)?.endpoint();
    let out = case
        .command(&["dead-letters", "--sqs", url, "--sqs-endpoint", &endpoint])
        .await?;
    out.lines()
        .map(|line| serde_json::from_str(line).map_err(|e| format!("{line:?}: {e}")))
        .collect()
}

/// The string message attributes of the one message of `dlq`, read without
/// keeping it (visible again at once).
async fn dead_letter_attributes(
    client: &Client,
    dlq: &str,
) -> Result<std::collections::BTreeMap<String, String>, String> {
    let answer = client
        .receive_message()
        .queue_url(dlq)
        .wait_time_seconds(1)
        .visibility_timeout(0)
        .message_attribute_names("All")
        .send()
        .await
        .map_err(|e| format!("reading {dlq}: {e:?}"))?;
    let [message] = answer.messages() else {
        return Err(format!(
            "{dlq} gave {} messages, expected 1",
            answer.messages().len()
        ));
    };
    Ok(message
        .message_attributes()
        .map(|attributes| {
            attributes
                .iter()
                .filter_map(|(name, value)| Some((name.clone(), value.string_value()?.to_owned())))
                .collect()
        })
        .unwrap_or_default())
}

/// The exercise on a FIFO queue (`<queue>.fifo`), each message's
/// deduplication id the SHA-256 of its content and no `message_id`
/// attribute (the key is the deduplication id): 10 identical sends give 1
/// delivery and 1 effect; a field changed gives one more of each; the first
/// content sent again once the queue forgot its id is delivered again, and
/// the inbox keeps its effect at one.
///
/// moto forgets a deduplication id when its message is deleted, where SQS
/// keeps it for 5 minutes from the send: the third send stands for a send
/// after the window, without waiting it out.
async fn the_fifo_content_deduplication_exercise(case: Case) -> Result<String, String> {
    let exercise = fifo_exercise(case).await?;
    let Exercise {
        inside,
        after_change,
        after_window,
    } = exercise;
    Ok(format!(
        "(deliveries, effects): 10 identical sends {inside:?}; a field changed {after_change:?}; \
         the first again after the window (moto: its message deleted) {after_window:?}"
    ))
}

/// The exercise's counts, each `(deliveries, effects)` so far.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Exercise {
    /// After 10 identical sends, inside the deduplication window.
    pub(crate) inside: (usize, i64),
    /// After one more with a field changed.
    pub(crate) after_change: (usize, i64),
    /// After the first content sent again once the queue forgot its id.
    pub(crate) after_window: (usize, i64),
}

/// The exercise on a FIFO queue (`<queue>.fifo`), each message's
/// deduplication id the SHA-256 of its content and no `message_id`
/// attribute: 10 identical sends, then one with a field changed, then the
/// first content again once the queue forgot its id (moto forgets it when
/// the message is deleted; SQS 5 minutes after the send). Fails unless the
/// counts are (1, 1), (2, 2), (3, 2) and the balance is exact. The e2e row
/// and `cargo xtask demo` run it.
pub(crate) async fn fifo_exercise(case: Case) -> Result<Exercise, String> {
    let mut case = case;
    case.queue.push_str(".fifo");
    let client = client(&case)?;
    let url = create_queue(&case, &client, &[(QueueAttributeName::FifoQueue, "true")]).await?;
    let publisher = Publisher::new(client.clone(), &url).map_err(|e| e.to_string())?;
    let account = "acct-fifo";
    let first = json!({"account_id": account, "amount": 10}).to_string();
    let changed = json!({"account_id": account, "amount": 11}).to_string();
    let send = |body: &str| {
        let outgoing = Outgoing::new(body).group(account);
        let publisher = &publisher;
        async move {
            publisher
                .send(&outgoing)
                .await
                .map(drop)
                .map_err(|e| format!("sending: {e}"))
        }
    };
    for _ in 0..10 {
        send(&first).await?;
    }
    let queued = depth(&client, &url).await?;
    ensure!(
        queued == 1,
        "10 identical sends left {queued} messages in the queue, expected 1"
    );
    let consumer = consumer(&case, &[]).await?;
    let log = consumer.log.clone();
    // (deliveries, effects) once `deliveries` were decided and the queue is
    // empty.
    let settled = |deliveries: usize| {
        let (case, client, url, log) = (&case, &client, &url, &log);
        async move {
            let started = Instant::now();
            loop {
                let logs = std::slice::from_ref(log);
                let decided = outcomes(logs, "processed").len() + outcomes(logs, "duplicate").len();
                // Counted once every delivery is decided (see `drained`).
                if decided >= deliveries && depth(client, url).await? == 0 {
                    let effects = case.balance(account).await?.operations;
                    return Ok::<_, String>((decided, effects));
                }
                ensure!(
                    started.elapsed() < PATIENCE,
                    "after {PATIENCE:?}: {decided} deliveries decided, messages left in the \
                     queue; expected {deliveries} and none"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    let inside = settled(1).await?;
    send(&changed).await?;
    let after_change = settled(2).await?;
    send(&first).await?;
    let after_window = settled(3).await?;
    consumer.terminate().await?;
    let balance = case.balance(account).await?;
    ensure!(
        inside == (1, 1) && after_change == (2, 2) && after_window == (3, 2),
        "(deliveries, effects): 10 identical {inside:?}, a field changed {after_change:?}, the \
         first again after the window {after_window:?}; expected (1, 1), (2, 2), (3, 2)"
    );
    ensure!(
        (balance.balance, balance.operations) == (21, 2),
        "{account}: {balance:?}, expected 21 in 2 operations"
    );
    Ok(Exercise {
        inside,
        after_change,
        after_window,
    })
}

//! The scenarios on Kafka (`run --kafka`, `docs/contract.md` §10), against
//! a throwaway Kafka-compatible broker: each case's queue name is its topic
//! and its group ([`Case::with_kafka`]).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use futures_util::FutureExt;
use idem_diesel::diesel;
use idem_diesel::diesel_async::RunQueryDsl;
use idem_kafka::rdkafka::ClientConfig;
use idem_kafka::rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use idem_kafka::rdkafka::client::DefaultClientContext;
use idem_kafka::rdkafka::consumer::{BaseConsumer, Consumer as _};
use idem_kafka::rdkafka::message::{Header, OwnedHeaders};
use idem_kafka::rdkafka::producer::{FutureProducer, FutureRecord};
use idem_kafka::rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use rand::seq::SliceRandom;

use super::faults;
use super::process::{Case, PATIENCE, processed};
use super::scenarios::{Scenario, Stream, payment, seeded, stream, wait_processed};
use payments_consumer::database::Database;
use payments_consumer::with_connection;

/// Every scenario on Kafka.
pub(crate) const KAFKA_SCENARIOS: &[Scenario] = &[
    Scenario {
        name: "kafka_lost_commit_answers",
        check: "consumer on Kafka: every 5th COMMIT answer lost, 240 records over 3 partitions, none halted, balances exact",
        stops_broker: false,
        long: false,
        postgres_only: true,
        run: |case| lost_commit_answers(case).boxed(),
    },
    Scenario {
        name: "kafka_db_outage",
        check: "consumer on Kafka: a 25 s database outage mid-stream, nothing dead-lettered, balances exact",
        stops_broker: false,
        long: true,
        postgres_only: true,
        run: |case| a_database_outage(case).boxed(),
    },
    Scenario {
        name: "kafka_broker_restart",
        check: "consumer on Kafka: the broker (durable storage) stopped 10 s and restarted mid-stream, balances exact",
        stops_broker: false,
        long: true,
        postgres_only: true,
        run: |case| a_broker_restart(case).boxed(),
    },
    Scenario {
        name: "kafka_backlog_memory",
        check: "consumer on Kafka: 100,000 records (100 MB) behind a slow handler, memory bounded",
        stops_broker: false,
        long: false,
        postgres_only: true,
        run: |case| a_backlog_stays_in_the_broker(case).boxed(),
    },
    Scenario {
        name: "kafka_oversized_dead_letter",
        check: "consumer on Kafka: a 1,010,000-byte dead letter cut to fit, marked; the partition goes on",
        stops_broker: false,
        long: false,
        postgres_only: false,
        run: |case| an_oversized_dead_letter(case).boxed(),
    },
    Scenario {
        name: "kafka_sigkill",
        check: "consumer on Kafka: SIGKILL x5 after commits, 500 records (100 duplicates), balances exact",
        stops_broker: false,
        long: false,
        postgres_only: false,
        run: |case| sigkill_after_commits(case, &[]).boxed(),
    },
    Scenario {
        name: "kafka_batch_sigkill",
        check: "consumer on Kafka: --batch 32, SIGKILL x5 after commits, 500 records (100 duplicates), balances exact",
        stops_broker: false,
        long: false,
        postgres_only: false,
        run: |case| sigkill_after_commits(case, &["--batch", "32"]).boxed(),
    },
    Scenario {
        name: "kafka_batch_dead_letter",
        check: "consumer on Kafka: --batch 32, a failing record dead-lettered alone after exactly 3 attempts, in order",
        stops_broker: false,
        long: false,
        postgres_only: false,
        run: |case| dead_letter_then(case, false, &["--batch", "32"]).boxed(),
    },
    Scenario {
        name: "kafka_join_leave",
        check: "consumer on Kafka: a member joins, the first leaves, mid-stream; balances exact",
        stops_broker: false,
        long: false,
        postgres_only: false,
        run: |case| a_member_joins_and_one_leaves(case).boxed(),
    },
    Scenario {
        name: "kafka_dead_letter",
        check: "consumer on Kafka: failing record in <topic>.dlq after 3 attempts, the partition goes on",
        stops_broker: false,
        long: false,
        postgres_only: false,
        run: |case| a_failing_record_is_dead_lettered_in_order(case).boxed(),
    },
    Scenario {
        name: "kafka_redrive",
        check: "consumer on Kafka: redrive after the fix, applied once; a second redrive moves nothing",
        stops_broker: false,
        long: false,
        postgres_only: false,
        run: |case| a_redrive_is_applied_once(case).boxed(),
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

fn servers(case: &Case) -> Result<&str, String> {
    case.kafka
        .as_deref()
        .ok_or_else(|| "a Kafka case needs Case::with_kafka".to_owned())
}

/// Creates the case's topic with `partitions` partitions.
async fn create_topic(case: &Case, partitions: i32) -> Result<(), String> {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", servers(case)?)
        .create()
        .map_err(|e| e.to_string())?;
    let created = admin
        .create_topics(
            &[NewTopic::new(
                &case.queue,
                partitions,
                TopicReplication::Fixed(1),
            )],
            &AdminOptions::new(),
        )
        .await
        .map_err(|e| e.to_string())?;
    for result in created {
        result.map_err(|(topic, code)| format!("creating {topic}: {code}"))?;
    }
    Ok(())
}

/// A producer to the case's broker.
fn producer(case: &Case) -> Result<FutureProducer, String> {
    ClientConfig::new()
        .set("bootstrap.servers", servers(case)?)
        .create()
        .map_err(|e| e.to_string())
}

/// Produces a payment keyed by its account (so an account's payments keep
/// their order in one partition), with its `message_id` header.
async fn produce(
    producer: &FutureProducer,
    topic: &str,
    message_id: &str,
    body: &[u8],
) -> Result<(), String> {
    let account = serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v["account_id"].as_str().map(str::to_owned))
        .unwrap_or_default();
    let record =
        FutureRecord::to(topic)
            .key(&account)
            .payload(body)
            .headers(OwnedHeaders::new().insert(Header {
                key: "message_id",
                value: Some(message_id),
            }));
    producer
        .send(record, Duration::from_secs(30))
        .await
        .map(drop)
        .map_err(|(e, _)| format!("producing {message_id}: {e}"))
}

async fn publish(case: &Case, stream: &Stream) -> Result<(), String> {
    let producer = producer(case)?;
    for (id, body) in &stream.messages {
        produce(&producer, &case.queue, id, body).await?;
    }
    Ok(())
}

#[derive(diesel::QueryableByName)]
struct Position {
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    records: i64,
}

/// How many of the topic's records the database's positions have passed
/// (the sum of its partitions' stored next offsets).
pub(crate) async fn positions(database: &Database, topic: &str) -> Result<i64, String> {
    // The topic is the case's own name (letters, digits, `_`).
    let query = format!(
        "SELECT CAST(COALESCE(SUM(next_offset), 0) AS BIGINT) AS records \
         FROM idem_kafka_offsets WHERE topic = '{topic}'"
    );
    let found: Result<i64, payments_consumer::ConsumerError> = async {
        Ok(with_connection!(database, connection => {
            diesel::sql_query(&query).get_result::<Position>(connection).await?.records
        }))
    }
    .await;
    found.map_err(|e| format!("reading the positions: {e}"))
}

/// How many of the topic's records the group's offsets at the broker have
/// passed (what a consumer trusting the broker would restart from).
async fn broker_positions(case: &Case, group: &str, partitions: i32) -> Result<i64, String> {
    let (servers, topic, group) = (
        servers(case)?.to_owned(),
        case.queue.clone(),
        group.to_owned(),
    );
    tokio::task::spawn_blocking(move || {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &servers)
            .set("group.id", &group)
            .create()
            .map_err(|e| e.to_string())?;
        let mut tpl = TopicPartitionList::new();
        for partition in 0..partitions {
            tpl.add_partition(&topic, partition);
        }
        let committed = consumer
            .committed_offsets(tpl, Duration::from_secs(10))
            .map_err(|e| e.to_string())?;
        Ok(committed
            .elements()
            .iter()
            .map(|e| match e.offset() {
                Offset::Offset(n) => n,
                _ => 0,
            })
            .sum())
    })
    .await
    .map_err(|e| e.to_string())?
}

/// Waits until the database's positions have passed every one of `records`.
async fn consumed(database: &Database, topic: &str, records: usize) -> Result<(), String> {
    let started = Instant::now();
    loop {
        let passed = positions(database, topic).await?;
        if passed == records as i64 {
            return Ok(());
        }
        ensure!(
            started.elapsed() < PATIENCE,
            "after {PATIENCE:?} the positions passed {passed} of {records} records"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// 240 records (40 of them a producer's resends) over 3 partitions while
/// the answer to every 5th COMMIT of the consumer's database is lost: a
/// position write retried after its commit landed unseen finds the row
/// where it goes and is done. Every partition reaches its end (none halted),
/// every balance exact, the consumer alive.
async fn lost_commit_answers(mut case: Case) -> Result<String, String> {
    let (mut rng, seed) = seeded();
    let failed = |why: String| format!("{why} (seed {seed}: set PAYMENTS_CONSUMER_SEED to replay)");
    create_topic(&case, 3).await?;
    let stream = stream(&mut rng, "kl", 200, 40, 12);
    publish(&case, &stream).await?;
    let proxy = faults::losing_commit_answers(&mut case)?;
    let database = case.database().await?;
    let consumer = case.consumer(&[]).await?;
    consumed(&database, &case.queue, stream.messages.len())
        .await
        .map_err(failed)?;
    let lost = faults::lost_at_least(&proxy, 10)?;
    let fenced = consumer.log_lines("rejoin").len();
    ensure!(
        fenced == 0,
        "{fenced} fenced partitions: a lost COMMIT answer was taken for another owner"
    );
    faults::alive(consumer).await?;
    let effects = stream.exact(&database).await.map_err(failed)?;
    Ok(format!(
        "{} records (40 duplicates), {lost} COMMIT answers lost, 0 partitions fenced; {effects} effects, {} balances exact",
        stream.messages.len(),
        stream.expected.len()
    ))
}

/// 150 records over 3 partitions; after 30 are applied the database goes
/// away for 25 s and comes back: each partition retries its record in
/// place, uncounted, and resumes by itself. Every balance exact, nothing
/// dead-lettered, the consumer alive.
async fn a_database_outage(mut case: Case) -> Result<String, String> {
    let (mut rng, seed) = seeded();
    let failed = |why: String| format!("{why} (seed {seed}: set PAYMENTS_CONSUMER_SEED to replay)");
    create_topic(&case, 3).await?;
    let stream = stream(&mut rng, "ko", 150, 0, 12);
    publish(&case, &stream).await?;
    let proxy = case.proxy_database()?;
    let database = case.database().await?;
    let consumer = case.consumer(&["--handler-latency-ms", "20"]).await?;
    wait_processed(&case, &database, 30).await.map_err(failed)?;
    faults::outage(&proxy).await;
    let during = processed(&database, &case.inbox_consumer()).await?;
    consumed(&database, &case.queue, stream.messages.len())
        .await
        .map_err(failed)?;
    faults::alive(consumer).await?;
    let effects = stream.exact(&database).await.map_err(failed)?;
    let dead = dead_letter_lines(&case).await?;
    ensure!(dead.is_empty(), "dead letters after the outage: {dead:?}");
    Ok(format!(
        "{} records; {during} applied when the database came back after {} s; {effects} effects, {} balances exact, 0 dead letters",
        stream.messages.len(),
        faults::OUTAGE.as_secs(),
        stream.expected.len()
    ))
}

/// `dead-letters --kafka`, one JSON value per line.
async fn dead_letter_lines(case: &Case) -> Result<Vec<serde_json::Value>, String> {
    let out = case
        .command(&[
            "dead-letters",
            "--kafka",
            servers(case)?,
            "--topic",
            &case.queue,
        ])
        .await?;
    out.lines()
        .map(|line| serde_json::from_str(line).map_err(|e| format!("{line:?}: {e}")))
        .collect()
}

/// A broker of its own that keeps its records in a file (tansu on SQLite);
/// 900 records over 3 partitions (more than the consumer fetches ahead:
/// 256 a partition); after 100 are applied the broker is stopped (every
/// connection reset, its port refusing) for 10 s and started again on the
/// same port and storage; 300 more records come after. The consumer rides
/// it out and resumes by itself: every balance exact, nothing
/// dead-lettered, the consumer alive.
async fn a_broker_restart(mut case: Case) -> Result<String, String> {
    const DOWN: Duration = Duration::from_secs(10);
    let (mut rng, seed) = seeded();
    let failed = |why: String| format!("{why} (seed {seed}: set PAYMENTS_CONSUMER_SEED to replay)");
    let broker = tokio::task::spawn_blocking(idem_testkit::TestKafka::start_durable)
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| format!("a durable Kafka broker: {e}"))?;
    let broker = std::sync::Arc::new(broker);
    case.kafka = Some(broker.servers());
    create_topic(&case, 3).await?;
    let stream = stream(&mut rng, "kr", 1_200, 0, 12);
    let (before, after) = stream.messages.split_at(900);
    let producer = producer(&case)?;
    for (id, body) in before {
        produce(&producer, &case.queue, id, body).await?;
    }
    let database = case.database().await?;
    let consumer = case.consumer(&["--handler-latency-ms", "5"]).await?;
    wait_processed(&case, &database, 100)
        .await
        .map_err(failed)?;
    let stopped = std::sync::Arc::clone(&broker);
    tokio::task::spawn_blocking(move || stopped.stop_broker())
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| format!("stopping the broker: {e}"))?;
    let at_stop = processed(&database, &case.inbox_consumer()).await?;
    tokio::time::sleep(DOWN).await;
    let started = std::sync::Arc::clone(&broker);
    tokio::task::spawn_blocking(move || started.start_broker())
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| format!("starting the broker again: {e}"))?;
    ensure!(
        at_stop < 900,
        "every record was applied before the broker stopped ({at_stop}): the restart proved nothing"
    );
    for (id, body) in after {
        produce(&producer, &case.queue, id, body).await?;
    }
    consumed(&database, &case.queue, stream.messages.len())
        .await
        .map_err(|why| format!("{} (the broker's log: {})", failed(why), broker.log()))?;
    faults::alive(consumer).await?;
    let effects = stream.exact(&database).await.map_err(failed)?;
    let dead = dead_letter_lines(&case).await?;
    ensure!(dead.is_empty(), "dead letters after the restart: {dead:?}");
    let _ = tokio::task::spawn_blocking(move || drop(broker)).await;
    Ok(format!(
        "{} records over 3 partitions (300 after the restart); the broker down {} s at {at_stop} applied; {effects} effects, {} balances exact, 0 dead letters",
        stream.messages.len(),
        DOWN.as_secs(),
        stream.expected.len()
    ))
}

/// 100,000 payments of about 1 KB each (100 MB) on one partition, behind a
/// handler that takes 2 ms a record: the consumer holds at most its queue
/// (256 records) and librdkafka's fetch ahead of it, never the backlog. Its
/// peak resident memory, read once it has applied 2,000 records, stays
/// under 96 MiB (it would pass the backlog's 100 MB if the records were
/// pulled in); the records it applied are each applied once.
async fn a_backlog_stays_in_the_broker(case: Case) -> Result<String, String> {
    const RECORDS: usize = 100_000;
    const BOUND_KIB: u64 = 96 * 1024;
    create_topic(&case, 1).await?;
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", servers(&case)?)
        .set("linger.ms", "20")
        .create()
        .map_err(|e| e.to_string())?;
    let account = format!("acct-{}", case.queue);
    let padding = "p".repeat(1000);
    let started = Instant::now();
    for chunk in 0..RECORDS / 5_000 {
        let sends = (chunk * 5_000..(chunk + 1) * 5_000).map(|i| {
            let body = format!(r#"{{"account_id":"{account}","amount":1,"padding":"{padding}"}}"#);
            let id = format!("b-{i}");
            let producer = &producer;
            let topic = &case.queue;
            async move {
                let record = FutureRecord::to(topic).key(&id).payload(&body).headers(
                    OwnedHeaders::new().insert(Header {
                        key: "message_id",
                        value: Some(&id),
                    }),
                );
                producer
                    .send(record, Duration::from_secs(60))
                    .await
                    .map(drop)
                    .map_err(|(e, _)| format!("producing {id}: {e}"))
            }
        });
        for sent in futures_util::future::join_all(sends).await {
            sent?;
        }
    }
    let produced_in = started.elapsed();
    let database = case.database().await?;
    let consumer = case.consumer(&["--handler-latency-ms", "2"]).await?;
    wait_processed(&case, &database, 2_000).await?;
    let peak = consumer.peak_rss_kib().ok_or("the consumer exited")?;
    faults::alive(consumer).await?;
    let applied = case.balance(&account).await?;
    ensure!(
        applied.balance == applied.operations && applied.operations >= 2_000,
        "{account}: {applied:?}, expected each applied record once (balance = operations)"
    );
    let passed = positions(&database, &case.queue).await?;
    ensure!(
        passed == applied.operations,
        "the position passed {passed} records, {} were applied",
        applied.operations
    );
    ensure!(
        peak < BOUND_KIB,
        "the consumer's peak resident memory was {} MiB with the backlog waiting, over {} MiB",
        peak / 1024,
        BOUND_KIB / 1024
    );
    Ok(format!(
        "{RECORDS} records of ~1 KB produced in {:.1} s; peak RSS {:.1} MiB after {} applied (bound {} MiB)",
        produced_in.as_secs_f64(),
        peak as f64 / 1024.0,
        applied.operations,
        BOUND_KIB / 1024
    ))
}

/// On one partition: a record of 1,010,000 bytes that is no payment (under
/// a broker's usual limit, over the producer's 1,000,000 default), then 10
/// payments. Its dead letter is cut to fit and marked with its size; the
/// payments behind it are applied; `dead-letters` shows `"truncated"`, and
/// `redrive` republishes nothing and names it.
async fn an_oversized_dead_letter(case: Case) -> Result<String, String> {
    const SIZE: usize = 1_010_000;
    create_topic(&case, 1).await?;
    let large: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", servers(&case)?)
        .set("message.max.bytes", "2000000")
        .create()
        .map_err(|e| e.to_string())?;
    let account = format!("acct-{}", case.queue);
    produce(&large, &case.queue, "big", "x".repeat(SIZE).as_bytes()).await?;
    for i in 0..10 {
        produce(
            &large,
            &case.queue,
            &format!("m-{i}"),
            &payment(&account, 5),
        )
        .await?;
    }
    let database = case.database().await?;
    let consumer = case.consumer(&[]).await?;
    consumed(&database, &case.queue, 11).await?;
    faults::alive(consumer).await?;
    let balance = case.balance(&account).await?;
    ensure!(
        (balance.balance, balance.operations) == (50, 10),
        "{account}: {balance:?}, expected 50 over 10 operations"
    );
    let letters = dead_letter_lines(&case).await?;
    ensure!(
        letters.len() == 1
            && letters[0]["message_id"] == "big"
            && letters[0]["truncated"] == SIZE
            && letters[0]["body"]
                .as_str()
                .is_some_and(|body| body.len() < 1_000_000),
        "dead letters: {} lines, the first {:?}",
        letters.len(),
        <[serde_json::Value]>::first(&letters).map(|l| (
            &l["message_id"],
            &l["truncated"],
            &l["reason"]
        ))
    );
    let redrive = case
        .command(&[
            "redrive",
            "--kafka",
            servers(&case)?,
            "--topic",
            &case.queue,
        ])
        .await?;
    ensure!(
        redrive.starts_with("re-drove 0 dead letters")
            && redrive.contains("not re-driven: message_id big"),
        "redrive printed {redrive:?}"
    );
    Ok("a 1,010,000-byte record dead-lettered cut to fit (truncated: 1010000), the 10 payments behind it applied; redrive republished 0 and named it".to_owned())
}

/// The crash from the question: 500 records (100 of them a producer's
/// resends) over 3 partitions; the consumer is `SIGKILL`ed 5 times mid-stream
/// (its commits just made, the broker's offsets committed every 5 s at
/// best) and restarted each time; every balance exact, and how far behind
/// the database the broker's offsets were at each kill.
async fn sigkill_after_commits(
    case: Case,
    flags: &'static [&'static str],
) -> Result<String, String> {
    const KILLS: usize = 5;
    const PARTITIONS: i32 = 3;
    let (mut rng, seed) = seeded();
    let failed = |why: String| format!("{why} (seed {seed}: set PAYMENTS_CONSUMER_SEED to replay)");
    create_topic(&case, PARTITIONS).await?;
    let stream = stream(&mut rng, "kk", 400, 100, 20);
    publish(&case, &stream).await?;
    let database = case.database().await?;
    let mut targets: Vec<i64> = (20..380).collect();
    targets.shuffle(&mut rng);
    let mut targets = targets[..KILLS].to_vec();
    targets.sort_unstable();
    let mut behind = Vec::new();
    // Each start joins a group of its own: tansu 0.6 gives a member that
    // joins while a killed one is still in its group (until its session
    // times out) no partition, and does not rebalance when the killed one
    // expires (a Kafka broker would). A new group has no committed offset at
    // all, so only the positions in the database keep it from starting over.
    for (n, target) in targets.into_iter().enumerate() {
        let group = format!("{}-{n}", case.queue);
        let consumer = case
            .consumer(&[&["--group", group.as_str()], flags].concat())
            .await?;
        wait_processed(&case, &database, target)
            .await
            .map_err(failed)?;
        consumer.kill().await;
        let in_database = positions(&database, &case.queue).await?;
        let at_broker = broker_positions(&case, &group, PARTITIONS).await?;
        behind.push(in_database - at_broker);
    }
    let group = format!("{}-{KILLS}", case.queue);
    let consumer = case
        .consumer(&[&["--group", group.as_str()], flags].concat())
        .await?;
    consumed(&database, &case.queue, stream.messages.len())
        .await
        .map_err(failed)?;
    consumer.terminate().await?;
    let effects = stream.exact(&database).await.map_err(failed)?;
    let applied = processed(&database, &case.inbox_consumer()).await?;
    ensure!(
        applied == stream.unique as i64,
        "the inbox holds {applied} messages, expected {}",
        stream.unique
    );
    Ok(format!(
        "{} records (100 duplicates), {KILLS} kills; the broker's offsets were {behind:?} records \
         behind the database's at the kills (each a replay without the positions in the \
         transaction); {effects} effects, {} balances exact",
        stream.messages.len(),
        stream.expected.len()
    ))
}

/// 300 records over 3 partitions: member A starts, member B joins after 100,
/// A leaves (SIGTERM) after 200, 100 more records come; every balance exact.
async fn a_member_joins_and_one_leaves(case: Case) -> Result<String, String> {
    let (mut rng, seed) = seeded();
    let failed = |why: String| format!("{why} (seed {seed}: set PAYMENTS_CONSUMER_SEED to replay)");
    create_topic(&case, 3).await?;
    let stream = stream(&mut rng, "kj", 400, 0, 12);
    let (first, rest) = stream.messages.split_at(300);
    let producer = producer(&case)?;
    for (id, body) in first {
        produce(&producer, &case.queue, id, body).await?;
    }
    let database = case.database().await?;
    let started = Instant::now();
    let a = case.consumer(&["--handler-latency-ms", "5"]).await?;
    wait_processed(&case, &database, 100)
        .await
        .map_err(failed)?;
    let b = case.consumer(&["--handler-latency-ms", "5"]).await?;
    wait_processed(&case, &database, 200)
        .await
        .map_err(failed)?;
    a.terminate().await?;
    for (id, body) in rest {
        produce(&producer, &case.queue, id, body).await?;
    }
    consumed(&database, &case.queue, stream.messages.len())
        .await
        .map_err(failed)?;
    b.terminate().await?;
    let effects = stream.exact(&database).await.map_err(failed)?;
    Ok(format!(
        "400 records over 3 partitions; B joined at 100, A left at 200; {effects} effects, {} \
         balances exact, in {:.1} s",
        stream.expected.len(),
        started.elapsed().as_secs_f64()
    ))
}

/// On one partition: a payment, one to `--fail-account`, two more. The
/// failing one is tried exactly 3 times, then is in `<topic>.dlq` with its
/// reason, its attempts and its origin; the payments behind it are applied
/// after it.
async fn a_failing_record_is_dead_lettered_in_order(case: Case) -> Result<String, String> {
    dead_letter_then(case, false, &[]).await
}

/// The dead letter of the scenario above, re-driven after the fix (a
/// consumer without `--fail-account`): applied once; a second redrive moves
/// nothing, and the listing is empty.
async fn a_redrive_is_applied_once(case: Case) -> Result<String, String> {
    dead_letter_then(case, true, &[]).await
}

async fn dead_letter_then(
    case: Case,
    redrive: bool,
    flags: &'static [&'static str],
) -> Result<String, String> {
    create_topic(&case, 1).await?;
    let producer = producer(&case)?;
    let topic = case.queue.clone();
    let ok = format!("acct-{topic}-ok");
    let bad = format!("acct-{topic}-bad");
    let records = [
        ("m-1", payment(&ok, 10)),
        ("m-2", payment(&bad, 7)),
        ("m-3", payment(&ok, 20)),
        ("m-4", payment(&ok, 30)),
    ];
    // One partition: every record, whatever its account, in this order.
    for (id, body) in &records {
        let record = FutureRecord::to(&topic)
            .partition(0)
            .key("same")
            .payload(body)
            .headers(OwnedHeaders::new().insert(Header {
                key: "message_id",
                value: Some(*id),
            }));
        producer
            .send(record, Duration::from_secs(30))
            .await
            .map_err(|(e, _)| e.to_string())?;
    }
    let database = case.database().await?;
    let consumer = case
        .consumer(&[&["--fail-account", bad.as_str()], flags].concat())
        .await?;
    consumed(&database, &topic, records.len()).await?;
    let balance = case.balance(&ok).await?;
    ensure!(
        (balance.balance, balance.operations) == (60, 3),
        "the payments behind the failing one: {balance:?}, expected 60 in 3 operations"
    );
    let servers = servers(&case)?.to_owned();
    let letters = list(&case, &servers).await?;
    let [letter] = letters.as_slice() else {
        return Err(format!("dead-letters printed {letters:?}, expected one"));
    };
    let attempts = letter["attempts"].as_array().map_or(0, Vec::len);
    ensure!(
        letter["topic"] == topic.as_str()
            && letter["message_id"] == "m-2"
            && attempts == 3
            && letter["reason"]
                .as_str()
                .is_some_and(|r| r.contains("--fail-account"))
            && letter["body"]["account_id"] == bad.as_str(),
        "dead-letters printed {letter}, expected m-2 from {topic} with 3 attempts and its reason"
    );
    let headers = dlq_headers(&servers, &format!("{topic}.dlq")).await?;
    for (name, value) in [
        ("message_id", "m-2"),
        ("idem-topic", topic.as_str()),
        ("idem-partition", "0"),
        ("idem-offset", "1"),
    ] {
        ensure!(
            headers.get(name).map(String::as_str) == Some(value),
            "the dead letter's header {name} is {:?}, expected {value:?} (headers {headers:?})",
            headers.get(name)
        );
    }
    if !redrive {
        consumer.terminate().await?;
        return Ok(format!(
            "m-2 tried 3 times, then in {topic}.dlq with idem-reason, idem-attempts, idem-topic, \
             idem-partition 0, idem-offset 1; the 3 payments behind it applied (60)"
        ));
    }
    consumer.terminate().await?;
    let fixed = case.consumer(&[]).await?;
    let out = case
        .command(&["redrive", "--kafka", &servers, "--topic", &topic])
        .await?;
    ensure!(
        out.trim() == format!("re-drove 1 dead letters from {topic}.dlq to {topic}"),
        "redrive printed {out:?}"
    );
    let started = Instant::now();
    loop {
        let paid = case.balance(&bad).await?;
        if paid.operations >= 1 {
            ensure!(
                (paid.balance, paid.operations) == (7, 1),
                "after the redrive: {paid:?}, expected 7 in 1 operation"
            );
            break;
        }
        ensure!(
            started.elapsed() < PATIENCE,
            "the re-driven payment was not applied within {PATIENCE:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let again = case
        .command(&["redrive", "--kafka", &servers, "--topic", &topic])
        .await?;
    ensure!(
        again.trim() == format!("re-drove 0 dead letters from {topic}.dlq to {topic}"),
        "a second redrive printed {again:?}"
    );
    let left = list(&case, &servers).await?;
    ensure!(left.is_empty(), "dead-letters after the redrive: {left:?}");
    // The re-driven record is past, in the database's positions too.
    consumed(&database, &topic, records.len() + 1).await?;
    fixed.terminate().await?;
    let paid = case.balance(&bad).await?;
    ensure!(
        (paid.balance, paid.operations) == (7, 1),
        "after the consumer stopped: {paid:?}, expected 7 in 1 operation"
    );
    Ok("dead letter re-driven: applied once (7, 1 operation); a second redrive moved 0, none listed".to_owned())
}

/// `dead-letters --kafka`, one JSON value per line.
async fn list(case: &Case, servers: &str) -> Result<Vec<serde_json::Value>, String> {
    let out = case
        .command(&["dead-letters", "--kafka", servers, "--topic", &case.queue])
        .await?;
    out.lines()
        .map(|line| serde_json::from_str(line).map_err(|e| format!("{line:?}: {e}")))
        .collect()
}

/// The headers of the first record of `dlq`.
async fn dlq_headers(servers: &str, dlq: &str) -> Result<BTreeMap<String, String>, String> {
    use idem_kafka::rdkafka::Message as _;
    use idem_kafka::rdkafka::message::Headers as _;
    let (servers, dlq) = (servers.to_owned(), dlq.to_owned());
    tokio::task::spawn_blocking(move || {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &servers)
            .set("group.id", format!("{dlq}-reader"))
            .create()
            .map_err(|e| e.to_string())?;
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(&dlq, 0, Offset::Beginning)
            .map_err(|e| e.to_string())?;
        consumer.assign(&tpl).map_err(|e| e.to_string())?;
        let started = Instant::now();
        while started.elapsed() < PATIENCE {
            if let Some(record) = consumer.poll(Duration::from_millis(200)) {
                let record = record.map_err(|e| e.to_string())?;
                let mut headers = BTreeMap::new();
                if let Some(found) = record.headers() {
                    for header in found.iter() {
                        headers.insert(
                            header.key.to_owned(),
                            String::from_utf8_lossy(header.value.unwrap_or_default()).into_owned(),
                        );
                    }
                }
                return Ok(headers);
            }
        }
        Err(format!("no record in {dlq} within {PATIENCE:?}"))
    })
    .await
    .map_err(|e| e.to_string())?
}

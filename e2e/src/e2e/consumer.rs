//! The consumer's rows: `payments-consumer` as a process against a throwaway
//! RabbitMQ node (and Kafka, SQS), on the run's PostgreSQL cluster and on
//! SQLite, every scenario of [`consumer_harness`](crate::consumer_harness),
//! on a queue and a database of its own.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use idem_testkit::{TestKafka, TestRabbitMq, TestSqs};

use crate::consumer_harness::{Case, KAFKA_SCENARIOS, SCENARIOS, SQS_SCENARIOS, Scenario};
use crate::example::Example;

use super::postgres::Cluster;
use super::report::{Row, Verdict};
use super::scenarios::CATALOG;
use super::site::StoreKind;
use super::{Room, Slots};

/// No consumer scenario runs longer (the slowest takes seconds).
const LIMIT: Duration = Duration::from_secs(150);

/// Whether `name` is a consumer scenario.
pub(crate) fn has(name: &str) -> bool {
    every().any(|scenario| scenario.name == name)
}

/// Every consumer scenario: on RabbitMQ, then on Kafka, then on SQS.
fn every() -> impl Iterator<Item = &'static Scenario> {
    SCENARIOS.iter().chain(KAFKA_SCENARIOS).chain(SQS_SCENARIOS)
}

/// Whether `scenario` runs on Kafka.
fn on_kafka(scenario: &Scenario) -> bool {
    KAFKA_SCENARIOS.iter().any(|s| s.name == scenario.name)
}

/// Whether `scenario` runs on SQS.
fn on_sqs(scenario: &Scenario) -> bool {
    SQS_SCENARIOS.iter().any(|s| s.name == scenario.name)
}

/// Starts moto's SQS server the SQS scenarios share, off the async workers.
async fn sqs() -> Result<Arc<TestSqs>, String> {
    match tokio::task::spawn_blocking(TestSqs::start).await {
        Ok(Ok(server)) => Ok(Arc::new(server)),
        Ok(Err(why)) => Err(format!("no SQS server: {why}")),
        Err(why) => Err(format!("the SQS server's start failed: {why}")),
    }
}

/// Starts the Kafka-compatible broker the Kafka scenarios share, off the
/// async workers.
async fn kafka() -> Result<Arc<TestKafka>, String> {
    match tokio::task::spawn_blocking(TestKafka::start).await {
        Ok(Ok(broker)) => Ok(Arc::new(broker)),
        Ok(Err(why)) => Err(format!("no Kafka broker: {why}")),
        Err(why) => Err(format!("the Kafka broker's start failed: {why}")),
    }
}

/// The names of the consumer scenarios.
pub(crate) fn names() -> impl Iterator<Item = &'static str> {
    every().map(|scenario| scenario.name)
}

/// The consumer's databases among `stores`: PostgreSQL (a fresh database of
/// the run's cluster per scenario) and SQLite (a file per scenario).
pub(crate) fn backends(stores: &[StoreKind]) -> Vec<StoreKind> {
    [StoreKind::Postgres, StoreKind::Sqlite]
        .into_iter()
        .filter(|store| stores.contains(store))
        .collect()
}

/// Starts the RabbitMQ node the consumer's scenarios and the chain share,
/// off the async workers.
pub(crate) async fn broker() -> Result<Arc<TestRabbitMq>, String> {
    match tokio::task::spawn_blocking(TestRabbitMq::start).await {
        Ok(Ok(broker)) => Ok(Arc::new(broker)),
        Ok(Err(why)) => Err(format!("no RabbitMQ node: {why}")),
        Err(why) => Err(format!("the RabbitMQ node's start failed: {why}")),
    }
}

/// Runs the selected scenarios on each of the consumer's databases among
/// `stores`, each on a queue and a database of its own, as many at once as
/// `slots` allows, and answers their rows; `binary` is the built consumer,
/// or why it is not there; `broker` the node ([`broker`]), or why there is
/// none. A scenario that stops the node (`stops_broker`) runs while no other
/// scenario on RabbitMQ does, first, beside those on Kafka and SQS.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn rows(
    binary: Result<PathBuf, String>,
    broker: Result<Arc<TestRabbitMq>, String>,
    cluster: Result<Arc<Cluster>, String>,
    root: &Path,
    selected: &[String],
    stores: &[StoreKind],
    servers: &Servers,
    slots: Slots,
) -> Vec<Row> {
    let mut chosen: Vec<(usize, &'static Scenario, StoreKind)> = backends(stores)
        .into_iter()
        .flat_map(|store| {
            every()
                .enumerate()
                .map(move |(i, scenario)| (i, scenario, store))
        })
        .filter(|(_, scenario, store)| {
            (!scenario.postgres_only || *store == StoreKind::Postgres)
                && (selected.is_empty() || selected.iter().any(|n| n == scenario.name))
        })
        .collect();
    if chosen.is_empty() {
        return Vec::new();
    }
    let setup = match (binary, broker) {
        (Ok(binary), Ok(broker)) => Ok((binary, broker)),
        (Err(why), _) => Err(format!("payments-consumer did not build: {why}")),
        (_, Err(why)) => Err(why),
    };
    let (binary, broker) = match setup {
        Ok(setup) => setup,
        Err(why) => {
            return chosen
                .into_iter()
                .map(|(i, scenario, store)| row(i, scenario, store, Err(why.clone())))
                .collect();
        }
    };
    let logs = root.join("consumer");
    // Those that stop the node first, so that they have it before any
    // other scenario on it queues; then the slowest, so that they do not
    // end the run alone: the long ones on SQS (moto serves a few hundred
    // calls a second), the other long ones, then the rest on SQS and on
    // Kafka.
    chosen.sort_by_key(|(_, scenario, _)| {
        std::cmp::Reverse((
            scenario.stops_broker,
            scenario.long,
            on_sqs(scenario),
            on_kafka(scenario),
        ))
    });
    // The node's restarts exclude the other scenarios on it, not the
    // machine: a restart waits for none but those, and they for it (the
    // lock is fair, so the restarts, queued first, go first; those on it
    // that take a slot meanwhile wait in it).
    let node = Arc::new(tokio::sync::RwLock::new(()));
    let (kafka_broker, sqs_server) = (&servers.kafka, &servers.sqs);
    let runs = chosen.into_iter().map(|(i, scenario, store)| {
        let (binary, broker, cluster, logs, slots) = (
            binary.clone(),
            broker.clone(),
            cluster.clone(),
            logs.clone(),
            slots.clone(),
        );
        let kafka = on_kafka(scenario).then(|| {
            kafka_broker
                .clone()
                .unwrap_or_else(|| Err("no Kafka broker was started".to_owned()))
        });
        let sqs = on_sqs(scenario).then(|| {
            sqs_server
                .clone()
                .unwrap_or_else(|| Err("no SQS server was started".to_owned()))
        });
        let node = Arc::clone(&node);
        async move {
            // The slot first, then the node: a scenario that holds the node
            // always has its slot, so none waits for a slot held by one
            // that waits for the node.
            let _slots = slots.take(Room::Shared).await;
            let on_node = !on_kafka(scenario) && !on_sqs(scenario);
            let _stopping = match scenario.stops_broker {
                true => Some(node.write().await),
                false => None,
            };
            let _running = match on_node && !scenario.stops_broker {
                true => Some(node.read().await),
                false => None,
            };
            let started = std::time::Instant::now();
            let outcome =
                run_one(scenario, store, binary, broker, &cluster, &logs, kafka, sqs).await;
            eprintln!(
                "e2e: consumer {} on {}: {:.1} s",
                scenario.name,
                store.name(),
                started.elapsed().as_secs_f64()
            );
            row(
                i,
                scenario,
                store,
                outcome.map_err(|why| format!("{why}\n(consumer logs: {})", logs.display())),
            )
        }
    });
    futures_util::future::join_all(runs).await
}

/// The Kafka broker and moto's SQS server the consumer's scenarios share,
/// each started if a selected scenario needs it.
#[derive(Debug, Default)]
pub(crate) struct Servers {
    kafka: Option<Result<Arc<TestKafka>, String>>,
    sqs: Option<Result<Arc<TestSqs>, String>>,
}

impl Servers {
    /// Starts, side by side, what the scenarios `selected` (none: all) need.
    pub(crate) async fn start(selected: &[String]) -> Self {
        let chosen = || {
            every().filter(|scenario| {
                selected.is_empty() || selected.iter().any(|n| n == scenario.name)
            })
        };
        let (kafka, sqs) = tokio::join!(
            async {
                match chosen().any(on_kafka) {
                    true => Some(kafka().await),
                    false => None,
                }
            },
            async {
                match chosen().any(on_sqs) {
                    true => Some(sqs().await),
                    false => None,
                }
            },
        );
        Self { kafka, sqs }
    }

    /// Stops them, off the async workers.
    pub(crate) async fn stop(self) {
        let _ = tokio::task::spawn_blocking(move || drop(self)).await;
    }
}

/// One scenario on a fresh queue and database, with the servers it needs
/// (`kafka`, `sqs`: started for it, or why they are not there).
#[allow(clippy::too_many_arguments)]
async fn run_one(
    scenario: &'static Scenario,
    store: StoreKind,
    binary: PathBuf,
    broker: Arc<TestRabbitMq>,
    cluster: &Result<Arc<Cluster>, String>,
    logs: &Path,
    kafka: Option<Result<Arc<TestKafka>, String>>,
    sqs: Option<Result<Arc<TestSqs>, String>>,
) -> Result<String, String> {
    let queue = format!("{}_{}", scenario.name, store.name());
    let database = database(store, cluster, logs, &queue).await?;
    let mut case = Case::new(&binary, broker.url(), database, queue, logs).with_broker(broker);
    if let Some(kafka) = kafka {
        case = case.with_kafka(kafka?.servers());
    }
    if let Some(sqs) = sqs {
        case = case.with_sqs(sqs?);
    }
    tokio::time::timeout(LIMIT, (scenario.run)(case))
        .await
        .unwrap_or_else(|_| Err(format!("ran past {} s", LIMIT.as_secs())))
}

/// A fresh database for the scenario's `queue` on `store`: a database of the
/// cluster, or a SQLite file beside the logs.
async fn database(
    store: StoreKind,
    cluster: &Result<Arc<Cluster>, String>,
    logs: &Path,
    queue: &str,
) -> Result<String, String> {
    if store == StoreKind::Sqlite {
        std::fs::create_dir_all(logs).map_err(|e| format!("{}: {e}", logs.display()))?;
        return Ok(format!(
            "sqlite://{}",
            logs.join(format!("{queue}.db")).display()
        ));
    }
    let cluster = cluster
        .as_ref()
        .map_err(|why| format!("no PostgreSQL: {why}"))?
        .clone();
    tokio::task::spawn_blocking(move || cluster.create_database())
        .await
        .map_err(|e| e.to_string())?
}

fn row(
    i: usize,
    scenario: &'static Scenario,
    store: StoreKind,
    outcome: Result<String, String>,
) -> Row {
    let (verdict, figure) = match outcome {
        Ok(figure) => (Verdict::Pass, figure),
        Err(details) => {
            let figure = details
                .lines()
                .next()
                .unwrap_or_default()
                .chars()
                .take(60)
                .collect();
            (Verdict::Fail(details), figure)
        }
    };
    Row {
        // After the HTTP catalogue, in the consumer's order.
        order: (CATALOG.len() + i, 0),
        check: scenario.check,
        example: Example::Consumer,
        store,
        verdict,
        figure,
    }
}

//! The consumer's rows: `payments-consumer` as a process against a throwaway
//! RabbitMQ node, on the run's PostgreSQL cluster and on SQLite, every
//! scenario of `payments_consumer::testing::SCENARIOS` (the ones its tests
//! run), on a queue and a database of its own.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use idem_testkit::{TestKafka, TestRabbitMq, TestSqs};
use payments_consumer::testing::{Case, KAFKA_SCENARIOS, SCENARIOS, SQS_SCENARIOS, Scenario};

use crate::example::Example;

use super::postgres::Cluster;
use super::report::{Row, Verdict};
use super::scenarios::CATALOG;
use super::site::StoreKind;

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
/// `stores`, one after the other (the crash test's timing wants the machine
/// to itself), and answers their rows; `binary` is the built consumer, or why
/// it is not there; `broker` the node ([`broker`]), or why there is none.
pub(crate) async fn rows(
    binary: Result<PathBuf, String>,
    broker: Result<Arc<TestRabbitMq>, String>,
    cluster: Result<Arc<Cluster>, String>,
    root: &Path,
    selected: &[String],
    stores: &[StoreKind],
) -> Vec<Row> {
    let chosen: Vec<(usize, &'static Scenario, StoreKind)> = backends(stores)
        .into_iter()
        .flat_map(|store| {
            every()
                .enumerate()
                .map(move |(i, scenario)| (i, scenario, store))
        })
        .filter(|(_, scenario, _)| {
            selected.is_empty() || selected.iter().any(|n| n == scenario.name)
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
    let mut rows = Vec::new();
    let mut kafka_broker: Option<Result<Arc<TestKafka>, String>> = None;
    let mut sqs_server: Option<Result<Arc<TestSqs>, String>> = None;
    for (i, scenario, store) in chosen {
        let queue = format!("{}_{}", scenario.name, store.name());
        let on_kafka = if on_kafka(scenario) {
            if kafka_broker.is_none() {
                kafka_broker = Some(kafka().await);
            }
            match kafka_broker.as_ref() {
                Some(Ok(broker)) => Some(broker.servers()),
                Some(Err(why)) => {
                    rows.push(row(i, scenario, store, Err(why.clone())));
                    continue;
                }
                None => None,
            }
        } else {
            None
        };
        let on_sqs = if on_sqs(scenario) {
            if sqs_server.is_none() {
                sqs_server = Some(sqs().await);
            }
            match sqs_server.as_ref() {
                Some(Ok(server)) => Some(server.clone()),
                Some(Err(why)) => {
                    rows.push(row(i, scenario, store, Err(why.clone())));
                    continue;
                }
                None => None,
            }
        } else {
            None
        };
        let outcome = match database(store, &cluster, &logs, &queue).await {
            Ok(database) => {
                let mut case = Case::new(&binary, broker.url(), database, queue, &logs)
                    .with_broker(broker.clone());
                if let Some(servers) = on_kafka {
                    case = case.with_kafka(servers);
                }
                if let Some(server) = on_sqs {
                    case = case.with_sqs(server);
                }
                tokio::time::timeout(LIMIT, (scenario.run)(case))
                    .await
                    .unwrap_or_else(|_| Err(format!("ran past {} s", LIMIT.as_secs())))
            }
            Err(why) => Err(why),
        };
        rows.push(row(
            i,
            scenario,
            store,
            outcome.map_err(|why| format!("{why}\n(consumer logs: {})", logs.display())),
        ));
    }
    // The Kafka broker stops here, off the async workers.
    let _ = tokio::task::spawn_blocking(move || drop(kafka_broker)).await;
    // And moto's server.
    let _ = tokio::task::spawn_blocking(move || drop(sqs_server)).await;
    rows
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

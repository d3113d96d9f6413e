//! The consumer's rows: `payments-consumer` as a process against a throwaway
//! RabbitMQ node and the run's PostgreSQL cluster, every scenario of
//! `payments_consumer::testing::SCENARIOS` (the ones its tests run), on a
//! queue and a database of its own.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use idem_testkit::TestRabbitMq;
use payments_consumer::testing::{Case, SCENARIOS, Scenario};

use crate::example::Example;

use super::postgres::Cluster;
use super::report::{Row, Verdict};
use super::scenarios::CATALOG;
use super::site::StoreKind;

/// No consumer scenario runs longer (the slowest takes seconds).
const LIMIT: Duration = Duration::from_secs(150);

/// Whether `name` is a consumer scenario.
pub(crate) fn has(name: &str) -> bool {
    SCENARIOS.iter().any(|scenario| scenario.name == name)
}

/// The names of the consumer scenarios.
pub(crate) fn names() -> impl Iterator<Item = &'static str> {
    SCENARIOS.iter().map(|scenario| scenario.name)
}

/// Runs the selected scenarios one after the other (the crash test's timing
/// wants the machine to itself) and answers their rows; `binary` is the built
/// consumer, or why it is not there.
pub(crate) async fn rows(
    binary: Result<PathBuf, String>,
    cluster: Result<Arc<Cluster>, String>,
    root: &Path,
    selected: &[String],
) -> Vec<Row> {
    let chosen: Vec<(usize, &'static Scenario)> = SCENARIOS
        .iter()
        .enumerate()
        .filter(|(_, scenario)| selected.is_empty() || selected.iter().any(|n| n == scenario.name))
        .collect();
    if chosen.is_empty() {
        return Vec::new();
    }
    let broker = tokio::task::spawn_blocking(TestRabbitMq::start).await;
    let setup = match (binary, cluster, broker) {
        (Ok(binary), Ok(cluster), Ok(Ok(broker))) => Ok((binary, cluster, broker)),
        (Err(why), _, _) => Err(format!("payments-consumer did not build: {why}")),
        (_, Err(why), _) => Err(format!("no PostgreSQL: {why}")),
        (_, _, Ok(Err(why))) => Err(format!("no RabbitMQ node: {why}")),
        (_, _, Err(why)) => Err(format!("the RabbitMQ node's start failed: {why}")),
    };
    let (binary, cluster, broker) = match setup {
        Ok(setup) => setup,
        Err(why) => {
            return chosen
                .into_iter()
                .map(|(i, scenario)| row(i, scenario, Err(why.clone())))
                .collect();
        }
    };
    let logs = root.join("consumer");
    let mut rows = Vec::new();
    for (i, scenario) in chosen {
        let outcome = match blocking_database(&cluster).await {
            Ok(database) => {
                let case = Case::new(&binary, broker.url(), database, scenario.name, &logs);
                tokio::time::timeout(LIMIT, (scenario.run)(case))
                    .await
                    .unwrap_or_else(|_| Err(format!("ran past {} s", LIMIT.as_secs())))
            }
            Err(why) => Err(why),
        };
        rows.push(row(
            i,
            scenario,
            outcome.map_err(|why| format!("{why}\n(consumer logs: {})", logs.display())),
        ));
    }
    // `rabbitmqctl stop` and the wait for the node, off the async workers.
    let _ = tokio::task::spawn_blocking(move || drop(broker)).await;
    rows
}

async fn blocking_database(cluster: &Arc<Cluster>) -> Result<String, String> {
    let cluster = cluster.clone();
    tokio::task::spawn_blocking(move || cluster.create_database())
        .await
        .map_err(|e| e.to_string())?
}

fn row(i: usize, scenario: &'static Scenario, outcome: Result<String, String>) -> Row {
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
        store: StoreKind::Postgres,
        verdict,
        figure,
    }
}

//! The orders examples (`docs/contract.md` §13) through crashes: each app,
//! with `--publish` to RabbitMQ and to Kafka (tansu), on SQLite in
//! transactional mode, dies at the two crash points its tests arm
//! (`ORDERS_CRASH_AT`: the order written, not committed; committed, not
//! answered), then is `SIGKILL`ed 5 times at random while 8 clients retry 48
//! keys. Each key must make one order, and each order one event (one message
//! id: a resend after a crash is the same event).
//!
//! The check itself is the orders apps' (`examples/orders-axum/tests/checks`),
//! run here as rows: it panics, naming what it saw, when an outcome is wrong.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use futures_util::future::join_all;

use crate::consumer_harness;
use crate::example::Example;

use super::report::{Row, Verdict};
use super::scenarios::CATALOG;
use super::site::StoreKind;
use super::{Room, Slots};

#[allow(dead_code, clippy::unwrap_used, clippy::expect_used)]
#[path = "../../../examples/orders-axum/tests/checks/mod.rs"]
mod checks;

/// Selects these rows (`--scenario orders-crash`).
pub(crate) const NAME: &str = "orders-crash";

const CHECK_RABBITMQ: &str = "orders app on SQLite, --publish → RabbitMQ: crashed at write and at answer, SIGKILL ×5 under 8 clients; one order and one event per key";
const CHECK_KAFKA: &str = "orders app on SQLite, --publish → Kafka: crashed at write and at answer, SIGKILL ×5 under 8 clients; one order and one event per key";

/// One check's bound (it takes about 10 s).
const LIMIT: Duration = Duration::from_secs(180);

/// Whether `name` selects these rows.
pub(crate) fn has(name: &str) -> bool {
    name == NAME
}

/// The orders example of a payments example's framework.
pub(crate) fn orders_of(example: Example) -> Option<Example> {
    match example {
        Example::Axum => Some(Example::OrdersAxum),
        Example::Actix => Some(Example::OrdersActix),
        _ => None,
    }
}

/// The rows: every app in `apps` (with its binary), on each broker.
pub(crate) async fn rows(apps: Vec<(Example, Result<PathBuf, String>)>, slots: Slots) -> Vec<Row> {
    let runs = apps.into_iter().flat_map(|(app, binary)| {
        [(0, checks::Broker::RabbitMq), (1, checks::Broker::Kafka)]
            .map(|(index, broker)| (app, binary.clone(), index, broker))
    });
    join_all(runs.map(|(app, binary, index, broker)| {
        let slots = slots.clone();
        async move {
            let _slot = slots.take(Room::Shared).await;
            let started = Instant::now();
            let (verdict, figure) = match binary {
                Err(why) => (Verdict::Fail(why), "did not build".to_owned()),
                Ok(binary) => run(binary, broker, started).await,
            };
            Row {
                // After the HTTP catalogue, the consumer's scenarios and the chain.
                order: (
                    CATALOG.len()
                        + consumer_harness::SCENARIOS.len()
                        + consumer_harness::KAFKA_SCENARIOS.len()
                        + 1,
                    index,
                ),
                check: if index == 0 {
                    CHECK_RABBITMQ
                } else {
                    CHECK_KAFKA
                },
                example: app,
                store: StoreKind::Sqlite,
                verdict,
                figure,
            }
        }
    }))
    .await
}

/// Runs the check as a task of its own, so that its panic is its failure.
async fn run(binary: PathBuf, broker: checks::Broker, started: Instant) -> (Verdict, String) {
    let binary = binary.display().to_string();
    let task = tokio::spawn(async move {
        checks::crashes_leave_one_order_and_one_event(&binary, broker).await;
    });
    match tokio::time::timeout(LIMIT, task).await {
        Ok(Ok(())) => (
            Verdict::Pass,
            format!(
                "50 keys, 50 orders, 50 events of one message id each; {} s",
                started.elapsed().as_secs()
            ),
        ),
        Ok(Err(error)) => {
            let why = match error.try_into_panic() {
                Ok(payload) => payload
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| payload.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                    .unwrap_or_else(|| "panicked".to_owned()),
                Err(error) => error.to_string(),
            };
            (Verdict::Fail(why), "check failed".to_owned())
        }
        Err(_) => (
            Verdict::Fail(format!("the check ran past {} s", LIMIT.as_secs())),
            "timed out".to_owned(),
        ),
    }
}

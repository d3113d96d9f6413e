//! The example as a process: the checks orders-axum's test runs too.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../../orders-axum/tests/checks/mod.rs"]
mod checks;

#[tokio::test]
async fn orders_are_made_once() {
    checks::orders_are_made_once(env!("CARGO_BIN_EXE_orders-actix")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crashes_leave_one_order_and_one_event_on_rabbitmq() {
    checks::crashes_leave_one_order_and_one_event(
        env!("CARGO_BIN_EXE_orders-actix"),
        checks::Broker::RabbitMq,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crashes_leave_one_order_and_one_event_on_kafka() {
    checks::crashes_leave_one_order_and_one_event(
        env!("CARGO_BIN_EXE_orders-actix"),
        checks::Broker::Kafka,
    )
    .await;
}

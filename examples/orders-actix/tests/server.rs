//! The example as a process: the checks orders-axum's test runs too.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../../orders-axum/tests/checks/mod.rs"]
// The crash checks in it run as `cargo xtask e2e` rows (`--scenario
// orders-crash`), with their own brokers.
#[allow(dead_code)]
mod checks;

#[tokio::test]
async fn orders_are_made_once() {
    checks::orders_are_made_once(env!("CARGO_BIN_EXE_orders-actix")).await;
}

#[tokio::test]
async fn a_bad_publish_url_fails_the_start() {
    checks::a_bad_publish_url_fails_the_start(env!("CARGO_BIN_EXE_orders-actix")).await;
}

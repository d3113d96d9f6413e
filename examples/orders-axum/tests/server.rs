//! The example as a process: see `checks`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod checks;

#[tokio::test]
async fn orders_are_made_once() {
    checks::orders_are_made_once(env!("CARGO_BIN_EXE_orders-axum")).await;
}

#[tokio::test]
async fn crashes_leave_one_order_and_one_event() {
    checks::crashes_leave_one_order_and_one_event(env!("CARGO_BIN_EXE_orders-axum")).await;
}

//! The broker's part of `cargo xtask demo`: one deposit delivered three times
//! by RabbitMQ, applied by a consumer without the inbox and by
//! `payments-consumer`.

use idem_rabbitmq::lapin::options::{BasicAckOptions, BasicGetOptions};
use payments_consumer::database::Database;
use payments_consumer::ledger::{Account, Ledger};
use payments_consumer::payment::Payment;
use payments_consumer::{ConsumerError, with_connection};

use crate::consumer_harness::{Case, Client, wait_operations};

/// The balances the two consumers ended with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Delivered3x {
    /// A consumer that applies every delivery (no inbox).
    pub(crate) without_inbox: Account,
    /// `payments-consumer run`.
    pub(crate) with_inbox: Account,
}

/// Publishes a deposit of 100 three times with one `message_id` (a producer
/// that retried) to each of two queues of the case (`<queue>_naive` and
/// `<queue>`): a consumer without the inbox applies the first queue's
/// deliveries, `payments-consumer run` the second's.
pub(crate) async fn delivered_three_times(case: &Case) -> Result<Delivered3x, String> {
    let body = |account: &str| {
        serde_json::json!({"account_id": account, "amount": 100})
            .to_string()
            .into_bytes()
    };
    let database = case.database().await?;

    let naive = Case::new(
        &case.binary,
        &case.amqp,
        &case.database,
        format!("{}_naive", case.queue),
        &case.dir,
    );
    let client = Client::connect(&naive).await?;
    for _ in 0..3 {
        client
            .publish(Some("deposit-1"), &body("demo-naive"))
            .await?;
    }
    let channel = client.channel();
    for _ in 0..3 {
        let got = channel
            .basic_get(naive.queue.as_str().into(), BasicGetOptions::default())
            .await
            .map_err(|e| e.to_string())?
            .ok_or("a delivery went missing")?;
        let payment = Payment::parse(&got.delivery.data).map_err(|e| e.to_string())?;
        apply_without_inbox(&database, &payment)
            .await
            .map_err(|e| e.to_string())?;
        got.delivery
            .ack(BasicAckOptions::default())
            .await
            .map_err(|e| e.to_string())?;
    }
    let without_inbox = database
        .account("demo-naive")
        .await
        .map_err(|e| e.to_string())?;

    let consumer = case.consumer(&[]).await?;
    let client = Client::connect(case).await?;
    for _ in 0..3 {
        client
            .publish(Some("deposit-1"), &body("demo-inbox"))
            .await?;
    }
    // One consumer takes the queue in order: once this one is applied, the
    // three before it were handled.
    client.publish(Some("deposit-2"), &body("demo-end")).await?;
    wait_operations(case, "demo-end", 1).await?;
    consumer.terminate().await?;
    let with_inbox = case.balance("demo-inbox").await?;
    Ok(Delivered3x {
        without_inbox,
        with_inbox,
    })
}

/// What a consumer without the inbox does: applies the payment, however
/// many times it is delivered.
async fn apply_without_inbox(database: &Database, payment: &Payment) -> Result<(), ConsumerError> {
    with_connection!(database, connection => connection.add(payment).await?);
    Ok(())
}

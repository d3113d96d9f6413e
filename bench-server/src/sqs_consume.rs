//! `sqs-consume`: one drain of an SQS queue of payments, through idem-sqs
//! (the inbox row and the effect in one transaction of `PgInbox` or
//! `SqliteInbox`, the message deleted after the commit), or through a bare
//! aws-sdk-sqs loop that receives, applies the same transaction without an
//! inbox, and deletes.
//!
//! As `consume` does for RabbitMQ:
//!
//! 1. **Set-up, not measured:** the database's ledger (`consume`'s), a fresh
//!    standard queue and its warm-up queue, filled with payments (each with
//!    its `message_id` attribute, 10 a `SendMessageBatch`); and the mean time
//!    of 20 `GetQueueUrl` calls, what one SQS call costs on this server
//!    (`sqs_call_ms`).
//! 2. **Warm-up, not measured:** the same kind of consumer drains the warm-up
//!    queue.
//! 3. **The drain, measured:** idem-sqs's window starts when it polls (its
//!    `on_polling`, after it read the queue's attributes and found or created
//!    its dead-letter queue), the bare loop's before its first receive; both
//!    end when every payment has committed and its message was deleted
//!    (idem-sqs is shut down once its handler ran `--messages` times: its
//!    shutdown waits for the running messages' commits and deletes). Both
//!    receive up to `min(10, free slots)` messages a call with the same long
//!    poll, run up to `--concurrency` at once, and delete each message with
//!    its own `DeleteMessage` after its commit: the same SQS calls per
//!    message. idem adds the attributes it reads (`message_id`,
//!    `ApproximateReceiveCount`), the inbox row, and a lease extension only
//!    for a handler running past a quarter of the visibility timeout (30 s:
//!    none here).
//! 4. **Checked, not measured:** the accounts counted exactly `--messages`
//!    more payments and the queue is empty (nothing left undeleted); the
//!    run's queues are deleted.
//!
//! Prints one JSON object: `messages`, `seconds`, `cpu_seconds` (this
//! process), `database_cpu_seconds` (PostgreSQL's, or null),
//! `sqs_call_ms`.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use idem_sqs::aws_sdk_sqs::Client;
use idem_sqs::aws_sdk_sqs::types::{
    Message, MessageAttributeValue, QueueAttributeName, SendMessageBatchRequestEntry,
};
use idem_sqs::{ClientConfig, ConsumerPolicy};
use tokio::task::JoinSet;

use crate::BoxError;
use crate::consume::{
    Apply, BareTransaction, Database, Kind, Ledger, Payment, Progress, Window, payment_body,
};

/// What `sqs-consume` runs.
#[derive(Debug, clap::Args)]
pub(crate) struct Options {
    /// The SQS endpoint (moto's server: `http://127.0.0.1:PORT`).
    #[arg(long)]
    sqs_endpoint: String,
    /// The run's queue (a fresh name: created, filled, drained and deleted
    /// here).
    #[arg(long)]
    queue: String,
    /// What every consume command takes beside its broker.
    #[command(flatten)]
    drain: crate::consume::Drain,
}

/// The consumer's name in the inbox.
const CONSUMER: &str = "payments";

/// The long poll of both consumers: the queue is never empty during a
/// drain, so it only bounds the receive left waiting at the end.
const WAIT: Duration = Duration::from_secs(1);

/// How many batches are sent at once while filling a queue.
const SENDING: usize = 16;

pub(crate) fn run(options: Options) -> Result<(), BoxError> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(options.drain.workers.max(1))
        .enable_all()
        .build()?
        .block_on(drain_once(options))
}

async fn drain_once(options: Options) -> Result<(), BoxError> {
    if options.drain.messages == 0 {
        return Err("--messages must be at least 1".into());
    }
    let client = ClientConfig::from_env()
        .endpoint(&options.sqs_endpoint)
        .region("us-east-1")
        .credentials("test", "test")
        .build()?;
    let queue = create_queue(&client, &options.queue).await?;
    let warmup = create_queue(&client, &format!("{}-warmup", options.queue)).await?;
    let (_, stop) = options
        .drain
        .publish(async |warming, count| {
            let url = if warming { &warmup } else { &queue };
            publish(&client, &options, url, count).await
        })
        .await?;
    if stop {
        return Ok(());
    }
    let sqs_call_ms = call_ms(&client, &queue).await?;
    // A connection per running handler, as `consume` gives.
    let database = Database::open(
        &options.drain.database,
        options.drain.accounts,
        None,
        options.drain.concurrency,
    )
    .await?;
    if options.drain.warmup > 0 {
        let mut ignored = Window::new(None);
        drain(
            &client,
            &database,
            &options,
            &warmup,
            options.drain.warmup,
            &mut ignored,
        )
        .await?;
    }
    let before = database.tally().await?;
    let mut window = Window::new(database.postgres_port());
    let drained = drain(
        &client,
        &database,
        &options,
        &queue,
        options.drain.messages,
        &mut window,
    )
    .await?;
    let measured = window.end()?;
    if drained != options.drain.messages {
        return Err(format!("{drained} messages drained, not {}", options.drain.messages).into());
    }
    let after = database.tally_after().await?;
    after.applied_since(&before, options.drain.messages)?;
    let left = depth(&client, &queue).await?;
    if left != 0 {
        let counts = client
            .get_queue_attributes()
            .queue_url(&queue)
            .attribute_names(QueueAttributeName::ApproximateNumberOfMessages)
            .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesNotVisible)
            .send()
            .await?;
        return Err(format!(
            "{left} messages left in the queue after the drain (nothing applied twice: {:?})",
            counts.attributes()
        )
        .into());
    }
    for url in [&queue, &warmup] {
        delete_queue(&client, url).await?;
    }
    println!(
        "{}",
        serde_json::json!({
            "messages": options.drain.messages,
            "seconds": measured.seconds,
            "cpu_seconds": measured.cpu_seconds,
            "database_cpu_seconds": measured.database_cpu_seconds,
            "statements": after.statements_since(&before),
            "peak_rss_bytes": crate::memory::peak_resident_bytes().ok(),
            "sqs_call_ms": sqs_call_ms,
        })
    );
    Ok(())
}

async fn drain(
    client: &Client,
    database: &Database,
    options: &Options,
    queue: &str,
    count: usize,
    window: &mut Window,
) -> Result<usize, BoxError> {
    match (database, options.drain.consumer) {
        (Database::Postgres { inbox, .. }, Kind::Idem) => {
            idem(client, inbox.clone(), options, queue, count, window).await
        }
        (Database::Sqlite { inbox }, Kind::Idem) => {
            idem(client, inbox.clone(), options, queue, count, window).await
        }
        (Database::Postgres { inbox, .. }, Kind::Bare) => {
            bare(client, inbox.pool().clone(), options, queue, count, window).await
        }
        (Database::Sqlite { inbox }, Kind::Bare) => {
            bare(client, inbox.pool().clone(), options, queue, count, window).await
        }
    }
}

/// idem-sqs's consumer on `inbox`, shut down once its handler ran `count`
/// times.
async fn idem<I>(
    client: &Client,
    inbox: I,
    options: &Options,
    queue: &str,
    count: usize,
    window: &mut Window,
) -> Result<usize, BoxError>
where
    I: idem_sqs::Inbox,
    I::Tx: Ledger + Sized,
{
    let progress = Progress::new(count);
    let consumer = idem_sqs::Consumer::builder(client.clone(), queue)
        .name(CONSUMER)
        .inbox(inbox)
        .policy(ConsumerPolicy::new())
        .concurrency(options.drain.concurrency)
        .wait_time(WAIT)
        .handler(Apply {
            progress: Arc::clone(&progress),
        })
        .build()?;
    consumer
        .run(progress.reached.notified(), |_| window.start())
        .await?;
    Ok(progress.count())
}

/// A bare aws-sdk-sqs loop: a receive of up to `min(10, free slots)`
/// messages in flight whenever a slot is free (as idem-sqs polls: beside the
/// running messages, never in their way), each message applied in its
/// transaction, up to `--concurrency` at once, and deleted after the commit;
/// stops once `count` were deleted.
async fn bare<T: BareTransaction>(
    client: &Client,
    transaction: T,
    options: &Options,
    queue: &str,
    count: usize,
    window: &mut Window,
) -> Result<usize, BoxError> {
    let concurrency = options.drain.concurrency.max(1);
    let wait = i32::try_from(WAIT.as_secs())?;
    let mut running: JoinSet<Result<(), BoxError>> = JoinSet::new();
    let mut polling: Option<Receive> = None;
    let mut deleted = 0;
    window.start();
    while deleted < count {
        let free = concurrency - running.len();
        if polling.is_none() && free > 0 {
            let receive = client
                .receive_message()
                .queue_url(queue)
                .max_number_of_messages(i32::try_from(free.min(10))?)
                .wait_time_seconds(wait)
                .send();
            polling = Some(Box::pin(async move {
                Ok(receive.await?.messages.unwrap_or_default())
            }));
        }
        tokio::select! {
            biased;
            Some(joined) = running.join_next() => {
                joined??;
                deleted += 1;
            }
            received = next_receive(&mut polling) => {
                polling = None;
                for message in received? {
                    let body = message.body.unwrap_or_default();
                    let receipt = message
                        .receipt_handle
                        .ok_or("a message without a receipt handle")?;
                    let (client, transaction, queue) =
                        (client.clone(), transaction.clone(), queue.to_owned());
                    running.spawn(async move {
                        let payment: Payment = serde_json::from_str(&body)?;
                        transaction.run(&payment).await?;
                        client
                            .delete_message()
                            .queue_url(queue)
                            .receipt_handle(receipt)
                            .send()
                            .await?;
                        Ok(())
                    });
                }
            }
        }
    }
    Ok(deleted)
}

/// A receive under way: its messages.
type Receive = Pin<Box<dyn Future<Output = Result<Vec<Message>, BoxError>> + Send>>;

/// The receive under way's answer; never, when there is none.
async fn next_receive(polling: &mut Option<Receive>) -> Result<Vec<Message>, BoxError> {
    match polling {
        Some(receive) => receive.await,
        None => std::future::pending().await,
    }
}

async fn create_queue(client: &Client, name: &str) -> Result<String, BoxError> {
    let created = client.create_queue().queue_name(name).send().await?;
    Ok(created
        .queue_url()
        .ok_or("CreateQueue answered no URL")?
        .to_owned())
}

/// Deletes the queue at `url` and idem-sqs's `<name>-dlq`, when there is one.
async fn delete_queue(client: &Client, url: &str) -> Result<(), BoxError> {
    let name = idem_sqs::queue_name(url)?;
    let dlq = idem_sqs::dead_letter_queue_name(name);
    if let Ok(found) = client.get_queue_url().queue_name(&dlq).send().await
        && let Some(dlq) = found.queue_url()
    {
        client.delete_queue().queue_url(dlq).send().await?;
    }
    client.delete_queue().queue_url(url).send().await?;
    Ok(())
}

/// Visible, in-flight and delayed messages of the queue at `url`.
async fn depth(client: &Client, url: &str) -> Result<u64, BoxError> {
    let answer = client
        .get_queue_attributes()
        .queue_url(url)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessages)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesNotVisible)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesDelayed)
        .send()
        .await?;
    Ok(answer
        .attributes()
        .map(|attributes| {
            attributes
                .values()
                .filter_map(|n| n.parse::<u64>().ok())
                .sum()
        })
        .unwrap_or(0))
}

/// The mean time of 20 `GetQueueUrl` calls, in milliseconds: a call whose
/// work on the server does not grow with the queue (moto's message counts
/// walk every message).
async fn call_ms(client: &Client, url: &str) -> Result<f64, BoxError> {
    const CALLS: u32 = 20;
    let name = idem_sqs::queue_name(url)?;
    let started = Instant::now();
    for _ in 0..CALLS {
        client.get_queue_url().queue_name(name).send().await?;
    }
    Ok(started.elapsed().as_secs_f64() * 1_000.0 / f64::from(CALLS))
}

/// Fills the queue at `url` with `count` payments, each with its own
/// `message_id` attribute, 10 a batch.
async fn publish(
    client: &Client,
    options: &Options,
    url: &str,
    count: usize,
) -> Result<(), BoxError> {
    let accounts = options.drain.accounts.max(1);
    let batches: Vec<Vec<usize>> = (0..count)
        .collect::<Vec<_>>()
        .chunks(10)
        .map(<[usize]>::to_vec)
        .collect();
    futures_util::stream::iter(batches)
        .map(|batch| async move {
            let mut send = client.send_message_batch().queue_url(url);
            for n in batch {
                let id = uuid::Uuid::now_v7().to_string();
                let attribute = MessageAttributeValue::builder()
                    .data_type("String")
                    .string_value(&id)
                    .build()?;
                send = send.entries(
                    SendMessageBatchRequestEntry::builder()
                        .id(format!("m{n}"))
                        .message_body(payment_body(&id, n, accounts))
                        .message_attributes(idem_sqs::MESSAGE_ID_ATTRIBUTE, attribute)
                        .build()?,
                );
            }
            let sent = send.send().await?;
            if !sent.failed().is_empty() {
                return Err(BoxError::from(format!(
                    "{} messages of a batch refused",
                    sent.failed().len()
                )));
            }
            Ok(())
        })
        .buffer_unordered(SENDING)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect()
}

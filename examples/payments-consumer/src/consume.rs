//! `run`: the consumer, declared on idem-rabbitmq, and the handler that
//! applies a payment.

use std::time::Duration;

use idem_diesel::idem_core::cleanup::{Cleanup, ExpiredRows};
use idem_rabbitmq::{
    Attempt, Backoff, Consumer, ConsumerPolicy, Handler, HandlerError, HandlerFuture, Inbox,
};

use crate::ConsumerError;
use crate::database::{Database, with_inbox};
use crate::ledger::Ledger;
use crate::payment::Payment;

/// No retry waits longer than this (the cap of `Backoff::for_consumers`).
pub const RETRY_CAP: Duration = Duration::from_secs(300);

/// What `run` needs on RabbitMQ: the queue, and the flags every broker shares.
#[derive(Clone, Debug)]
pub struct RunOptions {
    /// The broker, `amqp://user:password@host:port/vhost`.
    pub amqp: String,
    /// The work queue.
    pub queue: String,
    /// The flags every broker shares.
    pub settings: Settings,
}

/// `run`'s flags that every broker shares.
#[derive(Clone, Debug)]
pub struct Settings {
    /// The database, `postgres://…` or `sqlite://PATH`.
    pub database: String,
    /// How many failed attempts make a message a dead letter.
    pub max_attempts: u32,
    /// The first retry comes within this delay (full jitter), each later one
    /// within twice the previous bound, up to [`RETRY_CAP`].
    pub retry_base: Duration,
    /// More dead letters than this raise the alert.
    pub dead_letter_alert_threshold: u64,
    /// How many messages are processed at once.
    pub concurrency: usize,
    /// Every payment to this account fails (a deliberate bug).
    pub fail_account: Option<String>,
    /// Each effect waits this long inside its transaction (to show a slow
    /// handler); zero by default.
    pub handler_latency: Duration,
    /// Up to this many messages already delivered are applied in one
    /// transaction, one commit (1: one at a time, the default; on SQS a
    /// batch is at most one receive's 10 messages; on Kafka, a partition's
    /// records, in order).
    pub batch: usize,
}

impl Settings {
    /// The consumer policy these flags ask for.
    pub fn policy(&self) -> ConsumerPolicy {
        ConsumerPolicy::new()
            .max_attempts(self.max_attempts)
            .backoff(Backoff::new(
                self.retry_base,
                RETRY_CAP.max(self.retry_base),
            ))
            .dead_letter_threshold(self.dead_letter_alert_threshold)
    }

    /// The handler these flags ask for.
    pub fn handler(&self) -> ApplyPayment {
        ApplyPayment {
            failing: self.fail_account.clone(),
            latency: self.handler_latency,
        }
    }

    /// Opens the database (migrating it) with a connection per running
    /// handler and one for the cleanup job.
    pub async fn open(&self) -> Result<Database, ConsumerError> {
        let connections = u32::try_from(self.concurrency)
            .unwrap_or(u32::MAX)
            .saturating_add(1);
        Database::open(&self.database, connections).await
    }
}

/// The consumer's name in the inbox: `payments-consumer/<queue>`.
pub fn inbox_name(queue: &str) -> String {
    format!("payments-consumer/{queue}")
}

/// Opens the database (migrating it), then consumes until SIGTERM or
/// Ctrl-C, across broker restarts; calls `subscribed` with the queue once,
/// when first subscribed. On the signal the consumer takes no more
/// deliveries, finishes and acknowledges those it is processing, and
/// answers `Ok`.
pub async fn run(options: RunOptions, subscribed: impl FnOnce(&str)) -> Result<(), ConsumerError> {
    with_inbox!(options.settings.open().await?, inbox => {
        consume(inbox.clone(), inbox.cleanup(), options, subscribed).await
    })
}

/// Builds the consumer `builder` is about to make with the handler the flags
/// ask for, one payment at a time or `--batch`'s batches of them (each
/// payment in turn, all on the batch's one transaction), and runs `body`
/// with it as `consumer`: the two are consumers of different types.
macro_rules! with_handler {
    ($settings:expr, $builder:expr, $consumer:ident => $body:expr) => {
        if $settings.batch > 1 {
            let handler = idem_diesel::idem_core::consume::each($settings.handler());
            let $consumer = $builder.batch_handler(handler, $settings.batch).build()?;
            $body
        } else {
            let $consumer = $builder.handler($settings.handler()).build()?;
            $body
        }
    };
}
pub(crate) use with_handler;

/// The consumer on `inbox`, with the inbox's cleanup job beside it.
async fn consume<I>(
    inbox: I,
    cleanup: Cleanup<I>,
    options: RunOptions,
    subscribed: impl FnOnce(&str),
) -> Result<(), ConsumerError>
where
    I: Inbox + ExpiredRows,
    I::Tx: Ledger,
{
    let stop = stop_signal()?;
    let settings = &options.settings;
    let builder = Consumer::builder(&options.amqp, &options.queue)
        .name(inbox_name(&options.queue))
        .inbox(inbox)
        .policy(settings.policy())
        .concurrency(settings.concurrency);
    with_handler!(settings, builder, consumer => {
        let mut subscribed = Some(subscribed);
        let consumed = beside_cleanup(
            cleanup,
            consumer.run(stop, |subscription| {
                if let Some(subscribed) = subscribed.take() {
                    subscribed(&subscription.queue);
                }
            }),
        )
        .await;
        Ok(consumed?)
    })
}

/// Runs `consumer` with the inbox's `cleanup` job beside it; the job stops
/// when the consumer does.
pub async fn beside_cleanup<I: ExpiredRows, T>(
    cleanup: Cleanup<I>,
    consumer: impl Future<Output = T>,
) -> T {
    let (stop_cleanup, cleanup_stopped) = tokio::sync::oneshot::channel::<()>();
    let cleanup = tokio::spawn(cleanup.run(async {
        let _ = cleanup_stopped.await;
    }));
    let consumed = consumer.await;
    let _ = stop_cleanup.send(());
    let _ = cleanup.await;
    consumed
}

/// The handler: reads the payment and adds it to its account, on the
/// inbox's transaction.
///
/// | what goes wrong | the error | so |
/// |---|---|---|
/// | the body is not a payment ([`Payment::parse`]: not JSON, an amount not a positive integer, an account id empty or over 255 bytes) | permanent | dead-lettered at once |
/// | the balance would pass `i64::MAX` ([`Ledger::add`] writes nothing) | permanent | dead-lettered at once |
/// | `--fail-account` names the account | transient | retried, dead-lettered after `--max-attempts` |
/// | the database refuses the write | as the inbox classifies it: a constraint or data error is permanent, anything else transient | |
///
/// With `--handler-latency-ms` the effect waits that long inside its
/// transaction, after the write.
pub struct ApplyPayment {
    failing: Option<String>,
    latency: Duration,
}

/// Why the handler failed. Its text is the dead letter's reason and is
/// logged: it names no account and quotes no body.
#[derive(Debug, thiserror::Error)]
enum ApplyError {
    #[error("payments to the account of --fail-account fail on purpose")]
    FailingAccount,
    #[error("the balance would pass the largest 64-bit integer")]
    Overflow,
    #[error("the balance update failed")]
    Database(#[source] idem_diesel::diesel::result::Error),
}

impl<Tx: Ledger + ?Sized> Handler<Tx> for ApplyPayment {
    fn handle<'a>(&'a self, attempt: Attempt<'a>, tx: &'a mut Tx) -> HandlerFuture<'a> {
        Box::pin(async move {
            let payment = Payment::parse(attempt.body()).map_err(HandlerError::permanent)?;
            if self.failing.as_deref() == Some(payment.account_id.as_str()) {
                return Err(HandlerError::transient(ApplyError::FailingAccount));
            }
            match tx.add(&payment).await {
                Ok(true) => {
                    if !self.latency.is_zero() {
                        tokio::time::sleep(self.latency).await;
                    }
                    Ok(())
                }
                Ok(false) => Err(HandlerError::permanent(ApplyError::Overflow)),
                // Unclassified: the inbox knows its database's permanent errors.
                Err(error) => Err(ApplyError::Database(error).into()),
            }
        })
    }
}

/// Resolves on SIGTERM or Ctrl-C; the handlers are installed at once.
pub fn stop_signal() -> Result<impl Future<Output = ()>, ConsumerError> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut terminate = signal(SignalKind::terminate()).map_err(ConsumerError::Signal)?;
    let mut interrupt = signal(SignalKind::interrupt()).map_err(ConsumerError::Signal)?;
    Ok(async move {
        tokio::select! {
            _ = terminate.recv() => {}
            _ = interrupt.recv() => {}
        }
    })
}

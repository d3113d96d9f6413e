//! A message consumer over an at-least-once stream, with and without
//! idem-diesel's [`Inbox`].
//!
//! Every broker delivers at least once: a producer that retries publishes a
//! message twice, and a consumer that crashes after applying a message but
//! before acknowledging it gets it again. [`Broker`] plays such a stream: its
//! [`published`] log holds the message `m-2` three times (a retrying producer)
//! and one message without an id, and [`run`] makes the consumer crash once,
//! after it applied `m-3` and `m-4` but before it acknowledged them, so the
//! broker delivers them again.
//!
//! Two consumers read the stream and add each message's amount to an account
//! balance in PostgreSQL:
//!
//! - without the inbox, every delivery is applied: the balance counts `m-2`
//!   three times, `m-3` and `m-4` twice, and the message without an id once;
//! - with the inbox, each delivery goes through [`Inbox::process_once`]: the
//!   balance update and the inbox row commit together, redeliveries are
//!   skipped, and the message without an id is refused. The balance is exact.
//!
//! Both consumers meet a flaky fraud check that fails the first attempt of
//! `m-5`, and retry it after [`Backoff::delay`] (the binary uses
//! [`Backoff::for_consumers`]: full jitter, so that consumers that failed
//! together do not retry together).
//!
//! ```no_run
//! use idem_core::retry::Backoff;
//!
//! # async fn demo() -> Result<(), consumer::DemoError> {
//! let report = consumer::run("postgres://localhost/demo", Backoff::for_consumers()).await?;
//! assert_ne!(report.without_inbox, report.expected);
//! assert_eq!(report.with_inbox, report.expected);
//! for line in report.lines() {
//!     println!("{line}");
//! }
//! # Ok(())
//! # }
//! ```

use std::collections::HashSet;
use std::sync::Mutex;

use diesel::QueryableByName;
use diesel::sql_types::{BigInt, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use idem_core::retry::Backoff;
use idem_diesel::{Delivery, Inbox, InboxError, PgPool, PgStore, SetupError};

/// One message of the stream: a change to an account's balance.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    /// The message's id, as the producer set it; `None` when it forgot.
    pub id: Option<String>,
    /// The account to change.
    pub account: String,
    /// The amount to add (negative: withdraw).
    pub amount: i64,
}

/// An at-least-once broker: a log of published messages, read from the last
/// acknowledged offset. A consumer that stops without acknowledging gets the
/// unacknowledged messages again.
#[derive(Debug)]
pub struct Broker {
    log: Vec<Message>,
    acknowledged: usize,
}

/// What [`run`] saw.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Report {
    /// Messages delivered to each consumer (redeliveries included).
    pub deliveries: usize,
    /// The balance that applying each message once gives.
    pub expected: i64,
    /// The balance the consumer without the inbox ended with.
    pub without_inbox: i64,
    /// The balance the consumer with the inbox ended with.
    pub with_inbox: i64,
    /// What the consumer with the inbox did with its deliveries.
    pub inbox: Tally,
}

/// What the consumer with the inbox did with its deliveries.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tally {
    /// Messages applied (once each).
    pub processed: usize,
    /// Redeliveries skipped.
    pub duplicates: usize,
    /// Messages refused for want of an id.
    pub refused: usize,
    /// Attempts that failed and were retried.
    pub retries: u32,
}

/// Why the demo could not run.
#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    /// The database could not be reached or migrated.
    #[error("could not set up the database")]
    Setup(#[from] SetupError),
    /// A query failed.
    #[error("a query failed")]
    Database(#[from] diesel::result::Error),
    /// No connection could be had from the pool.
    #[error("no database connection")]
    Connection(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The inbox failed.
    #[error("the inbox failed")]
    Inbox(#[from] InboxError<ApplyError>),
}

/// Why applying a message failed.
#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    /// The fraud check did not answer; the message may be retried.
    #[error("the fraud check is unavailable")]
    CheckUnavailable,
    /// The balance update failed.
    #[error("the balance update failed")]
    Database(#[from] diesel::result::Error),
}

/// The consumer acknowledges every this many messages.
const ACKNOWLEDGE_EVERY: usize = 4;

/// The consumer crashes once, right after it applied this delivery (`m-4`)
/// and before acknowledging it.
const CRASH_AFTER: usize = 5;

/// What the producers published, in order: `m-2` three times (its producer
/// retried), and one message without an id.
pub fn published() -> Vec<Message> {
    let message = |id: Option<&str>, account: &str, amount| Message {
        id: id.map(str::to_owned),
        account: account.to_owned(),
        amount,
    };
    vec![
        message(Some("m-1"), "acct-a", 100),
        message(Some("m-2"), "acct-a", 250),
        message(Some("m-2"), "acct-a", 250),
        message(Some("m-2"), "acct-a", 250),
        message(Some("m-3"), "acct-b", 40),
        message(Some("m-4"), "acct-a", -30),
        message(None, "acct-b", 500),
        message(Some("m-5"), "acct-b", 75),
        message(Some("m-6"), "acct-a", 10),
    ]
}

/// The balance that applying each message with an id once gives.
pub fn expected_balance(messages: &[Message]) -> i64 {
    let mut seen = HashSet::new();
    messages
        .iter()
        .filter(|message| {
            message
                .id
                .as_ref()
                .is_some_and(|id| seen.insert(id.clone()))
        })
        .map(|message| message.amount)
        .sum()
}

/// Runs both consumers over the stream against the PostgreSQL database at
/// `url`, and reports their balances. Creates the inbox's tables and a
/// `consumer_demo_balances` table if missing; each run uses consumer names of
/// its own, so runs do not see each other.
pub async fn run(url: &str, backoff: Backoff) -> Result<Report, DemoError> {
    let store = PgStore::connect(url).await?;
    let pool = store.pool().clone();
    let inbox = Inbox::builder().max_attempts(5).build(pool.clone());
    inbox.migrate().await?;
    connection(&pool)
        .await?
        .batch_execute(
            "CREATE TABLE IF NOT EXISTS consumer_demo_balances (
                 consumer text   NOT NULL,
                 account  text   NOT NULL,
                 balance  bigint NOT NULL,
                 PRIMARY KEY (consumer, account)
             )",
        )
        .await?;
    let run = uuid::Uuid::new_v4().simple().to_string();
    let naive = format!("naive-{run}");
    let guarded = format!("inbox-{run}");

    let mut broker = Broker::new(published());
    let deliveries =
        consume_without_inbox(&mut broker, &pool, &naive, &FraudCheck::new(), backoff).await?;
    let mut broker = Broker::new(published());
    let (inbox_deliveries, tally) =
        consume_with_inbox(&mut broker, &inbox, &guarded, &FraudCheck::new(), backoff).await?;
    debug_assert_eq!(deliveries, inbox_deliveries);

    Ok(Report {
        deliveries,
        expected: expected_balance(&published()),
        without_inbox: balance(&pool, &naive).await?,
        with_inbox: balance(&pool, &guarded).await?,
        inbox: tally,
    })
}

impl Broker {
    /// A broker whose log holds `log`, nothing acknowledged.
    pub fn new(log: Vec<Message>) -> Self {
        Self {
            log,
            acknowledged: 0,
        }
    }

    /// The messages from the last acknowledged one on, with their offsets.
    pub fn unacknowledged(&self) -> impl Iterator<Item = (usize, &Message)> {
        self.log.iter().enumerate().skip(self.acknowledged)
    }

    /// Acknowledges every message before `offset`.
    pub fn acknowledge(&mut self, offset: usize) {
        self.acknowledged = self.acknowledged.max(offset.min(self.log.len()));
    }

    /// Whether every message was acknowledged.
    pub fn drained(&self) -> bool {
        self.acknowledged == self.log.len()
    }
}

impl Report {
    /// The report, for people.
    pub fn lines(&self) -> Vec<String> {
        let verdict = |balance| {
            if balance == self.expected {
                "exact"
            } else {
                "WRONG"
            }
        };
        vec![
            format!(
                "delivered {} messages: m-2 three times (its producer retried), \
                 m-3 and m-4 again after the consumer crashed before acknowledging them, \
                 and one without an id",
                self.deliveries
            ),
            format!(
                "without the inbox: balance {}, expected {}: {} (every delivery applied)",
                self.without_inbox,
                self.expected,
                verdict(self.without_inbox)
            ),
            format!(
                "with the inbox:    balance {}, expected {}: {} ({} processed, {} duplicates skipped, \
                 {} refused without an id, {} failed attempts retried)",
                self.with_inbox,
                self.expected,
                verdict(self.with_inbox),
                self.inbox.processed,
                self.inbox.duplicates,
                self.inbox.refused,
                self.inbox.retries
            ),
        ]
    }
}

/// A fraud check that is unavailable the first time it is asked about `m-5`.
#[derive(Debug)]
struct FraudCheck {
    asked: Mutex<HashSet<String>>,
}

impl FraudCheck {
    fn new() -> Self {
        Self {
            asked: Mutex::new(HashSet::new()),
        }
    }

    fn check(&self, message: &Message) -> Result<(), ApplyError> {
        let id = message.id.clone().unwrap_or_default();
        let first_time = self
            .asked
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(id.clone());
        if first_time && id == "m-5" {
            Err(ApplyError::CheckUnavailable)
        } else {
            Ok(())
        }
    }
}

/// The consumer's effect: adds the message's amount to its account's balance.
async fn apply(
    connection: &mut AsyncPgConnection,
    consumer: &str,
    message: &Message,
    check: &FraudCheck,
) -> Result<(), ApplyError> {
    check.check(message)?;
    diesel::sql_query(
        "INSERT INTO consumer_demo_balances (consumer, account, balance) VALUES ($1, $2, $3)
         ON CONFLICT (consumer, account)
         DO UPDATE SET balance = consumer_demo_balances.balance + excluded.balance",
    )
    .bind::<Text, _>(consumer)
    .bind::<Text, _>(&message.account)
    .bind::<BigInt, _>(message.amount)
    .execute(connection)
    .await?;
    Ok(())
}

/// Reads the broker to the end, restarting once after the simulated crash;
/// `handle` applies one delivery. Answers how many deliveries it handled.
async fn drain<H>(broker: &mut Broker, mut handle: H) -> Result<usize, DemoError>
where
    H: AsyncFnMut(&Message) -> Result<(), DemoError>,
{
    let mut deliveries = 0;
    let mut crashed = false;
    while !broker.drained() {
        let session: Vec<(usize, Message)> = broker
            .unacknowledged()
            .map(|(offset, message)| (offset, message.clone()))
            .collect();
        for (offset, message) in session {
            handle(&message).await?;
            deliveries += 1;
            if offset == CRASH_AFTER && !crashed {
                crashed = true;
                tracing::info!(offset, "the consumer crashed before acknowledging");
                break;
            }
            if (offset + 1) % ACKNOWLEDGE_EVERY == 0 || offset + 1 == broker.log.len() {
                broker.acknowledge(offset + 1);
            }
        }
    }
    Ok(deliveries)
}

async fn consume_without_inbox(
    broker: &mut Broker,
    pool: &PgPool,
    consumer: &str,
    check: &FraudCheck,
    backoff: Backoff,
) -> Result<usize, DemoError> {
    drain(broker, async |message| {
        let mut attempt = 1;
        loop {
            let mut connection = connection(pool).await?;
            match apply(&mut connection, consumer, message, check).await {
                Ok(()) => return Ok(()),
                Err(ApplyError::CheckUnavailable) => {
                    tokio::time::sleep(backoff.delay(attempt)).await;
                    attempt += 1;
                }
                Err(ApplyError::Database(error)) => return Err(error.into()),
            }
        }
    })
    .await
}

async fn consume_with_inbox(
    broker: &mut Broker,
    inbox: &Inbox,
    consumer: &str,
    check: &FraudCheck,
    backoff: Backoff,
) -> Result<(usize, Tally), DemoError> {
    let mut tally = Tally::default();
    let deliveries = drain(broker, async |message| {
        loop {
            let outcome = inbox
                .process_once(consumer, message.id.as_deref(), async |connection| {
                    apply(connection, consumer, message, check).await
                })
                .await;
            match outcome {
                Ok(Delivery::Processed(())) => tally.processed += 1,
                Ok(Delivery::Duplicate) => tally.duplicates += 1,
                Ok(Delivery::DeadLetter) => {}
                Err(InboxError::MissingMessageId) => tally.refused += 1,
                Err(InboxError::Failed { attempt, .. }) => {
                    tally.retries += 1;
                    tokio::time::sleep(backoff.delay(attempt)).await;
                    continue;
                }
                Err(InboxError::DeadLettered { attempts, source }) => {
                    tracing::error!(attempts, error = %source, "message dead-lettered; re-drive it once fixed");
                }
                Err(error) => return Err(error.into()),
            }
            return Ok(());
        }
    })
    .await?;
    Ok((deliveries, tally))
}

#[derive(QueryableByName)]
struct Balance {
    #[diesel(sql_type = BigInt)]
    balance: i64,
}

/// The sum of `consumer`'s account balances.
async fn balance(pool: &PgPool, consumer: &str) -> Result<i64, DemoError> {
    let row = diesel::sql_query(
        "SELECT COALESCE(sum(balance), 0)::bigint AS balance
         FROM consumer_demo_balances WHERE consumer = $1",
    )
    .bind::<Text, _>(consumer)
    .get_result::<Balance>(&mut *connection(pool).await?)
    .await?;
    Ok(row.balance)
}

async fn connection(
    pool: &PgPool,
) -> Result<
    bb8::PooledConnection<
        '_,
        diesel_async::pooled_connection::AsyncDieselConnectionManager<AsyncPgConnection>,
    >,
    DemoError,
> {
    pool.get()
        .await
        .map_err(|error| DemoError::Connection(Box::new(error)))
}

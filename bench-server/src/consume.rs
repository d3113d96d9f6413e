//! `consume`: one drain of a queue of payments, through idem's consumer
//! (idem-rabbitmq with `PgInbox` or `SqliteInbox`) or through a bare lapin
//! consumer that applies the same transaction without an inbox.
//!
//! One run, in order:
//!
//! 1. **Set-up, not measured:** the database's pool (the inbox's, which the
//!    bare consumer borrows, so that the pool is not a difference), the inbox's
//!    migration, the ledger's tables and accounts; then the database is
//!    settled ([`Database::settle`]), so that no background work the earlier
//!    drains left behind falls inside this one's window.
//! 2. **Publish, not measured:** the queue is declared as idem's consumer
//!    declares it ([`Topology`]: the bare consumer reads the same kind of
//!    queue), then `--messages` payments are published with
//!    idem-rabbitmq's `Publisher` (confirms, persistent, a UUID v7
//!    `message_id` each, as the publisher gives by default, which is also the
//!    body's `payment_id`), plus `--warmup` to a warm-up queue.
//! 3. **Warm-up, not measured:** the same consumer drains the warm-up queue,
//!    so that the pool's connections are open and their statements prepared
//!    before the clock starts.
//! 4. **The drain, measured:** from the subscription (`on_subscribed`, or the
//!    bare consumer's `basic.consume`) until the consumer stopped, every
//!    message acknowledged after its commit. The bare consumer counts its acks
//!    and, at `--messages`, cancels and closes. idem's consumer is shut down
//!    when its handler has run `--messages` times; its graceful shutdown
//!    waits for the running messages to commit and be acknowledged, then
//!    closes: the clock covers every ack. This process's CPU time and (on
//!    PostgreSQL) the server's are read at both ends.
//! 5. **Checked, not measured:** the accounts counted exactly `--messages`
//!    more payments and the queue is empty (nothing left unacknowledged,
//!    nothing applied twice); the run's queues are deleted.
//!
//! The transaction, on both sides: the account's balance `UPDATE` and the
//! payment's `INSERT` (diesel's query builder, so each is a prepared
//! statement), acknowledged after the commit; `BEGIN`/`COMMIT` on PostgreSQL,
//! `BEGIN IMMEDIATE`/`COMMIT` on SQLite (the inbox's own). idem adds the inbox
//! row, sent with the `BEGIN` on PostgreSQL, and its failures' cleanup, sent
//! with the `COMMIT`: the same round trips.
//!
//! Prints one JSON object: `messages`, `seconds`, `cpu_seconds` (this
//! process), `database_cpu_seconds` (PostgreSQL's, or null), `publish_seconds` (null
//! with `--published`). With `--publish-only`, it publishes and prints
//! `published`, `warmup` and `publish_seconds` alone.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Instant;

use diesel::connection::{AnsiTransactionManager as SyncTransactions, TransactionManager as _};
use diesel::result::QueryResult;
use diesel::{ExpressionMethods, QueryDsl};
use diesel_async::{
    AnsiTransactionManager, AsyncPgConnection, SimpleAsyncConnection, TransactionManager,
};
use futures_util::{StreamExt, TryStreamExt};
use idem_diesel::{AsyncSqliteConnection, PgInbox, PgPool, SqliteInbox, SqlitePool};
use idem_rabbitmq::lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicQosOptions, QueueDeleteOptions,
};
use idem_rabbitmq::lapin::types::FieldTable;
use idem_rabbitmq::lapin::{self, Channel, ConnectionProperties};
use idem_rabbitmq::{
    Attempt, BatchHandler, Consumer, ConsumerPolicy, Handler, HandlerError, HandlerFuture, Inbox,
    Message, Publisher, Topology,
};
use idem_testkit::cpu::{cpu_seconds, postgres_cpu_seconds};
use tokio::sync::Notify;
use tokio::task::JoinSet;

use crate::BoxError;

/// What `consume` runs.
#[derive(Debug, clap::Args)]
pub(crate) struct Options {
    /// The broker: `amqp://user:password@host:port/vhost`.
    #[arg(long)]
    amqp: String,
    /// The run's work queue (a fresh name: declared, filled and drained here).
    #[arg(long)]
    queue: String,
    /// Unacknowledged deliveries the broker sends ahead (`basic.qos`).
    #[arg(long, default_value_t = idem_rabbitmq::DEFAULT_PREFETCH)]
    prefetch: u16,
    /// Database connections (default: the concurrency on PostgreSQL, the
    /// inbox's default of 4 on SQLite, whose writers take turns anyway).
    #[arg(long)]
    pool: Option<u32>,
    /// What every consume command takes beside its broker.
    #[command(flatten)]
    drain: crate::consume::Drain,
}

/// What every consume command (`consume`, `kafka-consume`, `sqs-consume`)
/// takes beside its broker, flattened into each: the same flags, the same
/// defaults.
#[derive(Debug, clap::Args)]
pub(crate) struct Drain {
    /// The database: `postgres://…` or `sqlite://PATH`.
    #[arg(long)]
    pub(crate) database: String,
    /// `idem` (the broker's idem crate and the database's inbox) or `bare`
    /// (the broker's client and the same transaction, no inbox).
    #[arg(long)]
    pub(crate) consumer: Kind,
    /// Messages processed at once (on Kafka: the topic's partitions).
    #[arg(long)]
    pub(crate) concurrency: usize,
    /// Messages in the measured drain.
    #[arg(long)]
    pub(crate) messages: usize,
    /// Messages drained first, unmeasured.
    #[arg(long, default_value_t = 0)]
    pub(crate) warmup: usize,
    /// Accounts the payments are spread over.
    #[arg(long, default_value_t = 1_000)]
    pub(crate) accounts: usize,
    /// Tokio worker threads.
    #[arg(long, default_value_t = 2)]
    pub(crate) workers: usize,
    /// idem's consumer: a batch handler deciding up to this many deliveries
    /// together, in one transaction (`ConsumerBuilder::batch_handler`);
    /// without it, the handler, one at a time. The bare consumer ignores it.
    #[arg(long)]
    pub(crate) batch: Option<usize>,
    /// Only publish the run's messages (and its warm-up's), print
    /// `{"published": N}` and stop, for a later run with `--published`.
    #[arg(long, conflicts_with = "published")]
    pub(crate) publish_only: bool,
    /// Drain what an earlier `--publish-only` run with the same queue (or
    /// topic) and counts published, publishing nothing: a run under
    /// callgrind then counts the consumer's instructions alone.
    #[arg(long)]
    pub(crate) published: bool,
}

impl Drain {
    /// Publishes the run's messages and its warm-up's with `publish`, unless
    /// `--published` says they are there; answers the seconds it took
    /// (`None`: nothing published), and whether the run stops there
    /// (`--publish-only`, which then printed what it published).
    pub(crate) async fn publish<F>(&self, publish: F) -> Result<(Option<f64>, bool), BoxError>
    where
        F: AsyncFn(bool, usize) -> Result<(), BoxError>,
    {
        if self.published {
            return Ok((None, false));
        }
        let started = Instant::now();
        publish(false, self.messages).await?;
        if self.warmup > 0 {
            publish(true, self.warmup).await?;
        }
        let seconds = started.elapsed().as_secs_f64();
        if self.publish_only {
            println!(
                "{}",
                serde_json::json!({
                    "published": self.messages,
                    "warmup": self.warmup,
                    "publish_seconds": seconds,
                })
            );
        }
        Ok((Some(seconds), self.publish_only))
    }
}

/// Which consumer a run drains with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Kind {
    /// The broker's idem crate on the database's inbox.
    Idem,
    /// The broker's client, the same transaction, no inbox.
    Bare,
}

/// SQLite's pool unless `--pool` says otherwise: `SqliteInbox`'s default.
const SQLITE_POOL: u32 = 4;

/// The consumer's name in the inbox, the same in every run (the message ids
/// are UUIDs, new in every run).
const CONSUMER: &str = "payments";

/// How many publishes wait for their confirmation at once.
const PUBLISHING: usize = 256;

diesel::table! {
    /// The accounts the payments move.
    bench_accounts (account_id) {
        account_id -> Text,
        balance -> BigInt,
        operations -> BigInt,
    }
}

diesel::table! {
    /// One row per payment applied.
    bench_payments (payment_id) {
        payment_id -> Text,
        account_id -> Text,
        amount -> BigInt,
        currency -> Text,
        reference -> Text,
    }
}

/// A count, as SQL answers it.
#[derive(diesel::QueryableByName)]
struct Total {
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    n: i64,
}

/// What the handler reads of a message's body.
#[derive(serde::Deserialize)]
pub(crate) struct Payment {
    payment_id: String,
    account_id: String,
    amount: i64,
    currency: String,
    reference: String,
}

type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The effect, on a connection whose transaction is open: the same
/// statements for both consumers.
pub(crate) trait Ledger: Send {
    /// The balance `UPDATE` and the payment's `INSERT`; an unknown account
    /// is `NotFound`.
    fn apply<'a>(&'a mut self, payment: &'a Payment) -> BoxFuture<'a, QueryResult<()>>;
    /// How many payments the accounts counted, in all.
    fn applied(&mut self) -> BoxFuture<'_, QueryResult<i64>>;
}

macro_rules! ledger {
    ($connection:ty) => {
        impl Ledger for $connection {
            fn apply<'a>(&'a mut self, payment: &'a Payment) -> BoxFuture<'a, QueryResult<()>> {
                Box::pin(async move {
                    use diesel_async::RunQueryDsl;
                    use bench_accounts::dsl as accounts;
                    use bench_payments::dsl as payments;
                    let updated = diesel::update(accounts::bench_accounts.find(&payment.account_id))
                        .set((
                            accounts::balance.eq(accounts::balance + payment.amount),
                            accounts::operations.eq(accounts::operations + 1),
                        ))
                        .execute(self)
                        .await?;
                    if updated != 1 {
                        return Err(diesel::result::Error::NotFound);
                    }
                    diesel::insert_into(payments::bench_payments)
                        .values((
                            payments::payment_id.eq(&payment.payment_id),
                            payments::account_id.eq(&payment.account_id),
                            payments::amount.eq(payment.amount),
                            payments::currency.eq(&payment.currency),
                            payments::reference.eq(&payment.reference),
                        ))
                        .execute(self)
                        .await
                        .map(drop)
                })
            }

            fn applied(&mut self) -> BoxFuture<'_, QueryResult<i64>> {
                Box::pin(async move {
                    use diesel_async::RunQueryDsl;
                    diesel::sql_query(
                        "SELECT CAST(COALESCE(SUM(operations), 0) AS BIGINT) AS n FROM bench_accounts",
                    )
                    .get_result::<Total>(self)
                    .await
                    .map(|total| total.n)
                })
            }
        }
    };
}

ledger!(AsyncPgConnection);
ledger!(AsyncSqliteConnection);

/// The effect of a batch of payments, on a connection whose transaction is
/// open: what a batch handler does with the batch it is given.
pub(crate) trait BatchLedger: Ledger {
    /// Every payment's balance change and `INSERT`; an unknown account is
    /// `NotFound`.
    fn apply_all<'a>(&'a mut self, payments: &'a [Payment]) -> BoxFuture<'a, QueryResult<()>>;
}

/// On PostgreSQL, two statements whatever the batch's size: the accounts'
/// `UPDATE` from the batch's sums per account, and one multi-row `INSERT`.
impl BatchLedger for AsyncPgConnection {
    fn apply_all<'a>(&'a mut self, payments: &'a [Payment]) -> BoxFuture<'a, QueryResult<()>> {
        Box::pin(async move {
            use diesel::sql_types::{Array, BigInt, Text};
            use diesel_async::RunQueryDsl;
            let column = |f: fn(&Payment) -> &str| payments.iter().map(f).collect::<Vec<&str>>();
            let accounts = column(|p| &p.account_id);
            let amounts: Vec<i64> = payments.iter().map(|p| p.amount).collect();
            let changes = diesel::sql_query(
                "WITH sums AS (
                     SELECT account_id, sum(amount)::bigint AS amount, count(*) AS n
                     FROM unnest($1::text[], $2::bigint[]) AS p(account_id, amount)
                     GROUP BY account_id)
                 UPDATE bench_accounts AS a
                 SET balance = a.balance + sums.amount, operations = a.operations + sums.n
                 FROM sums WHERE a.account_id = sums.account_id",
            )
            .bind::<Array<Text>, _>(&accounts)
            .bind::<Array<BigInt>, _>(&amounts);
            let inserts = diesel::sql_query(
                "INSERT INTO bench_payments (payment_id, account_id, amount, currency, reference)
                 SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[], $4::text[], $5::text[])",
            )
            .bind::<Array<Text>, _>(column(|p| &p.payment_id))
            .bind::<Array<Text>, _>(&accounts)
            .bind::<Array<BigInt>, _>(&amounts)
            .bind::<Array<Text>, _>(column(|p| &p.currency))
            .bind::<Array<Text>, _>(column(|p| &p.reference));
            let mut distinct = accounts.clone();
            distinct.sort_unstable();
            distinct.dedup();
            let connection: &AsyncPgConnection = self;
            let (mut first, mut second) = (connection, connection);
            // Both sent at once (one round trip): the connection pipelines
            // the futures polled together.
            let (updated, inserted) =
                tokio::join!(changes.execute(&mut first), inserts.execute(&mut second));
            if updated? != distinct.len() {
                return Err(diesel::result::Error::NotFound);
            }
            inserted.map(drop)
        })
    }
}

/// On SQLite, on the connection's thread at once (one hop, not one a
/// statement): each account's `UPDATE` with its sums, one multi-row
/// `INSERT`.
impl BatchLedger for AsyncSqliteConnection {
    fn apply_all<'a>(&'a mut self, payments: &'a [Payment]) -> BoxFuture<'a, QueryResult<()>> {
        Box::pin(async move {
            let mut sums: std::collections::BTreeMap<String, (i64, i64)> = Default::default();
            for payment in payments {
                let sum = sums.entry(payment.account_id.clone()).or_default();
                sum.0 += payment.amount;
                sum.1 += 1;
            }
            let rows: Vec<(String, String, i64, String, String)> = payments
                .iter()
                .map(|p| {
                    (
                        p.payment_id.clone(),
                        p.account_id.clone(),
                        p.amount,
                        p.currency.clone(),
                        p.reference.clone(),
                    )
                })
                .collect();
            self.spawn_blocking(move |c| {
                use bench_accounts::dsl as accounts;
                use bench_payments::dsl as payments;
                use diesel::RunQueryDsl;
                for (account, (amount, n)) in &sums {
                    let updated = diesel::update(accounts::bench_accounts.find(account))
                        .set((
                            accounts::balance.eq(accounts::balance + amount),
                            accounts::operations.eq(accounts::operations + n),
                        ))
                        .execute(c)?;
                    if updated != 1 {
                        return Err(diesel::result::Error::NotFound);
                    }
                }
                let values: Vec<_> = rows
                    .iter()
                    .map(|(id, account, amount, currency, reference)| {
                        (
                            payments::payment_id.eq(id),
                            payments::account_id.eq(account),
                            payments::amount.eq(amount),
                            payments::currency.eq(currency),
                            payments::reference.eq(reference),
                        )
                    })
                    .collect();
                diesel::insert_into(payments::bench_payments)
                    .values(values)
                    .execute(c)
                    .map(drop)
            })
            .await
        })
    }
}

/// The bare consumer's transaction on a pool of the database.
pub(crate) trait BareTransaction: Clone + Send + Sync + 'static {
    /// Checks a connection out, begins, applies `payment`, commits.
    fn run<'a>(&'a self, payment: &'a Payment) -> BoxFuture<'a, Result<(), BoxError>>;
}

impl BareTransaction for PgPool {
    fn run<'a>(&'a self, payment: &'a Payment) -> BoxFuture<'a, Result<(), BoxError>> {
        Box::pin(async move {
            let mut pooled = self.get().await?;
            let connection: &mut AsyncPgConnection = &mut pooled;
            // What `AsyncConnection::transaction` does.
            AnsiTransactionManager::begin_transaction(connection).await?;
            match connection.apply(payment).await {
                Ok(()) => AnsiTransactionManager::commit_transaction(connection).await?,
                Err(error) => {
                    AnsiTransactionManager::rollback_transaction(connection).await?;
                    return Err(error.into());
                }
            }
            Ok(())
        })
    }
}

impl BareTransaction for SqlitePool {
    fn run<'a>(&'a self, payment: &'a Payment) -> BoxFuture<'a, Result<(), BoxError>> {
        Box::pin(async move {
            let mut pooled = self.get().await?;
            let connection: &mut AsyncSqliteConnection = &mut pooled;
            // `BEGIN IMMEDIATE`, as the inbox: the file's write lock from the
            // start, so that concurrent transactions wait their turn.
            connection
                .spawn_blocking(|c| SyncTransactions::begin_transaction_sql(c, "BEGIN IMMEDIATE"))
                .await?;
            match connection.apply(payment).await {
                Ok(()) => {
                    connection
                        .spawn_blocking(SyncTransactions::commit_transaction)
                        .await?;
                }
                Err(error) => {
                    connection
                        .spawn_blocking(SyncTransactions::rollback_transaction)
                        .await?;
                    return Err(error.into());
                }
            }
            Ok(())
        })
    }
}

/// idem's handler: the effect on the inbox's transaction, counted.
pub(crate) struct Apply {
    pub(crate) progress: Arc<Progress>,
}

impl<Tx: Ledger> Handler<Tx> for Apply {
    fn handle<'a>(&'a self, attempt: Attempt<'a>, tx: &'a mut Tx) -> HandlerFuture<'a> {
        Box::pin(async move {
            self.progress.begin();
            let payment: Payment = attempt.json().map_err(HandlerError::permanent)?;
            tx.apply(&payment).await?;
            self.progress.one();
            Ok(())
        })
    }
}

/// idem's batch handler: the batch's effects on the inbox's transaction,
/// counted.
pub(crate) struct ApplyBatch {
    pub(crate) progress: Arc<Progress>,
}

impl<Tx: BatchLedger> BatchHandler<Tx> for ApplyBatch {
    fn handle<'a>(&'a self, batch: &'a [Attempt<'a>], tx: &'a mut Tx) -> HandlerFuture<'a> {
        Box::pin(async move {
            self.progress.begin();
            let payments = batch
                .iter()
                .map(|attempt| attempt.json::<Payment>())
                .collect::<Result<Vec<Payment>, _>>()
                .map_err(HandlerError::permanent)?;
            tx.apply_all(&payments).await?;
            for _ in batch {
                self.progress.one();
            }
            Ok(())
        })
    }
}

/// Counts messages; says so when the first one reaches the handler and
/// when the target is reached.
pub(crate) struct Progress {
    done: AtomicUsize,
    target: usize,
    begun: AtomicBool,
    pub(crate) first: Notify,
    pub(crate) reached: Notify,
}

impl Progress {
    pub(crate) fn new(target: usize) -> Arc<Self> {
        Arc::new(Self {
            done: AtomicUsize::new(0),
            target,
            begun: AtomicBool::new(false),
            first: Notify::new(),
            reached: Notify::new(),
        })
    }

    /// A message reached the handler: the first one says so (once).
    pub(crate) fn begin(&self) {
        if !self.begun.swap(true, Ordering::Relaxed) {
            self.first.notify_one();
        }
    }

    pub(crate) fn one(&self) {
        if self.done.fetch_add(1, Ordering::Relaxed) + 1 == self.target {
            self.reached.notify_one();
        }
    }

    pub(crate) fn count(&self) -> usize {
        self.done.load(Ordering::Relaxed)
    }
}

/// The measured window: the clock and the CPU readings at its start.
pub(crate) struct Window {
    postgres_port: Option<u16>,
    started: Option<(Instant, Option<f64>, Option<f64>)>,
}

/// What the window measured.
pub(crate) struct Drained {
    pub(crate) seconds: f64,
    pub(crate) cpu_seconds: Option<f64>,
    pub(crate) database_cpu_seconds: Option<f64>,
}

impl Window {
    pub(crate) fn new(postgres_port: Option<u16>) -> Self {
        Self {
            postgres_port,
            started: None,
        }
    }

    /// Starts the window (once: a second subscription, after a reconnection,
    /// does not restart it).
    pub(crate) fn start(&mut self) {
        if self.started.is_none() {
            let cpu = cpu_seconds(std::process::id());
            let database = self.postgres_port.and_then(postgres_cpu_seconds);
            self.started = Some((Instant::now(), cpu, database));
        }
    }

    pub(crate) fn end(&self) -> Result<Drained, BoxError> {
        let (started, cpu, database) = self.started.ok_or("the consumer never subscribed")?;
        let seconds = started.elapsed().as_secs_f64();
        let after = |before: Option<f64>, now: Option<f64>| before.zip(now).map(|(b, a)| a - b);
        Ok(Drained {
            seconds,
            cpu_seconds: after(cpu, cpu_seconds(std::process::id())),
            database_cpu_seconds: after(
                database,
                self.postgres_port.and_then(postgres_cpu_seconds),
            ),
        })
    }
}

/// The database of a run.
pub(crate) enum Database {
    Postgres { inbox: PgInbox, port: Option<u16> },
    Sqlite { inbox: SqliteInbox },
}

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
    let warmup_queue = format!("{}.warmup", options.queue);
    let (publish_seconds, stop) = options
        .drain
        .publish(async |warmup, count| {
            let queue = if warmup {
                &warmup_queue
            } else {
                &options.queue
            };
            publish(&options, queue, count).await
        })
        .await?;
    if stop {
        return Ok(());
    }
    let database = Database::open(
        &options.drain.database,
        options.drain.accounts,
        options.pool,
        options.drain.concurrency,
    )
    .await?;
    if options.drain.warmup > 0 {
        let mut ignored = Window::new(None);
        database
            .drain(&options, &warmup_queue, options.drain.warmup, &mut ignored)
            .await?;
    }
    let before = database.tally().await?;
    let mut window = Window::new(database.postgres_port());
    let drained = database
        .drain(
            &options,
            &options.queue,
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
    clean_up(&options, &[&options.queue, &warmup_queue]).await?;
    println!(
        "{}",
        serde_json::json!({
            "messages": options.drain.messages,
            "seconds": measured.seconds,
            "cpu_seconds": measured.cpu_seconds,
            "database_cpu_seconds": measured.database_cpu_seconds,
            "statements": after.statements_since(&before),
            "peak_rss_bytes": crate::memory::peak_resident_bytes().ok(),
            "publish_seconds": publish_seconds,
        })
    );
    Ok(())
}

impl Database {
    /// The pool and the inbox's tables, the ledger's tables and accounts.
    pub(crate) async fn open(
        url: &str,
        accounts: usize,
        pool: Option<u32>,
        concurrency: usize,
    ) -> Result<Self, BoxError> {
        let accounts = accounts.max(1);
        if url.starts_with("sqlite:") {
            let inbox = SqliteInbox::builder()
                .max_connections(pool.unwrap_or(SQLITE_POOL))
                .connect(url)
                .await?;
            inbox.migrate().await?;
            let seed = format!(
                "WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i + 1 < {accounts})
                 INSERT OR IGNORE INTO bench_accounts SELECT printf('acc-%05d', i), 0, 0 FROM n"
            );
            create_ledger(&mut *inbox.pool().get().await?, &seed).await?;
            let database = Self::Sqlite { inbox };
            database.settle().await?;
            Ok(database)
        } else {
            let connections =
                pool.unwrap_or_else(|| u32::try_from(concurrency).unwrap_or(u32::MAX));
            let inbox = PgInbox::builder()
                .max_connections(connections)
                .connect(url)
                .await?;
            inbox.migrate().await?;
            let seed = format!(
                "INSERT INTO bench_accounts
                     SELECT format('acc-%s', lpad(i::text, 5, '0')), 0, 0
                     FROM generate_series(0, {accounts} - 1) AS i
                 ON CONFLICT DO NOTHING"
            );
            create_ledger(&mut *inbox.pool().get().await?, &seed).await?;
            let database = Self::Postgres {
                inbox,
                port: port_of(url),
            };
            database.settle().await?;
            Ok(database)
        }
    }

    /// Does now, before the warm-up, the background work that the earlier
    /// runs on this database left due, so that none of it lands in this
    /// run's window: on PostgreSQL, autovacuum is turned off for the
    /// database's tables (each bench database is the consumers' alone), then
    /// `VACUUM (ANALYZE)` and a `CHECKPOINT`; on SQLite, the WAL is
    /// checkpointed into the file and truncated. Every drain then starts
    /// from the same kind of state (tables vacuumed, statistics fresh, no
    /// dirty pages), whichever rows ran before it, and no autovacuum or timed
    /// checkpoint lands in one side's window and not in the other's.
    pub(crate) async fn settle(&self) -> Result<(), BoxError> {
        match self {
            Self::Postgres { inbox, .. } => {
                let mut connection = inbox.pool().get().await?;
                // Each its own query: `VACUUM` runs outside any transaction.
                for sql in [
                    "DO $$ DECLARE t text; BEGIN
                         FOR t IN SELECT format('%I.%I', schemaname, tablename) FROM pg_tables
                                  WHERE schemaname = 'public' LOOP
                             EXECUTE format('ALTER TABLE %s SET (autovacuum_enabled = off)', t);
                         END LOOP;
                     END $$",
                    "VACUUM (ANALYZE)",
                    "CHECKPOINT",
                ] {
                    connection.batch_execute(sql).await?;
                }
            }
            Self::Sqlite { inbox } => {
                let mut connection = inbox.pool().get().await?;
                connection
                    .batch_execute("PRAGMA wal_checkpoint(TRUNCATE)")
                    .await?;
            }
        }
        Ok(())
    }

    pub(crate) fn postgres_port(&self) -> Option<u16> {
        match self {
            Self::Postgres { port, .. } => *port,
            Self::Sqlite { .. } => None,
        }
    }

    /// Drains `count` messages of `queue` with the run's consumer; answers
    /// how many it counted.
    async fn drain(
        &self,
        options: &Options,
        queue: &str,
        count: usize,
        window: &mut Window,
    ) -> Result<usize, BoxError> {
        match (self, options.drain.consumer) {
            (Self::Postgres { inbox, .. }, Kind::Idem) => {
                idem(inbox.clone(), options, queue, count, window).await
            }
            (Self::Sqlite { inbox }, Kind::Idem) => {
                idem(inbox.clone(), options, queue, count, window).await
            }
            (Self::Postgres { inbox, .. }, Kind::Bare) => {
                bare(inbox.pool().clone(), options, queue, count, window).await
            }
            (Self::Sqlite { inbox }, Kind::Bare) => {
                bare(inbox.pool().clone(), options, queue, count, window).await
            }
        }
    }

    /// How many payments the accounts counted, in all.
    pub(crate) async fn applied(&self) -> Result<i64, BoxError> {
        Ok(match self {
            Self::Postgres { inbox, .. } => inbox.pool().get().await?.applied().await?,
            Self::Sqlite { inbox } => inbox.pool().get().await?.applied().await?,
        })
    }

    /// The payments counted and, on PostgreSQL, the statements the cluster
    /// ran (`pg_stat_statements`, its own reads aside), read so that a drain
    /// between two tallies counts exactly its own statements: the payments
    /// first here, and last in [`tally_after`](Self::tally_after).
    pub(crate) async fn tally(&self) -> Result<Tally, BoxError> {
        let applied = self.applied().await?;
        Ok(Tally {
            applied,
            statements: self.statements().await,
        })
    }

    /// [`tally`](Self::tally) at the end of a drain: the statements first.
    pub(crate) async fn tally_after(&self) -> Result<Tally, BoxError> {
        let statements = self.statements().await;
        Ok(Tally {
            applied: self.applied().await?,
            statements,
        })
    }

    async fn statements(&self) -> Option<u64> {
        use diesel_async::RunQueryDsl;
        let Self::Postgres { inbox, .. } = self else {
            return None;
        };
        let mut connection = inbox.pool().get().await.ok()?;
        diesel::sql_query(
            "SELECT CAST(coalesce(sum(calls), 0) AS BIGINT) AS n FROM pg_stat_statements
             WHERE query NOT LIKE '%pg_stat_statements%'",
        )
        .get_result::<Total>(&mut *connection)
        .await
        .ok()
        .and_then(|total| u64::try_from(total.n).ok())
    }
}

/// What a drain changed: [`Database::tally`] at both ends.
pub(crate) struct Tally {
    applied: i64,
    statements: Option<u64>,
}

impl Tally {
    /// The payments counted since `before`, checked against `expected`.
    pub(crate) fn applied_since(&self, before: &Self, expected: usize) -> Result<(), BoxError> {
        let applied = self.applied - before.applied;
        if applied == expected as i64 {
            Ok(())
        } else {
            Err(
                format!("the accounts counted {applied} payments in the drain, not {expected}")
                    .into(),
            )
        }
    }

    /// PostgreSQL's statements since `before`: the drain's, its consumer's
    /// start and stop included.
    pub(crate) fn statements_since(&self, before: &Self) -> Option<u64> {
        self.statements?.checked_sub(before.statements?)
    }
}

/// The ledger's tables (the same text on both databases), and its accounts
/// (`seed`, in the database's dialect).
async fn create_ledger(
    connection: &mut (impl SimpleAsyncConnection + Send),
    seed: &str,
) -> Result<(), BoxError> {
    connection
        .batch_execute(&format!(
            "CREATE TABLE IF NOT EXISTS bench_accounts (
                 account_id text PRIMARY KEY, balance bigint NOT NULL, operations bigint NOT NULL);
             CREATE TABLE IF NOT EXISTS bench_payments (
                 payment_id text PRIMARY KEY, account_id text NOT NULL, amount bigint NOT NULL,
                 currency text NOT NULL, reference text NOT NULL);
             {seed};"
        ))
        .await?;
    Ok(())
}

/// idem-rabbitmq's consumer on `inbox`, shut down once its handler ran
/// `count` times.
async fn idem<I>(
    inbox: I,
    options: &Options,
    queue: &str,
    count: usize,
    window: &mut Window,
) -> Result<usize, BoxError>
where
    I: Inbox,
    I::Tx: BatchLedger + Sized,
{
    let progress = Progress::new(count);
    let builder = Consumer::builder(&options.amqp, queue)
        .name(CONSUMER)
        .inbox(inbox)
        .policy(ConsumerPolicy::new())
        .prefetch(options.prefetch)
        .concurrency(options.drain.concurrency);
    if let Some(size) = options.drain.batch {
        let apply = ApplyBatch {
            progress: Arc::clone(&progress),
        };
        let consumer = builder.batch_handler(apply, size).build()?;
        run_idem(consumer, &progress, window).await
    } else {
        let apply = Apply {
            progress: Arc::clone(&progress),
        };
        run_idem(builder.handler(apply).build()?, &progress, window).await
    }
}

/// Runs idem's `consumer` until its handler ran the drain's count.
async fn run_idem<I: Inbox, H: Handler<I::Tx> + 'static>(
    consumer: Consumer<I, H>,
    progress: &Progress,
    window: &mut Window,
) -> Result<usize, BoxError> {
    let mut subscriptions = 0;
    consumer
        .run(progress.reached.notified(), |_| {
            subscriptions += 1;
            window.start();
        })
        .await?;
    if subscriptions != 1 {
        return Err(format!("the consumer subscribed {subscriptions} times, not once").into());
    }
    Ok(progress.count())
}

/// A bare lapin consumer: up to `--concurrency` messages at once, each
/// parsed, applied in its transaction and acknowledged after the commit;
/// cancels and closes once it acknowledged `count`.
async fn bare<T: BareTransaction>(
    transaction: T,
    options: &Options,
    queue: &str,
    count: usize,
    window: &mut Window,
) -> Result<usize, BoxError> {
    let connection =
        lapin::Connection::connect(&options.amqp, ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    channel
        .basic_qos(options.prefetch, BasicQosOptions::default())
        .await?;
    let tag = format!("bare-{}", uuid::Uuid::new_v4().simple());
    let mut deliveries = channel
        .basic_consume(
            queue.into(),
            tag.as_str().into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    window.start();
    let concurrency = options.drain.concurrency.max(1);
    let mut running: JoinSet<Result<(), BoxError>> = JoinSet::new();
    let mut acked = 0;
    while acked < count {
        tokio::select! {
            biased;
            Some(joined) = running.join_next() => {
                joined??;
                acked += 1;
            }
            delivery = deliveries.next(), if running.len() < concurrency => {
                let delivery = delivery.ok_or("the subscription ended")??;
                let transaction = transaction.clone();
                running.spawn(async move {
                    let payment: Payment = serde_json::from_slice(&delivery.data)?;
                    transaction.run(&payment).await?;
                    delivery.acker.ack(BasicAckOptions::default()).await?;
                    Ok(())
                });
            }
        }
    }
    channel
        .basic_cancel(tag.as_str().into(), BasicCancelOptions::default())
        .await?;
    channel.close(200, "bye".into()).await?;
    connection.close(200, "bye".into()).await?;
    Ok(acked)
}

/// Declares `queue` as idem's consumer does, and publishes `count` payments
/// to it, each with its own `message_id`.
async fn publish(options: &Options, queue: &str, count: usize) -> Result<(), BoxError> {
    let (connection, channel) = open(options).await?;
    Topology::new(queue).declare(&channel).await?;
    let publisher = Publisher::connect(&options.amqp).await?;
    futures_util::stream::iter(0..count)
        .map(|n| {
            let id = uuid::Uuid::now_v7().to_string();
            let message = Message::new(payment_body(&id, n, options.drain.accounts.max(1))).id(id);
            let publisher = &publisher;
            async move { publisher.publish(queue, &message).await.map(drop) }
        })
        .buffer_unordered(PUBLISHING)
        .try_collect::<()>()
        .await?;
    publisher.close().await;
    channel.close(200, "bye".into()).await?;
    connection.close(200, "bye".into()).await?;
    Ok(())
}

/// Checks that `queues` are empty (nothing was left unacknowledged), then
/// deletes them and their dead-letter queues.
async fn clean_up(options: &Options, queues: &[&str]) -> Result<(), BoxError> {
    let (connection, channel) = open(options).await?;
    let ready = idem_rabbitmq::ready(&channel, queues[0]).await?;
    if ready != 0 {
        return Err(format!("{ready} messages left in the queue after the drain").into());
    }
    for queue in queues {
        delete_queue(&channel, queue).await?;
    }
    channel.close(200, "bye".into()).await?;
    connection.close(200, "bye".into()).await?;
    Ok(())
}

/// Deletes `queue` and the dead-letter queues its [`Topology`] declared.
pub(crate) async fn delete_queue(channel: &Channel, queue: &str) -> Result<(), BoxError> {
    let topology = Topology::new(queue);
    for name in [
        queue.to_owned(),
        topology.dead_letter_hop(),
        topology.dead_letter_queue(),
    ] {
        channel
            .queue_delete(name.as_str().into(), QueueDeleteOptions::default())
            .await?;
    }
    Ok(())
}

async fn open(options: &Options) -> Result<(lapin::Connection, Channel), BoxError> {
    let connection =
        lapin::Connection::connect(&options.amqp, ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    Ok((connection, channel))
}

/// A payment as a payment service would publish it (about 330 bytes of
/// JSON): its id, the account, the amount in cents, and the details a
/// consumer reads past.
pub(crate) fn payment_body(id: &str, n: usize, accounts: usize) -> String {
    serde_json::json!({
        "payment_id": id,
        "account_id": format!("acc-{:05}", n.wrapping_mul(7_919) % accounts),
        "amount": 100 + n.wrapping_mul(37) % 99_900,
        "currency": "EUR",
        "reference": format!("invoice INV-{n:08}"),
        "created_at": "2025-06-01T12:00:00.000Z",
        "method": {"type": "card", "brand": "visa", "last4": "4242", "exp": "12/28"},
        "customer": {"id": format!("cus_{:08x}", n.wrapping_mul(2_654_435_761) & 0xffff_ffff), "country": "FR"},
        "metadata": {"order_id": format!("ord_{n}"), "channel": "web"},
    })
    .to_string()
}

/// The port of a `postgres://user@host:port/db` URL.
pub(crate) fn port_of(url: &str) -> Option<u16> {
    let authority = url.split_once("://")?.1.split('/').next()?;
    let host = authority
        .rsplit_once('@')
        .map_or(authority, |(_, host)| host);
    host.rsplit_once(':')?.1.parse().ok()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_postgres_url_gives_its_port() {
        assert_eq!(
            port_of("postgres://postgres@127.0.0.1:5433/consumer"),
            Some(5433)
        );
        assert_eq!(port_of("postgres://127.0.0.1/consumer"), None);
    }

    #[test]
    fn payments_parse_and_spread_over_the_accounts() {
        let id = uuid::Uuid::now_v7().to_string();
        let body = payment_body(&id, 7, 1_000);
        let payment: Payment = serde_json::from_str(&body).unwrap();
        assert_eq!(payment.payment_id, id);
        assert_eq!(payment.account_id, "acc-00433");
        assert!(payment.amount > 0);
        assert!((250..450).contains(&body.len()), "{} bytes", body.len());
    }
}

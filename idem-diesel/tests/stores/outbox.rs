//! The transactional outbox (`PgOutbox`, `SqliteOutbox`) and its relay, with
//! a publisher in memory: staging commits or rolls back with the caller's
//! transaction, each event is published with its id, per key in order (two
//! relays at once on PostgreSQL), again after a relay dropped mid-batch,
//! parked without blocking other keys, retried after a failure, deleted by
//! the cleanup job once sent and past the retention, and (feature `metrics`)
//! counted.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use diesel::sql_types::{BigInt, Text};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, TransactionManager};
use idem_core::consume::{
    Attempt, ConsumerPolicy, Decision, HandlerError, HandlerFuture, Message, Protocol, handler,
};
use idem_core::outbox::{Event, Publish, PublishError, PublishFuture};
use idem_core::retry::Backoff;
use idem_core::{Begin, Engine, Fingerprint, IdempotencyKey, Policy, Scope, StoredResponse};
use idem_diesel::{
    AsyncSqliteConnection, PgOutbox, PgTransaction, Relay, SetupError, SqliteInbox, SqliteOutbox,
    SweepReport,
};

use crate::{Databases, TestFn};
use idem_testkit::fault::{Fault, Proxy};

pub(crate) const TESTS: &[(&str, TestFn)] = &[
    (
        "outbox::postgres_a_relay_starts_only_on_a_verified_table",
        |d| Box::pin(a_relay_starts_only_on_a_verified_table(d, Kind::Postgres)),
    ),
    (
        "outbox::sqlite_a_relay_starts_only_on_a_verified_table",
        |d| Box::pin(a_relay_starts_only_on_a_verified_table(d, Kind::Sqlite)),
    ),
    (
        "outbox::postgres_a_rolled_back_transaction_stages_nothing",
        |d| Box::pin(a_rolled_back_transaction_stages_nothing(d, Kind::Postgres)),
    ),
    (
        "outbox::sqlite_a_rolled_back_transaction_stages_nothing",
        |d| Box::pin(a_rolled_back_transaction_stages_nothing(d, Kind::Sqlite)),
    ),
    (
        "outbox::postgres_a_committed_event_is_published_with_its_id_as_message_id",
        |d| {
            Box::pin(a_committed_event_is_published_with_its_id(
                d,
                Kind::Postgres,
            ))
        },
    ),
    (
        "outbox::sqlite_a_committed_event_is_published_with_its_id_as_message_id",
        |d| Box::pin(a_committed_event_is_published_with_its_id(d, Kind::Sqlite)),
    ),
    (
        "outbox::postgres_two_relays_publish_each_event_once_in_order_per_key",
        |d| Box::pin(postgres_two_relays_publish_each_event_once_in_order_per_key(d)),
    ),
    (
        "outbox::postgres_a_relay_keeps_its_batches_in_flight_in_order_per_key",
        |d| Box::pin(a_relay_keeps_its_batches_in_flight(d, Kind::Postgres)),
    ),
    ("outbox::sqlite_a_relay_keeps_one_batch_in_flight", |d| {
        Box::pin(a_relay_keeps_its_batches_in_flight(d, Kind::Sqlite))
    }),
    ("outbox::sqlite_a_relay_keeps_the_order_of_each_key", |d| {
        Box::pin(sqlite_a_relay_keeps_the_order_of_each_key(d))
    }),
    (
        "outbox::postgres_a_relay_dropped_mid_batch_publishes_again_after_restart",
        |d| Box::pin(a_relay_dropped_mid_batch_publishes_again(d, Kind::Postgres)),
    ),
    (
        "outbox::sqlite_a_relay_dropped_mid_batch_publishes_again_after_restart",
        |d| Box::pin(a_relay_dropped_mid_batch_publishes_again(d, Kind::Sqlite)),
    ),
    (
        "outbox::postgres_a_batch_is_the_earliest_events_whose_turn_it_is",
        |d| {
            Box::pin(a_batch_is_the_earliest_events_whose_turn_it_is(
                d,
                Kind::Postgres,
            ))
        },
    ),
    (
        "outbox::sqlite_a_batch_is_the_earliest_events_whose_turn_it_is",
        |d| {
            Box::pin(a_batch_is_the_earliest_events_whose_turn_it_is(
                d,
                Kind::Sqlite,
            ))
        },
    ),
    ("outbox::postgres_a_parked_event_blocks_no_other_key", |d| {
        Box::pin(a_parked_event_blocks_no_other_key(d, Kind::Postgres))
    }),
    ("outbox::sqlite_a_parked_event_blocks_no_other_key", |d| {
        Box::pin(a_parked_event_blocks_no_other_key(d, Kind::Sqlite))
    }),
    (
        "outbox::postgres_a_failed_event_is_retried_and_its_key_waits_for_it",
        |d| {
            Box::pin(a_failed_event_is_retried_and_its_key_waits(
                d,
                Kind::Postgres,
            ))
        },
    ),
    (
        "outbox::sqlite_a_failed_event_is_retried_and_its_key_waits_for_it",
        |d| Box::pin(a_failed_event_is_retried_and_its_key_waits(d, Kind::Sqlite)),
    ),
    (
        "outbox::postgres_cleanup_deletes_sent_events_past_the_retention",
        |d| {
            Box::pin(cleanup_deletes_sent_events_past_the_retention(
                d,
                Kind::Postgres,
            ))
        },
    ),
    (
        "outbox::sqlite_cleanup_deletes_sent_events_past_the_retention",
        |d| {
            Box::pin(cleanup_deletes_sent_events_past_the_retention(
                d,
                Kind::Sqlite,
            ))
        },
    ),
    (
        "outbox::postgres_a_commit_wakes_a_waiting_relay_before_its_poll",
        |d| Box::pin(a_commit_wakes_a_waiting_relay(d, Kind::Postgres)),
    ),
    (
        "outbox::sqlite_a_commit_wakes_a_waiting_relay_before_its_poll",
        |d| Box::pin(a_commit_wakes_a_waiting_relay(d, Kind::Sqlite)),
    ),
    (
        "outbox::sqlite_a_relay_stops_when_told_while_looking_again_after_a_wake",
        |d| Box::pin(sqlite_a_relay_stops_when_told_while_looking_again_after_a_wake(d)),
    ),
    (
        "outbox::postgres_an_unconfirmed_publish_is_retried_after_the_publish_timeout",
        |d| Box::pin(an_unconfirmed_publish_is_retried(d, Kind::Postgres)),
    ),
    (
        "outbox::sqlite_an_unconfirmed_publish_is_retried_after_the_publish_timeout",
        |d| Box::pin(an_unconfirmed_publish_is_retried(d, Kind::Sqlite)),
    ),
    (
        "outbox::postgres_a_stage_is_one_statement_and_a_relay_batch_four",
        |d| Box::pin(postgres_a_stage_is_one_statement_and_a_relay_batch_four(d)),
    ),
    (
        "outbox::postgres_an_event_staged_in_transactional_mode_commits_with_the_record",
        |d| Box::pin(postgres_an_event_staged_in_transactional_mode_commits_with_the_record(d)),
    ),
    (
        "outbox::sqlite_an_event_staged_in_an_inbox_handler_commits_with_the_message",
        |d| Box::pin(sqlite_an_event_staged_in_an_inbox_handler_commits_with_the_message(d)),
    ),
    (
        "outbox::postgres_a_stop_while_settling_on_a_silent_database_ends_after_its_grace",
        |d| Box::pin(postgres_a_stop_while_settling_on_a_silent_database(d)),
    ),
    #[cfg(feature = "metrics")]
    ("outbox::postgres_the_relay_records_its_metrics", |d| {
        Box::pin(the_relay_records_its_metrics(d, Kind::Postgres))
    }),
    #[cfg(feature = "metrics")]
    ("outbox::sqlite_the_relay_records_its_metrics", |d| {
        Box::pin(the_relay_records_its_metrics(d, Kind::Sqlite))
    }),
];

/// A relay told to stop while its batch settles on a database that stopped
/// answering (behind a proxy holding every byte): it stops after its grace,
/// the batch neither counted nor marked sent; its connections reset, the
/// database holds the event unsent, for the next relay.
async fn postgres_a_stop_while_settling_on_a_silent_database(databases: Arc<Databases>) {
    /// Publishes, then silences the database before the batch settles.
    struct Silencing(Arc<Proxy>, Arc<AtomicUsize>);
    impl Publish for Silencing {
        fn publish<'a>(&'a self, _event: &'a Event) -> PublishFuture<'a> {
            Box::pin(async move {
                self.0.set(Fault::Stall);
                self.1.fetch_add(1, Ordering::SeqCst);
                Ok(())
            })
        }
    }
    let url = databases.fresh_postgres().await;
    let (head, name) = url.rsplit_once('/').expect("a database name");
    let port: u16 = head
        .rsplit_once(':')
        .and_then(|(_, port)| port.parse().ok())
        .expect("a port");
    let proxy = Arc::new(Proxy::postgres(([127, 0, 0, 1], port).into()).expect("a proxy"));
    let proxied = PgOutbox::connect(&format!("postgres://postgres@{}/{name}", proxy.addr()))
        .await
        .expect("connect through the proxy");
    proxied.migrate().await.expect("migrate");
    let db = Db::Postgres(proxied);
    db.stage(&[event("acc_1", "1")], true).await;
    let Db::Postgres(outbox) = &db else {
        unreachable!()
    };
    let published = Arc::new(AtomicUsize::new(0));
    let relay = outbox
        .relay(Silencing(Arc::clone(&proxy), Arc::clone(&published)))
        .expect("migrated");
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let task = tokio::spawn(relay.run(async move {
        let mut stopped = stopped;
        let _ = stopped.wait_for(|stop| *stop).await;
    }));
    while AtomicUsize::load(&published, Ordering::SeqCst) == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    stop.send(true).unwrap();
    let relayed = tokio::time::timeout(Duration::from_secs(30), task)
        .await
        .expect("the relay stopped within 30 s on a silent database")
        .unwrap();
    assert_eq!((relayed.published, relayed.parked), (0, 0));
    proxy.set(Fault::Reset);
    let direct = PgOutbox::connect(&url).await.expect("connect");
    let backlog = direct.backlog().await.expect("the backlog");
    assert_eq!(backlog.unsent, 1, "{backlog:?}");
}

#[derive(Clone, Copy, Debug)]
enum Kind {
    Postgres,
    Sqlite,
}

/// One outbox, on either database, as the tests drive it.
#[derive(Clone)]
enum Db {
    Postgres(PgOutbox),
    Sqlite(SqliteOutbox),
}

impl Db {
    async fn fresh(databases: &Arc<Databases>, kind: Kind, retention: Duration) -> Self {
        let db = match kind {
            Kind::Postgres => {
                let url = databases.fresh_postgres().await;
                Db::Postgres(
                    PgOutbox::builder()
                        .retention(retention)
                        .max_connections(8)
                        .connect(&url)
                        .await
                        .expect("connect"),
                )
            }
            Kind::Sqlite => Db::Sqlite(
                SqliteOutbox::builder()
                    .retention(retention)
                    .connect(&databases.fresh_sqlite_url())
                    .await
                    .expect("connect"),
            ),
        };
        match &db {
            Db::Postgres(outbox) => outbox.migrate().await.expect("migrate"),
            Db::Sqlite(outbox) => outbox.migrate().await.expect("migrate"),
        }
        // Twice: the migration is idempotent.
        match &db {
            Db::Postgres(outbox) => outbox.migrate().await.expect("migrate again"),
            Db::Sqlite(outbox) => outbox.migrate().await.expect("migrate again"),
        }
        db
    }

    /// Stages `events` in one transaction of the test's own, with a write of
    /// its own beside them, then commits it or rolls it back.
    async fn stage(&self, events: &[Event], commit: bool) {
        match self {
            Db::Postgres(outbox) => {
                let mut pooled = outbox.pool().get().await.expect("a connection");
                let connection: &mut AsyncPgConnection = &mut pooled;
                <AsyncPgConnection as AsyncConnection>::TransactionManager::begin_transaction(
                    connection,
                )
                .await
                .expect("BEGIN");
                diesel::sql_query(
                    "CREATE TABLE IF NOT EXISTS effects (id bigserial PRIMARY KEY, what text)",
                )
                .execute(connection)
                .await
                .expect("the effects table");
                for event in events {
                    // The effect and the stage, pipelined: sent together.
                    let shared: &AsyncPgConnection = connection;
                    let mut for_effect = shared;
                    let (effect, staged) = tokio::join!(
                        diesel::sql_query("INSERT INTO effects (what) VALUES ($1)")
                            .bind::<Text, _>(event.key())
                            .execute(&mut for_effect),
                        outbox.stage(shared, event),
                    );
                    effect.expect("the effect");
                    staged.expect("stage");
                }
                if commit {
                    <AsyncPgConnection as AsyncConnection>::TransactionManager::commit_transaction(
                        connection,
                    )
                    .await
                    .expect("COMMIT");
                } else {
                    <AsyncPgConnection as AsyncConnection>::TransactionManager::rollback_transaction(
                        connection,
                    )
                    .await
                    .expect("ROLLBACK");
                }
            }
            Db::Sqlite(outbox) => {
                let mut pooled = outbox.pool().get().await.expect("a connection");
                let connection: &mut AsyncSqliteConnection = &mut pooled;
                <AsyncSqliteConnection as AsyncConnection>::TransactionManager::begin_transaction(
                    connection,
                )
                .await
                .expect("BEGIN");
                diesel::sql_query(
                    "CREATE TABLE IF NOT EXISTS effects (id INTEGER PRIMARY KEY, what TEXT)",
                )
                .execute(connection)
                .await
                .expect("the effects table");
                for event in events {
                    diesel::sql_query("INSERT INTO effects (what) VALUES (?1)")
                        .bind::<Text, _>(event.key())
                        .execute(connection)
                        .await
                        .expect("the effect");
                    outbox.stage(connection, event).await.expect("stage");
                }
                if commit {
                    <AsyncSqliteConnection as AsyncConnection>::TransactionManager::commit_transaction(
                        connection,
                    )
                    .await
                    .expect("COMMIT");
                } else {
                    <AsyncSqliteConnection as AsyncConnection>::TransactionManager::rollback_transaction(
                        connection,
                    )
                    .await
                    .expect("ROLLBACK");
                }
            }
        }
    }

    fn relay(&self, publisher: Recorder) -> Relay<Recorder> {
        let relay = match self {
            Db::Postgres(outbox) => outbox.relay(publisher),
            Db::Sqlite(outbox) => outbox.relay(publisher),
        };
        relay
            .expect("migrated")
            .poll_interval(Duration::from_millis(50))
            .backoff(Backoff::new(
                Duration::from_millis(20),
                Duration::from_millis(100),
            ))
    }

    async fn backlog(&self) -> idem_diesel::Backlog {
        match self {
            Db::Postgres(outbox) => outbox.backlog().await,
            Db::Sqlite(outbox) => outbox.backlog().await,
        }
        .expect("backlog")
    }

    async fn parked(&self) -> Vec<idem_diesel::ParkedEvent> {
        match self {
            Db::Postgres(outbox) => outbox.parked().await,
            Db::Sqlite(outbox) => outbox.parked().await,
        }
        .expect("parked")
    }

    async fn effects(&self) -> i64 {
        #[derive(diesel::QueryableByName)]
        struct N {
            #[diesel(sql_type = BigInt)]
            n: i64,
        }
        let sql = "SELECT count(*) AS n FROM effects";
        match self {
            Db::Postgres(outbox) => {
                let mut c = outbox.pool().get().await.expect("a connection");
                diesel::sql_query(sql).get_result::<N>(&mut *c).await
            }
            Db::Sqlite(outbox) => {
                let mut c = outbox.pool().get().await.expect("a connection");
                diesel::sql_query(sql).get_result::<N>(&mut *c).await
            }
        }
        .map(|row| row.n)
        .unwrap_or(0)
    }

    /// Runs relays until nothing is unsent.
    async fn drain(&self, relay: &Relay<Recorder>) {
        let started = Instant::now();
        loop {
            relay.run_once().await.expect("a batch");
            if self.backlog().await.unsent == 0 {
                return;
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "the outbox did not drain: {:?}",
                self.backlog().await
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// A broker in memory: records what it took, refuses or fails on demand,
/// and can stop answering after a number of events (a relay that hangs
/// mid-batch).
#[derive(Clone, Default)]
struct Recorder {
    published: Arc<Mutex<Vec<Event>>>,
    /// Payloads refused for good.
    refuse: Arc<Mutex<HashSet<String>>>,
    /// Payloads failing this many more times.
    failures: Arc<Mutex<HashMap<String, u32>>>,
    /// Stop answering once this many were published.
    hang_after: Option<usize>,
    /// Publish attempts, failed ones included.
    attempts: Arc<AtomicUsize>,
    /// A pause before each publish, so that relays overlap.
    pause: Duration,
    /// Publishes under way, and the most there were at once.
    publishing: Arc<AtomicUsize>,
    most_at_once: Arc<AtomicUsize>,
}

impl Publish for Recorder {
    fn publish<'a>(&'a self, event: &'a Event) -> PublishFuture<'a> {
        Box::pin(async move {
            self.attempts.fetch_add(1, Ordering::SeqCst);
            let now = self.publishing.fetch_add(1, Ordering::SeqCst) + 1;
            self.most_at_once.fetch_max(now, Ordering::SeqCst);
            if !self.pause.is_zero() {
                tokio::time::sleep(self.pause).await;
            }
            self.publishing.fetch_sub(1, Ordering::SeqCst);
            let payload = String::from_utf8_lossy(event.payload()).into_owned();
            if self.refuse.lock().unwrap().contains(&payload) {
                return Err(PublishError::Refused("too large".to_owned()));
            }
            if let Some(left) = self.failures.lock().unwrap().get_mut(&payload)
                && *left > 0
            {
                *left -= 1;
                return Err(PublishError::unavailable("the broker is down"));
            }
            if let Some(limit) = self.hang_after
                && self.published.lock().unwrap().len() >= limit
            {
                std::future::pending::<()>().await;
            }
            self.published.lock().unwrap().push(event.clone());
            Ok(())
        })
    }
}

impl Recorder {
    fn published(&self) -> Vec<Event> {
        self.published.lock().unwrap().clone()
    }

    fn payloads(&self) -> Vec<String> {
        self.published()
            .iter()
            .map(|event| String::from_utf8_lossy(event.payload()).into_owned())
            .collect()
    }
}

fn event(key: &str, payload: &str) -> Event {
    Event::new("payments", key, payload.to_owned())
}

async fn a_rolled_back_transaction_stages_nothing(databases: Arc<Databases>, kind: Kind) {
    let db = Db::fresh(&databases, kind, Duration::from_secs(3600)).await;
    db.stage(&[event("acc_1", "1"), event("acc_2", "2")], false)
        .await;
    assert_eq!(db.backlog().await.unsent, 0);
    assert_eq!(db.effects().await, 0);
    let recorder = Recorder::default();
    let relay = db.relay(recorder.clone());
    assert_eq!(relay.run_once().await.unwrap().published, 0);
    assert!(recorder.published().is_empty());
}

async fn a_committed_event_is_published_with_its_id(databases: Arc<Databases>, kind: Kind) {
    let db = Db::fresh(&databases, kind, Duration::from_secs(3600)).await;
    let staged = event("acc_1", r#"{"account_id":"acc_1","amount":5}"#)
        .header("content-type", "application/json");
    db.stage(std::slice::from_ref(&staged), true).await;
    let backlog = db.backlog().await;
    assert_eq!((backlog.unsent, backlog.parked), (1, 0));
    assert!(backlog.oldest_unsent.is_some());
    assert_eq!(db.effects().await, 1);
    let recorder = Recorder::default();
    let relay = db.relay(recorder.clone());
    let relayed = relay.run_once().await.unwrap();
    assert_eq!(relayed.published, 1);
    assert_eq!(recorder.published(), vec![staged.clone()]);
    assert_eq!(recorder.published()[0].id(), staged.id());
    // Marked sent: a second look publishes nothing.
    assert_eq!(relay.run_once().await.unwrap().published, 0);
    assert_eq!(recorder.published().len(), 1);
    let backlog = db.backlog().await;
    assert_eq!((backlog.unsent, backlog.oldest_unsent), (0, None));
}

/// 10 keys × 20 events, staged in order, drained by two relays at once whose
/// publishes take a moment: every event once, each key's in staged order.
async fn postgres_two_relays_publish_each_event_once_in_order_per_key(databases: Arc<Databases>) {
    let db = Db::fresh(&databases, Kind::Postgres, Duration::from_secs(3600)).await;
    let mut events = Vec::new();
    for n in 0..20 {
        for key in 0..10 {
            events.push(event(&format!("acc_{key}"), &format!("{key}:{n}")));
        }
    }
    for chunk in events.chunks(25) {
        db.stage(chunk, true).await;
    }
    let recorder = Recorder {
        pause: Duration::from_millis(2),
        ..Recorder::default()
    };
    let relays: Vec<_> = (0..2)
        .map(|_| db.relay(recorder.clone()).batch_size(7))
        .collect();
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let tasks: Vec<_> = relays
        .into_iter()
        .map(|relay| {
            let mut stopped = stopped.clone();
            tokio::spawn(relay.run(async move {
                let _ = stopped.wait_for(|stop| *stop).await;
            }))
        })
        .collect();
    let started = Instant::now();
    while db.backlog().await.unsent > 0 {
        assert!(started.elapsed() < Duration::from_secs(60), "not drained");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.send(true).unwrap();
    let mut by_relay = Vec::new();
    for task in tasks {
        by_relay.push(task.await.unwrap().published);
    }
    assert_eq!(by_relay.iter().sum::<u64>(), 200, "{by_relay:?}");
    assert!(
        by_relay.iter().all(|&n| n > 0),
        "both relays took part: {by_relay:?}"
    );
    let published = recorder.published();
    let ids: HashSet<_> = published.iter().map(Event::id).collect();
    assert_eq!((published.len(), ids.len()), (200, 200));
    assert_in_order_per_key(&recorder.payloads());
}

/// One relay with batches of one event and two batches in flight: on
/// PostgreSQL two publishes overlap (never more), every event is published
/// once, each key's in staged order; on SQLite, whose one writer takes one
/// batch at a time, the relay keeps one in flight.
async fn a_relay_keeps_its_batches_in_flight(databases: Arc<Databases>, kind: Kind) {
    let db = Db::fresh(&databases, kind, Duration::from_secs(3600)).await;
    let mut events = Vec::new();
    for n in 0..6 {
        for key in 0..5 {
            events.push(event(&format!("acc_{key}"), &format!("{key}:{n}")));
        }
    }
    db.stage(&events, true).await;
    let recorder = Recorder {
        pause: Duration::from_millis(20),
        ..Recorder::default()
    };
    let relay = db
        .relay(recorder.clone())
        .batch_size(1)
        .batches_in_flight(2);
    let (stop, mut stopped) = tokio::sync::watch::channel(false);
    let task = tokio::spawn(relay.run(async move {
        let _ = stopped.wait_for(|stop| *stop).await;
    }));
    let started = Instant::now();
    while db.backlog().await.unsent > 0 {
        assert!(started.elapsed() < Duration::from_secs(60), "not drained");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.send(true).unwrap();
    assert_eq!(task.await.unwrap().published, 30);
    let expected = match kind {
        Kind::Postgres => 2,
        Kind::Sqlite => 1,
    };
    assert_eq!(
        AtomicUsize::load(&recorder.most_at_once, Ordering::SeqCst),
        expected
    );
    let published = recorder.published();
    let ids: HashSet<_> = published.iter().map(Event::id).collect();
    assert_eq!((published.len(), ids.len()), (30, 30));
    assert_in_order_per_key(&recorder.payloads());
}

/// Each key's payloads (`key:n`) appear with `n` increasing by one.
fn assert_in_order_per_key(payloads: &[String]) {
    let mut next: HashMap<&str, u32> = HashMap::new();
    for payload in payloads {
        let (key, n) = payload.split_once(':').unwrap();
        let n: u32 = n.parse().unwrap();
        let expected = next.entry(key).or_insert(0);
        assert_eq!(n, *expected, "key {key} out of order in {payloads:?}");
        *expected += 1;
    }
}

/// Events staged with `stage_blocking` (on diesel's synchronous connection)
/// leave in order per key.
async fn sqlite_a_relay_keeps_the_order_of_each_key(databases: Arc<Databases>) {
    let db = Db::fresh(&databases, Kind::Sqlite, Duration::from_secs(3600)).await;
    let mut events = Vec::new();
    for n in 0..10 {
        for key in 0..5 {
            events.push(event(&format!("acc_{key}"), &format!("{key}:{n}")));
        }
    }
    // Staged from a blocking thread, in an immediate transaction of its own.
    let Db::Sqlite(outbox) = &db else {
        unreachable!()
    };
    let staging = outbox.clone();
    let mut pooled = outbox.pool().get().await.unwrap();
    pooled
        .spawn_blocking(move |c| {
            c.immediate_transaction(|c| {
                for event in &events {
                    staging.stage_blocking(c, event)?;
                }
                Ok::<_, diesel::result::Error>(())
            })
        })
        .await
        .unwrap();
    drop(pooled);
    let recorder = Recorder::default();
    let relay = db.relay(recorder.clone()).batch_size(7);
    db.drain(&relay).await;
    assert_eq!(recorder.published().len(), 50);
    assert_in_order_per_key(&recorder.payloads());
}

/// A relay that hangs after 3 publishes is dropped mid-batch (a crash): a new
/// relay publishes every event, the first 3 again, with the same ids.
async fn a_relay_dropped_mid_batch_publishes_again(databases: Arc<Databases>, kind: Kind) {
    let db = Db::fresh(&databases, kind, Duration::from_secs(3600)).await;
    let events: Vec<_> = (0..6)
        .map(|n| event(&format!("k{n}"), &format!("{n}")))
        .collect();
    db.stage(&events, true).await;
    let hanging = Recorder {
        hang_after: Some(3),
        ..Recorder::default()
    };
    let relay = db.relay(hanging.clone()).batch_size(10);
    let task = tokio::spawn(relay.run(std::future::pending()));
    let started = Instant::now();
    while hanging.published().len() < 3 {
        assert!(started.elapsed() < Duration::from_secs(10), "no publish");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    task.abort();
    let _ = task.await;
    let first = hanging.published();
    assert_eq!(first.len(), 3);
    let recorder = Recorder::default();
    let relay = db.relay(recorder.clone());
    db.drain(&relay).await;
    let again = recorder.published();
    assert_eq!(again.len(), 6, "every event, the first three again");
    let ids: HashSet<_> = again.iter().map(Event::id).collect();
    assert_eq!(ids, events.iter().map(Event::id).collect::<HashSet<_>>());
    for event in &first {
        assert!(ids.contains(&event.id()), "republished with the same id");
    }
}

/// An event refused for good is parked with its reason; the other keys, and
/// the events behind it in its own key, go on.
async fn a_parked_event_blocks_no_other_key(databases: Arc<Databases>, kind: Kind) {
    let db = Db::fresh(&databases, kind, Duration::from_secs(3600)).await;
    let refused = event("acc_1", "huge");
    db.stage(
        &[
            refused.clone(),
            event("acc_2", "acc_2:0"),
            event("acc_1", "acc_1:after"),
        ],
        true,
    )
    .await;
    let recorder = Recorder::default();
    recorder.refuse.lock().unwrap().insert("huge".to_owned());
    let relay = db.relay(recorder.clone());
    db.drain(&relay).await;
    assert_eq!(relay.report().parked, 1);
    let mut payloads = recorder.payloads();
    payloads.sort();
    assert_eq!(payloads, vec!["acc_1:after", "acc_2:0"]);
    let parked = db.parked().await;
    assert_eq!(parked.len(), 1);
    assert_eq!(
        (parked[0].id, parked[0].reason.as_str(), parked[0].attempts),
        (refused.id(), "too large", 1)
    );
    let backlog = db.backlog().await;
    assert_eq!((backlog.unsent, backlog.parked), (0, 1));
}

/// A batch is the earliest events whose turn it is, with the events behind
/// them in their keys: when the heads alone fill it, no event past the last
/// head (the bound PostgreSQL's statement reads each key to); when one key
/// holds the backlog, that key's earliest events.
async fn a_batch_is_the_earliest_events_whose_turn_it_is(databases: Arc<Databases>, kind: Kind) {
    let db = Db::fresh(&databases, kind, Duration::from_secs(3600)).await;
    let staged = [
        ("acc_1", "acc_1:0"),
        ("acc_2", "acc_2:0"),
        ("acc_1", "acc_1:1"),
        ("acc_3", "acc_3:0"),
        ("acc_1", "acc_1:2"),
        ("acc_2", "acc_2:1"),
        ("acc_4", "acc_4:0"),
    ];
    let events: Vec<_> = staged
        .iter()
        .map(|(key, payload)| event(key, payload))
        .collect();
    db.stage(&events, true).await;
    let recorder = Recorder::default();
    let relay = db.relay(recorder.clone()).batch_size(3);
    let mut batches = Vec::new();
    while batches.len() < 5 {
        let before = recorder.payloads().len();
        let relayed = relay.run_once().await.unwrap();
        if relayed.published == 0 {
            break;
        }
        let mut batch = recorder.payloads()[before..].to_vec();
        batch.sort();
        batches.push(batch);
    }
    assert_eq!(
        batches,
        vec![
            vec!["acc_1:0", "acc_1:1", "acc_2:0"],
            vec!["acc_1:2", "acc_2:1", "acc_3:0"],
            vec!["acc_4:0"],
        ]
    );
    assert_in_order_per_key(&recorder.payloads());

    let db = Db::fresh(&databases, kind, Duration::from_secs(3600)).await;
    let mut events: Vec<_> = (0..5)
        .map(|n| event("acc_1", &format!("acc_1:{n}")))
        .collect();
    events.push(event("acc_2", "acc_2:0"));
    db.stage(&events, true).await;
    let recorder = Recorder::default();
    let relay = db.relay(recorder.clone()).batch_size(3);
    assert_eq!(relay.run_once().await.unwrap().published, 3);
    assert_eq!(recorder.payloads(), vec!["acc_1:0", "acc_1:1", "acc_1:2"]);
}

/// An event the broker did not take is tried again after a backoff, and the
/// event behind it in its key waits for it; other keys do not.
async fn a_failed_event_is_retried_and_its_key_waits(databases: Arc<Databases>, kind: Kind) {
    let db = Db::fresh(&databases, kind, Duration::from_secs(3600)).await;
    db.stage(
        &[
            event("acc_1", "acc_1:0"),
            event("acc_1", "acc_1:1"),
            event("acc_2", "acc_2:0"),
        ],
        true,
    )
    .await;
    let recorder = Recorder::default();
    recorder
        .failures
        .lock()
        .unwrap()
        .insert("acc_1:0".to_owned(), 2);
    let relay = db.relay(recorder.clone());
    let first = relay.run_once().await.unwrap();
    assert_eq!((first.published, first.retried), (1, 1));
    assert_eq!(recorder.payloads(), vec!["acc_2:0"]);
    db.drain(&relay).await;
    assert_eq!(relay.report().retried, 2);
    assert_eq!(recorder.payloads(), vec!["acc_2:0", "acc_1:0", "acc_1:1"]);
}

async fn cleanup_deletes_sent_events_past_the_retention(databases: Arc<Databases>, kind: Kind) {
    // A retention long enough that the first sweep certainly comes within it
    // on a loaded machine, short enough to wait out.
    let db = Db::fresh(&databases, kind, Duration::from_secs(2)).await;
    db.stage(
        &[event("a", "sent"), event("b", "huge"), event("c", "later")],
        true,
    )
    .await;
    let recorder = Recorder::default();
    recorder.refuse.lock().unwrap().insert("huge".to_owned());
    recorder
        .failures
        .lock()
        .unwrap()
        .insert("later".to_owned(), 1_000);
    let relay = db.relay(recorder.clone());
    relay.run_once().await.unwrap();
    let sweep = |db: Db| async move {
        let report = match db {
            Db::Postgres(outbox) => outbox.cleanup().sweep().await,
            Db::Sqlite(outbox) => outbox.cleanup().sweep().await,
        };
        match report {
            SweepReport::Swept(sweep) => sweep.deleted,
            other => panic!("the sweep did not run: {other:?}"),
        }
    };
    // Within the retention: nothing goes.
    assert_eq!(sweep(db.clone()).await, 0);
    tokio::time::sleep(Duration::from_millis(2100)).await;
    assert_eq!(sweep(db.clone()).await, 1);
    let backlog = db.backlog().await;
    assert_eq!(
        (backlog.unsent, backlog.parked),
        (1, 1),
        "unsent and parked stay"
    );
}

/// A relay refuses to start on an outbox whose table nobody verified in
/// this process, naming the fix; `check_schema` names a missing table, and
/// passes once it is migrated; a second outbox on the migrated database
/// starts after `check_schema`, a third with the builder's
/// `skip_schema_check`.
async fn a_relay_starts_only_on_a_verified_table(databases: Arc<Databases>, kind: Kind) {
    async fn open(url: &str, kind: Kind, skip: bool) -> Db {
        match kind {
            Kind::Postgres => {
                let builder = PgOutbox::builder();
                let builder = if skip {
                    builder.skip_schema_check()
                } else {
                    builder
                };
                Db::Postgres(builder.connect(url).await.expect("connect"))
            }
            Kind::Sqlite => {
                let builder = SqliteOutbox::builder();
                let builder = if skip {
                    builder.skip_schema_check()
                } else {
                    builder
                };
                Db::Sqlite(builder.connect(url).await.expect("connect"))
            }
        }
    }
    async fn check(db: &Db) -> Result<(), SetupError> {
        match db {
            Db::Postgres(outbox) => outbox.check_schema().await,
            Db::Sqlite(outbox) => outbox.check_schema().await,
        }
    }
    fn relay(db: &Db) -> Result<(), String> {
        let relay = match db {
            Db::Postgres(outbox) => outbox.relay(Recorder::default()).map(drop),
            Db::Sqlite(outbox) => outbox.relay(Recorder::default()).map(drop),
        };
        relay.map_err(|not_ready| not_ready.to_string())
    }
    let url = match kind {
        Kind::Postgres => databases.fresh_postgres().await,
        Kind::Sqlite => databases.fresh_sqlite_url(),
    };
    let db = open(&url, kind, false).await;
    let refused = relay(&db).expect_err("not verified");
    assert!(
        refused.contains("idem_outbox") && refused.contains("outbox.migrate()"),
        "{refused}"
    );
    match check(&db).await {
        Err(SetupError::OutboxSchema { missing }) => assert_eq!(missing, ["idem_outbox"]),
        other => panic!("a missing table: {other:?}"),
    }
    assert!(relay(&db).is_err(), "a failed check passes nothing");
    match &db {
        Db::Postgres(outbox) => outbox.migrate().await.expect("migrate"),
        Db::Sqlite(outbox) => outbox.migrate().await.expect("migrate"),
    }
    assert_eq!(relay(&db), Ok(()));
    let checked = open(&url, kind, false).await;
    assert!(relay(&checked).is_err());
    check(&checked).await.expect("the migrated table passes");
    assert_eq!(relay(&checked), Ok(()));
    assert_eq!(relay(&open(&url, kind, true).await), Ok(()));
}

/// A relay waiting with a long poll interval publishes a committed event
/// within a fraction of it: woken by `NOTIFY` (PostgreSQL) or by the stage
/// (SQLite).
async fn a_commit_wakes_a_waiting_relay(databases: Arc<Databases>, kind: Kind) {
    let db = Db::fresh(&databases, kind, Duration::from_secs(3600)).await;
    let recorder = Recorder::default();
    let relay = db
        .relay(recorder.clone())
        .poll_interval(Duration::from_secs(30));
    let task = tokio::spawn(relay.run(std::future::pending()));
    match &db {
        // Once its LISTEN is in place, an event committed after it can only
        // reach the relay by NOTIFY (or the 30 s poll).
        Db::Postgres(outbox) => listening(outbox).await,
        // The stage's wake-up is kept until the relay waits for it: there is
        // nothing to wait for. (A relay that has not looked yet finds the
        // event by its first look, which proves less, not something false.)
        Db::Sqlite(_) => {}
    }
    let started = Instant::now();
    db.stage(&[event("acc_1", "woken")], true).await;
    while recorder.published().is_empty() {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the relay was not woken by the commit"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    task.abort();
    let _ = task.await;
}

/// Waits (bounded) until a backend of the outbox's database is listening:
/// the relay's `LISTEN` is in place.
async fn listening(outbox: &PgOutbox) {
    #[derive(diesel::QueryableByName)]
    struct Listeners {
        #[diesel(sql_type = BigInt)]
        n: i64,
    }
    let started = Instant::now();
    loop {
        let mut connection = outbox.pool().get().await.expect("a connection");
        let listeners = diesel::sql_query(
            "SELECT count(*) AS n FROM pg_stat_activity \
             WHERE datname = current_database() AND query LIKE 'LISTEN %'",
        )
        .get_result::<Listeners>(&mut *connection)
        .await
        .expect("pg_stat_activity");
        if listeners.n > 0 {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the relay did not LISTEN within 10 s"
        );
        drop(connection);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A transactional-mode handler stages its event on the execution's
/// transaction: it commits with the record, and a dropped execution (rolled
/// back) leaves none.
async fn postgres_an_event_staged_in_transactional_mode_commits_with_the_record(
    databases: Arc<Databases>,
) {
    let store = crate::postgres::fresh_store(&databases).await;
    let outbox = PgOutbox::new(store.pool().clone());
    outbox.migrate().await.unwrap();
    let transactional = store.transactional();
    let engine = Engine::new(transactional.clone(), Policy::required());
    let db = Db::Postgres(outbox.clone());
    for (name, commit) in [("order-1", true), ("order-2", false)] {
        let key = IdempotencyKey::new(name).unwrap();
        let Begin::Execute(execution) = engine
            .begin(Scope::new("alice"), key, Fingerprint::from_bytes([1; 32]))
            .await
        else {
            panic!("a new key executes");
        };
        let context = Arc::clone(execution.context().expect("transactional"));
        let transaction = context
            .downcast::<PgTransaction>()
            .expect("a PgTransaction");
        let response = execution
            .run(async {
                let connection = transaction.connection().await.expect("open");
                outbox
                    .stage(&connection, &event("acc_1", name))
                    .await
                    .expect("stage");
                StoredResponse::new(201, vec![], "charged")
            })
            .await;
        if commit {
            let answer = execution.settle(&response).await.answer(response);
            assert_eq!(answer.status, 201);
        } else {
            drop(execution);
        }
    }
    let started = Instant::now();
    while transactional.open_transactions() > 0 && started.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let recorder = Recorder::default();
    db.drain(&db.relay(recorder.clone())).await;
    assert_eq!(recorder.payloads(), vec!["order-1"]);
}

/// A `SqliteInbox` handler stages its event on the inbox's transaction: it
/// commits with the message's inbox row, and a failing handler stages none.
async fn sqlite_an_event_staged_in_an_inbox_handler_commits_with_the_message(
    databases: Arc<Databases>,
) {
    let outbox = SqliteOutbox::connect(&databases.fresh_sqlite_url())
        .await
        .unwrap();
    outbox.migrate().await.unwrap();
    let inbox = SqliteInbox::new(outbox.pool().clone());
    inbox.migrate().await.unwrap();
    let protocol = Protocol::new("balances", inbox, ConsumerPolicy::new().max_attempts(1));
    let staging = outbox.clone();
    let apply = handler(
        move |attempt: Attempt<'_>, tx: &mut AsyncSqliteConnection| -> HandlerFuture<'_> {
            let outbox = staging.clone();
            Box::pin(async move {
                let body = std::str::from_utf8(attempt.body()).unwrap().to_owned();
                outbox.stage(tx, &event("acc_1", &body)).await?;
                if body == "fails" {
                    return Err(HandlerError::permanent(std::io::Error::other("no")));
                }
                Ok(())
            })
        },
    );
    let processed = protocol
        .decide(&Message::new("applied").id("m-1"), &apply)
        .await;
    assert!(matches!(processed, Decision::Ack(_)), "{processed:?}");
    let failed = protocol
        .decide(&Message::new("fails").id("m-2"), &apply)
        .await;
    assert!(!matches!(failed, Decision::Ack(_)), "{failed:?}");
    let db = Db::Sqlite(outbox);
    let recorder = Recorder::default();
    db.drain(&db.relay(recorder.clone())).await;
    assert_eq!(recorder.payloads(), vec!["applied"]);
}

/// A stage that rolls back still wakes the SQLite relay, which then looks
/// again for a while; told to stop meanwhile, it stops at once.
async fn sqlite_a_relay_stops_when_told_while_looking_again_after_a_wake(
    databases: Arc<Databases>,
) {
    let db = Db::fresh(&databases, Kind::Sqlite, Duration::from_secs(3600)).await;
    let relay = db
        .relay(Recorder::default())
        .poll_interval(Duration::from_secs(30));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(relay.run(async move {
        let _ = stopped.await;
    }));
    tokio::time::sleep(Duration::from_millis(100)).await;
    db.stage(&[event("acc_1", "rolled back")], false).await;
    tokio::time::sleep(Duration::from_millis(30)).await;
    stop.send(()).unwrap();
    let relayed = tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .expect("the relay stopped")
        .expect("the relay ended cleanly");
    assert_eq!(relayed.published, 0);
}

/// What reaches the server, statement by statement (their first words): a
/// stage is one statement; a relay batch is `BEGIN` with the take, then the
/// settlement with `COMMIT` (each pair sent together); an empty look is
/// `BEGIN` with the take, then `ROLLBACK`.
async fn postgres_a_stage_is_one_statement_and_a_relay_batch_four(databases: Arc<Databases>) {
    use diesel::connection::InstrumentationEvent;
    use diesel_async::pooled_connection::{
        AsyncDieselConnectionManager, ManagerConfig, RecyclingMethod,
    };

    let url = databases.fresh_postgres().await;
    let sent: Arc<Mutex<Vec<String>>> = Arc::default();
    let mut config = ManagerConfig::<AsyncPgConnection>::default();
    config.recycling_method = RecyclingMethod::Fast;
    let seen = Arc::clone(&sent);
    config.custom_setup = Box::new(move |url| {
        let seen = Arc::clone(&seen);
        Box::pin(async move {
            let mut connection = AsyncPgConnection::establish(url).await?;
            connection.set_instrumentation(move |event: InstrumentationEvent<'_>| {
                if let InstrumentationEvent::StartQuery { query, .. } = event {
                    // The statement's first words, never its binds.
                    let text = query.to_string();
                    let words: Vec<&str> = text
                        .split_whitespace()
                        .take_while(|word| *word != "--")
                        .take(2)
                        .collect();
                    seen.lock().unwrap().push(words.join(" "));
                }
            });
            Ok(connection)
        })
    });
    let pool: idem_diesel::PgPool = bb8::Pool::builder()
        .max_size(1)
        .build(AsyncDieselConnectionManager::new_with_config(url, config))
        .await
        .expect("a pool");
    let outbox = PgOutbox::new(pool);
    outbox.migrate().await.expect("migrate");
    {
        let mut connection = outbox.pool().get().await.unwrap();
        sent.lock().unwrap().clear();
        outbox
            .stage(&connection, &event("acc_1", "1"))
            .await
            .unwrap();
        let staged = std::mem::take(&mut *sent.lock().unwrap());
        assert_eq!(staged, vec!["WITH staged"], "a stage: one statement");
        diesel::sql_query("SELECT 1")
            .execute(&mut *connection)
            .await
            .unwrap();
    }
    let relay = Db::Postgres(outbox.clone()).relay(Recorder::default());
    sent.lock().unwrap().clear();
    // With `metrics`, each look ends with the oldest unsent event's age.
    let gauge: &[&str] = if cfg!(feature = "metrics") {
        &["SELECT ("]
    } else {
        &[]
    };
    assert_eq!(relay.run_once().await.unwrap().published, 1);
    let batch = std::mem::take(&mut *sent.lock().unwrap());
    assert_eq!(
        batch,
        [
            &["BEGIN; SET", "WITH heads", "WITH sent", "COMMIT"][..],
            gauge
        ]
        .concat(),
        "a batch: BEGIN with the take, the settlement with COMMIT"
    );
    assert_eq!(relay.run_once().await.unwrap().published, 0);
    let empty = std::mem::take(&mut *sent.lock().unwrap());
    assert_eq!(
        empty,
        [&["BEGIN; SET", "WITH heads", "ROLLBACK"][..], gauge].concat(),
        "an empty look"
    );
}

/// A broker that never confirms (a publisher that hangs) holds the batch no
/// longer than the publish timeout: the event is counted as not taken, and a
/// later relay publishes it.
async fn an_unconfirmed_publish_is_retried(databases: Arc<Databases>, kind: Kind) {
    let db = Db::fresh(&databases, kind, Duration::from_secs(3600)).await;
    db.stage(&[event("acc_1", "stalled")], true).await;
    let stalled = Recorder {
        hang_after: Some(0),
        ..Recorder::default()
    };
    let relay = db
        .relay(stalled.clone())
        .publish_timeout(Duration::from_millis(200));
    let relayed = tokio::time::timeout(Duration::from_secs(10), relay.run_once())
        .await
        .expect("the batch ended at the publish timeout")
        .unwrap();
    assert_eq!((relayed.published, relayed.retried), (0, 1));
    assert_eq!(db.backlog().await.unsent, 1);
    let recorder = Recorder::default();
    db.drain(&db.relay(recorder.clone())).await;
    assert_eq!(recorder.payloads(), vec!["stalled"]);
}

/// With `metrics`, the outbox counts what it staged, published, retried and
/// parked, and the relay sets the oldest unsent event's age at each look: read
/// back from a recorder installed on this thread for the test's duration.
#[cfg(feature = "metrics")]
async fn the_relay_records_its_metrics(databases: Arc<Databases>, kind: Kind) {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};

    fn value(snapshotter: &Snapshotter, name: &str) -> Option<DebugValue> {
        snapshotter
            .snapshot()
            .into_vec()
            .into_iter()
            .find(|(key, ..)| key.key().name() == name)
            .map(|(.., value)| value)
    }
    fn counter(snapshotter: &Snapshotter, name: &str) -> u64 {
        match value(snapshotter, name) {
            Some(DebugValue::Counter(n)) => n,
            None => 0,
            other => panic!("{name}: not a counter: {other:?}"),
        }
    }
    fn gauge(snapshotter: &Snapshotter, name: &str) -> f64 {
        match value(snapshotter, name) {
            Some(DebugValue::Gauge(value)) => value.into_inner(),
            other => panic!("{name}: not set as a gauge: {other:?}"),
        }
    }

    let db = Db::fresh(&databases, kind, Duration::from_secs(3600)).await;
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let handle = tokio::runtime::Handle::current();
    // The recorder is this thread's: the code under test runs on it.
    tokio::task::block_in_place(|| {
        metrics::with_local_recorder(&recorder, || {
            handle.block_on(async {
                db.stage(
                    &[
                        event("acc_1", "1"),
                        event("acc_2", "2"),
                        event("acc_3", "3"),
                    ],
                    true,
                )
                .await;
                assert_eq!(counter(&snapshotter, "idem_outbox_staged_total"), 3);
                // One fails once: it waits, unsent, and the gauge says since when.
                let recorder = Recorder::default();
                recorder.failures.lock().unwrap().insert("2".to_owned(), 1);
                let relay = db.relay(recorder.clone());
                assert_eq!(relay.run_once().await.expect("a batch").published, 2);
                assert!(gauge(&snapshotter, "idem_outbox_oldest_unsent_seconds") > 0.0);
                db.drain(&relay).await;
                assert_eq!(counter(&snapshotter, "idem_outbox_published_total"), 3);
                assert_eq!(counter(&snapshotter, "idem_outbox_retried_total"), 1);
                assert_eq!(counter(&snapshotter, "idem_outbox_parked_total"), 0);
                assert_eq!(
                    gauge(&snapshotter, "idem_outbox_oldest_unsent_seconds"),
                    0.0,
                    "nothing unsent"
                );

                db.stage(&[event("acc_4", "huge")], true).await;
                recorder.refuse.lock().unwrap().insert("huge".to_owned());
                db.drain(&relay).await;
                assert_eq!(counter(&snapshotter, "idem_outbox_staged_total"), 4);
                assert_eq!(counter(&snapshotter, "idem_outbox_parked_total"), 1);
                assert_eq!(counter(&snapshotter, "idem_outbox_published_total"), 3);
                assert_eq!(
                    gauge(&snapshotter, "idem_outbox_oldest_unsent_seconds"),
                    0.0,
                    "a parked event is not unsent"
                );
            });
        });
    });
}

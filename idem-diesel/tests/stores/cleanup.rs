//! The cleanup job: batches, exact counts, one runner at a time, errors,
//! shutdown.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use diesel_async::{AsyncConnection, AsyncPgConnection, SimpleAsyncConnection};
use idem_diesel::{PgStore, Sweep, SweepReport};
use tokio::sync::{mpsc, watch};

use crate::{Databases, TestFn, error_chain, postgres, sqlite};

pub(crate) const TESTS: &[(&str, TestFn)] = &[
    (
        "cleanup::postgres_sweep_deletes_100k_expired_and_keeps_live",
        |d| Box::pin(postgres_sweep_deletes_100k_expired_and_keeps_live(d)),
    ),
    (
        "cleanup::sqlite_sweep_deletes_100k_expired_and_keeps_live",
        |d| Box::pin(sqlite_sweep_deletes_100k_expired_and_keeps_live(d)),
    ),
    (
        "cleanup::postgres_runners_started_together_sweep_once",
        |d| Box::pin(postgres_runners_started_together_sweep_once(d)),
    ),
    ("cleanup::runner_keeps_going_after_an_error", |d| {
        Box::pin(runner_keeps_going_after_an_error(d))
    }),
];

/// A report, comparable.
#[derive(Debug, PartialEq, Eq)]
enum Seen {
    Swept(Sweep),
    Skipped,
    Failed { swept: Sweep, error: String },
}

fn seen(report: &SweepReport) -> Seen {
    match report {
        SweepReport::Swept(sweep) => Seen::Swept(*sweep),
        SweepReport::Skipped => Seen::Skipped,
        SweepReport::Failed { swept, error } => Seen::Failed {
            swept: *swept,
            error: error_chain(error),
        },
        other => panic!("an unknown report: {other:?}"),
    }
}

/// 99 990 completed records past retention and 10 abandoned claims past lease
/// and retention (expired); 1 000 completed within retention, 10 claims past
/// retention under a live lease, 10 lapsed claims within retention (live).
const POSTGRES_RECORDS: &str = "
    INSERT INTO idem_records
        (scope, key, fingerprint, state, status, headers, body, replayable, expires_at, created_at)
    SELECT 'bulk', 'expired-' || n, decode(repeat('00', 32), 'hex'), 'completed',
           200, '\\x', '\\x78', true, now() - interval '1 hour', now() - interval '2 hours'
    FROM generate_series(1, 99990) AS n;
    INSERT INTO idem_records (scope, key, fingerprint, state, owner, lease_until, expires_at)
    SELECT 'bulk', 'abandoned-' || n, decode(repeat('00', 32), 'hex'), 'in_progress',
           gen_random_uuid(), now() - interval '1 minute', now() - interval '1 minute'
    FROM generate_series(1, 10) AS n;
    INSERT INTO idem_records
        (scope, key, fingerprint, state, status, headers, body, replayable, expires_at)
    SELECT 'bulk', 'live-' || n, decode(repeat('00', 32), 'hex'), 'completed',
           200, '\\x', '\\x78', true, now() + interval '1 hour'
    FROM generate_series(1, 1000) AS n;
    INSERT INTO idem_records (scope, key, fingerprint, state, owner, lease_until, expires_at)
    SELECT 'bulk', 'running-' || n, decode(repeat('00', 32), 'hex'), 'in_progress',
           gen_random_uuid(), now() + interval '1 hour', now() - interval '1 minute'
    FROM generate_series(1, 10) AS n;
    INSERT INTO idem_records (scope, key, fingerprint, state, owner, lease_until, expires_at)
    SELECT 'bulk', 'lapsed-' || n, decode(repeat('00', 32), 'hex'), 'in_progress',
           gen_random_uuid(), now() - interval '1 minute', now() + interval '1 hour'
    FROM generate_series(1, 10) AS n;
";

/// What is left of `POSTGRES_RECORDS` / `sqlite_records` after a sweep.
const LIVE: i64 = 1_020;

async fn postgres_sweep_deletes_100k_expired_and_keeps_live(databases: Arc<Databases>) {
    let store = postgres::fresh_store(&databases).await;
    postgres::execute(&store, POSTGRES_RECORDS).await;
    let report = store
        .cleanup()
        .batch_size(5_000)
        .pause(Duration::ZERO)
        .sweep()
        .await;
    assert_eq!(
        seen(&report),
        Seen::Swept(Sweep {
            deleted: 100_000,
            batches: 21
        }),
        "20 full batches, then a short one ends the sweep"
    );
    assert_eq!(
        postgres::count(&store, "SELECT count(*) AS n FROM idem_records").await,
        LIVE
    );
    assert_eq!(
        postgres::count(
            &store,
            "SELECT count(*) AS n FROM idem_records
             WHERE key LIKE 'expired-%' OR key LIKE 'abandoned-%'"
        )
        .await,
        0
    );
    let again = store.cleanup().sweep().await;
    assert_eq!(
        seen(&again),
        Seen::Swept(Sweep {
            deleted: 0,
            batches: 1
        })
    );
}

/// The same records as `POSTGRES_RECORDS`, for SQLite (times in µs since the
/// epoch), each set inserted by one statement over a recursive CTE.
fn sqlite_records() -> String {
    let now = i64::try_from(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_micros(),
    )
    .unwrap();
    let hour = 3_600_000_000_i64;
    let (past, future) = (now - hour, now + hour);
    let set = |count: u32, name: &str, state: &str, lease: &str, expires: i64| {
        let (owner, response) = if state == "completed" {
            ("NULL", "200, x'', x'78', 1")
        } else {
            ("randomblob(16)", "NULL, NULL, NULL, NULL")
        };
        format!(
            "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < {count})
             INSERT INTO idem_records (scope, key, fingerprint, state, owner, lease_until,
                                       status, headers, body, replayable, expires_at, created_at)
             SELECT 'bulk', '{name}-' || i, zeroblob(32), '{state}', {owner}, {lease},
                    {response}, {expires}, {past}
             FROM n;\n"
        )
    };
    [
        set(99_990, "expired", "completed", "NULL", past),
        set(10, "abandoned", "in_progress", &past.to_string(), past),
        set(1_000, "live", "completed", "NULL", future),
        set(10, "running", "in_progress", &future.to_string(), past),
        set(10, "lapsed", "in_progress", &past.to_string(), future),
    ]
    .concat()
}

async fn sqlite_sweep_deletes_100k_expired_and_keeps_live(databases: Arc<Databases>) {
    let store = sqlite::fresh_store(&databases).await;
    sqlite::execute(&store, &sqlite_records()).await;
    assert_eq!(
        sqlite::count(&store, "SELECT count(*) AS n FROM idem_records").await,
        100_000 + LIVE
    );
    let report = store
        .cleanup()
        .batch_size(5_000)
        .pause(Duration::ZERO)
        .sweep()
        .await;
    assert_eq!(
        seen(&report),
        Seen::Swept(Sweep {
            deleted: 100_000,
            batches: 21
        })
    );
    assert_eq!(
        sqlite::count(&store, "SELECT count(*) AS n FROM idem_records").await,
        LIVE
    );
    assert_eq!(
        sqlite::count(
            &store,
            "SELECT count(*) AS n FROM idem_records
             WHERE key LIKE 'expired-%' OR key LIKE 'abandoned-%'"
        )
        .await,
        0
    );
}

async fn postgres_runners_started_together_sweep_once(databases: Arc<Databases>) {
    let url = databases.fresh_postgres().await;
    let first = PgStore::connect(&url).await.expect("connect");
    first.migrate().await.expect("migrate");
    let second = PgStore::connect(&url).await.expect("connect");
    postgres::execute(&first, POSTGRES_RECORDS).await;

    // Hold one expired record: whichever runner takes the sweep lock cannot
    // finish its sweep (nor let go of the lock) until this transaction ends, so
    // the other runner's attempt certainly meets a held lock.
    let mut blocker = AsyncPgConnection::establish(&url).await.expect("connect");
    blocker
        .batch_execute("BEGIN; SELECT 1 FROM idem_records WHERE key = 'expired-500' FOR UPDATE;")
        .await
        .expect("lock a record");

    let (reports, mut received) = mpsc::unbounded_channel();
    let (stop, stopped) = watch::channel(false);
    let runners: Vec<_> = [first.clone(), second]
        .into_iter()
        .enumerate()
        .map(|(runner, store)| {
            let reports = reports.clone();
            let mut stopped = stopped.clone();
            let cleanup = store
                .cleanup()
                .batch_size(1_000)
                .pause(Duration::ZERO)
                .interval(Duration::from_secs(3600))
                .on_report(move |report| {
                    let _ = reports.send((runner, seen(report)));
                });
            tokio::spawn(cleanup.run(async move {
                let _ = stopped.wait_for(|stop| *stop).await;
            }))
        })
        .collect();

    let (loser, report) = received.recv().await.expect("a report");
    assert_eq!(
        report,
        Seen::Skipped,
        "while one runner sweeps, the other skips its sweep"
    );
    blocker.batch_execute("ROLLBACK").await.expect("rollback");
    let (winner, report) = received.recv().await.expect("a report");
    assert_ne!(winner, loser);
    assert_eq!(
        report,
        Seen::Swept(Sweep {
            deleted: 100_000,
            batches: 101
        }),
        "the runner holding the lock sweeps everything"
    );

    stop.send(true).expect("runners listen");
    let mut totals = Vec::new();
    for runner in runners {
        totals.push(runner.await.expect("a runner ends"));
    }
    totals.sort_unstable();
    assert_eq!(totals, [0, 100_000], "each runner's total");
    drop(reports);
    assert!(
        received.recv().await.is_none(),
        "exactly two reports: one sweep and one skip"
    );
    assert_eq!(
        postgres::count(&first, "SELECT count(*) AS n FROM idem_records").await,
        LIVE
    );
}

async fn runner_keeps_going_after_an_error(databases: Arc<Databases>) {
    let url = databases.fresh_postgres().await;
    // Not migrated: the first sweeps fail on the missing table.
    let store = PgStore::builder()
        .table("late_table")
        .connect(&url)
        .await
        .expect("connect");
    let (reports, mut received) = mpsc::unbounded_channel();
    let (stop, mut stopped) = watch::channel(false);
    let runner = tokio::spawn(
        store
            .cleanup()
            .interval(Duration::from_millis(20))
            .on_report(move |report| {
                let _ = reports.send(seen(report));
            })
            .run(async move {
                let _ = stopped.wait_for(|stop| *stop).await;
            }),
    );

    match received.recv().await.expect("a report") {
        Seen::Failed { swept, error } => {
            assert_eq!(swept, Sweep::default());
            assert!(
                error.contains("\"late_table\" does not exist"),
                "the report keeps the database's cause: {error}"
            );
        }
        other => panic!("a sweep of a missing table reported {other:?}"),
    }
    // The table and its expired records appear together, so each later sweep
    // sees either nothing (and fails) or all 250.
    postgres::execute(
        &store,
        &format!(
            "BEGIN;
             {}
             INSERT INTO late_table
                 (scope, key, fingerprint, state, status, headers, body, replayable, expires_at)
             SELECT 's', 'k-' || n, decode(repeat('00', 32), 'hex'), 'completed',
                    200, '\\x', '\\x', true, now() - interval '1 second'
             FROM generate_series(1, 250) AS n;
             COMMIT;",
            store.ddl()
        ),
    )
    .await;
    loop {
        match received.recv().await.expect("a report") {
            Seen::Failed { .. } => continue,
            report => {
                assert_eq!(
                    report,
                    Seen::Swept(Sweep {
                        deleted: 250,
                        batches: 1
                    }),
                    "the runner sweeps again after failing"
                );
                break;
            }
        }
    }
    stop.send(true).expect("the runner listens");
    assert_eq!(runner.await.expect("the runner ends"), 250);
}

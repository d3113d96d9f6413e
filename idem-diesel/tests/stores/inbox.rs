//! The consumer inbox on PostgreSQL: duplicates skipped, the consumer's writes
//! and the inbox row committed together, failures counted to the dead letters,
//! re-drives, the dead-letter alert, refused messages without an id, and the
//! cleanup of processed messages.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use diesel::sql_types::{BigInt, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idem_diesel::{DeadLetterAlert, Delivery, Inbox, InboxError, PgStore, Sweep, SweepReport};

use crate::postgres::{count, execute, fresh_store};
use crate::{Databases, TestFn};

pub(crate) const TESTS: &[(&str, TestFn)] = &[
    ("inbox::a_duplicate_delivery_is_skipped", |d| {
        Box::pin(a_duplicate_delivery_is_skipped(d))
    }),
    ("inbox::a_concurrent_duplicate_waits_and_is_skipped", |d| {
        Box::pin(a_concurrent_duplicate_waits_and_is_skipped(d))
    }),
    ("inbox::the_writes_and_the_inbox_row_commit_together", |d| {
        Box::pin(the_writes_and_the_inbox_row_commit_together(d))
    }),
    (
        "inbox::the_last_allowed_attempt_dead_letters_with_every_attempt",
        |d| Box::pin(the_last_allowed_attempt_dead_letters_with_every_attempt(d)),
    ),
    ("inbox::redrive_lets_a_dead_letter_through_again", |d| {
        Box::pin(redrive_lets_a_dead_letter_through_again(d))
    }),
    (
        "inbox::the_alert_fires_once_the_dead_letters_pass_the_threshold",
        |d| Box::pin(the_alert_fires_once_the_dead_letters_pass_the_threshold(d)),
    ),
    ("inbox::a_message_without_an_id_is_refused", |d| {
        Box::pin(a_message_without_an_id_is_refused(d))
    }),
    (
        "inbox::cleanup_deletes_processed_messages_past_retention",
        |d| Box::pin(cleanup_deletes_processed_messages_past_retention(d)),
    ),
];

/// A consumer's failure.
#[derive(Debug, thiserror::Error)]
enum ConsumerError {
    #[error("the provider refused (attempt {0})")]
    Refused(u32),
    #[error("the ledger write failed")]
    Database(#[from] diesel::result::Error),
}

/// A migrated store and inbox on a fresh database, with a `ledger` table.
async fn fresh_inbox(
    databases: &Arc<Databases>,
    inbox: idem_diesel::InboxBuilder,
) -> (PgStore, Inbox) {
    let store = fresh_store(databases).await;
    let inbox = inbox.build(store.pool().clone());
    inbox.migrate().await.expect("migrate the inbox");
    inbox.migrate().await.expect("a second migrate is a no-op");
    execute(
        &store,
        "CREATE TABLE ledger (message_id text NOT NULL, amount bigint NOT NULL)",
    )
    .await;
    (store, inbox)
}

/// The consumer's effect: a ledger row.
async fn write_ledger(
    connection: &mut AsyncPgConnection,
    message_id: &str,
    amount: i64,
) -> Result<(), diesel::result::Error> {
    diesel::sql_query("INSERT INTO ledger (message_id, amount) VALUES ($1, $2)")
        .bind::<Text, _>(message_id)
        .bind::<BigInt, _>(amount)
        .execute(connection)
        .await
        .map(drop)
}

async fn ledger_rows(store: &PgStore) -> i64 {
    count(store, "SELECT count(*) AS n FROM ledger").await
}

async fn inbox_rows(store: &PgStore) -> i64 {
    count(store, "SELECT count(*) AS n FROM idem_inbox").await
}

/// A delivery of `message_id` whose consumer fails with `Refused`.
async fn failing_delivery(
    inbox: &Inbox,
    message_id: &str,
    runs: &AtomicU32,
) -> Result<Delivery<()>, InboxError<ConsumerError>> {
    inbox
        .process_once("ledger", Some(message_id), async |connection| {
            write_ledger(connection, message_id, 1).await?;
            let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
            Err::<(), _>(ConsumerError::Refused(run))
        })
        .await
}

async fn a_duplicate_delivery_is_skipped(databases: Arc<Databases>) {
    let (store, inbox) = fresh_inbox(&databases, Inbox::builder()).await;
    let runs = AtomicU32::new(0);
    let mut outcomes = Vec::new();
    for _ in 0..3 {
        let outcome = inbox
            .process_once("ledger", Some("m-1"), async |connection| {
                runs.fetch_add(1, Ordering::SeqCst);
                write_ledger(connection, "m-1", 10).await?;
                Ok::<_, ConsumerError>(10_i64)
            })
            .await
            .expect("process");
        outcomes.push(outcome);
    }
    assert_eq!(
        outcomes,
        vec![
            Delivery::Processed(10),
            Delivery::Duplicate,
            Delivery::Duplicate
        ]
    );
    assert_eq!(AtomicU32::load(&runs, Ordering::SeqCst), 1);
    assert_eq!(ledger_rows(&store).await, 1);

    // Another consumer of the same message processes it on its own.
    let other = inbox
        .process_once("audit", Some("m-1"), async |_| Ok::<_, ConsumerError>(()))
        .await
        .expect("process");
    assert_eq!(other, Delivery::Processed(()));
    assert_eq!(inbox_rows(&store).await, 2);
}

async fn a_concurrent_duplicate_waits_and_is_skipped(databases: Arc<Databases>) {
    let (store, inbox) = fresh_inbox(&databases, Inbox::builder()).await;
    let (entered, first_entered) = tokio::sync::oneshot::channel::<()>();
    let (finish, finished) = tokio::sync::oneshot::channel::<()>();
    let first = tokio::spawn({
        let inbox = inbox.clone();
        async move {
            inbox
                .process_once("ledger", Some("m-1"), async move |connection| {
                    write_ledger(connection, "m-1", 10).await?;
                    let _ = entered.send(());
                    let _ = finished.await;
                    Ok::<_, ConsumerError>(())
                })
                .await
        }
    });
    first_entered.await.unwrap();
    let second = tokio::spawn({
        let inbox = inbox.clone();
        async move {
            inbox
                .process_once("ledger", Some("m-1"), async |connection| {
                    write_ledger(connection, "m-1", 10).await?;
                    Ok::<_, ConsumerError>(())
                })
                .await
        }
    });
    // The second delivery waits on the first one's uncommitted inbox row.
    loop {
        let waiting = count(
            &store,
            "SELECT count(*) AS n FROM pg_stat_activity
             WHERE datname = current_database() AND wait_event_type = 'Lock'",
        )
        .await;
        if waiting == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(!second.is_finished());
    finish.send(()).unwrap();
    assert_eq!(first.await.unwrap().unwrap(), Delivery::Processed(()));
    assert_eq!(second.await.unwrap().unwrap(), Delivery::Duplicate);
    assert_eq!(ledger_rows(&store).await, 1);
}

async fn the_writes_and_the_inbox_row_commit_together(databases: Arc<Databases>) {
    let (store, inbox) = fresh_inbox(&databases, Inbox::builder()).await;
    let runs = AtomicU32::new(0);
    let failed = failing_delivery(&inbox, "m-1", &runs).await;
    assert!(
        matches!(
            failed,
            Err(InboxError::Failed {
                attempt: 1,
                max_attempts: 5,
                ..
            })
        ),
        "{failed:?}"
    );
    assert_eq!(
        ledger_rows(&store).await,
        0,
        "the failed attempt's write is rolled back"
    );
    assert_eq!(inbox_rows(&store).await, 0, "and so is its inbox row");

    // A write that fails in the database fails the attempt the same way.
    let failed = inbox
        .process_once("ledger", Some("m-1"), async |connection| {
            write_ledger(connection, "m-1", 1).await?;
            diesel::sql_query("INSERT INTO no_such_table VALUES (1)")
                .execute(connection)
                .await?;
            Ok::<_, ConsumerError>(())
        })
        .await;
    assert!(
        matches!(
            failed,
            Err(InboxError::Failed {
                attempt: 2,
                source: ConsumerError::Database(_),
                ..
            })
        ),
        "{failed:?}"
    );
    assert_eq!(
        (ledger_rows(&store).await, inbox_rows(&store).await),
        (0, 0)
    );

    let processed = inbox
        .process_once("ledger", Some("m-1"), async |connection| {
            write_ledger(connection, "m-1", 1).await?;
            Ok::<_, ConsumerError>(())
        })
        .await
        .unwrap();
    assert_eq!(processed, Delivery::Processed(()));
    assert_eq!(
        (ledger_rows(&store).await, inbox_rows(&store).await),
        (1, 1)
    );
    assert_eq!(
        count(&store, "SELECT count(*) AS n FROM idem_inbox_failures").await,
        0,
        "a processed message's failures are forgotten"
    );
}

async fn the_last_allowed_attempt_dead_letters_with_every_attempt(databases: Arc<Databases>) {
    let (store, inbox) = fresh_inbox(&databases, Inbox::builder().max_attempts(3)).await;
    let runs = AtomicU32::new(0);
    let before = SystemTime::now() - Duration::from_secs(5);
    let mut attempts = Vec::new();
    for _ in 0..3 {
        attempts.push(failing_delivery(&inbox, "m-9", &runs).await);
    }
    let after = SystemTime::now() + Duration::from_secs(5);
    assert!(matches!(
        attempts[0],
        Err(InboxError::Failed {
            attempt: 1,
            max_attempts: 3,
            ..
        })
    ));
    assert!(matches!(
        attempts[1],
        Err(InboxError::Failed {
            attempt: 2,
            max_attempts: 3,
            ..
        })
    ));
    assert!(
        matches!(
            attempts[2],
            Err(InboxError::DeadLettered {
                attempts: 3,
                source: ConsumerError::Refused(3)
            })
        ),
        "the third failure dead-letters it: {:?}",
        attempts[2]
    );

    let letters = inbox.dead_letters("ledger").await.unwrap();
    assert_eq!(letters.len(), 1);
    let letter = &letters[0];
    assert_eq!(
        (
            letter.consumer.as_str(),
            letter.message_id.as_str(),
            letter.attempts
        ),
        ("ledger", "m-9", 3)
    );
    assert_eq!(letter.last_error, "the provider refused (attempt 3)");
    assert_eq!(letter.attempted_at.len(), 3, "every attempt's time");
    assert!(
        letter.attempted_at.windows(2).all(|pair| pair[0] < pair[1]),
        "{letter:?}"
    );
    assert!(
        letter
            .attempted_at
            .iter()
            .all(|at| (before..after).contains(at))
    );
    assert!(letter.attempted_at[2] <= letter.dead_at);
    assert_eq!(
        inbox.dead_letter("ledger", "m-9").await.unwrap().as_ref(),
        Some(letter),
        "one message's dead letter, as listed"
    );
    assert_eq!(inbox.dead_letter("ledger", "m-8").await.unwrap(), None);
    assert_eq!(inbox.dead_letter("other", "m-9").await.unwrap(), None);
    assert_eq!(
        count(&store, "SELECT count(*) AS n FROM idem_inbox_failures").await,
        0
    );

    // Deliveries of a dead letter are skipped, never retried by the inbox.
    let skipped = failing_delivery(&inbox, "m-9", &runs).await.unwrap();
    assert_eq!(skipped, Delivery::DeadLetter);
    assert_eq!(
        AtomicU32::load(&runs, Ordering::SeqCst),
        3,
        "the consumer ran exactly 3 times"
    );
    assert_eq!(
        (ledger_rows(&store).await, inbox_rows(&store).await),
        (0, 0)
    );
}

async fn redrive_lets_a_dead_letter_through_again(databases: Arc<Databases>) {
    let (store, inbox) = fresh_inbox(&databases, Inbox::builder().max_attempts(1)).await;
    let runs = AtomicU32::new(0);
    let buried = failing_delivery(&inbox, "m-3", &runs).await;
    assert!(matches!(
        buried,
        Err(InboxError::DeadLettered { attempts: 1, .. })
    ));
    assert_eq!(
        inbox.redrive("ledger", "m-4").await.unwrap(),
        None,
        "not a dead letter"
    );

    let letter = inbox
        .redrive("ledger", "m-3")
        .await
        .unwrap()
        .expect("the dead letter");
    assert_eq!((letter.message_id.as_str(), letter.attempts), ("m-3", 1));
    assert!(inbox.dead_letters("ledger").await.unwrap().is_empty());
    assert_eq!(
        inbox.redrive("ledger", "m-3").await.unwrap(),
        None,
        "re-driven once"
    );

    let processed = inbox
        .process_once("ledger", Some("m-3"), async |connection| {
            write_ledger(connection, "m-3", 3).await?;
            Ok::<_, ConsumerError>(())
        })
        .await
        .unwrap();
    assert_eq!(processed, Delivery::Processed(()));
    assert_eq!(ledger_rows(&store).await, 1);
}

async fn the_alert_fires_once_the_dead_letters_pass_the_threshold(databases: Arc<Databases>) {
    let alerts = Arc::new(Mutex::new(Vec::<DeadLetterAlert>::new()));
    let builder = Inbox::builder()
        .max_attempts(1)
        .dead_letter_threshold(2)
        .on_dead_letter_threshold({
            let alerts = Arc::clone(&alerts);
            move |alert| alerts.lock().unwrap().push(alert.clone())
        });
    let (_store, inbox) = fresh_inbox(&databases, builder).await;
    let runs = AtomicU32::new(0);
    for (message, alerts_after) in [("m-1", 0), ("m-2", 0), ("m-3", 1), ("m-4", 1)] {
        let buried = failing_delivery(&inbox, message, &runs).await;
        assert!(matches!(buried, Err(InboxError::DeadLettered { .. })));
        assert_eq!(
            alerts.lock().unwrap().len(),
            alerts_after,
            "after {message}"
        );
    }
    assert_eq!(
        alerts.lock().unwrap()[0],
        DeadLetterAlert {
            dead_letters: 3,
            threshold: 2,
            consumer: "ledger".to_owned(),
            message_id: "m-3".to_owned(),
        }
    );
    // Re-drives bring the count back under; crossing again raises it again.
    for message in ["m-3", "m-4"] {
        inbox.redrive("ledger", message).await.unwrap();
    }
    for message in ["m-3", "m-4"] {
        let buried = failing_delivery(&inbox, message, &runs).await;
        assert!(matches!(buried, Err(InboxError::DeadLettered { .. })));
    }
    assert_eq!(alerts.lock().unwrap().len(), 2);
}

async fn a_message_without_an_id_is_refused(databases: Arc<Databases>) {
    let (store, inbox) = fresh_inbox(&databases, Inbox::builder()).await;
    let runs = AtomicU32::new(0);
    for id in [None, Some(""), Some("   ")] {
        let refused = inbox
            .process_once("ledger", id, async |connection| {
                runs.fetch_add(1, Ordering::SeqCst);
                write_ledger(connection, "none", 1).await?;
                Ok::<_, ConsumerError>(())
            })
            .await;
        assert!(
            matches!(refused, Err(InboxError::MissingMessageId)),
            "{id:?}: {refused:?}"
        );
    }
    assert_eq!(
        AtomicU32::load(&runs, Ordering::SeqCst),
        0,
        "never processed"
    );
    assert_eq!(
        (ledger_rows(&store).await, inbox_rows(&store).await),
        (0, 0)
    );
    assert_eq!(
        count(&store, "SELECT count(*) AS n FROM idem_inbox_failures").await,
        0
    );
}

async fn cleanup_deletes_processed_messages_past_retention(databases: Arc<Databases>) {
    let (store, inbox) = fresh_inbox(
        &databases,
        Inbox::builder()
            .retention(Duration::from_secs(3600))
            .max_attempts(1),
    )
    .await;
    // 250 processed two hours ago, 5 processed now; 3 abandoned failure counts,
    // 1 recent; 1 dead letter (never swept).
    execute(
        &store,
        "INSERT INTO idem_inbox (consumer, message_id, processed_at)
         SELECT 'ledger', 'old-' || n, now() - interval '2 hours' FROM generate_series(1, 250) AS n;
         INSERT INTO idem_inbox (consumer, message_id)
         SELECT 'ledger', 'new-' || n FROM generate_series(1, 5) AS n;
         INSERT INTO idem_inbox_failures
             (consumer, message_id, attempts, last_error, attempted_at, last_attempt_at)
         SELECT 'ledger', 'gave-up-' || n, 1, 'refused', ARRAY[now() - interval '3 hours'],
                now() - interval '3 hours'
         FROM generate_series(1, 3) AS n;
         INSERT INTO idem_inbox_failures
             (consumer, message_id, attempts, last_error, attempted_at, last_attempt_at)
         VALUES ('ledger', 'retrying', 1, 'refused', ARRAY[now()], now());",
    )
    .await;
    let runs = AtomicU32::new(0);
    let _ = failing_delivery(&inbox, "dead", &runs).await;

    let report = inbox.cleanup().batch_size(100).sweep().await;
    match report {
        SweepReport::Swept(sweep) => assert_eq!(
            sweep,
            Sweep {
                deleted: 253,
                batches: 3
            }
        ),
        other => panic!("{other:?}"),
    }
    assert_eq!(inbox_rows(&store).await, 5);
    assert_eq!(
        count(&store, "SELECT count(*) AS n FROM idem_inbox_failures").await,
        1
    );
    assert_eq!(inbox.dead_letters("ledger").await.unwrap().len(), 1);

    // The store's job sweeps the inbox too, under its lock, in one report.
    execute(
        &store,
        "INSERT INTO idem_inbox (consumer, message_id, processed_at)
         SELECT 'ledger', 'old-again-' || n, now() - interval '2 hours'
         FROM generate_series(1, 7) AS n",
    )
    .await;
    match store.cleanup().also(inbox.clone()).sweep().await {
        SweepReport::Swept(sweep) => assert_eq!(
            sweep,
            Sweep {
                deleted: 7,
                batches: 2
            }
        ),
        other => panic!("{other:?}"),
    }
    assert_eq!(inbox_rows(&store).await, 5);
}

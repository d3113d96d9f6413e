//! The trials besides the crash test: transactional mode's duplicates, a
//! restart, and the routes' answers on PostgreSQL.

use std::sync::Arc;

use payments::Principal;

use crate::Suite;
use crate::database::{Database, OperationRow, Sight};
use crate::server::{Post, Reply, Server};

const BODY: &str = r#"{"amount": 250, "currency": "EUR"}"#;

fn charge<'a>(account_path: &'a str, principal: &'a str, key: &'a str, body: &'a str) -> Post<'a> {
    Post {
        path: account_path,
        principal,
        key: Some(key),
        body,
    }
}

/// The first request's transaction is caught open (the test holds the
/// account's row, so its balance update waits); a duplicate sent then finds
/// the key running, waits (the test sees it poll), and once the first commits
/// gets the committed answer, byte for byte, marked as a replay. One charge.
pub(crate) async fn a_duplicate_during_the_transaction_replays_the_committed_answer(
    suite: Arc<Suite>,
) {
    let url = suite.fresh_database().await;
    let server = Server::start(suite.binary(), &url, 0).await;
    let endpoint = server.endpoint().clone();
    let mut holder = Database::connect(&url).await;
    let mut observer = Database::connect(&url).await;
    let path = "/accounts/acct-dup/charges";

    holder.hold("acct-dup").await;
    let first = {
        let endpoint = endpoint.clone();
        tokio::spawn(async move { endpoint.post(charge(path, "alice", "dup-1", BODY)).await })
    };
    observer.wait_for(Sight::LockWait).await;
    let duplicate = {
        let endpoint = endpoint.clone();
        tokio::spawn(async move { endpoint.post(charge(path, "alice", "dup-1", BODY)).await })
    };
    observer.wait_for(Sight::DuplicateWaiting).await;
    // Neither can have an answer yet: the first cannot commit while the row is held.
    assert!(!first.is_finished() && !duplicate.is_finished());
    holder.release().await;

    let first = first
        .await
        .expect("the first's task")
        .expect("the first's answer");
    let duplicate = duplicate
        .await
        .expect("the duplicate's task")
        .expect("the duplicate's answer");
    assert_eq!((first.status, first.replayed), (201, false), "{first:?}");
    assert_eq!(
        duplicate,
        Reply {
            status: 201,
            replayed: true,
            body: first.body.clone()
        }
    );
    assert_eq!(endpoint.account("acct-dup").await, (250, 1));
    let rows = observer.operations("acct-dup").await;
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0].idempotency_key.as_deref(), Some("dup-1"));

    // Once committed, the same key with another body is a reuse.
    let reused = endpoint
        .post(charge(
            path,
            "alice",
            "dup-1",
            r#"{"amount": 1, "currency": "EUR"}"#,
        ))
        .await
        .expect("an answer");
    assert_eq!(reused.status, 422, "{reused:?}");
    assert_eq!(endpoint.account("acct-dup").await, (250, 1));
    server.kill().await;
}

/// Charges and deposits, a `SIGKILL`, a new server on the same database: the
/// account still shows every amount and operation, and the charge's key
/// replays its answer instead of charging again.
pub(crate) async fn the_ledger_and_the_records_survive_a_restart(suite: Arc<Suite>) {
    let url = suite.fresh_database().await;
    let path = "/accounts/acct-restart/charges";
    let deposits = "/accounts/acct-restart/deposits";

    let server = Server::start(suite.binary(), &url, 0).await;
    let endpoint = server.endpoint().clone();
    let charged = endpoint
        .until_final(charge(path, "alice", "order-1", BODY))
        .await;
    assert_eq!((charged.status, charged.replayed), (201, false));
    let deposited = endpoint
        .until_final(Post {
            path: deposits,
            principal: "alice",
            key: None,
            body: r#"{"amount": 100, "currency": "EUR"}"#,
        })
        .await;
    assert_eq!(deposited.status, 201);
    assert_eq!(endpoint.account("acct-restart").await, (350, 2));
    server.kill().await;

    let server = Server::start(suite.binary(), &url, 0).await;
    let endpoint = server.endpoint().clone();
    assert_eq!(endpoint.account("acct-restart").await, (350, 2));
    let retried = endpoint
        .until_final(charge(path, "alice", "order-1", BODY))
        .await;
    assert_eq!(
        retried,
        Reply {
            status: 201,
            replayed: true,
            body: charged.body
        }
    );
    assert_eq!(endpoint.account("acct-restart").await, (350, 2));
    server.kill().await;
}

/// The routes on PostgreSQL, in transactional mode, answer as on every store:
/// a keyed deposit takes effect once and replays, deposits without a key take
/// effect every time, an invalid body and an overflowing balance are `400`s
/// that apply nothing (and replay), and two principals do not share a key.
pub(crate) async fn deposits_invalid_bodies_overflow_and_principals_on_postgres(suite: Arc<Suite>) {
    let url = suite.fresh_database().await;
    let server = Server::start(suite.binary(), &url, 0).await;
    let endpoint = server.endpoint().clone();
    let mut observer = Database::connect(&url).await;
    let charges = "/accounts/acct-routes/charges";
    let deposits = "/accounts/acct-routes/deposits";

    // A keyed deposit: once.
    let keyed = Post {
        path: deposits,
        principal: "alice",
        key: Some("deposit-1"),
        body: BODY,
    };
    let first = endpoint.until_final(keyed).await;
    let again = endpoint.until_final(keyed).await;
    assert_eq!((first.status, first.replayed), (201, false), "{first:?}");
    assert_eq!(
        again,
        Reply {
            status: 201,
            replayed: true,
            body: first.body
        }
    );
    // Without a key: every delivery.
    let unkeyed = Post { key: None, ..keyed };
    for _ in 0..2 {
        let reply = endpoint.until_final(unkeyed).await;
        assert_eq!((reply.status, reply.replayed), (201, false), "{reply:?}");
    }
    assert_eq!(endpoint.account("acct-routes").await, (750, 3));

    // An invalid body: a 400 that is stored and replayed; nothing applied.
    let invalid = charge(
        charges,
        "alice",
        "bad-1",
        r#"{"amount": 0, "currency": "EUR"}"#,
    );
    for replayed in [false, true] {
        let reply = endpoint.until_final(invalid).await;
        assert_eq!((reply.status, reply.replayed), (400, replayed), "{reply:?}");
        assert!(reply.body.contains("/invalid-request"), "{reply:?}");
    }
    // An overflowing balance: a 400 in the transaction, which commits the
    // record and nothing of the charge.
    let max = format!(r#"{{"amount": {}, "currency": "EUR"}}"#, i64::MAX);
    let overflow = charge(charges, "alice", "huge-1", &max);
    for replayed in [false, true] {
        let reply = endpoint.until_final(overflow).await;
        assert_eq!((reply.status, reply.replayed), (400, replayed), "{reply:?}");
        assert!(reply.body.contains("would overflow"), "{reply:?}");
    }
    assert_eq!(endpoint.account("acct-routes").await, (750, 3));

    // Two principals, one key: two charges.
    let alice = endpoint
        .until_final(charge(charges, "alice", "same", BODY))
        .await;
    let bob = endpoint
        .until_final(charge(charges, "bob", "same", BODY))
        .await;
    assert_eq!((alice.status, bob.status), (201, 201));
    assert!(!alice.replayed && !bob.replayed);
    assert_ne!(alice.body, bob.body);
    assert_eq!(endpoint.account("acct-routes").await, (1250, 5));

    let rows = observer.operations("acct-routes").await;
    let summary: Vec<(&str, Option<&str>, Option<&str>)> = rows
        .iter()
        .map(|row: &OperationRow| {
            (
                row.kind.as_str(),
                row.idempotency_scope.as_deref(),
                row.idempotency_key.as_deref(),
            )
        })
        .collect();
    let mut summary = summary;
    summary.sort();
    // The ledger records the scope: the hash of the token, never the token.
    let (alice, bob) = (Principal::from_token("alice"), Principal::from_token("bob"));
    let mut expected = [
        ("charge", Some(alice.as_str()), Some("same")),
        ("charge", Some(bob.as_str()), Some("same")),
        ("deposit", None, None),
        ("deposit", None, None),
        ("deposit", Some(alice.as_str()), Some("deposit-1")),
    ];
    expected.sort();
    assert_eq!(summary, expected);
    server.kill().await;
}

//! The binary's flags and the routes' answers on the stores that need no
//! server (memory, SQLite): no trial here starts PostgreSQL.

use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};

use crate::Suite;
use crate::server::{Launch, Post, Reply, Scratch, Server, help};

const BODY: &str = r#"{"amount": 100, "currency": "EUR"}"#;
const CHARGES: &str = "/accounts/acct-1/charges";
const DEPOSITS: &str = "/accounts/acct-1/deposits";

/// A charge of `BODY` to `acct-1` as `principal` (empty: none) with `key`.
fn charge<'a>(principal: &'a str, key: Option<&'a str>) -> Post<'a> {
    Post {
        path: CHARGES,
        principal,
        key,
        body: BODY,
    }
}

/// The server on the memory store, with no provider latency.
async fn on_memory(suite: &Suite) -> Server {
    Server::start(suite.binary(), "memory", 0).await
}

/// Sends `post` once; it must be answered.
async fn send(server: &Server, post: Post<'_>) -> Reply {
    server.endpoint().post(post).await.expect("an answer")
}

/// The `type` of a problem answer.
fn problem_type(reply: &Reply) -> String {
    let problem: Value = serde_json::from_str(&reply.body)
        .unwrap_or_else(|error| panic!("a problem as JSON ({error}): {reply:?}"));
    problem["type"].as_str().unwrap_or_default().to_owned()
}

/// Charges `order-1` as `alice`: a fresh `201`.
async fn first_charge(server: &Server) -> Reply {
    let first = send(server, charge("alice", Some("order-1"))).await;
    assert_eq!((first.status, first.replayed), (201, false), "{first:?}");
    first
}

/// Retries `order-1`: `first` replayed, byte for byte, and `acct-1` charged once.
async fn replayed_once(server: &Server, first: Reply) {
    let retry = send(server, charge("alice", Some("order-1"))).await;
    assert_eq!(
        retry,
        Reply {
            replayed: true,
            ..first
        }
    );
    assert_eq!(server.endpoint().account("acct-1").await, (100, 1));
}

/// On `--store memory`, a retried charge replays its answer and charges once,
/// and no database file is written.
pub(crate) async fn the_binary_charges_once_per_key_on_the_memory_store(suite: Arc<Suite>) {
    let scratch = Scratch::new("payments-memory");
    let server = Server::launch(
        suite.binary(),
        Launch {
            dir: Some(scratch.path()),
            ..Launch::new("memory")
        },
    )
    .await;
    let first = first_charge(&server).await;
    replayed_once(&server, first).await;
    server.kill().await;
    assert!(!scratch.path().join("payments.db").exists());
}

/// Without `--store`, the records and the ledger go to `payments.db` in the
/// working directory, and both survive a restart: the retry replays, once.
pub(crate) async fn the_default_sqlite_store_keeps_records_and_ledger_across_a_restart(
    suite: Arc<Suite>,
) {
    let scratch = Scratch::new("payments-sqlite");
    let launch = Launch::default_store_in(scratch.path());
    let server = Server::launch(suite.binary(), launch.clone()).await;
    let first = first_charge(&server).await;
    server.kill().await;
    assert!(scratch.path().join("payments.db").exists());

    let server = Server::launch(suite.binary(), launch).await;
    // The ledger is in the same file: the charge is still there, once.
    assert_eq!(server.endpoint().account("acct-1").await, (100, 1));
    replayed_once(&server, first).await;
    server.kill().await;
}

/// `--help` shows `--retention-secs` and `--cleanup-interval-secs` with their
/// defaults.
pub(crate) async fn the_help_lists_retention_and_cleanup_interval_with_their_defaults(
    suite: Arc<Suite>,
) {
    let help = help(suite.binary()).await;
    let line_of = |flag: &str| {
        let mut lines = help
            .lines()
            .skip_while(|line| !line.trim().starts_with(flag));
        assert!(lines.next().is_some(), "{flag} not in\n{help}");
        lines.next().unwrap_or_default().to_owned()
    };
    assert!(
        line_of("--retention-secs <RETENTION_SECS>").ends_with("[default: 86400]"),
        "{help}"
    );
    assert!(
        line_of("--cleanup-interval-secs <CLEANUP_INTERVAL_SECS>").ends_with("[default: 60]"),
        "{help}"
    );
}

/// With a retention of a second, a charge retried past it (and a sweep of
/// the cleanup job) runs again.
pub(crate) async fn a_charge_retried_after_its_retention_runs_afresh(suite: Arc<Suite>) {
    let scratch = Scratch::new("payments-retention");
    let server = Server::launch(
        suite.binary(),
        Launch::default_store_in(scratch.path())
            .arg("--retention-secs", 1)
            .arg("--cleanup-interval-secs", 1),
    )
    .await;
    first_charge(&server).await;
    let retry = send(&server, charge("alice", Some("order-1"))).await;
    assert_eq!((retry.status, retry.replayed), (201, true), "{retry:?}");
    // Past the retention (and a sweep of the cleanup job), the key is new again.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let later = send(&server, charge("alice", Some("order-1"))).await;
    assert_eq!((later.status, later.replayed), (201, false), "{later:?}");
    assert_eq!(server.endpoint().account("acct-1").await, (200, 2));
    server.kill().await;
}

/// A `--store` no store answers to: the binary exits with an error naming it,
/// and listens nowhere.
pub(crate) async fn the_binary_refuses_an_unknown_store(suite: Arc<Suite>) {
    let scratch = Scratch::new("payments-unknown");
    let output = tokio::process::Command::new(suite.binary())
        .args(["--listen", "127.0.0.1:0", "--store", "mysql://localhost"])
        .env_remove("DATABASE_URL")
        .current_dir(scratch.path())
        .output()
        .await
        .expect("run the binary");
    assert!(!output.status.success(), "{output:?}");
    assert!(output.stdout.is_empty(), "{output:?}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("unknown store \"mysql://localhost\""),
        "{stderr}"
    );
}

/// A charge answers `201` and its receipt: a UUID, the account, the amount,
/// the currency and the new balance, nothing else.
pub(crate) async fn a_charge_answers_its_receipt(suite: Arc<Suite>) {
    let server = on_memory(&suite).await;
    let reply = send(&server, charge("alice", Some("c-1"))).await;
    assert_eq!((reply.status, reply.replayed), (201, false), "{reply:?}");
    let receipt: Value = serde_json::from_str(&reply.body).expect("a receipt as JSON");
    let id = receipt["id"].as_str().expect("an id");
    assert_eq!(id.len(), 36, "a UUID: {id}");
    assert_eq!(
        receipt,
        json!({"id": id, "account_id": "acct-1", "amount": 100, "currency": "EUR", "balance": 100})
    );
    server.kill().await;
}

/// A charge without a key is a `400` `missing-key`; without a bearer token, a
/// `401` `unauthorized`; neither applies anything.
pub(crate) async fn a_charge_needs_a_key_and_a_principal(suite: Arc<Suite>) {
    let server = on_memory(&suite).await;
    let keyless = send(&server, charge("alice", None)).await;
    assert_eq!(
        (keyless.status, problem_type(&keyless).as_str()),
        (400, "https://idem.rs/problems/missing-key"),
        "{keyless:?}"
    );
    let anonymous = send(&server, charge("", Some("c-1"))).await;
    assert_eq!(
        (anonymous.status, problem_type(&anonymous).as_str()),
        (401, "https://idem.rs/problems/unauthorized"),
        "{anonymous:?}"
    );
    assert_eq!(server.endpoint().account("acct-1").await, (0, 0));
    server.kill().await;
}

/// Deposits without a key take effect every time; with one, once.
pub(crate) async fn deposits_without_a_key_take_effect_every_time(suite: Arc<Suite>) {
    let server = on_memory(&suite).await;
    for key in [None, None, None, Some("d-1"), Some("d-1"), Some("d-1")] {
        let deposit = Post {
            path: DEPOSITS,
            principal: "alice",
            key,
            body: BODY,
        };
        let reply = send(&server, deposit).await;
        assert_eq!(reply.status, 201, "{key:?}: {reply:?}");
    }
    assert_eq!(server.endpoint().account("acct-1").await, (400, 4));
    server.kill().await;
}

/// An invalid body is a `400` `invalid-request` problem, stored: the retry
/// replays it. Nothing is applied.
pub(crate) async fn an_invalid_body_is_a_400_problem_and_is_replayed(suite: Arc<Suite>) {
    let server = on_memory(&suite).await;
    let bad = Post {
        body: r#"{"amount": 0, "currency": "EUR"}"#,
        ..charge("alice", Some("bad-1"))
    };
    for replayed in [false, true] {
        let reply = send(&server, bad).await;
        assert_eq!((reply.status, reply.replayed), (400, replayed), "{reply:?}");
        assert_eq!(
            problem_type(&reply),
            "https://idem.rs/problems/invalid-request"
        );
    }
    assert_eq!(server.endpoint().account("acct-1").await, (0, 0));
    server.kill().await;
}

/// Two principals sending one key make two charges.
pub(crate) async fn principals_do_not_share_keys(suite: Arc<Suite>) {
    let server = on_memory(&suite).await;
    let alice = send(&server, charge("alice", Some("same"))).await;
    let bob = send(&server, charge("bob", Some("same"))).await;
    let id = |reply: &Reply| {
        let receipt: Value = serde_json::from_str(&reply.body).expect("a receipt as JSON");
        receipt["id"].clone()
    };
    assert_ne!(id(&alice), id(&bob), "{alice:?} {bob:?}");
    assert_eq!(server.endpoint().account("acct-1").await.0, 200);
    server.kill().await;
}

/// Twenty charges with one key at once, with a provider that takes 200 ms:
/// each is a `201` or a `409`, at least one a `201`, and the account is
/// charged once.
pub(crate) async fn parallel_charges_with_one_key_charge_once(suite: Arc<Suite>) {
    let server = Server::start(suite.binary(), "memory", 200).await;
    let attempts: Vec<_> = (0..20)
        .map(|_| {
            let endpoint = server.endpoint().clone();
            tokio::spawn(async move { endpoint.post(charge("alice", Some("crowd"))).await })
        })
        .collect();
    let mut statuses = Vec::new();
    for attempt in attempts {
        let reply = attempt.await.expect("a task").expect("an answer");
        statuses.push(reply.status);
    }
    assert!(
        statuses.iter().all(|status| matches!(status, 201 | 409)),
        "{statuses:?}"
    );
    assert!(statuses.contains(&201), "{statuses:?}");
    assert_eq!(server.endpoint().account("acct-1").await, (100, 1));
    server.kill().await;
}

//! `--publish` (`docs/contract.md` §11): refused without transactions;
//! on SQLite and PostgreSQL, every charge and deposit applied is published
//! once, with its id as `message_id`, in order per account, and nothing else.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use idem_rabbitmq::lapin::options::BasicGetOptions;
use idem_rabbitmq::lapin::{Connection, ConnectionProperties};
use serde_json::Value;

use crate::Suite;
use crate::server::{Launch, Post, Scratch, Server};

/// `--publish` with the memory store or Redis: exit status 2 and the reason,
/// before anything is opened.
pub(crate) async fn publish_needs_a_store_with_transactions(suite: Arc<Suite>) {
    let scratch = Scratch::new("payments-publish");
    for (store, kind) in [("memory", "memory"), ("redis://127.0.0.1:1", "Redis")] {
        let output = tokio::process::Command::new(suite.binary())
            .args(["--listen", "127.0.0.1:0", "--store", store])
            .args(["--publish", "amqp://guest:secret-pw@127.0.0.1:1/%2f"])
            .env_remove("DATABASE_URL")
            .current_dir(scratch.path())
            .output()
            .await
            .expect("run the binary");
        assert_eq!(output.status.code(), Some(2), "{output:?}");
        assert!(output.stdout.is_empty(), "{output:?}");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            stderr.contains("--publish needs a store with transactions")
                && stderr.contains(&format!("the {kind} store has none")),
            "{stderr}"
        );
        assert!(!stderr.contains("secret-pw"), "{stderr}");
    }
}

/// On SQLite and on PostgreSQL (transactional mode): three charges (one of
/// them replayed), two unkeyed deposits and an invalid body make five
/// events, each published once with a UUID `message_id`, each account's in
/// the order applied; their sums are the API's balances.
pub(crate) async fn every_operation_applied_is_published_once(suite: Arc<Suite>) {
    let scratch = Scratch::new("payments-publish");
    let postgres = suite.fresh_database().await;
    for (n, store) in [scratch.sqlite(), postgres].into_iter().enumerate() {
        let amqp = suite.broker_url().await;
        let queue = format!("payments-publish-{}-{n}", std::process::id());
        let server = Server::launch(
            suite.binary(),
            Launch::new(&store)
                .arg("--publish", &amqp)
                .arg("--publish-to", &queue),
        )
        .await;
        let post = |path: &'static str, key: Option<&'static str>, body: &'static str| Post {
            path,
            principal: "alice",
            key,
            body,
        };
        let charge = r#"{"amount": 100, "currency": "EUR"}"#;
        let small = r#"{"amount": 25, "currency": "EUR"}"#;
        let deposit = r#"{"amount": 10, "currency": "EUR"}"#;
        for (path, key, body, status) in [
            ("/accounts/acc-1/charges", Some("c-1"), charge, 201),
            ("/accounts/acc-1/charges", Some("c-1"), charge, 201),
            ("/accounts/acc-2/charges", Some("c-2"), small, 201),
            ("/accounts/acc-1/charges", Some("c-3"), small, 201),
            ("/accounts/acc-2/deposits", None, deposit, 201),
            ("/accounts/acc-2/deposits", None, deposit, 201),
            (
                "/accounts/acc-2/charges",
                Some("c-4"),
                r#"{"amount": -1}"#,
                400,
            ),
        ] {
            let reply = server.endpoint().until_final(post(path, key, body)).await;
            assert_eq!(reply.status, status, "{path} {key:?}: {reply:?}");
        }
        let events = drain(&amqp, &queue, 5).await;
        let ids: HashSet<&str> = events.iter().map(|(id, _)| id.as_str()).collect();
        assert_eq!(ids.len(), 5, "five distinct ids: {events:?}");
        assert!(
            ids.iter().all(|id| uuid::Uuid::parse_str(id).is_ok()),
            "UUIDs: {events:?}"
        );
        let mut amounts: HashMap<String, Vec<i64>> = HashMap::new();
        for (_, body) in &events {
            let account = body["account_id"].as_str().expect("an account").to_owned();
            assert_eq!(body.as_object().map(|o| o.len()), Some(2), "{body}");
            amounts
                .entry(account)
                .or_default()
                .push(body["amount"].as_i64().expect("an amount"));
        }
        assert_eq!(amounts["acc-1"], [100, 25], "{store}: in order");
        assert_eq!(amounts["acc-2"], [25, 10, 10], "{store}: in order");
        for (account, amounts) in &amounts {
            let (balance, operations) = server.endpoint().account(account).await;
            assert_eq!(
                (balance, operations),
                (amounts.iter().sum::<i64>(), amounts.len() as u64),
                "{store}: {account}"
            );
        }
        server.kill().await;
    }
}

/// Takes `count` messages from `queue` (waiting up to 30 s for them), then
/// checks that no more come within a moment: `(message_id, body)` each.
async fn drain(url: &str, queue: &str, count: usize) -> Vec<(String, Value)> {
    let connection = Connection::connect(url, ConnectionProperties::default())
        .await
        .expect("connect to RabbitMQ");
    let channel = connection.create_channel().await.expect("a channel");
    let mut taken = Vec::new();
    let started = Instant::now();
    let mut quiet_since = None;
    loop {
        let got = channel
            .basic_get(queue.into(), BasicGetOptions { no_ack: true })
            .await
            .expect("basic.get");
        match got {
            Some(message) => {
                let id = message
                    .delivery
                    .properties
                    .message_id()
                    .as_ref()
                    .map(|id| id.as_str().to_owned())
                    .expect("a message_id");
                let body = serde_json::from_slice(&message.delivery.data).expect("a JSON body");
                taken.push((id, body));
                quiet_since = None;
            }
            None if taken.len() >= count => {
                let since = *quiet_since.get_or_insert_with(Instant::now);
                if since.elapsed() > Duration::from_millis(1500) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            None => {
                assert!(
                    started.elapsed() < Duration::from_secs(30),
                    "{} of {count} events published to {queue}",
                    taken.len()
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    let _ = connection.close(200, "drained".into()).await;
    assert_eq!(taken.len(), count, "exactly {count} events: {taken:?}");
    taken
}

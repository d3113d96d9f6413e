//! The payment provider behind charges (`--provider-url`), on every store, and
//! the flags that configure it.

use std::sync::Arc;

use idem_core::{IdempotencyKey, Scope};
use payments::{Principal, forwarded_key};
use payments_provider::Provider;

use crate::Suite;
use crate::server::{Launch, Post, Reply, Scratch, Server, help};

const BODY: &str = r#"{"amount": 250, "currency": "EUR"}"#;

/// The stores a provider trial runs on: memory, a SQLite file in `scratch`, and
/// a fresh PostgreSQL database (transactional).
async fn stores(suite: &Arc<Suite>, scratch: &Scratch) -> [String; 3] {
    [
        "memory".to_owned(),
        scratch.sqlite(),
        suite.fresh_database().await,
    ]
}

/// The `Idempotency-Key` the service forwards for `token`'s `key`.
fn forwarded(token: &str, key: &str) -> String {
    let scope = Scope::from(Principal::from_token(token));
    forwarded_key(&scope, &IdempotencyKey::new(key).expect("a valid key"))
}

fn charge<'a>(principal: &'a str, key: &'a str) -> Post<'a> {
    Post {
        path: "/accounts/acct-provider/charges",
        principal,
        key: Some(key),
        body: BODY,
    }
}

/// A charge calls `POST {URL}/payments` once with the charge as JSON and a
/// forwarded key that is stable for the charge and differs between principals
/// and keys; its replay calls nothing.
pub(crate) async fn a_charge_calls_the_provider_once_with_a_stable_forwarded_key(
    suite: Arc<Suite>,
) {
    let scratch = Scratch::new("payments-provider");
    for store in stores(&suite, &scratch).await {
        let provider = Provider::start().await.expect("a provider");
        let server = Server::launch(
            suite.binary(),
            Launch::new(&store).arg("--provider-url", provider.url()),
        )
        .await;
        let endpoint = server.endpoint();
        let first = endpoint
            .post(charge("alice", "p-1"))
            .await
            .expect("an answer");
        assert_eq!(
            (first.status, first.replayed),
            (201, false),
            "{store}: {first:?}"
        );
        let replay = endpoint
            .post(charge("alice", "p-1"))
            .await
            .expect("an answer");
        assert_eq!(
            replay,
            Reply {
                status: 201,
                replayed: true,
                body: first.body.clone()
            },
            "{store}"
        );
        let bob = endpoint
            .post(charge("bob", "p-1"))
            .await
            .expect("an answer");
        let other = endpoint
            .post(charge("alice", "p-2"))
            .await
            .expect("an answer");
        assert_eq!((bob.status, other.status), (201, 201), "{store}");

        let alice_key = forwarded("alice", "p-1");
        let calls = provider.calls_per_key();
        assert_eq!(
            calls.len(),
            3,
            "{store}: three charges, three keys: {calls:?}"
        );
        for key in [
            alice_key.clone(),
            forwarded("bob", "p-1"),
            forwarded("alice", "p-2"),
        ] {
            assert_eq!(calls.get(&key), Some(&1), "{store}: {key} in {calls:?}");
        }
        let call = &provider.received()[0];
        assert_eq!(call.request_line, "POST /payments", "{store}");
        assert_eq!(call.idempotency_key.as_deref(), Some(alice_key.as_str()));
        assert_eq!(call.content_type.as_deref(), Some("application/json"));
        let body: serde_json::Value = serde_json::from_slice(&call.body).expect("a JSON body");
        assert_eq!(
            body,
            serde_json::json!({"account_id": "acct-provider", "amount": 250, "currency": "EUR"}),
            "{store}"
        );
        assert_eq!(endpoint.account("acct-provider").await, (750, 3), "{store}");
        server.kill().await;
    }
}

/// A provider that declines (`500`) or cannot be reached: the charge is a `502`
/// problem, nothing is applied, and the retry with the same key calls the
/// provider again with the same forwarded key and applies once.
pub(crate) async fn a_failed_provider_call_is_a_502_and_the_retry_calls_again(suite: Arc<Suite>) {
    let scratch = Scratch::new("payments-provider");
    for store in stores(&suite, &scratch).await {
        let provider = Provider::start().await.expect("a provider");
        provider.answer_with(500);
        let server = Server::launch(
            suite.binary(),
            Launch::new(&store).arg("--provider-url", provider.url()),
        )
        .await;
        let endpoint = server.endpoint();
        let declined = endpoint
            .post(charge("alice", "f-1"))
            .await
            .expect("an answer");
        assert_provider_failed(&declined, &store);
        assert_eq!(endpoint.account("acct-provider").await, (0, 0), "{store}");

        provider.answer_with(201);
        let retried = endpoint
            .post(charge("alice", "f-1"))
            .await
            .expect("an answer");
        assert_eq!(
            (retried.status, retried.replayed),
            (201, false),
            "{store}: {retried:?}"
        );
        assert_eq!(provider.calls(&forwarded("alice", "f-1")), 2, "{store}");
        assert_eq!(endpoint.account("acct-provider").await, (250, 1), "{store}");
        server.kill().await;

        // Nobody listens at the URL: refused.
        let gone = provider.url();
        drop(provider);
        let server = Server::launch(
            suite.binary(),
            Launch::new(&store).arg("--provider-url", &gone),
        )
        .await;
        let refused = server
            .endpoint()
            .post(charge("alice", "f-2"))
            .await
            .expect("an answer");
        assert_provider_failed(&refused, &store);
        // The memory store's ledger started afresh with the new server.
        let kept = if store == "memory" { (0, 0) } else { (250, 1) };
        assert_eq!(
            server.endpoint().account("acct-provider").await,
            kept,
            "{store}"
        );
        server.kill().await;
    }
}

fn assert_provider_failed(reply: &Reply, store: &str) {
    assert_eq!(reply.status, 502, "{store}: {reply:?}");
    let problem: serde_json::Value = serde_json::from_str(&reply.body).expect("a problem body");
    assert_eq!(
        problem["type"], "https://idem.rs/problems/provider-failed",
        "{store}: {problem}"
    );
    assert_eq!(problem["status"], 502, "{store}: {problem}");
}

/// `--help` documents both flags and their defaults.
pub(crate) async fn help_lists_the_provider_and_lease_flags(suite: Arc<Suite>) {
    let help = help(suite.binary()).await;
    for expected in [
        "--provider-url <URL>",
        "--lease-secs <LEASE_SECS>",
        "[default: 30]",
        "--provider-latency-ms",
    ] {
        assert!(
            help.contains(expected),
            "--help lacks {expected:?}:\n{help}"
        );
    }
}

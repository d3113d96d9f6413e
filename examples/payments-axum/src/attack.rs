//! Issue 26's attack on the in-memory store, over HTTP: many bearer tokens
//! (many scopes) fill a small `MemoryStore` with large answers after a victim
//! has charged. However many scopes there are, none of the victim's records
//! is given up for room (`docs/contract.md` §6): each retry replays, nothing
//! is charged twice, and what the full store refuses is new claims (`503
//! store-unavailable` with `Retry-After`), for every scope alike.
//!
//! The app is served in-process, as `main` serves it, over a `MemoryStore`
//! bounded to 256 KiB: the binary's `--store memory` has 512 MiB and no flag
//! to change it (`docs/contract.md` §8 lists the flags).

// Test code: a failed expectation is a panic, which fails the test.
#![allow(clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use idem_core::MemoryStore;
use payments::{Guards, Ledger, Payments};
use serde_json::Value;

/// The store's bound: room for the victim's records and a few dozen of the
/// attackers' 8 KiB answers.
const STORE_BYTES: usize = 256 * 1024;
/// The victim's charges.
const VICTIM_CHARGES: usize = 20;
/// The attackers: so many tokens (scopes), each charging so many times to an
/// account whose id is so long (it comes back in each answer).
const ATTACKERS: usize = 50;
const ATTACKER_CHARGES: usize = 9;
const ATTACKER_ACCOUNT_BYTES: usize = 8 * 1024;
const CHARGE: &str = r#"{"amount": 100, "currency": "EUR"}"#;

/// One answer, as the test reads it.
struct Answer {
    status: u16,
    replayed: bool,
    retry_after: Option<u64>,
    body: String,
}

impl Answer {
    fn problem_type(&self) -> String {
        serde_json::from_str::<Value>(&self.body).map_or_else(
            |_| String::new(),
            |problem| problem["type"].as_str().unwrap_or_default().to_owned(),
        )
    }
}

/// The app over `store` on 127.0.0.1, port 0; served until the test ends.
async fn serve(store: MemoryStore) -> String {
    let guards = Guards::plain(Arc::new(store));
    let app = crate::app(guards, Payments::new(Ledger::memory(), Duration::ZERO));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind 127.0.0.1:0");
    let addr = listener.local_addr().expect("its address");
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}")
}

async fn charge(
    client: &reqwest::Client,
    base: &str,
    token: &str,
    account: &str,
    key: &str,
) -> Answer {
    let response = client
        .post(format!("{base}/accounts/{account}/charges"))
        .bearer_auth(token)
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(CHARGE)
        .send()
        .await
        .expect("an answer");
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .and_then(|value| value.to_str().ok())
            .map(str::to_owned)
    };
    let replayed = header("idempotent-replayed").is_some_and(|value| value == "true");
    let retry_after = header("retry-after").and_then(|value| value.parse().ok());
    Answer {
        status: response.status().as_u16(),
        replayed,
        retry_after,
        body: response.text().await.expect("a body"),
    }
}

/// `(balance, operations)` of `account`.
async fn account(client: &reqwest::Client, base: &str, token: &str, account: &str) -> (i64, i64) {
    let body: Value = client
        .get(format!("{base}/accounts/{account}"))
        .bearer_auth(token)
        .send()
        .await
        .expect("an answer")
        .json()
        .await
        .expect("an account as JSON");
    (
        body["balance"].as_i64().expect("a balance"),
        body["operations"].as_i64().expect("operations"),
    )
}

/// The attack: the victim charges; then [`ATTACKERS`] tokens charge with 8 KiB
/// account ids until the store is full and past it. Every one of the victim's
/// keys then replays its first answer byte for byte, its balance is what its
/// charges made it, and a new charge (the victim's too) is refused `503` with
/// `Retry-After`, not run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_scopes_filling_the_memory_store_never_charge_a_retry_twice() {
    let store = MemoryStore::builder().max_bytes(STORE_BYTES).build();
    let base = serve(store.clone()).await;
    let client = reqwest::Client::new();

    let mut firsts = Vec::new();
    for charge_number in 0..VICTIM_CHARGES {
        let key = format!("victim-{charge_number}");
        let first = charge(&client, &base, "victim", "acct-victim", &key).await;
        assert_eq!(
            (first.status, first.replayed),
            (201, false),
            "{}",
            first.body
        );
        firsts.push((key, first.body));
    }
    let charged = (100 * VICTIM_CHARGES as i64, VICTIM_CHARGES as i64);
    assert_eq!(
        account(&client, &base, "victim", "acct-victim").await,
        charged
    );

    let long_account = "a".repeat(ATTACKER_ACCOUNT_BYTES);
    let (mut applied, mut refused) = (0, 0);
    for attacker in 0..ATTACKERS {
        let token = format!("attacker-{attacker}");
        for charge_number in 0..ATTACKER_CHARGES {
            let key = format!("fill-{charge_number}");
            let answer = charge(&client, &base, &token, &long_account, &key).await;
            match answer.status {
                201 => applied += 1,
                503 => {
                    assert_eq!(
                        answer.problem_type(),
                        "https://idem.rs/problems/store-unavailable",
                        "{}",
                        answer.body
                    );
                    assert!(
                        answer.retry_after.is_some_and(|seconds| seconds > 0),
                        "a full store's 503 says when to retry"
                    );
                    refused += 1;
                }
                status => panic!("{attacker}/{charge_number}: {status} {}", answer.body),
            }
        }
    }
    // Shown with `--nocapture`: the figures behind the verdict.
    eprintln!(
        "{ATTACKERS} attackers: {applied} charges applied, {refused} refused; the store holds {} bytes of {STORE_BYTES}",
        store.used_bytes()
    );
    for (key, first) in &firsts {
        let retry = charge(&client, &base, "victim", "acct-victim", key).await;
        assert_eq!(
            (retry.status, retry.replayed),
            (201, true),
            "{key}: {}",
            retry.body
        );
        assert_eq!(&retry.body, first, "{key} replays its first answer");
    }
    assert_eq!(
        account(&client, &base, "victim", "acct-victim").await,
        charged,
        "no retry charged again"
    );
    assert!(
        store.used_bytes() <= STORE_BYTES,
        "the store keeps its bound: {}",
        store.used_bytes()
    );
    assert!(
        refused > ATTACKERS * ATTACKER_CHARGES / 2,
        "the store filled: {applied} charges applied, {refused} refused"
    );

    // The full store's cost: new claims, the victim's too, until records expire.
    let new = charge(&client, &base, "victim", "acct-victim", "victim-new").await;
    assert_eq!(new.status, 503, "{}", new.body);
    assert!(new.retry_after.is_some_and(|seconds| seconds > 0));
    assert_eq!(
        account(&client, &base, "victim", "acct-victim").await,
        charged
    );
}

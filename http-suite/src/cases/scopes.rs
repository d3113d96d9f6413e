//! Scopes and stores: who sees which record, and a store that is down
//! (`docs/contract.md` §1, §4).

use serde_json::json;

use crate::client::{Call, Client, assert_executed, assert_problem, assert_replay_of};
use crate::{FAILING_STORE_SECRET, FULL_STORE_RECORDS, Target};

pub(crate) async fn scopes_are_isolated(target: Target) {
    let client = Client::new(&target);
    let body = r#"{"amount":5}"#;
    let mut firsts = Vec::new();
    for (principal, call) in [
        (
            "alice",
            Call::post("/required", "shared-1", body).principal("alice"),
        ),
        (
            "bob",
            Call::post("/required", "shared-1", body).principal("bob"),
        ),
        ("anonymous", Call::post("/required", "shared-1", body)),
    ] {
        let first = client.send(&call).await;
        assert_executed(&first, 201);
        assert_eq!(first.json()["principal"], json!(principal));
        firsts.push((call, first));
    }
    let executions: Vec<u64> = firsts.iter().map(|(_, first)| first.execution()).collect();
    assert_eq!(executions, vec![1, 2, 3]);
    for (call, first) in &firsts {
        assert_replay_of(&client.send(call).await, first);
    }
    assert_eq!(client.executions().await.started, 3);
}

pub(crate) async fn failing_store_fails_closed(target: Target) {
    let client = Client::new(&target);
    let call = Call::post("/required", "down-1", "{}");
    for _ in 0..2 {
        let answer = client.send(&call).await;
        let problem = assert_problem(&answer, 503, "store-unavailable");
        let retry_after = answer.header("retry-after");
        assert!(
            retry_after.parse::<u64>().is_ok_and(|s| s >= 1),
            "Retry-After: {retry_after:?}"
        );
        assert!(
            !String::from_utf8_lossy(&answer.body).contains(FAILING_STORE_SECRET),
            "the store's error leaked to the client: {problem}"
        );
    }
    assert_eq!(client.executions().await.started, 0);

    // Requests that need no store are served.
    let unkeyed = client
        .send(&Call::new("POST", "/optional").body("{}"))
        .await;
    assert_executed(&unkeyed, 201);
    // A fail-open route runs its handler without idempotency, every time.
    let open = Call::post("/fail-open", "down-2", "{}");
    for execution in [2, 3] {
        let answer = client.send(&open).await;
        assert_executed(&answer, 201);
        assert_eq!(answer.execution(), execution);
    }
    assert_eq!(client.executions().await.started, 3);
}

/// A full in-memory store (`docs/contract.md` §6): once its records are
/// taken, a new key is answered `503 store-unavailable` with `Retry-After`
/// and its handler does not run, while every completed record stays, so each
/// retry of an earlier key replays rather than running a second time.
pub(crate) async fn full_memory_store_fails_closed_and_keeps_its_replays(target: Target) {
    let client = Client::new(&target);
    let mut firsts = Vec::new();
    for n in 0..FULL_STORE_RECORDS {
        let call = Call::post("/required", &format!("full-{n}"), "{}").principal(&format!("p{n}"));
        let first = client.send(&call).await;
        assert_executed(&first, 201);
        firsts.push((call, first));
    }
    for principal in ["p0", "someone-else"] {
        let refused = client
            .send(&Call::post("/required", "full-new", "{}").principal(principal))
            .await;
        assert_problem(&refused, 503, "store-unavailable");
        let retry_after = refused.header("retry-after");
        assert!(
            retry_after.parse::<u64>().is_ok_and(|s| s >= 1),
            "Retry-After: {retry_after:?}"
        );
    }
    for (call, first) in &firsts {
        let retry = client.send(call).await;
        assert_replay_of(&retry, first);
    }
    assert_eq!(
        client.executions().await.started,
        FULL_STORE_RECORDS as u64,
        "no handler ran for a refused claim, and none ran again"
    );
}

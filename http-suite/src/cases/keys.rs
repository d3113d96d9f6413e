//! The `Idempotency-Key` header and which requests are covered (`docs/contract.md` §2).

use crate::Target;
use crate::client::{Call, Client, assert_executed, assert_problem, assert_replay_of};

pub(crate) async fn malformed_keys_are_invalid(target: Target) {
    let client = Client::new(&target);
    let too_long = "k".repeat(256);
    let quoted_too_long = format!("\"{too_long}\"");
    let malformed: [(&str, Vec<&[u8]>); 12] = [
        ("an empty value", vec![b""]),
        ("only whitespace", vec![b"   "]),
        ("an empty sf string", vec![b"\"\""]),
        ("two fields", vec![b"a", b"b"]),
        ("two equal fields", vec![b"a", b"a"]),
        ("a bare value with a comma", vec![b"a,b"]),
        ("an unterminated sf string", vec![b"\"abc"]),
        ("a bad escape in an sf string", vec![b"\"a\\x\""]),
        ("a tab inside", vec![b"a\tb"]),
        ("a non-ASCII byte", vec!["café".as_bytes()]),
        ("256 characters", vec![too_long.as_bytes()]),
        ("a quoted 256 characters", vec![quoted_too_long.as_bytes()]),
    ];
    for (what, fields) in malformed {
        let call = fields
            .iter()
            .fold(Call::new("POST", "/required").body("{}"), |call, field| {
                call.raw_key(field)
            });
        let answer = client.send(&call).await;
        assert_eq!(answer.status, 400, "{what}: {answer:?}");
        assert_problem(&answer, 400, "invalid-key");
    }
    assert_eq!(client.executions().await.started, 0);
}

pub(crate) async fn valid_key_forms_name_the_same_record(target: Target) {
    let client = Client::new(&target);
    let first = client
        .send(&Call::post("/required", "order-17", "{}"))
        .await;
    assert_executed(&first, 201);
    for form in ["\"order-17\"", "  order-17  ", "\"order-17\";param=1"] {
        let answer = client.send(&Call::post("/required", form, "{}")).await;
        assert_replay_of(&answer, &first);
    }
    let longest = "k".repeat(255);
    let answer = client.send(&Call::post("/required", &longest, "{}")).await;
    assert_executed(&answer, 201);
    assert_eq!(client.executions().await.started, 2);
}

pub(crate) async fn missing_required_key_is_rejected(target: Target) {
    let client = Client::new(&target);
    for method in ["POST", "PATCH"] {
        let answer = client
            .send(&Call::new(method, "/required").body("{}"))
            .await;
        assert_problem(&answer, 400, "missing-key");
    }
    assert_eq!(client.executions().await.started, 0);
}

pub(crate) async fn optional_route_without_key_runs_every_time(target: Target) {
    let client = Client::new(&target);
    let unkeyed = Call::new("POST", "/optional").body("{}");
    for execution in 1..=2 {
        let answer = client.send(&unkeyed).await;
        assert_executed(&answer, 201);
        assert_eq!(answer.execution(), execution);
    }
    let keyed = Call::post("/optional", "optional-1", "{}");
    let first = client.send(&keyed).await;
    assert_executed(&first, 201);
    assert_replay_of(&client.send(&keyed).await, &first);
    let malformed = client
        .send(&Call::new("POST", "/optional").raw_key(b"a,b").body("{}"))
        .await;
    assert_problem(&malformed, 400, "invalid-key");
    assert_eq!(client.executions().await.started, 3);
}

pub(crate) async fn uncovered_methods_pass_through(target: Target) {
    let client = Client::new(&target);
    let mut executions = 0;
    for method in ["PUT", "DELETE", "GET"] {
        for keyed in [true, false] {
            let mut call = Call::new(method, "/required").body("{}");
            if keyed {
                call = call.key("uncovered-1");
            }
            let answer = client.send(&call).await;
            executions += 1;
            assert_executed(&answer, 201);
            assert_eq!(answer.execution(), executions, "{method} ran its handler");
        }
    }
    // Malformed keys are not looked at on an uncovered method either.
    let answer = client
        .send(&Call::new("PUT", "/required").raw_key(b"a,b"))
        .await;
    assert_executed(&answer, 201);
    // PATCH is covered.
    let patch = Call::new("PATCH", "/required")
        .key("uncovered-2")
        .body("{}");
    let first = client.send(&patch).await;
    assert_executed(&first, 201);
    assert_replay_of(&client.send(&patch).await, &first);
    assert_eq!(client.executions().await.started, executions + 2);
}
